"""Shards over extraction ranks by real tokens (extract/assign.py), and compression threads per rank.

Covered: the assignment is a partition of the shards, the same on every call (what every rank of a job
computes for itself), within the LPT bound (heaviest rank <= mean + largest shard) and never worse than
counting shards on a case where counting is badly off; one rank gets everything; a rank may get none;
real tokens per shard from a packing plan equal a direct count; threads per rank come from the affinity
mask and LOCAL_WORLD_SIZE. (A 2-process torchrun extraction writing the same cache bit for bit as one
process is tests/test_extract.py's.)
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from dflash.extract.assign import assign_shards, shard_real_tokens, writer_threads_per_rank
from dflash.extract.pack import pack


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_partition_deterministic_and_balanced(world, seed):
    rng = random.Random(seed)
    tokens = [rng.randint(1_000, 60_000) for _ in range(rng.randint(1, 40))]
    parts = assign_shards(tokens, world)
    assert len(parts) == world
    flat = sorted(s for p in parts for s in p)
    assert flat == list(range(len(tokens))), "every shard exactly once"
    assert all(p == sorted(p) for p in parts)
    assert assign_shards(list(tokens), world) == parts, "deterministic"
    loads = [sum(tokens[s] for s in p) for p in parts]
    assert max(loads) <= sum(tokens) / world + max(tokens)
    by_count = [sum(tokens[s] for s in range(len(tokens)) if s % world == r) for r in range(world)]
    assert max(loads) <= max(by_count) or world == 1 or len(tokens) <= world


def test_tokens_beat_counting_where_counting_is_off():
    tokens = [100, 1, 100, 1, 100, 1, 100, 1]  # by count, rank 0 of 2 gets every heavy shard
    parts = assign_shards(tokens, 2)
    loads = [sum(tokens[s] for s in p) for p in parts]
    assert loads == [202, 202]
    assert assign_shards([7], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="world"):
        assign_shards([1], 0)


def test_shard_real_tokens_from_a_plan():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 500).tolist()
    plan = pack(lengths, 512)
    for rows_per_shard in (1, 7, len(plan), len(plan) + 3):
        got = shard_real_tokens(plan, lengths, rows_per_shard)
        want = [sum(lengths[d] for r in plan[s:s + rows_per_shard] for d in r) for s in range(0, len(plan), rows_per_shard)]
        assert got.tolist() == want
    assert int(shard_real_tokens(plan, lengths, 7).sum()) == sum(lengths)


def test_writer_threads_per_rank(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    assert writer_threads_per_rank(1) == cores
    assert writer_threads_per_rank(cores * 4) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    assert writer_threads_per_rank() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert writer_threads_per_rank() == 16
