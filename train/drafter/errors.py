"""The drafter's error: a config, checkpoint or target head that cannot be used. Below train/drafter/model.py and
train/drafter/rope.py, which both raise it (train/drafter/model.py re-exports it)."""

from __future__ import annotations

from dflash.core.errors import DflashError


class DrafterError(DflashError, ValueError):
    """A drafter config, checkpoint or target head that cannot be used (one `error:` line in the CLI)."""
