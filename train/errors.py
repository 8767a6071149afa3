"""The drafter's error: a config, checkpoint or target head that cannot be used. Below train/model.py and
train/rope.py, which both raise it (train/model.py re-exports it)."""

from __future__ import annotations

from dflash.core.errors import DflashError


class DrafterError(DflashError, ValueError):
    """A drafter config, checkpoint or target head that cannot be used (one `error:` line in the CLI)."""
