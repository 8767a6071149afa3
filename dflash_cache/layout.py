"""What dflash writes inside a cache directory, told apart from everything else in it.

A cache directory holds what the writer makes (format.py's layout):

    zarr.json, shards/zarr.json, shards/NNNNNN/zarr.json,
    shards/NNNNNN/<array>/zarr.json and shards/NNNNNN/<array>/c/<chunk coordinates>
        (<array>: input_ids, loss_mask, doc_ids, hidden, and hidden_scales in a quantised cache)
    temp files of interrupted writes (*.partial, store.PARTIAL) and the lock (.dflash.lock*, lock.py)

and possibly things a user put there (notes, a copy of the data, another folder). Those are *foreign*:
`dflash cache verify` lists them as a note and `dflash extract --overwrite` keeps them; nothing in dflash
deletes them.

    foreign_entries(store, spec)   every foreign file or folder (a folder once, not each file in it)
    remove_own(store)              delete what dflash wrote, keep the rest; returns what was kept

With a spec (verify) the layout is checked exactly: shard indices in range, the arrays of that cache, chunk
coordinates that exist in it. Without one (--overwrite of a cache about to be replaced) any shard index, any
of dflash's array names and anything under an array's c/ counts as dflash's.
"""

from __future__ import annotations

from .format import ARRAYS, SCALES, SHARDS, SMALL_ARRAYS, CacheSpec, shard_arrays
from .lock import LOCK_NAME
from .store import PARTIAL, Store

LOCK_PREFIX = LOCK_NAME  # the lock and its temp files (lock.py)

OWN, FOREIGN, MIXED = "own", "foreign", "mixed"  # MIXED: a folder of dflash's whose entries are judged one by one


def _chunk_coords(spec: CacheSpec, shard: int, array: str) -> list[int]:
    """Number of chunks along each dimension of `array` in `shard`."""
    _, rows = spec.shard_rows(shard)
    if array in SMALL_ARRAYS:  # one chunk
        return [1, 1]
    return [rows, spec.chunks_per_row(), 1]


def judge(parts: list[str], spec: CacheSpec | None, is_dir: bool) -> str:
    """OWN, FOREIGN or MIXED for the entry at path `parts` (relative to the cache root)."""
    name = parts[-1]
    if not is_dir and name.endswith(PARTIAL):
        return OWN
    n = len(parts)
    if n == 1:
        if name.startswith(LOCK_PREFIX) or (name == "zarr.json" and not is_dir):
            return OWN
        return MIXED if name == SHARDS and is_dir else FOREIGN
    if parts[0] != SHARDS:
        return FOREIGN
    if n == 2:
        if name == "zarr.json":
            return FOREIGN if is_dir else OWN
        ok = is_dir and name.isdigit() and name == f"{int(name):06d}" and (spec is None or int(name) < spec.num_shards)
        return MIXED if ok else FOREIGN
    arrays = shard_arrays(spec) if spec is not None else (*ARRAYS, SCALES)
    if n == 3:
        if name == "zarr.json":
            return FOREIGN if is_dir else OWN
        return MIXED if is_dir and name in arrays else FOREIGN
    if n == 4:
        if name == "zarr.json":
            return FOREIGN if is_dir else OWN
        if name != "c" or not is_dir:
            return FOREIGN
        return OWN if spec is None else MIXED
    # under <array>/c/: coordinates, one level per dimension, the last level files
    if spec is None:
        return OWN
    dims = _chunk_coords(spec, int(parts[1]), parts[2])
    level = n - 5  # 0 for the first coordinate
    if level >= len(dims) or not (name.isdigit() and name == str(int(name)) and int(name) < dims[level]):
        return FOREIGN
    last = level == len(dims) - 1
    return (OWN if not is_dir else FOREIGN) if last else (MIXED if is_dir else FOREIGN)


def _walk(store: Store, spec: CacheSpec | None, on_own, on_foreign) -> None:
    """Visit every entry, calling on_own(key, is_dir) / on_foreign(key, is_dir) for the topmost of each kind."""
    stack = [[]]
    while stack:
        parts = stack.pop()
        for name, is_dir in store.list_entries("/".join(parts)):
            child = parts + [name]
            key = "/".join(child)
            verdict = judge(child, spec, is_dir)
            if verdict == MIXED:
                stack.append(child)
            elif verdict == OWN:
                on_own(key, is_dir)
            else:
                on_foreign(key, is_dir)


def foreign_entries(store: Store, spec: CacheSpec | None = None) -> list[str]:
    """Every file or folder in the cache that dflash did not write ("notes.txt", "extra/"), sorted."""
    found: list[str] = []
    _walk(store, spec, lambda key, is_dir: None, lambda key, is_dir: found.append(key + ("/" if is_dir else "")))
    return sorted(found)


def remove_own(store: Store, keep_lock: bool = True) -> list[str]:
    """Delete what dflash wrote in the cache (the lock too unless keep_lock); return what was kept (foreign).

    The shards' record (shards/zarr.json) goes first and the root zarr.json last, so that an interrupted removal
    leaves a cache with fewer shards (or none), never shards without their root."""
    own: list[str] = []
    kept: list[str] = []

    def mine(key: str, is_dir: bool) -> None:
        if not (keep_lock and key.startswith(LOCK_PREFIX)):
            own.append(key)

    _walk(store, None, mine, lambda key, is_dir: kept.append(key + ("/" if is_dir else "")))
    first = [k for k in own if k == f"{SHARDS}/zarr.json"]
    last = [k for k in own if k == "zarr.json"]
    for key in first + sorted(k for k in own if k not in first and k not in last) + last:
        store.delete_prefix(key)
    _remove_empty_dirs(store, kept)
    return sorted(kept)


def _remove_empty_dirs(store: Store, kept: list[str]) -> None:
    """The folders of dflash's that removal emptied (shards/NNNNNN/<array>, ...), bottom up; none holding a kept
    entry."""
    def prune(prefix: str) -> bool:  # True: prefix is now empty and removed
        empty = True
        for name, is_dir in store.list_entries(prefix):
            key = f"{prefix}/{name}"
            if is_dir and not any(k == key + "/" or k.startswith(key + "/") for k in kept):
                empty = prune(key) and empty
            else:
                empty = False
        if empty:
            store.delete_prefix(prefix)
        return empty

    if any(name == SHARDS and is_dir for name, is_dir in store.list_entries("")):
        prune(SHARDS)
