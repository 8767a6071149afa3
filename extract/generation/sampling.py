"""Sampling for `dflash regenerate`'s engine: greedy, or temperature / top-p with one uniform per (row, step) drawn
from a counter-based hash of (seed, dataset row, turn, step). The text of a conversation then depends on neither
the batch it ran in, nor the part size, nor the number of GPUs, so a rerun reproduces it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = np.asarray(x, dtype=_U64)
    with np.errstate(over="ignore"):
        z = x + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))


def rng_key(*ints: int) -> int:
    """A 64-bit key for a sequence of non-negative integers, e.g. rng_key(seed, dataset_row, turn)."""
    h = np.zeros(1, dtype=_U64)
    for i in ints:
        h = _splitmix64(h ^ np.array([int(i) & 0xFFFFFFFFFFFFFFFF], dtype=_U64))
    return int(h[0])


def uniforms(keys: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """float64 uniforms in [0, 1), one per (key, step)."""
    k = np.array([int(x) for x in keys], dtype=_U64)
    s = _splitmix64(np.array([int(x) for x in steps], dtype=_U64))
    return (_splitmix64(k ^ s) >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor | None) -> torch.Tensor:
    """Next token per row of logits [B, V]: argmax when temperature <= 0, else inverse-CDF sampling with the row's
    uniform u [B] from softmax(logits / T), restricted to the smallest top-p nucleus when top_p < 1."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        probs = probs * ((probs.cumsum(-1) - probs) < top_p)  # the nucleus always keeps the top token
    else:
        order = None
    cdf = probs.double().cumsum(-1)
    target = (u.to(cdf.device, torch.float64) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    if order is not None:
        idx = order.gather(-1, idx)
    return idx.squeeze(-1)
