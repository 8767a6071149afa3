"""Config dataclasses from YAML presets plus command-line flags (flags win), with errors that name the flag.

A preset is a YAML file with one section per command:

    extract: {seq_len: 4096, layers: auto}
    train:   {drafter_layers: 5, lr: 6.0e-4}

`--config NAME` takes a path, or the name of a preset in the configs/ folder, which ships inside the package
as `dflash.configs` (read through importlib.resources: it works from a checkout, an editable install and a wheel).

Contract:
- A preset is read as YAML 1.2 reads booleans: only true/false are booleans, so `tokenize_cache: off` or
  `compile: off` stay the words they are (YAML 1.1 read off/no/on/yes as booleans). A boolean setting takes
  true/false and the words on/off/yes/no.
- Each preset value is checked against its field's type (coerce): an integer, a float (6e-4 as well as 6.0e-4:
  YAML reads the first as a string), a string, a list of integers, a mapping; a wrong one is a ConfigError naming
  the flag and the preset.
- Flags win over the preset. Where a config declares EXCLUSIVE pairs (train: max_steps / epochs), a flag given for
  one member drops the preset's value of the other; a preset that sets both is named.
- Every problem is a ConfigError (a DflashError: one `error:` line) naming the flag (`check`), or the preset file and
  the line of a YAML error. A value a preset set says so in the message ("(set by --config FILE)").
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from importlib import resources
from typing import Any, TypeVar

import yaml

from dflash.core.config_error import ConfigError, flag  # noqa: F401  (re-exported: the settings' error and flag names)
from dflash.core.paths import path_form

C = TypeVar("C")





class PresetLoader(yaml.SafeLoader):
    """yaml.SafeLoader with YAML 1.2's booleans: true/false only (1.1 also reads on/off/yes/no as booleans, which
    turned `tokenize_cache: off` into False)."""


PresetLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
PresetLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))

BOOL_WORDS = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}


def finite(x) -> bool:
    """A real number that is neither nan nor infinite (for checks: `check(finite(x) and x > 0, ...)`)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def presets() -> dict[str, resources.abc.Traversable]:
    """name -> file of every preset shipped in dflash.configs (configs/*.yaml)."""
    return {f.name[:-5]: f for f in resources.files("dflash.configs").iterdir() if f.name.endswith(".yaml")}


def resolve_preset(name: str):
    """A path given with --config (a file:// URL as the path it names), or the packaged preset of that name (with or
    without .yaml)."""
    name = path_form(name, "config")
    if os.path.islink(name) and not os.path.exists(name):
        raise ConfigError(f"--config {name} is a dangling symlink (to {os.readlink(name)}, which does not exist)")
    if os.path.isdir(name):
        raise ConfigError(f"--config {name} is a directory; give a YAML file or the name of a preset")
    if os.path.exists(name):
        return name
    shipped = presets()
    stem = name[:-5] if name.endswith(".yaml") else name
    if stem in shipped:
        return shipped[stem]
    raise ConfigError(f"--config: no file {name!r} (presets: {', '.join(sorted(shipped)) or 'none'})")


def read_preset(name: str | None, section: str) -> dict[str, Any]:
    """The `section` mapping of a preset, keys with - or _ alike; {} without a preset. ConfigError naming the file
    (and the line of a YAML error) for anything that is not a YAML mapping of mappings."""
    if not name:
        return {}
    path = resolve_preset(name)
    try:
        with (open(path, "rb") if isinstance(path, str) else path.open("rb")) as f:
            doc = yaml.load(f.read().decode("utf-8"), Loader=PresetLoader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not a UTF-8 text file (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path}: not valid YAML{where}: {what}") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it: {e.strerror or e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path} must hold a mapping of sections (extract:, train:, ...), "
                          f"not a {type(doc).__name__}")
    sec = doc.get(section, {}) or {}
    if not isinstance(sec, dict):
        raise ConfigError(f"--config: section '{section}' of {path} must be a mapping, not a {type(sec).__name__}")
    bad = [k for k in sec if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"--config: section '{section}' of {path} has a key {bad[0]!r} that is not a setting name")
    return {k.replace("-", "_"): v for k, v in sec.items()}


def _type_name(v) -> str:
    return "null" if v is None else type(v).__name__


def coerce(name: str, value, hint) -> Any:
    """`value` (read from a preset) as the type `hint` of setting `name` wants, or a ConfigError naming its flag.
    Integers stay integers (a boolean is not one), floats take integers and strings such as 6e-4 (which YAML reads
    as a string), booleans take on/off/yes/no, strings take numbers (a split named 2024), list[int] takes a list or
    "1,9,17" ("auto": None)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        hint = kinds[0] if len(kinds) == 1 else Any
    if hint is Any:
        return value
    origin = typing.get_origin(hint) or hint
    bad = f"{flag(name)} expects {{}}, got {value!r} ({_type_name(value)})"
    if origin is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOL_WORDS:
            return BOOL_WORDS[value.lower()]
        raise ConfigError(bad.format("true or false"), name)
    if origin is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(bad.format("an integer"), name)
    if origin is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(bad.format("a number"), name)
    if origin is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(bad.format("a string" + (" (quote it)" if isinstance(value, bool) else "")), name)
    if origin is list:
        if isinstance(value, str):
            return parse_int_list(value, name) if typing.get_args(hint) == (int,) else [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(bad.format("a list"), name)
        if typing.get_args(hint) == (int,):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                raise ConfigError(bad.format("a list of integers"), name)
        return list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(bad.format("a mapping (key: value, ...)"), name)
        return value
    return value


def coerce_all(cls, values: dict[str, Any], preset: str | None) -> dict[str, Any]:
    """Preset `values` of the dataclass `cls`, each coerced to its field's type; a bad one is a ConfigError naming the
    flag and the preset."""
    hints = typing.get_type_hints(cls)
    try:
        return {k: coerce(k, v, hints[k]) for k, v in values.items()}
    except ConfigError as e:
        raise ConfigError(f"{e} (set by --config {preset})", e.field) from None


def build(cls: type[C], preset: str | None, section: str, flags: dict[str, Any]) -> C:
    """cls(**defaults | preset[section] | flags that were given); unknown keys are errors. Preset values are coerced
    to their fields' types (coerce); a flag of one of cls.EXCLUSIVE's pairs drops the preset's other member."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = read_preset(preset, section)
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"--config: unknown setting(s) {', '.join(unknown)} in section '{section}' of {preset}")
    values = coerce_all(cls, values, preset)
    given = {k: v for k, v in flags.items() if v is not None and k in names}
    for group in getattr(cls, "EXCLUSIVE", ()):
        if any(k in given for k in group):
            for k in group:
                if k not in given:
                    values.pop(k, None)
        elif sum(values.get(k) is not None for k in group) > 1:
            raise ConfigError(f"--config {preset} sets both {' and '.join(group)} in section '{section}' "
                              f"({' and '.join(flag(k) for k in group)} are exclusive): keep one, or give one as a "
                              "flag", group[0])
    from_preset = set(values) - set(given)
    values.update(given)
    try:
        return cls(**values)
    except ConfigError as e:
        if e.field in from_preset:
            raise ConfigError(f"{e} (set by --config {preset})", e.field) from None
        raise
    except TypeError as e:
        raise ConfigError(str(e)) from e


def check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{flag(name)} {msg}", name)


def parse_kv(items: tuple[str, ...] | list[str] | None, name: str) -> dict[str, Any]:
    """['enable_thinking=false', 'x=3'] -> {'enable_thinking': False, 'x': 3} (values parsed as YAML, whose off/no
    are false here: template variables are mostly switches). KEY must be a name a template can use."""
    out: dict[str, Any] = {}
    for it in items or ():
        if "=" not in it:
            raise ConfigError(f"{flag(name)} expects KEY=VALUE, got {it!r}", name)
        k, v = it.split("=", 1)
        k = k.strip()
        if not k.isidentifier():
            raise ConfigError(f"{flag(name)} {it!r}: the key {k!r} is not a name (letters, digits, _)", name)
        try:
            out[k] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise ConfigError(f"{flag(name)} {it!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e}); "
                              "quote it as a string: KEY='...'", name) from None
    return out


def parse_int_list(s: str | list | None, name: str) -> list[int] | None:
    if s is None or s == "auto":
        return None
    if isinstance(s, (list, tuple)):
        return [int(x) for x in s]
    try:
        return [int(x) for x in str(s).replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"{flag(name)} expects comma-separated integers such as 1,9,17, got {s!r}") from None


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
