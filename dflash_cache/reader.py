"""Reading a cache: random access to rows, and the deterministic sharded batch iterator.

    cache = dflash_cache.open(path, expect={"layer_ids": [1, 9, 17, 25, 33], "seq_len": 4096})
    len(cache)                   # rows
    cache.metadata["layer_ids"]  # the root metadata
    cache[i]                     # {"input_ids": int32 [T], "loss_mask": uint8 [T], "doc_ids": int32 [T],
                                 #  "hidden": bfloat16 [T, K*H]} as torch tensors
    for batch in cache.batches(4, rank=r, world=w, epoch=e, seed=0):
        ...                      # the same dict with a leading [4] dim, plus "row_index", "row_valid"

A cache on a basis (format.py, basis.py) holds z = P x: its rows' "hidden" is [T, R] (+ H with a last hidden state),
and cache.basis() is P.

Quantised caches (hidden_dtype float8_e4m3fn / fp4_e2m1, see format.py): random access (cache[i],
read_rows) dequantises to bfloat16 on the CPU, so such a reader sees what it sees in a bf16 cache
(read_rows(..., raw=True) gives the stored form). The batch iterator moves the stored bytes only: it
refuses a quantised cache unless the consumer says it takes them (batches(..., quantized=True)); its
batches then hold "hidden" as stored (float8_e4m3fn [B, T, K*H] or uint8 [B, T, K*H/2]) and
"hidden_scales", and the consumer dequantises on its device with quant.dequantize(hidden, hidden_scales).

Decoding runs in background threads (blosc/zstd release the GIL) straight into the batch buffers;
no thread here ever touches CUDA. With pin_memory=True the buffers are a ring of pinned tensors
allocated once by the caller's (main) thread; the caller must call batch.release() once its
host-to-device copy has completed, and only then is the buffer reused. epochs=None iterates epoch
after epoch with the same threads and buffers, decoding the next epoch's first batches ahead.

The data order (Cache.epoch_rows), one rule for every run, so that a trainer that follows a cache while it is
being written (open(..., follow=True), `dflash train --follow`) reads exactly what a run over the finished
cache reads with the same seed:
  * Shards are written and read in `shard_order(num_shards)`: 0, a, 2a, ... (mod num_shards), a stride near
    num_shards x 0.618 that is prime to num_shards. `dflash extract` commits each rank's shards in that order
    (extract/run.py), so the committed shards grow along it whatever the number of ranks.
  * Epoch 0 cuts that order into windows of `window_rows` rows (whole shards: ceil(window_rows /
    rows_per_shard) of them) and visits the windows in turn, the rows of each window shuffled (one generator
    seeded by (seed, 0) draws the windows' permutations one after the other). A follower therefore needs only
    the shards of the window it is in, and it trails the extraction by about one window.
  * Epochs >= 1 are one permutation of all rows (seeded by (seed, epoch)): the cache is complete by then, since
    epoch 0 read every row.
  * window_rows >= the cache's rows (or None) makes epoch 0 one permutation too: a cache that fits in one window
    is read exactly as before windows existed.
  Shuffle quality: the packer fills rows best-fit decreasing, so consecutive rows are alike (the first ones hold
  the longest conversations, the last ones the shortest). Consecutive shards of the stride order lie ~0.38 or
  ~0.62 of the cache apart and any W of them are spread over the whole cache (the golden-ratio sequence is the
  most even there is), so every window is a stratified sample of all rows, not a stretch of similar ones. What
  remains is that rows of one shard (rows_per_shard consecutive rows) always share a window in epoch 0, and that
  a window's rows cannot meet rows of other windows in a batch; later epochs mix everything.
"""

from __future__ import annotations

import collections
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from .format import (
    HIDDEN,
    SCALES,
    SMALL_ARRAYS,
    CacheCorruptError,
    CacheError,
    CacheIncompleteError,
    SMALL_CODEC,
    COMMIT_KEY,
    CacheSpec,
    check_expectations,
    chunk_key,
    commit_problems,
    committed_shards,
    read_root,
    root_digest,
    shard_key,
)
from . import quant
from .store import Codec, Store, crc32

if TYPE_CHECKING:
    import torch
# torch is imported where tensors are made, so that `dflash cache info|verify` start in a fraction of a second.


def open(path: str, expect: dict[str, Any] | None = None, allow_incomplete: bool = False,
         threads: int = 4, follow: bool = False) -> "Cache":
    """Open a cache for reading. `expect` maps (dotted) metadata fields to required values.

    allow_incomplete: a cache with uncommitted shards opens, and its rows are those of the committed shards.
    follow: a cache that is still being written opens with every row of its plan (len() is the final row count);
    rows of shards not yet committed are waited for by the batch iterator (batches(..., wait=...))."""
    return Cache(path, expect=expect, allow_incomplete=allow_incomplete, threads=threads, follow=follow)


def shard_order(num_shards: int) -> list[int]:
    """The order in which shards are written and first read (module docstring): s_k = k * a mod num_shards, with
    a the integer nearest num_shards * 0.618 that is prime to num_shards (1 for one or two shards)."""
    if num_shards <= 2:
        return list(range(num_shards))
    golden = (5 ** 0.5 - 1) / 2
    base = round(num_shards * golden)
    for d in range(num_shards):  # the nearest coprime stride, upward first (1 is coprime: the search ends)
        for a in (base + d, base - d):
            if 0 < a < num_shards and math.gcd(a, num_shards) == 1:
                return [k * a % num_shards for k in range(num_shards)]
    return list(range(num_shards))  # unreachable: a = 1 is always prime to num_shards


class Batch(dict):
    """A dict of CPU tensors; call release() after its data was copied elsewhere (pinned mode)."""

    def __init__(self, data: dict[str, "torch.Tensor"], release=None):
        super().__init__(data)
        self._release = release

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


class Cache:
    def __init__(self, path: str, expect=None, allow_incomplete=False, threads=4, follow=False,
                 metadata: dict | None = None):
        self.path = str(path)
        self.store = Store(path)
        self.metadata = read_root(self.store) if metadata is None else metadata  # verify: the recorded root
        self.spec = CacheSpec.from_metadata(self.metadata)
        self.root_digest = root_digest(self.metadata)  # each commit record names the root it was written under
        check_expectations(self.metadata, expect, self.path)
        self.commits = committed_shards(self.store, self.spec.num_shards)
        missing = [s for s in range(self.spec.num_shards) if s not in self.commits]
        self.complete = not missing
        self.follow = follow
        if missing and not (allow_incomplete or follow):
            raise CacheIncompleteError(
                f"cache {self.path} is incomplete: {len(missing)} of {self.spec.num_shards} shards are not committed "
                f"(first: {missing[0]}); rerun the extraction to finish it"
            )
        # global row index -> (shard, row in shard), in shard order: over the plan's shards when the cache is
        # complete or followed (row i is then row i of the plan), else over the committed shards. Row counts come
        # from the plan; a commit record that disagrees is corrupt (see commit_record()).
        self._shards = list(range(self.spec.num_shards)) if (self.complete or follow) else sorted(self.commits)
        counts = [self.spec.shard_rows(s)[1] for s in self._shards]
        self._starts = np.cumsum([0] + counts)
        hdt, sdt = self.spec.hidden_storage
        self._hidden_codec = Codec(self.spec.codec, np.dtype(hdt).itemsize)
        self._scales_codec = Codec(SMALL_CODEC, np.dtype(sdt).itemsize) if sdt else None
        self._small_codec = Codec(SMALL_CODEC, 4)
        self._small: collections.OrderedDict[int, dict[str, np.ndarray]] = collections.OrderedDict()
        self._small_lock = threading.Lock()
        self._records_ok: set[int] = set()
        self._tls = threading.local()
        self.threads = threads

    # -- basic facts ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def layer_ids(self) -> list[int]:
        return list(self.spec.layer_ids)

    @property
    def context_layer_ids(self) -> list[int]:
        """The layers a drafter reads as context (layer_ids but the last of a last_hidden cache)."""
        return self.spec.context_layer_ids

    @property
    def last_hidden(self) -> bool:
        """Whether each row's last H channels are the target's last hidden state (format.py)."""
        return self.spec.last_hidden

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def basis_rank(self) -> int:
        """R when the context features are stored on their own basis (rows hold z = P x: basis.py), else 0."""
        return self.spec.basis_rank

    def basis(self) -> np.ndarray | None:
        """P (float32 [R, K*H]) of a cache on a basis, read from its root and checked against its digest; None
        for a cache of plain features."""
        if not self.spec.basis:
            return None
        if getattr(self, "_basis", None) is None:
            from . import basis

            self._basis = basis.read(self.store, self.spec.basis, self.path)
        return self._basis

    @property
    def hidden_dtype(self) -> str:
        return self.spec.hidden_dtype

    @property
    def real_tokens(self) -> int:
        return sum(int(c.get("real_tokens", 0)) for c in self.commits.values() if isinstance(c, dict))

    def locate(self, i: int) -> tuple[int, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for a cache of {n} rows")
        i %= n
        k = int(np.searchsorted(self._starts, i, side="right") - 1)
        return self._shards[k], i - int(self._starts[k])

    @property
    def committed_rows(self) -> int:
        return sum(self.spec.shard_rows(s)[1] for s in self.commits)

    def poll(self, shards) -> list[int]:
        """Which of `shards` are still not committed, after re-reading the commit records of those not known to be
        (a followed cache grows while it is read; commits are never taken back while it is read)."""
        missing = []
        for s in sorted(set(int(x) for x in shards)):
            if s in self.commits:
                continue
            doc = self.store.get_json(f"{shard_key(s)}/zarr.json")
            rec = ((doc or {}).get("attributes") or {}).get(COMMIT_KEY)
            if rec is None:
                missing.append(s)
            else:
                self.commits[s] = rec
        if not missing and len(self.commits) == self.spec.num_shards:
            self.complete = True
        return missing

    def refresh(self) -> int:
        """Re-read every commit record (a listing of the shards); returns how many shards are committed."""
        self.commits.update(committed_shards(self.store, self.spec.num_shards))
        self.complete = len(self.commits) == self.spec.num_shards
        return len(self.commits)

    def commit_record(self, shard: int) -> dict[str, Any]:
        """A shard's commit record, checked to hold every checksum (CacheCorruptError if it does not)."""
        if shard not in self.commits:
            raise CacheIncompleteError(f"cache {self.path}: shard {shard} is not committed (yet)")
        rec = self.commits[shard]
        if shard not in self._records_ok:
            problems = commit_problems(self.spec, shard, rec, self.root_digest)
            if problems:
                raise CacheCorruptError(f"cache {self.path}: shard {shard}: {problems[0]}; run `dflash cache verify`")
            self._records_ok.add(shard)
        return rec

    # -- decoding --------------------------------------------------------------------------------
    def _fetch(self, key: str, shard: int, codec: Codec, out: np.ndarray) -> memoryview:
        """The stored bytes of a chunk: read straight into `out` when stored raw, else into this
        thread's scratch buffer (reused: large fresh buffers cost page faults on every read)."""
        raw = codec.name == "none"
        buf = memoryview(out).cast("B") if raw else self._scratch(0)
        n = self.store.get_into(key, buf)
        if n is not None and n > len(buf) and not raw:
            buf = self._scratch(n)
            n = self.store.get_into(key, buf)
        if n is None:
            raise CacheCorruptError(f"cache {self.path}: shard {shard} is committed but {key} is missing; run `dflash cache verify`")
        if raw and n != out.nbytes:
            raise CacheCorruptError(f"cache {self.path}: shard {shard}: {key} has {n} bytes, expected {out.nbytes} "
                                    "(truncated or overwritten); run `dflash cache verify`")
        return buf[:n]

    def _scratch(self, size: int) -> memoryview:
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._tls.buf = bytearray(max(size, 1 << 20))
        return memoryview(buf)

    def _decode(self, key: str, shard: int, codec: Codec, out: np.ndarray, crc: int | None) -> None:
        data = self._fetch(key, shard, codec, out)
        try:
            if codec.name != "none":
                codec.decode(data, out)
        except Exception as e:
            raise CacheCorruptError(f"cache {self.path}: shard {shard}: cannot decode {key} ({e}); run `dflash cache verify`") from e
        if crc is not None and crc32(out) != crc:
            raise CacheCorruptError(f"cache {self.path}: shard {shard}: checksum mismatch in {key}")

    def decode_chunk(self, array: str, shard: int, coords: tuple[int, ...], out: np.ndarray, crc: int | None) -> None:
        """Decode one stored chunk of `array` (input_ids, loss_mask, doc_ids, hidden or hidden_scales) of a shard,
        at chunk coordinates `coords`, into out, and check it against `crc` (None: no check). A missing,
        truncated, undecodable or mismatching chunk raises CacheCorruptError naming the shard and the chunk."""
        codec = self._hidden_codec if array == HIDDEN else self._scales_codec if array == SCALES else self._small_codec
        self._decode(chunk_key(f"{shard_key(shard)}/{array}", coords), shard, codec, out, crc)

    def shard_small(self, shard: int, check: bool = True) -> dict[str, np.ndarray]:
        """The small arrays of a shard (input_ids, loss_mask, doc_ids), cached in memory."""
        with self._small_lock:
            if shard in self._small:
                self._small.move_to_end(shard)
                return self._small[shard]
        rec = self.commit_record(shard)
        rows, T = int(rec["rows"]), self.spec.seq_len
        out = {}
        for name, dtype in SMALL_ARRAYS.items():
            arr = np.empty((rows, T), dtype=dtype)
            crc = rec["crc32"][name][0] if check else None
            self._decode(chunk_key(f"{shard_key(shard)}/{name}", (0, 0)), shard, self._small_codec, arr, crc)
            out[name] = arr
        with self._small_lock:
            self._small[shard] = out
            while len(self._small) > 64:
                self._small.popitem(last=False)
        return out

    def read_hidden_into(self, shard: int, row: int, out: np.ndarray, check: bool = False,
                         scales_out: np.ndarray | None = None) -> None:
        """Decode row `row` of `shard` into out (as stored: uint16 [T, K*H] bf16 bits, uint8 [T, K*H] fp8,
        uint8 [T, K*H/2] fp4) and, for a quantised cache, its scales into scales_out ([T, S])."""
        C = self.spec.hidden_chunk_tokens
        for c in range(self.spec.chunks_per_row()):
            sc = scales_out[c * C:(c + 1) * C] if scales_out is not None else None
            self._read_hidden_chunk(shard, row, c, out[c * C:(c + 1) * C], check, sc)

    def _read_hidden_chunk(self, shard: int, row: int, c: int, out: np.ndarray, check: bool,
                           scales_out: np.ndarray | None = None) -> None:
        """Decode hidden chunk c (tokens c*C .. (c+1)*C) of a row into out ([C, stored width]) and its
        scales chunk into scales_out (a quantised cache must be given one)."""
        k = row * self.spec.chunks_per_row() + c
        crcs = self.commit_record(shard)["crc32"] if check else None
        self._decode(chunk_key(f"{shard_key(shard)}/{HIDDEN}", (row, c, 0)), shard, self._hidden_codec, out,
                     crcs[HIDDEN][k] if crcs else None)
        if self.spec.quantized:
            if scales_out is None:
                raise CacheError(f"cache {self.path} is {self.spec.hidden_dtype}: its hidden bytes need their scales")
            self._decode(chunk_key(f"{shard_key(shard)}/{SCALES}", (row, c, 0)), shard, self._scales_codec,
                         scales_out, crcs[SCALES][k] if crcs else None)

    def _copy_small(self, shard: int, row: int, bufs: dict[str, np.ndarray], slot: int) -> None:
        small = self.shard_small(shard)
        for name in SMALL_ARRAYS:
            bufs[name][slot] = small[name][row]

    def _read_row_into(self, i: int, bufs: dict[str, np.ndarray], slot: int, check: bool) -> None:
        shard, r = self.locate(i)
        self._copy_small(shard, r, bufs, slot)
        self.read_hidden_into(shard, r, bufs[HIDDEN][slot], check, bufs[SCALES][slot] if SCALES in bufs else None)

    def _submit_row(self, pool: ThreadPoolExecutor, i: int, bufs: dict[str, np.ndarray], slot: int,
                    check: bool) -> list[Future]:
        """_read_row_into as one task per hidden chunk, so that one row is decoded on many cores."""
        shard, r = self.locate(i)
        C = self.spec.hidden_chunk_tokens
        futs = [pool.submit(self._copy_small, shard, r, bufs, slot)]
        for c in range(self.spec.chunks_per_row()):
            sc = bufs[SCALES][slot, c * C:(c + 1) * C] if SCALES in bufs else None
            futs.append(pool.submit(self._read_hidden_chunk, shard, r, c, bufs[HIDDEN][slot, c * C:(c + 1) * C],
                                    check, sc))
        return futs

    def _alloc(self, n: int, pin: bool) -> tuple[dict[str, "torch.Tensor"], dict[str, np.ndarray]]:
        import torch

        T, W, spec = self.spec.seq_len, self.spec.stored_width, self.spec
        hidden_dtype, scales_dtype = quant.torch_dtypes(spec.hidden_dtype)
        tens = {
            "input_ids": torch.empty(n, T, dtype=torch.int32, pin_memory=pin),
            "loss_mask": torch.empty(n, T, dtype=torch.uint8, pin_memory=pin),
            "doc_ids": torch.empty(n, T, dtype=torch.int32, pin_memory=pin),
            HIDDEN: torch.empty(n, T, W, dtype=hidden_dtype, pin_memory=pin),
        }
        if spec.quantized:
            tens[SCALES] = torch.empty(n, T, spec.scale_width, dtype=scales_dtype, pin_memory=pin)
        views = {k: v.numpy() for k, v in tens.items() if k != HIDDEN}
        views[HIDDEN] = (tens[HIDDEN].view(torch.int16).numpy().view(np.uint16) if hidden_dtype == torch.bfloat16
                         else tens[HIDDEN].view(torch.uint8).numpy())
        return tens, views

    def __getitem__(self, i: int) -> dict[str, "torch.Tensor"]:
        """Row i (hidden as bfloat16, dequantised on the CPU for a quantised cache), every chunk CRC-checked."""
        return {k: v[0] for k, v in self.read_rows([int(i)], check=True).items()}

    def read_rows(self, indices, check: bool = False, raw: bool = False) -> dict[str, "torch.Tensor"]:
        """Rows as CPU tensors: hidden as bfloat16 (dequantised), or with raw=True as stored (+ hidden_scales)."""
        tens, views = self._alloc(len(indices), False)
        for slot, i in enumerate(indices):
            self._read_row_into(int(i), views, slot, check)
        if self.spec.quantized and not raw:
            tens[HIDDEN] = quant.dequantize(tens[HIDDEN], tens.pop(SCALES))
        return tens

    # -- the training iterator ---------------------------------------------------------------------
    def steps_per_epoch(self, batch_rows: int, world: int = 1) -> int:
        return -(-len(self) // (batch_rows * world))

    def epoch_rows(self, epoch: int, seed: int, window_rows: int | None = None) -> np.ndarray:
        """Every row index once, in the order epoch `epoch` reads them (the rule in the module docstring)."""
        n = len(self)
        rng = np.random.default_rng([seed, epoch])
        planned = self.complete or self.follow  # row i is row i of the plan: windows of the shard order apply
        if epoch > 0 or not window_rows or window_rows >= n or not planned:
            return rng.permutation(n)
        per = max(1, -(-int(window_rows) // self.spec.rows_per_shard))  # shards per window
        order = shard_order(self.spec.num_shards)
        out = []
        for k in range(0, len(order), per):
            rows = np.sort(np.concatenate([np.arange(*self._row_span(s)) for s in order[k:k + per]]))
            out.append(rows[rng.permutation(len(rows))])
        return np.concatenate(out)

    def _row_span(self, shard: int) -> tuple[int, int]:
        start, count = self.spec.shard_rows(shard)
        return start, start + count

    def epoch_order(self, batch_rows: int, rank: int, world: int, epoch: int, seed: int,
                    window_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(row indices [steps, batch_rows], valid [steps, batch_rows]) for one rank and epoch.

        The epoch's rows in epoch_rows' order, shared by all ranks; rank r takes every world-th batch
        slot. The tail is filled with repeats of the epoch's first rows marked invalid (their loss mask is
        zeroed), so every row is seen exactly once per epoch across ranks and every batch has the same shape.
        """
        if batch_rows < 1:
            raise CacheError(f"batch_rows must be at least 1, got {batch_rows}")
        if not 0 <= rank < world:
            raise CacheError(f"rank {rank} is out of range for world size {world}")
        n = len(self)
        if n == 0:
            raise CacheError(f"cache {self.path} has no rows")
        perm = self.epoch_rows(epoch, seed, window_rows)
        steps = self.steps_per_epoch(batch_rows, world)
        total = steps * batch_rows * world
        idx = np.concatenate([perm, perm[np.arange(total - n) % n]])
        valid = np.arange(total) < n
        idx = idx.reshape(steps, world, batch_rows)[:, rank]
        valid = valid.reshape(steps, world, batch_rows)[:, rank]
        return idx, valid

    def batches(self, batch_rows: int, *, rank: int = 0, world: int = 1, epoch: int = 0, seed: int = 0,
                start_step: int = 0, prefetch: int = 4, threads: int | None = None, pin_memory: bool = False,
                check: bool = False, epochs: int | None = 1, reuse_buffers: bool | None = None,
                quantized: bool = False, window_rows: int | None = None,
                wait: Callable[[list[int], int], None] | None = None) -> Iterator[Batch]:
        """Fixed-shape batches for one rank: `epochs` epochs (None: endless) from step `start_step` of
        `epoch` on (for resume), in epoch_order(..., window_rows). Decoding runs ahead across epoch boundaries
        on one thread pool.

        With pin_memory (or reuse_buffers) the batches live in a ring of prefetch + 2 preallocated
        buffers: call batch.release() once a batch has been copied away, and its buffer is refilled.
        quantized=True: the consumer takes a quantised cache's stored bytes and scales (module docstring);
        without it a quantised cache is refused (its bytes are not bf16 values).

        A followed cache (open(..., follow=True)): a batch is decoded only once every shard its rows lie in is
        committed (poll()); batches are still yielded in order, so decoding ahead stops at the first batch
        whose shards are missing. When no decoded batch is left, the iterator calls wait(missing shards, rows
        yielded so far) again and again until they are committed: wait sleeps a little, may report, and raises
        to give up (a dead extraction is its business). Without `wait` a missing shard is an error.
        """
        import torch

        if self.spec.quantized and not quantized:
            raise CacheError(
                f"cache {self.path} holds {self.spec.hidden_dtype} hidden states (bytes + scales), and this reader "
                "expects bfloat16: dequantise with dflash_cache.quant.dequantize and pass batches(..., quantized=True), "
                "or read rows with cache[i] / read_rows (dequantised)")

        if start_step < 0:
            raise CacheError(f"start_step must be >= 0, got {start_step}")
        if epochs is not None and epochs < 1:
            raise CacheError(f"epochs must be >= 1 or None (endless), got {epochs}")

        def plan():  # (row indices, valid, rows whose shards must be there) of each batch, epoch after epoch
            e, first = epoch, start_step
            while epochs is None or e < epoch + epochs:
                order, valid = self.epoch_order(batch_rows, rank, world, e, seed, window_rows)
                # a followed cache: a rank waits for the shards of the step's whole global batch, so that the ranks
                # wait here together, not one of them in the next all-reduce while another waits for data
                every = self.epoch_order(batch_rows * world, 0, 1, e, seed, window_rows)[0] \
                    if (wait is not None and world > 1 and not self.complete) else order
                for k in range(first, len(order)):
                    yield order[k], valid[k], every[k]
                e, first = e + 1, 0
                if len(order) == 0:  # an empty cache has no batches in any epoch
                    return

        it = plan()
        upcoming = next(it, None)
        if upcoming is None:
            return
        use_ring = pin_memory if reuse_buffers is None else reuse_buffers
        pool = ThreadPoolExecutor(threads or self.threads, thread_name_prefix="dflash-read")
        ring = [self._alloc(batch_rows, pin_memory) for _ in range(prefetch + 2)] if use_ring else None
        free = collections.deque(range(len(ring))) if ring is not None else None
        lock = threading.Lock()

        def give_back(slot: int):
            def release():
                with lock:
                    free.append(slot)
            return release

        def start(rows: np.ndarray, valid: np.ndarray):
            """Allocate (or take a free ring buffer) and submit the decoding of one batch."""
            if ring is None:
                slot, (tens, views) = None, self._alloc(batch_rows, pin_memory)
            else:
                with lock:
                    slot = free.popleft()
                tens, views = ring[slot]
            futs = [f for j, i in enumerate(rows) for f in self._submit_row(pool, int(i), views, j, check)]
            return rows, valid, tens, views, slot, futs

        def can_start() -> bool:
            if ring is None:
                return True
            with lock:
                return bool(free)

        served = 0  # rows yielded so far (for wait's report)

        def missing(rows: np.ndarray) -> list[int]:
            """Shards of `rows` not committed yet (a complete cache has none)."""
            if self.complete:
                return []
            return self.poll({self.locate(int(i))[0] for i in rows})

        pending: collections.deque = collections.deque()
        try:
            def top_up():
                nonlocal upcoming
                while len(pending) < prefetch and upcoming is not None and can_start():
                    absent = missing(upcoming[2])
                    if absent and pending:
                        return  # decode what is there; look again after the next batch
                    while absent:  # nothing else to hand out: wait for the extraction
                        if wait is None:
                            raise CacheIncompleteError(
                                f"cache {self.path}: shard {absent[0]} is not committed (the next batch needs it)")
                        wait(absent, served)
                        absent = missing(upcoming[2])
                    pending.append(start(*upcoming[:2]))
                    upcoming = next(it, None)

            top_up()
            while pending:
                rows, valid, tens, views, slot, futs = pending.popleft()
                for f in futs:
                    f.result()
                bad = ~valid
                if bad.any():
                    views["loss_mask"][bad] = 0  # filler rows (repeats that even out the ranks) teach nothing
                out = dict(tens)
                out["row_index"] = torch.from_numpy(rows.astype(np.int64))
                out["row_valid"] = torch.from_numpy(valid.copy())
                yield Batch(out, give_back(slot) if slot is not None else None)
                served += len(rows)
                top_up()
                if ring is not None and not pending and upcoming is not None:
                    raise CacheError(
                        f"all {len(ring)} batch buffers are held by the consumer: call batch.release() "
                        "once a batch has been copied away"
                    )
        finally:
            for *_, futs in pending:
                for f in futs:
                    f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
