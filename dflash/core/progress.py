"""Progress bars: tqdm on an interactive terminal; in logs (not a tty) a line every 30 s instead of \\r spam."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def bar(enabled: bool = True, **kw) -> tqdm:
    tty = sys.stderr.isatty()
    kw.setdefault("dynamic_ncols", True)
    if not tty:
        kw.setdefault("mininterval", 30.0)
        kw.setdefault("ncols", 100)
    return tqdm(disable=not enabled, file=sys.stderr, **kw)
