"""Which extraction rank runs which shard, and how many compression threads a rank gets.

Contract:
  * `assign_shards(shard_tokens, world)` -> one sorted list of shard ids per rank: a partition of
    range(len(shard_tokens)), the same on every rank and every rerun (it depends only on its inputs),
    balanced by real tokens with greedy longest-processing-time: shards in decreasing token order
    (ties: lower id first) each go to the rank with the fewest tokens so far (ties: lower rank). The
    heaviest rank then carries at most the mean load + the largest shard (and at most 4/3 of the
    optimum). Counting shards instead (shard s -> rank s % world) ignores that the last shard is short
    and that rows differ in real tokens.
  * `shard_real_tokens(plan, lengths, rows_per_shard)` -> the real (non-padding) tokens of each shard.
  * `writer_threads_per_rank()` -> the CPU cores this process may use (its affinity mask) divided by the
    extraction processes on this node (LOCAL_WORLD_SIZE under torchrun), at least 1: ranks on one node
    share its cores, so each compresses with its share rather than every rank starting the same count.
"""

from __future__ import annotations

import heapq
import os

import numpy as np


def shard_real_tokens(plan: list[list[int]], lengths, rows_per_shard: int) -> np.ndarray:
    """int64 [num_shards]: real tokens per shard of `rows_per_shard` rows (the last one may be short)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    per_row = np.fromiter((int(lengths[r].sum()) if len(r) else 0 for r in plan), dtype=np.int64, count=len(plan))
    nshards = -(-len(plan) // rows_per_shard)
    padded = np.zeros(nshards * rows_per_shard, dtype=np.int64)
    padded[: len(per_row)] = per_row
    return padded.reshape(nshards, rows_per_shard).sum(1)


def assign_shards(shard_tokens, world: int) -> list[list[int]]:
    """Greedy LPT partition of the shards over `world` ranks by real tokens (module docstring)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    tokens = [int(t) for t in shard_tokens]
    order = sorted(range(len(tokens)), key=lambda s: (-tokens[s], s))
    heap = [(0, r) for r in range(world)]  # (load, rank): the least-loaded rank, lowest rank on ties
    out: list[list[int]] = [[] for _ in range(world)]
    for s in order:
        load, r = heapq.heappop(heap)
        out[r].append(s)
        heapq.heappush(heap, (load + tokens[s], r))
    return [sorted(x) for x in out]


def writer_threads_per_rank(local_world: int | None = None) -> int:
    """Compression/write threads for one extraction rank: this process's cores / ranks on the node, >= 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cores // max(1, local_world))
