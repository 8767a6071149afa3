"""Config dataclasses from YAML presets plus command-line flags (flags win), with errors that name the flag.

A preset is a YAML file with one section per command:

    extract: {seq_len: 4096, layers: auto}
    train:   {drafter_layers: 5, lr: 6.0e-4}

`--config NAME` takes a path, or the name of a file in the repository's configs/ folder.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

import yaml

from dflash.errors import DflashError

C = TypeVar("C")

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class ConfigError(DflashError, ValueError):
    """A bad setting; the message names the flag (e.g. --seq-len)."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_preset(name: str) -> str:
    if os.path.exists(name):
        return name
    for cand in (os.path.join(CONFIG_DIR, name), os.path.join(CONFIG_DIR, name + ".yaml")):
        if os.path.exists(cand):
            return cand
    known = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml")) if os.path.isdir(CONFIG_DIR) else []
    raise ConfigError(f"--config: no file {name!r} (presets: {', '.join(known) or 'none'})")


def read_preset(name: str | None, section: str) -> dict[str, Any]:
    if not name:
        return {}
    path = resolve_preset(name)
    with open(path) as f:
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
