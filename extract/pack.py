"""Packing documents into fixed-length rows: deterministic best-fit decreasing, then row materialisation.

    plan = pack(lengths, seq_len)             # per row: document indices in placement order
    stats = pack_stats(plan, lengths, seq_len)
    arrays = materialize(plan, docs, seq_len, pad_id, start, stop)   # rows [start, stop) as fixed-shape arrays
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heappop, heappush

import numpy as np


def pack(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Best-fit decreasing bin packing of documents into rows of capacity `seq_len`. Deterministic.

    Documents are placed in order of (-length, index); each goes to the open row with the least remaining capacity
    that still fits it (ties: the lowest row id), else to a new row. Returns, per row (in creation order), the
    document indices in the order they were placed.

    Rows are kept in buckets by remaining capacity (a min-heap of row ids per capacity) and the non-empty
    capacities in a sorted list (at most seq_len + 1 entries), so each placement is a bisection plus O(log rows)
    heap work: about 1-2 s per million documents in pure Python.
    """
    seq_len = int(seq_len)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if len(lens) == 0:
        return []
    bad = np.flatnonzero((lens < 1) | (lens > seq_len))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"document {i} has length {int(lens[i])}; every length must be in 1..seq_len={seq_len} "
                         f"({len(bad)} documents out of range)")
    order = np.argsort(-lens, kind="stable")  # by (-length, index)
    rows: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # remaining capacity -> min-heap of row ids
    caps: list[int] = []  # sorted remaining capacities whose bucket is non-empty
    bisect_left, insort = bisect.bisect_left, bisect.insort
    for doc, n in zip(order.tolist(), lens[order].tolist()):
        k = bisect_left(caps, n)
        if k < len(caps):  # best fit: the smallest remaining capacity >= n
            cap = caps[k]
            heap = buckets[cap]
            row = heappop(heap)
            if not heap:
                del buckets[cap]
                caps.pop(k)
            rows[row].append(doc)
            left = cap - n
        else:  # nothing fits: a new row
            row = len(rows)
            rows.append([doc])
            left = seq_len - n
        if left > 0:
            heap = buckets.get(left)
            if heap is None:
                buckets[left] = [row]
                insort(caps, left)
            else:
                heappush(heap, row)
    return rows


@dataclass
class PackStats:
    rows: int
    tokens: int  # real (document) tokens
    padding_fraction: float  # padding / (rows * seq_len)
    docs: int = 0

    def summary(self) -> str:
        return (f"{self.docs} documents packed into {self.rows} rows: {self.tokens} tokens, "
                f"{100 * self.padding_fraction:.2f}% padding")


def pack_stats(rows: list[list[int]], lengths: Sequence[int], seq_len: int) -> PackStats:
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    tokens = int(sum(int(lens[r].sum()) for r in rows if r))
    capacity = len(rows) * int(seq_len)
    return PackStats(rows=len(rows), tokens=tokens,
                     padding_fraction=(1.0 - tokens / capacity) if capacity else 0.0,
                     docs=sum(len(r) for r in rows))


def materialize(rows_plan: list[list[int]], docs, seq_len: int, pad_id: int, start: int, stop: int) -> dict:
    """Rows [start, stop) of a packing plan as fixed-shape arrays ([n, seq_len] each):

    input_ids int32 (pad_id on padding), loss_mask uint8 (0 on padding), doc_ids int32 (1, 2, ... in placement
    order within the row, 0 on padding), position_ids int32 (0, 1, ... restarting for each document, 0 on padding).
    `docs[i]` is (ids, loss_mask) of document i.
    """
    seq_len = int(seq_len)
    if not 0 <= start <= stop <= len(rows_plan):
        raise ValueError(f"rows [{start}, {stop}) out of range for a plan of {len(rows_plan)} rows")
    n = stop - start
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    loss_mask = np.zeros((n, seq_len), dtype=np.uint8)
    doc_ids = np.zeros((n, seq_len), dtype=np.int32)
    position_ids = np.zeros((n, seq_len), dtype=np.int32)
    ramp = np.arange(seq_len, dtype=np.int32)
    for r in range(n):
        t = 0
        for j, d in enumerate(rows_plan[start + r], start=1):
            ids, mask = docs[d]
            m = len(ids)
            if len(mask) != m:
                raise ValueError(f"document {d}: {m} ids but {len(mask)} loss-mask values")
            if t + m > seq_len:
                raise ValueError(f"row {start + r} overflows seq_len={seq_len} at document {d}")
            input_ids[r, t:t + m] = ids
            loss_mask[r, t:t + m] = mask
            doc_ids[r, t:t + m] = j
            position_ids[r, t:t + m] = ramp[:m]
            t += m
    return {"input_ids": input_ids, "loss_mask": loss_mask, "doc_ids": doc_ids, "position_ids": position_ids}
