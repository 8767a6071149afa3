"""`dflash cache info` and `dflash cache verify`: what a cache holds, and whether every byte is intact."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .format import (
    COMMIT_KEY,
    HIDDEN,
    SCALES,
    SMALL_ARRAYS,
    CacheSpec,
    commit_problems,
    group_json,
    read_root,
    shard_key,
)
from .reader import Cache
from .store import Store


def info(path: str) -> dict[str, Any]:
    cache = Cache(path, allow_incomplete=True)
    spec = cache.spec
    rows = len(cache)
    real = cache.real_tokens
    stored_tokens = rows * spec.seq_len
    on_disk = cache.store.size_bytes()
    sup = sum(int(c.get("supervised_tokens", 0)) for c in cache.commits.values())
    return {
        "path": cache.path,
        "complete": cache.complete,
        "shards_committed": len(cache.commits),
        "shards_planned": spec.num_shards,
        "rows": rows,
        "rows_planned": spec.num_rows,
        "seq_len": spec.seq_len,
        "real_tokens": real,
        "supervised_tokens": sup,
        "padding_fraction": (1 - real / stored_tokens) if stored_tokens else 0.0,
        "bytes_on_disk": on_disk,
        "bytes_per_real_token": on_disk / real if real else None,
        "hidden_dtype": spec.hidden_dtype,
        "raw_hidden_bytes_per_token": spec.hidden_bytes_per_token,  # hidden + scales, before compression
        "metadata": cache.metadata,
    }


@dataclass
class VerifyReport:
    path: str
    shards_planned: int = 0
    shards_ok: list[int] = field(default_factory=list)
    bad: dict[int, list[str]] = field(default_factory=dict)  # shard -> problems
    uncommitted: list[int] = field(default_factory=list)
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.bad and not self.uncommitted


def _verify_shard(cache: Cache, s: int) -> tuple[list[str], int]:
    spec: CacheSpec = cache.spec
    rec = cache.commits[s]
    problems = commit_problems(spec, s, rec)
    if problems:  # without its checksums a shard cannot be checked, nor read
        return problems, 0
    nbytes = 0
    _, rows = spec.shard_rows(s)
    T, W, C = spec.seq_len, spec.stored_width, spec.hidden_chunk_tokens
    want_shapes = {**{n: [rows, T] for n in SMALL_ARRAYS}, HIDDEN: [rows, T, W]}
    if spec.quantized:
        want_shapes[SCALES] = [rows, T, spec.scale_width]
    for name, shape in want_shapes.items():
        meta = cache.store.get_json(f"{shard_key(s)}/{name}/zarr.json")
        if meta is None:
            problems.append(f"{name}: array metadata missing or unreadable")
        elif list(meta.get("shape", [])) != shape:
            problems.append(f"{name}: shape {meta.get('shape')} != {shape}")
    crcs = rec["crc32"]
    for name, dtype in SMALL_ARRAYS.items():
        arr = np.empty((rows, T), dtype=dtype)
        try:
            cache.decode_chunk(name, s, (0, 0), arr, crcs[name][0])
            nbytes += arr.nbytes
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            problems.append(f"{name}: {e}")
    hdt, sdt = spec.hidden_storage
    chunked = [(HIDDEN, np.empty((C, W), dtype=hdt))]
    if sdt is not None:
        chunked.append((SCALES, np.empty((C, spec.scale_width), dtype=sdt)))
    per_row = spec.chunks_per_row()
    for name, buf in chunked:
        for r in range(rows):
            for c in range(per_row):
                try:
                    cache.decode_chunk(name, s, (r, c, 0), buf, crcs[name][r * per_row + c])
                    nbytes += buf.nbytes
                except Exception as e:  # noqa: BLE001
                    problems.append(f"{name}: {e}")
    return problems, nbytes


def verify(path: str, threads: int = 4, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Re-read every committed shard, decode every chunk, check checksums and shapes."""
    read_root(Store(path))
    cache = Cache(path, allow_incomplete=True)
    rep = VerifyReport(path=cache.path, shards_planned=cache.spec.num_shards)
    rep.uncommitted = [s for s in range(cache.spec.num_shards) if s not in cache.commits]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        futs = {s: pool.submit(_verify_shard, cache, s) for s in sorted(cache.commits)}
        for s, f in futs.items():
            problems, n = f.result()
            rep.bytes_checked += n
            if problems:
                rep.bad[s] = problems
            else:
                rep.shards_ok.append(s)
            if progress:
                progress(1)
    return rep


def uncommit(path: str, shards: list[int]) -> list[int]:
    """Un-commit these shards (their commit record is removed, their data left for the next writer to replace):
    the next `dflash extract` with the same settings redoes exactly them. Returns the shards un-committed."""
    store = Store(path)
    done = []
    for s in sorted(set(shards)):
        doc = store.get_json(f"{shard_key(s)}/zarr.json")
        if doc is not None and COMMIT_KEY not in (doc.get("attributes") or {}):
            continue
        store.put(f"{shard_key(s)}/zarr.json", group_json({}))  # atomic: the shard is uncommitted, never half
        done.append(s)
    return done


# Fields of a shard's commit record that differ between two runs writing the same shard (when it was written,
# and by which writer). Everything else in a cache -- every chunk file, every array's zarr.json, the rest of
# each commit record, and the root's attributes except info.run -- is byte-identical after a resume.
VOLATILE_COMMIT_FIELDS = ("time", "writer")
