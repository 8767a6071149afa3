"""What dflash writes inside a cache directory, told apart from everything else in it.

A cache directory holds what the writer makes (format.py's layout):

    zarr.json, shards/zarr.json, shards/NNNNNN/zarr.json,
    shards/NNNNNN/<array>/zarr.json and shards/NNNNNN/<array>/c/<chunk coordinates>
    basis/ (a cache whose features are on their own basis: the array P, basis.py)
        (<array>: input_ids, loss_mask, doc_ids, hidden, and hidden_scales in a quantised cache)
    temp files of interrupted writes (*.partial, store.PARTIAL) and the lock (.dflash.lock*, lock.py)

and possibly things a user put there (notes, a copy of the data, another folder). Those are *foreign*:
`dflash cache verify` lists them as a note and `dflash extract --overwrite` keeps them; nothing in dflash
deletes them.

    foreign_entries(store, spec)   every foreign file or folder (a folder once, not each file in it)
    remove_own(store, spec, under) delete what dflash wrote (in the folder `under`), keep the rest; returns what
                                   was kept

With the cache's spec the layout is checked exactly: shard indices in range, the arrays of that cache, chunk
coordinates that exist in it. Without one any shard index, any of dflash's array names and anything under an
array's c/ counts as dflash's.
"""

from __future__ import annotations

from .format import ARRAYS, SCALES, SHARDS, SMALL_ARRAYS, CacheSpec, shard_arrays

BASIS = "basis"  # the root array of a cache on a basis (basis.py)
from .lock import LOCK_NAME
from .store import PARTIAL, Store

OWN, FOREIGN, MIXED = "own", "foreign", "mixed"  # MIXED: a folder of dflash's whose entries are judged one by one


def _chunk_grid(spec: CacheSpec, shard: int, array: str) -> list[int]:
    """Number of chunks along each dimension of `array` in `shard`."""
    _, rows = spec.shard_rows(shard)
    return [1, 1] if array in SMALL_ARRAYS else [rows, spec.chunks_per_row(), 1]


def judge(parts: list[str], spec: CacheSpec | None, is_dir: bool) -> str:
    """OWN, FOREIGN or MIXED for the entry at `parts` (its path from the cache root), an entry of the root or of a
    folder judged MIXED (the walk descends into no other)."""
    name, depth = parts[-1], len(parts)
    if not is_dir and (name.endswith(PARTIAL) or (name == "zarr.json" and depth <= 4)):
        return OWN  # temp files; zarr.json of the root, shards/, shards/NNNNNN/, shards/NNNNNN/<array>/
    if depth == 1:
        return (OWN if name.startswith(LOCK_NAME) or (name == BASIS and is_dir) else MIXED if name == SHARDS and is_dir
                else FOREIGN)
    if not is_dir and depth < 6:
        return FOREIGN  # only chunks are files below the shards folder, apart from zarr.json
    if depth == 2:  # a shard
        ok = name.isdigit() and name == f"{int(name):06d}" and (spec is None or int(name) < spec.num_shards)
        return MIXED if ok else FOREIGN
    if depth == 3:  # an array of a shard
        return MIXED if name in (shard_arrays(spec) if spec is not None else (*ARRAYS, SCALES)) else FOREIGN
    if depth == 4:  # the array's chunks
        return FOREIGN if name != "c" else OWN if spec is None else MIXED
    # below <array>/c/: one level per dimension, chunk files at the last (small arrays: c/0/0; hidden: c/r/c/0)
    grid = _chunk_grid(spec, int(parts[1]), parts[2])
    level = depth - 5
    if level >= len(grid) or not (name.isdigit() and name == str(int(name)) and int(name) < grid[level]):
        return FOREIGN
    return MIXED if is_dir and level < len(grid) - 1 else OWN if not is_dir and level == len(grid) - 1 else FOREIGN


def _walk(store: Store, spec: CacheSpec | None, on_own, on_foreign, under: str = "") -> None:
    """Visit every entry (under the folder `under`), calling on_own(key, is_dir) / on_foreign(key, is_dir) for the
    topmost of each kind."""
    if store.local:
        entries = store.list_entries
    else:  # an object store: one listing of every key, not one per folder
        tree: dict[str, dict[str, bool]] = {}  # folder -> {name: is a folder}
        for key in store.list_keys(under):
            parts = key.split("/")
            for i, name in enumerate(parts):
                children = tree.setdefault("/".join(parts[:i]), {})
                children[name] = children.get(name, False) or i < len(parts) - 1
        entries = lambda prefix: sorted(tree.get(prefix, {}).items())  # noqa: E731
    stack = [under.split("/") if under else []]
    while stack:
        parts = stack.pop()
        for name, is_dir in entries("/".join(parts)):
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


def remove_own(store: Store, spec: CacheSpec | None = None, under: str = "", keep_lock: bool = True) -> list[str]:
    """Delete what dflash wrote in the cache (written with `spec`, None: any), or in its folder `under` (a shard
    about to be rewritten), the lock too unless keep_lock; return what was kept (foreign).

    The shards' record (shards/zarr.json) goes first and the root zarr.json last, so that an interrupted removal
    leaves a cache with fewer shards (or none), never shards without their root."""
    own: list[str] = []
    kept: list[str] = []

    def mine(key: str, is_dir: bool) -> None:
        if not (keep_lock and key.startswith(LOCK_NAME)):
            own.append(key)

    _walk(store, spec, mine, lambda key, is_dir: kept.append(key + ("/" if is_dir else "")), under)
    first = [k for k in own if k == f"{SHARDS}/zarr.json"]
    last = [k for k in own if k == "zarr.json"]
    for key in first + sorted(k for k in own if k not in first and k not in last) + last:
        store.delete_prefix(key)
    _remove_empty_dirs(store, kept, under or SHARDS)
    return sorted(kept)


def _remove_empty_dirs(store: Store, kept: list[str], top: str) -> None:
    """The folders of dflash's under `top` that removal emptied (shards/NNNNNN/<array>, ...), bottom up; none
    holding a kept entry."""
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

    parent, _, name = top.rpartition("/")
    if (name, True) in store.list_entries(parent):
        prune(top)
