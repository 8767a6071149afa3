"""The error of a bad setting and the flag that names it: what dflash.core.config and dflash.core.paths both raise
(paths below config, so that config can read a --config given as a file:// URL)."""

from __future__ import annotations

from dflash.core.errors import DflashError


class ConfigError(DflashError, ValueError):
    """A bad setting; the message names the flag (e.g. --seq-len). `field`: the setting it is about, if one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")
