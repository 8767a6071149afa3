"""Config dataclasses from YAML presets plus command-line flags (flags win), with errors that name the flag.

A preset is a YAML file with one section per command:

    extract: {seq_len: 4096, layers: auto}
    train:   {drafter_layers: 5, lr: 6.0e-4}

`--config NAME` takes a path, or the name of a preset in the configs/ folder, which ships inside the package
as `dflash.configs` (read through importlib.resources: it works from a checkout, an editable install and a wheel).
"""

from __future__ import annotations

import dataclasses
import os
from importlib import resources
from typing import Any, TypeVar

import yaml

from dflash.core.errors import DflashError

C = TypeVar("C")



class ConfigError(DflashError, ValueError):
    """A bad setting; the message names the flag (e.g. --seq-len)."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def presets() -> dict[str, resources.abc.Traversable]:
    """name -> file of every preset shipped in dflash.configs (configs/*.yaml)."""
    return {f.name[:-5]: f for f in resources.files("dflash.configs").iterdir() if f.name.endswith(".yaml")}


def resolve_preset(name: str):
    """A path given with --config, or the packaged preset of that name (with or without .yaml)."""
    if os.path.exists(name):
        return name
    shipped = presets()
    stem = name[:-5] if name.endswith(".yaml") else name
    if stem in shipped:
        return shipped[stem]
    raise ConfigError(f"--config: no file {name!r} (presets: {', '.join(sorted(shipped)) or 'none'})")


def read_preset(name: str | None, section: str) -> dict[str, Any]:
    if not name:
        return {}
    path = resolve_preset(name)
    with (open(path) if isinstance(path, str) else path.open()) as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of sections")
    sec = doc.get(section, {}) or {}
    if not isinstance(sec, dict):
        raise ConfigError(f"--config: section '{section}' of {path} must be a mapping")
    return {k.replace("-", "_"): v for k, v in sec.items()}


def build(cls: type[C], preset: str | None, section: str, flags: dict[str, Any]) -> C:
    """cls(**defaults | preset[section] | flags that were given); unknown keys are errors."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = read_preset(preset, section)
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"--config: unknown setting(s) {', '.join(unknown)} in section '{section}'")
    values.update({k: v for k, v in flags.items() if v is not None and k in names})
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from e


def check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{flag(name)} {msg}")


def parse_kv(items: tuple[str, ...] | list[str] | None, name: str) -> dict[str, Any]:
    """['enable_thinking=false', 'x=3'] -> {'enable_thinking': False, 'x': 3} (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for it in items or ():
        if "=" not in it:
            raise ConfigError(f"{flag(name)} expects KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
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
