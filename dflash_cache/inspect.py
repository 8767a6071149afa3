"""`dflash cache info` and `dflash cache verify`: what a cache holds, and whether every byte is intact.

verify tells three kinds of findings apart, because they are repaired differently:

  * data: a shard whose commit record is unusable or whose chunks are missing, truncated, undecodable or fail
    their CRC-32 (or were written as another shard, or for another cache). `repair` un-commits it, and the next
    `dflash extract` with the same settings rewrites exactly it.
  * metadata: the root zarr.json against its record in shards/zarr.json (format.root_record_json), the record
    itself, each shard group's zarr fields and each array's zarr.json against what the cache's spec makes of it
    (format.array_layout): shape, chunks, data type, codecs, fill value, attributes. The chunks do not depend on
    these files (they are read through the spec and checked by their checksums), so `repair` rewrites the files
    from the record or the spec and un-commits nothing for them.
  * doubt: when the root cannot be checked (no intact record, written by an older dflash) and no committed shard
    verifies against it, or every shard says it was written under another root, the root is what is in doubt,
    not the shards: verify says so and `repair` un-commits nothing.

Files and folders in the cache that dflash did not write are listed as a note (layout.foreign_entries); nothing
deletes them.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .format import (
    COMMIT_KEY,
    FORMAT_NAME,
    FORMAT_VERSION,
    HIDDEN,
    ROOT_RECORD_DIGEST,
    SCALES,
    SHARDS,
    SMALL_ARRAYS,
    CacheCorruptError,
    CacheSpec,
    CacheVersionError,
    array_layout,
    attributes_of,
    commit_problems,
    committed_shards,
    fingerprint,
    group_json,
    load_json,
    read_root,
    root_changes,
    root_digest,
    root_record,
    root_record_json,
    shard_arrays,
    shard_key,
)
from .layout import foreign_entries
from .reader import Cache
from .store import Store
from .writer import array_json


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
        "basis": basis_info(spec),
        "metadata": cache.metadata,
    }


def basis_info(spec: CacheSpec) -> dict[str, Any] | None:
    """What `cache info` says of a cache on a basis (basis.py): R, the features' width, the energy the basis keeps
    (overall and per captured context layer, over its fit tokens) and how it was fitted; None without one."""
    b = spec.basis
    if not b:
        return None
    return {"rank": spec.basis_rank, "width": b.get("width"), "digest": b.get("digest"),
            "energy": b.get("energy"), "energy_per_layer": dict(zip(map(str, spec.context_layer_ids),
                                                                    b.get("energy_per_layer") or [])),
            "fit_tokens": b.get("fit_tokens"), "fit_rows": b.get("fit_rows"), "source": b.get("source")}


@dataclass
class VerifyReport:
    """What `verify` found (see the module docstring). ok: nothing but foreign entries and notes."""

    path: str
    shards_planned: int = 0
    shards_ok: list[int] = field(default_factory=list)
    bad: dict[int, list[str]] = field(default_factory=dict)  # shard -> data problems: repair un-commits it
    uncommitted: list[int] = field(default_factory=list)
    bytes_checked: int = 0
    metadata: list[str] = field(default_factory=list)  # "FILE: what is wrong ..." for each damaged metadata file
    fixes: dict[str, bytes] = field(default_factory=dict)  # file -> what repair writes there (record or spec)
    unrepairable: list[str] = field(default_factory=list)  # what repair cannot restore, and what to do instead
    keep_commits: bool = False  # the root is in doubt: repair un-commits nothing
    foreign: list[str] = field(default_factory=list)  # entries dflash did not write ("notes.txt", "extra/")
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad and not self.uncommitted and not self.metadata and not self.unrepairable

    @property
    def ok_after_repair(self) -> bool:
        """Whether `repair` leaves an intact, complete cache (metadata rewritten, nothing to re-extract)."""
        return not self.bad and not self.uncommitted and not self.unrepairable


ANOTHER_ROOT = "commit record: written for another cache"  # commit_problems' words for a root digest mismatch
_MISSING = object()


def _field_changes(doc: dict, want: dict, limit: int = 3) -> list[str]:
    """How a metadata document differs from the expected one, field by field."""
    keys = [k for k in sorted(set(doc) | set(want)) if doc.get(k, _MISSING) != want.get(k, _MISSING)]
    out = [f"{k} is {doc[k]!r}, expected {want[k]!r}" if k in doc and k in want else
           f"{k} is missing" if k in want else f"{k} is not expected" for k in keys[:limit]]
    return out + ([f"and {len(keys) - limit} more"] if len(keys) > limit else [])


def _check_group(rep: VerifyReport, key: str, doc: Any, want_bytes: bytes) -> None:
    """A group zarr.json whose attributes are intact but whose zarr fields (zarr_format, node_type, ...) are not."""
    want = json.loads(want_bytes)
    if isinstance(doc, dict) and doc != want:
        rep.metadata.append(f"{key}: {'; '.join(_field_changes(doc, want))} (zarr's own fields; the attributes are "
                            "intact); --repair rewrites it")
        rep.fixes[key] = want_bytes


def _shard_groups(store: Store, spec: CacheSpec, rep: VerifyReport) -> dict[int, Any]:
    """shard -> commit record of every committed shard; a shard group zarr.json that cannot be read is a bad shard
    (its record, with the checksums, is lost)."""
    commits: dict[int, Any] = {}
    for name in store.list_dir(SHARDS):
        if not (name.isdigit() and name == f"{int(name):06d}" and int(name) < spec.num_shards):
            continue  # not a shard of this cache (foreign_entries lists it)
        s, key = int(name), f"{SHARDS}/{name}/zarr.json"
        doc, why = load_json(store, key)
        attrs = attributes_of(doc)
        if doc is None and why == "missing":
            continue  # a shard directory without its group: uncommitted
        if attrs is None:
            rep.bad[s] = [f"{key}: {why or 'its attributes are not an object'}: the shard's commit record is lost"]
            continue
        if attrs.get(COMMIT_KEY) is None:
            continue
        commits[s] = attrs[COMMIT_KEY]
        _check_group(rep, key, doc, group_json({COMMIT_KEY: commits[s]}))
    rep.uncommitted = [s for s in range(spec.num_shards) if s not in commits and s not in rep.bad]
    return commits


def _root(store: Store, rep: VerifyReport) -> tuple[dict[str, Any] | None, str | None, bool]:
    """(the root attributes to check the shards against, the root digest their records must carry or None when
    they cannot be checked for it, whether the root was checked: against its record or the shards' digests of it).
    Records what is wrong with the root zarr.json and its record in rep."""
    doc, why = load_json(store, "zarr.json")
    attrs = attributes_of(doc)
    recorded, rec_why = root_record(store)
    rec_doc = load_json(store, f"{SHARDS}/zarr.json")[0]
    if recorded is not None:
        want = json.loads(group_json(recorded))
        if doc != want:
            what = "; ".join(root_changes(attrs, recorded) if attrs is not None else [why or "no attributes"])
            if attrs == recorded:
                what = "; ".join(_field_changes(doc, want)) + " (zarr's own fields; the attributes are intact)"
            rep.metadata.append(f"zarr.json: {what}: the root metadata differs from its record in {SHARDS}/zarr.json, "
                                "written with the cache (no shard is affected); --repair restores it from the record")
            rep.fixes["zarr.json"] = group_json(recorded)
        _check_group(rep, f"{SHARDS}/zarr.json", rec_doc, root_record_json(recorded))
        _refuse_newer(store, recorded)
        return recorded, root_digest(recorded), True

    # no intact record: the root is checked against the root digest in the shards' commit records, if any
    if attrs is None or attrs.get("format") != FORMAT_NAME:
        if rec_why == "absent":
            read_root(store, check_record=False)  # not a cache: NotACacheError naming what is wrong
        rep.unrepairable.append(f"zarr.json: {why or 'not the root of a dflash cache'}, and {rec_why[len('damaged: '):]}: "
                                "nothing to restore the root metadata from; extract the cache again")
        return None, None, False
    _refuse_newer(store, attrs)
    digest = root_digest(attrs)
    try:
        records = committed_shards(store, CacheSpec.from_metadata(attrs).num_shards)
    except CacheCorruptError:
        records = {}  # verify reports the root's own problem
    seen = {rec.get("root") for rec in records.values() if isinstance(rec, dict) and "root" in rec}
    doubt = bool(seen) and digest not in seen
    if doubt:
        rep.keep_commits = True
        rep.unrepairable.append(
            f"zarr.json: differs from the root metadata the shards were written under (their commit records carry its "
            f"digest), and its record in {SHARDS}/zarr.json is {rec_why.replace('damaged: ', '')}: the changed fields "
            "cannot be named or restored; restore zarr.json from a copy, or extract the cache again (--repair "
            "un-commits nothing)")
    elif rec_why.startswith("damaged"):
        recorded_digest = (attributes_of(rec_doc) or {}).get(ROOT_RECORD_DIGEST)
        basis = ("the root matches the digest recorded with it" if recorded_digest == fingerprint(attrs) else
                 "the root matches the digest every shard carries" if seen else
                 "nothing contradicts the root (no shard records its digest)")
        rep.metadata.append(f"{SHARDS}/zarr.json: {rec_why[len('damaged: '):]} ({basis}); --repair rewrites the "
                            "record from the root")
        rep.fixes[f"{SHARDS}/zarr.json"] = root_record_json(attrs)
    elif rec_doc is None:
        rep.metadata.append(f"{SHARDS}/zarr.json: missing (the shards group and its record of the root metadata); "
                            "--repair rewrites it from the root")
        rep.fixes[f"{SHARDS}/zarr.json"] = root_record_json(attrs)
    else:
        rep.notes.append("this cache records no copy of its root metadata (written by an older dflash): a changed "
                         "zarr.json can be noticed only where it disagrees with the shards, and not restored")
    _check_group(rep, "zarr.json", doc, group_json(attrs))
    return attrs, None if doubt else digest, digest in seen


def _refuse_newer(store: Store, attrs: dict[str, Any]) -> None:
    """The error read_root raises for a root written by a newer dflash."""
    if isinstance(attrs.get("format_version"), int) and attrs["format_version"] > FORMAT_VERSION:
        raise CacheVersionError(f"{store.url} was written in cache format version {attrs['format_version']}; this "
                                f"dflash reads versions <= {FORMAT_VERSION}: upgrade dflash")


def _array_metadata(store: Store, spec: CacheSpec, s: int, rep_lines: list[str], fixes: dict[str, bytes]) -> None:
    """Each array's zarr.json of shard s against what the spec makes of it."""
    _, rows = spec.shard_rows(s)
    for name in shard_arrays(spec):
        key = f"{shard_key(s)}/{name}/zarr.json"
        want_bytes = array_json(*array_layout(spec, name, rows))
        want = json.loads(want_bytes)
        doc, why = load_json(store, key)
        if doc == want:
            continue
        what = why if doc is None else "; ".join(_field_changes(doc, want))
        rep_lines.append(f"{key}: {what} (the array's metadata, not its chunks: those are checked on their own); "
                         "--repair rewrites it from the cache's spec")
        fixes[key] = want_bytes


def _verify_shard(cache: Cache, s: int, rec: Any, root: str | None) -> tuple[list[str], list[str], dict[str, bytes], int]:
    """(data problems, metadata problems, metadata fixes, bytes decoded) of committed shard s."""
    spec: CacheSpec = cache.spec
    problems = commit_problems(spec, s, rec, root)
    if problems:  # without its checksums a shard cannot be checked, nor read: it is redone
        return problems, [], {}, 0
    meta: list[str] = []
    fixes: dict[str, bytes] = {}
    _array_metadata(cache.store, spec, s, meta, fixes)
    nbytes = 0
    _, rows = spec.shard_rows(s)
    T, W, C = spec.seq_len, spec.stored_width, spec.hidden_chunk_tokens
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
    return problems, meta, fixes, nbytes


def verify(path: str, threads: int = 4, progress: Callable[[int], None] | None = None,
           on_start: Callable[[int], None] | None = None) -> VerifyReport:
    """Check the cache at `path`: its root metadata against their record, every committed shard's commit record,
    array metadata and chunks (decoded, CRC-checked), and list what dflash did not write. on_start(n) is called
    with the number of committed shards before they are checked, progress(1) after each."""
    store = Store(path)
    if store.root_is_file() or not store.exists_root():
        read_root(store)  # raises the error that names what the path is
    rep = VerifyReport(path=str(path))
    attrs, root, checked = _root(store, rep)
    if attrs is None:
        return rep
    try:
        spec = CacheSpec.from_metadata(attrs)
    except CacheCorruptError as e:
        rep.unrepairable.append(f"zarr.json: {e}: the shards cannot be checked against it; restore zarr.json from a "
                                "copy, or extract the cache again")
        rep.keep_commits = True
        return rep
    rep.shards_planned = spec.num_shards
    if spec.basis:  # P against the digest in the root: a damaged basis makes every shard unreadable as features
        from . import basis

        try:
            basis.read(store, spec.basis)
        except CacheCorruptError as e:
            rep.unrepairable.append(f"{basis.BASIS}: {e}; nothing to restore it from: extract the cache again")
    commits = _shard_groups(store, spec, rep)
    cache = Cache(path, allow_incomplete=True, metadata=attrs)
    if on_start:
        on_start(len(commits))
    with ThreadPoolExecutor(max(1, threads)) as pool:
        futs = {s: pool.submit(_verify_shard, cache, s, commits[s], root) for s in sorted(commits)}
        for s, f in futs.items():
            problems, meta, fixes, n = f.result()
            rep.bytes_checked += n
            rep.metadata += meta
            rep.fixes.update(fixes)
            if problems:
                rep.bad[s] = problems
            else:
                rep.shards_ok.append(s)
            if progress:
                progress(1)
    another = [s for s, p in rep.bad.items() if any(x.startswith(ANOTHER_ROOT) for x in p)]
    if commits and not rep.shards_ok and not rep.keep_commits and (not checked or len(another) == len(commits)):
        rep.keep_commits = True
        rep.unrepairable.append(
            "zarr.json: no committed shard verifies against the root metadata"
            + (" (each was written under another root)" if another else ", which cannot be checked (no record of it)")
            + ": the root is in doubt, not the shards; --repair un-commits nothing: restore zarr.json from a copy, or "
            "extract the cache again")
    rep.foreign = foreign_entries(store, spec)
    return rep


def repair(path: str, rep: VerifyReport) -> list[str]:
    """Act on a VerifyReport: rewrite each damaged metadata file from its record or the spec (the root first), then
    un-commit the bad shards (not when the root is in doubt). Returns one line per action. Hold the cache's lock
    (dflash_cache.lock) around it: not while an extract writes the cache."""
    store = Store(path)
    done = []
    order = sorted(rep.fixes, key=lambda k: (k != "zarr.json", k != f"{SHARDS}/zarr.json", k))
    for key in order:
        store.put(key, rep.fixes[key])
    if order:
        head = ", ".join(order[:6]) + (f" (+{len(order) - 6} more)" if len(order) > 6 else "")
        done.append(f"rewrote {len(order)} metadata file(s) from the record of the root metadata and the cache's "
                    f"spec: {head}; no chunk was touched")
    if rep.bad and not rep.keep_commits:
        fixed = uncommit(path, list(rep.bad))
        done.append(f"un-committed {len(fixed)} shard(s) {', '.join(f'{s:06d}' for s in fixed)}; rerun the same "
                    "`dflash extract` command to rewrite them")
    return done


def uncommit(path: str, shards: list[int]) -> list[int]:
    """Un-commit these shards (their commit record is removed, their data left for the next writer to replace):
    the next `dflash extract` with the same settings redoes exactly them. Returns the shards un-committed."""
    store = Store(path)
    done = []
    for s in sorted(set(shards)):
        attrs = attributes_of(load_json(store, f"{shard_key(s)}/zarr.json")[0])
        if attrs is not None and COMMIT_KEY not in attrs:
            continue
        store.put(f"{shard_key(s)}/zarr.json", group_json({}))  # atomic: the shard is uncommitted, never half
        done.append(s)
    return done


# Fields of a shard's commit record that differ between two runs writing the same shard (when it was written,
# and by which writer). Everything else in a cache -- every chunk file, every array's zarr.json, the rest of
# each commit record, and the root's attributes except info.run -- is byte-identical after a resume.
VOLATILE_COMMIT_FIELDS = ("time", "writer")
