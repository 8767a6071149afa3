"""Intra-op CPU threads of the decoding commands (eval, regenerate, prompts): `--threads`.

Decoding runs one small forward per generated token. On a CPU its ops (the demo's 135M target: matmuls of a few
MFLOP) are too small for several intra-op threads to pay, and on a machine shared with other work the threads wait
for each other: on a loaded 2-core machine one MT-Bench prompt of the demo's eval gave no result in 280 s with the
default threads (2) and took 38 s with one, and the target alone decoding 48 tokens took 11-21 s with one thread
against 34-65 s with two (2026-12-03). So threads 0 (auto) is one thread on a CPU, unless OMP_NUM_THREADS says
otherwise; N > 0 is N; on CUDA the host's threads only launch kernels and are left as they are.

    with decode_threads(cfg.threads, cfg.device):   # the work, then torch's threads as they were
        ...

The previous count is restored after the work: the demo runs its stages in one process, and training keeps its own.
A count above `max_threads()` (4 per core, at least 64) is refused by the commands' configs (check_threads): a
typo such as 100000 made torch start threads until the process could start no more, then crash.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from dflash.core.dist import parse_device


def max_threads() -> int:
    """The most --threads a decoding command takes on this machine: 4 per core, at least 64."""
    return max(64, 4 * (os.cpu_count() or 1))


def check_threads(threads: int) -> None:
    """--threads in [0, max_threads()] (0: the default rule above), else a ConfigError naming --threads."""
    from dflash.core.config import check

    most = max_threads()
    check(0 <= threads <= most, "threads", f"must be in [0, {most}] (0: 1 on a CPU; the most is 4 per core of this "
          f"machine, at least 64), got {threads}")


def chosen_threads(requested: int, device: str | None) -> int | None:
    """The intra-op threads to set for decoding on `device`, or None to leave torch's as they are."""
    if requested > 0:
        return requested
    if os.environ.get("OMP_NUM_THREADS") or parse_device(device).type != "cpu":
        return None
    return 1


@contextlib.contextmanager
def decode_threads(requested: int, device: str | None) -> Iterator[int]:
    """Within: chosen_threads(requested, device) intra-op threads (yields the count in effect); restored after."""
    before = torch.get_num_threads()
    n = chosen_threads(requested, device)
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
