"""Writing a cache: create or reopen the root, then write whole shards, each committed atomically.

    spec = CacheSpec(seq_len=T, hidden_size=H, layer_ids=[1, 9, 17, 25, 33], num_rows=N, rows_per_shard=R)
    w = CacheWriter(path, spec)                       # creates, or reopens and checks the metadata
    for s in range(spec.num_shards):
        if s not in w.committed:                      # resume: committed shards are kept
            w.submit_shard(s, input_ids, loss_mask, doc_ids, hidden)   # returns at once*
            # fp8/fp4 caches: hidden as stored (quant.quantize, e.g. on the GPU) + hidden_scales=...,
            # or bf16 hidden, quantised here in the caller's thread
    w.close()                                         # waits; raises the first write error

* unless max_queued_shards shards are already pending: then it waits for one (bounded memory).

Many writers (processes, machines) may write disjoint shards of one cache at the same time: a shard
is written by exactly one writer, and the root is created once with identical content.
Encoding, checksums and file writes run in background threads; they never touch CUDA (a CUDA
tensor handed to submit_shard is copied to the host in the caller's thread). Any failed write
(disk full, ...) is raised as a CacheError naming the file.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable

import numpy as np

from . import basis as basis_mod
from .format import (
    COMMIT_KEY,
    HIDDEN,
    SCALES,
    SHARDS,
    SMALL_ARRAYS,
    CacheError,
    CacheMismatchError,
    CacheNotFoundError,
    CacheSpec,
    CacheVersionError,
    NotACacheError,
    SMALL_CODEC,
    array_layout,
    chunk_key,
    committed_shards,
    flatten,
    group_json,
    read_root,
    root_digest,
    root_record,
    root_record_json,
    shard_arrays,
    shard_key,
)
from . import quant
from .layout import remove_own
from .lock import LOCK_NAME
from .store import PARTIAL, Codec, Store, crc32, zarr_compressors

_META_CACHE: dict[tuple, bytes] = {}
_META_LOCK = threading.Lock()


def array_json(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str, codec: str, attrs: dict,
               typesize: int = 2) -> bytes:
    """zarr.json of an array, produced by zarr itself (so it is valid for the installed zarr)."""
    key = (shape, chunks, dtype, codec, json.dumps(attrs, sort_keys=True), typesize)
    with _META_LOCK:
        if key not in _META_CACHE:
            import zarr
            from zarr.core.buffer import default_buffer_prototype
            from zarr.core.sync import sync
            from zarr.storage import MemoryStore

            ms = MemoryStore()
            zarr.create_array(ms, name="a", shape=shape, chunks=chunks, dtype=dtype,
                              compressors=zarr_compressors(codec, typesize), fill_value=0, attributes=attrs)
            _META_CACHE[key] = sync(ms.get("a/zarr.json", prototype=default_buffer_prototype())).to_bytes()
        return _META_CACHE[key]


# Metadata that legitimately differs between runs writing the same cache.
VOLATILE_PREFIXES = ("info.run.",)
# Fields a user sets, checked before the ones derived from them (num_shards, hidden_chunk_tokens when
# chosen, num_layers), so that a mismatch names the setting that actually changed.
PRIMARY_FIELDS = ("format", "hidden_dtype", "basis.rank", "basis.digest", "format_version", "last_hidden", "seq_len", "hidden_size", "layer_ids",
                  "num_rows", "rows_per_shard", "codec", "hidden_chunk_tokens")


def _field_order(key: str) -> tuple[int, str]:
    return (PRIMARY_FIELDS.index(key) if key in PRIMARY_FIELDS else len(PRIMARY_FIELDS), key)


def compare_metadata(cached: dict, wanted: dict, path: str) -> None:
    a, b = flatten(cached), flatten(wanted)
    for k in sorted(set(a) | set(b), key=_field_order):
        if k.startswith(VOLATILE_PREFIXES):
            continue
        if json.loads(json.dumps(a.get(k))) != json.loads(json.dumps(b.get(k))):
            raise CacheMismatchError(k, a.get(k), b.get(k), path,
                                     "this run's settings differ from the existing cache; pass --overwrite to replace it")


def existing_root(store: Store, path: str) -> dict[str, Any] | None:
    """The metadata of the cache at `store`, or None where there is none yet (absent or empty directory).

    A directory holding only temp files is empty: a writer killed while creating the root leaves that,
    and so does a concurrent writer caught mid-creation (whose zarr.json appears a moment later).
    """
    try:
        return read_root(store)
    except CacheNotFoundError:
        return None
    except NotACacheError:
        if store.root_is_file():
            raise
        if not [n for n in store.list_dir("") if not n.endswith(PARTIAL) and not n.startswith(LOCK_NAME)]:
            return None
        try:
            return read_root(store)  # another writer may have created it since the first look
        except NotACacheError:
            # never write into, or delete, a directory that is not a cache (even with overwrite)
            raise NotACacheError(
                f"{path} exists and is not a dflash cache; refusing to write into it or replace it: "
                "choose another path or remove it yourself"
            ) from None


class CacheWriter:
    """Writes shards of one cache; see the module docstring.

    threads: chunk encode/write threads. max_inflight_shards: shards written at once.
    max_queued_shards: shards submitted and not yet committed (their arrays are held in memory);
    submit_shard waits while this many are pending. Default 2 * max_inflight_shards.
    overwrite: replace an existing cache at `path`, removing only what dflash wrote there (layout.remove_own);
    `kept` then lists the entries that stayed (a user's files and folders).
    basis: P (float32 [R, K*H]) of a spec with a basis record (basis.py): written into a new cache's root before its
    zarr.json; an existing cache keeps its own (its record must equal the spec's, digest included).
    """

    def __init__(self, path: str, spec: CacheSpec, *, overwrite: bool = False, threads: int = 8,
                 max_inflight_shards: int = 2, create: bool = True, writer_id: str | None = None,
                 max_queued_shards: int | None = None, basis: np.ndarray | None = None):
        self.store = Store(path)
        self.spec = spec
        self.path = str(path)
        self.writer_id = writer_id or f"{socket.gethostname()}:{os.getpid()}"
        hdt, sdt = spec.hidden_storage
        self._hidden_codec = Codec(spec.codec, np.dtype(hdt).itemsize)
        self._scales_codec = Codec(SMALL_CODEC, np.dtype(sdt).itemsize) if sdt else None
        self._small_codec = Codec(SMALL_CODEC, 4)
        meta = spec.to_metadata()
        existing = existing_root(self.store, self.path)
        self.kept: list[str] = []  # overwrite: what was in the directory that dflash did not write (kept)
        if existing is not None and overwrite and create:
            # the old cache (its spec: read_root checked it) goes; the lock and a user's files stay
            self.kept = remove_own(self.store, CacheSpec.from_metadata(existing))
            existing = None
        if existing is not None:
            if bool(existing.get("last_hidden", False)) != spec.last_hidden:  # before the version it implies
                compare_metadata({"last_hidden": bool(existing.get("last_hidden", False))},
                                 {"last_hidden": spec.last_hidden}, self.path)
            if existing.get("hidden_dtype", "bfloat16") == spec.hidden_dtype and existing.get("format_version") != meta["format_version"]:
                raise CacheVersionError(f"{self.path} has format version {existing.get('format_version')}; cannot append to it")
            compare_metadata(existing, meta, self.path)
            if root_record(self.store)[1] == "absent":  # its creator died before writing it, or an older dflash
                self.store.put(f"{SHARDS}/zarr.json", root_record_json(existing))  # (the root matches this run's)
        elif create:
            if spec.basis:  # P first: a root that exists always has its basis

                if basis is None or basis_mod.digest(basis) != spec.basis.get("digest"):
                    raise CacheError(f"{self.path}: the spec's basis record needs its basis P (digest "
                                     f"{spec.basis.get('digest')!r})")
                basis_mod.write(self.store, basis, array_json(*basis_mod.array_layout(basis.shape)))
            self.store.put("zarr.json", group_json(meta))
            self.store.put(f"{SHARDS}/zarr.json", root_record_json(meta))
        else:
            raise CacheError(f"no cache at {self.path} to write into")
        self.metadata = meta
        self.root_digest = root_digest(existing if existing is not None else meta)  # in every commit record
        self.committed = set(committed_shards(self.store, spec.num_shards))
        self.max_queued_shards = max(1, max_queued_shards or 2 * max_inflight_shards)
        self._chunk_pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="dflash-chunk")
        self._shard_pool = ThreadPoolExecutor(max(1, max_inflight_shards), thread_name_prefix="dflash-shard")
        self._futures: list[Future] = []
        self.bytes_written = 0
        self.raw_bytes = 0
        self._lock = threading.Lock()

    # -- writing ---------------------------------------------------------------------------------
    def _check_arrays(self, shard: int, arrays: dict[str, np.ndarray]) -> int:
        _, rows = self.spec.shard_rows(shard)
        T, W = self.spec.seq_len, self.spec.stored_width
        want = {"input_ids": (rows, T), "loss_mask": (rows, T), "doc_ids": (rows, T), HIDDEN: (rows, T, W)}
        if self.spec.quantized:
            want[SCALES] = (rows, T, self.spec.scale_width)
        for name, shape in want.items():
            if tuple(arrays[name].shape) != shape:
                raise CacheError(f"shard {shard}: array '{name}' has shape {tuple(arrays[name].shape)}, expected {shape}")
        return rows

    def _as_numpy(self, name: str, x) -> np.ndarray:
        """A numpy view of x. A torch tensor is moved to the CPU here, in the caller's thread."""
        torch = sys.modules.get("torch")  # x can only be a tensor if torch is loaded
        hdt, sdt = self.spec.hidden_storage
        want = {HIDDEN: hdt, SCALES: sdt}.get(name)
        if torch is not None and isinstance(x, torch.Tensor):
            if name == HIDDEN:
                need = quant.torch_dtypes(self.spec.hidden_dtype)[0]
                if x.dtype != need:
                    raise CacheError(f"hidden of a {self.spec.hidden_dtype} cache must be {need}, got {x.dtype}")
                x = x.detach().cpu()
                return (x.view(torch.int16).numpy().view(np.uint16) if need == torch.bfloat16 else x.view(torch.uint8).numpy())
            x = x.detach().cpu().numpy()
        x = np.asarray(x)
        if want is not None:
            if x.dtype != np.dtype(want):
                if not self.spec.quantized:
                    raise CacheError(f"hidden must be bf16 bits (uint16) or a torch.bfloat16 tensor, got {x.dtype}")
                raise CacheError(f"{name} of a {self.spec.hidden_dtype} cache must be stored as {want}, got {x.dtype}")
            return x
        return x.astype(SMALL_ARRAYS[name], copy=False)

    def _prepare(self, shard: int, input_ids, loss_mask, doc_ids, hidden, hidden_scales=None) -> dict[str, np.ndarray]:
        if self.spec.quantized and hidden_scales is None:
            hidden, hidden_scales = self._quantize_here(hidden)
        elif not self.spec.quantized and hidden_scales is not None:
            raise CacheError("hidden_scales given for a bfloat16 cache (it has none)")
        arrays = {"input_ids": input_ids, "loss_mask": loss_mask, "doc_ids": doc_ids, HIDDEN: hidden}
        if hidden_scales is not None:
            arrays[SCALES] = hidden_scales
        arrays = {k: self._as_numpy(k, v) for k, v in arrays.items()}
        self._check_arrays(shard, arrays)
        return arrays

    def _quantize_here(self, hidden):
        """bf16 hidden states (a torch.bfloat16 tensor or bf16 bits as uint16) for a quantised cache: quantise
        them in the caller's thread (extraction quantises on the GPU instead and passes hidden_scales)."""
        import torch

        if not isinstance(hidden, torch.Tensor):
            arr = np.asarray(hidden)
            if arr.dtype != np.uint16:
                raise CacheError(f"hidden of a {self.spec.hidden_dtype} cache without hidden_scales must be bf16 "
                                 f"(a torch.bfloat16 tensor or uint16 bits), got {arr.dtype}")
            hidden = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
        elif hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CacheError(f"hidden of a {self.spec.hidden_dtype} cache without hidden_scales must be a float tensor "
                             f"to quantise, got {hidden.dtype}")
        return quant.quantize(hidden, self.spec.hidden_dtype, self.spec.feature_width // self.spec.scale_group)

    def _put_chunk(self, key: str, arr: np.ndarray, codec: Codec) -> tuple[int, int]:
        c = crc32(arr)
        data = codec.encode(arr)
        self.store.put(key, data)  # raises CacheError naming the file (disk full, ...)
        return c, len(data)

    def write_shard(self, shard: int, input_ids, loss_mask, doc_ids, hidden, *, hidden_scales=None) -> dict[str, Any]:
        """Write and commit one shard (blocking; chunks are encoded in parallel)."""
        return self._write(shard, self._prepare(shard, input_ids, loss_mask, doc_ids, hidden, hidden_scales))

    def _write(self, shard: int, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        rows = arrays["doc_ids"].shape[0]
        T, C = self.spec.seq_len, self.spec.hidden_chunk_tokens
        base = shard_key(shard)
        remove_own(self.store, self.spec, base)  # whatever a crashed writer left (a user's files there stay: layout.py)
        self.store.put(f"{base}/zarr.json", group_json({}))
        jobs: dict[str, list[Future]] = {}
        try:
            for name in shard_arrays(self.spec):
                self.store.put(f"{base}/{name}/zarr.json", array_json(*array_layout(self.spec, name, rows)))
            for name in SMALL_ARRAYS:
                jobs[name] = [self._chunk_pool.submit(self._put_chunk, chunk_key(f"{base}/{name}", (0, 0)),
                                                      np.ascontiguousarray(arrays[name]), self._small_codec)]
            h = arrays[HIDDEN]
            jobs[HIDDEN] = [self._chunk_pool.submit(self._put_chunk, chunk_key(f"{base}/{HIDDEN}", (r, c, 0)),
                                                    h[r, c * C:(c + 1) * C], self._hidden_codec)
                            for r in range(rows) for c in range(T // C)]
            if self.spec.quantized:
                sc = arrays[SCALES]
                jobs[SCALES] = [self._chunk_pool.submit(self._put_chunk, chunk_key(f"{base}/{SCALES}", (r, c, 0)),
                                                        sc[r, c * C:(c + 1) * C], self._scales_codec)
                                for r in range(rows) for c in range(T // C)]
            doc = arrays["doc_ids"]
            stats = {
                "rows": rows,
                "real_tokens": int(np.count_nonzero(doc)),
                "docs": int(doc.max(axis=1).astype(np.int64).sum()) if rows else 0,
                "supervised_tokens": int(np.count_nonzero(arrays["loss_mask"])),
            }
            crcs, stored = {}, 0
            for name, futs in jobs.items():
                res = [f.result() for f in futs]
                crcs[name] = [c for c, _ in res]
                stored += sum(n for _, n in res)
        except BaseException:
            for futs in jobs.values():  # the shard failed: do not write (or wait for) the rest of it
                for f in futs:
                    f.cancel()
            raise
        record = {**stats, "crc32": crcs, "stored_bytes": stored, "shard": shard, "root": self.root_digest,
                  "writer": self.writer_id,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.store.put(f"{base}/zarr.json", group_json({COMMIT_KEY: record}))  # the commit: last, atomic
        with self._lock:
            self.committed.add(shard)
            self.bytes_written += stored
            self.raw_bytes += sum(a.nbytes for a in arrays.values())
        return record

    def submit_shard(self, shard: int, input_ids, loss_mask, doc_ids, hidden,
                     on_done: Callable[[Future], None] | None = None, *, hidden_scales=None) -> Future:
        """Write a shard in the background. The arrays must stay untouched until the future is done.

        Shapes and dtypes are checked (and tensors moved to the CPU) here, in the caller's thread. Returns
        at once unless max_queued_shards shards are pending; then it waits for one to finish, so a writer
        slower than its producer holds bounded memory. Raises the error of an earlier failed shard.
        """
        arrays = self._prepare(shard, input_ids, loss_mask, doc_ids, hidden, hidden_scales)
        self.raise_errors()
        while len(self._futures) >= self.max_queued_shards:
            wait(self._futures, return_when=FIRST_COMPLETED)
            self.raise_errors()
        fut = self._shard_pool.submit(self._write, shard, arrays)
        if on_done is not None:
            fut.add_done_callback(on_done)
        self._futures.append(fut)
        return fut

    def raise_errors(self) -> None:
        """Re-raise the first failed background write (and forget finished ones)."""
        still = []
        for f in self._futures:
            if f.done():
                f.result()
            else:
                still.append(f)
        self._futures = still

    def wait(self) -> None:
        """Wait for every submitted shard; raise the first error."""
        futs, self._futures = self._futures, []
        wait(futs)
        for f in futs:
            f.result()

    def close(self) -> None:
        """Wait for every submitted shard, shut the threads down, then raise the first error if any."""
        try:
            self.wait()
        finally:
            self._shard_pool.shutdown(wait=True)
            self._chunk_pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def abort(self) -> None:
        """Stop: cancel shards not started, wait for those in progress; commits already made stay."""
        self._shard_pool.shutdown(wait=True, cancel_futures=True)
        self._chunk_pool.shutdown(wait=True, cancel_futures=True)

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            self.abort()
