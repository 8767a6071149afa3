"""Tokenise a chat dataset once, in parallel, into flat arrays on disk that every rank (and a rerun) shares.

    data = tokenize_cached(ds, chat_tok, seq_len, source, cache_dir, workers=16, dist=dist)

Contract:
  * The result equals `tokenize_dataset(ds, chat_tok, seq_len, source)`: the same documents in the same order
    (ids, loss masks), the same sample_index and counts, hence the same `data_fingerprint` and packing. Its
    `docs` is a `FlatDocs` (a sequence of (ids, mask) views into two flat arrays, not a list of arrays).
  * Work: `workers` processes (fork, before any CUDA work) each tokenise a contiguous range of rows with
    tokenize_dataset and write flat arrays; the parent concatenates them in row order. DataError from a
    worker (it names the global row) is raised in the parent.
  * Cache: a directory `<cache_dir>/<key>` with ids.npy (int32), mask.npy (uint8), offsets.npy (int64,
    n+1), sample_index.npy (int64) and meta.json (counts, the data fingerprint, the size and sha256 tree digest
    of each array file, and a checksum of its own fields), made visible by one rename (a crash leaves no
    half-written entry). key = sha256 of (the content fingerprint of the data files as load_chat_dataset
    records it, else the dataset's fingerprint as `datasets` computes it; the source path, the number of rows,
    the tokenizer fingerprint, the chat template fingerprint, seq_len, this module's format version). Entries
    are read with mmap: resident memory stays that of the arrays actually touched.
  * Checked on every read: before an entry is used its files are compared with the sizes and digests its
    meta.json recorded when it was written (dflash.core.io.check_files: sizes first, then one streamed read
    hashed in parallel threads). A damaged entry (bytes changed, a file cut short or missing, meta.json
    garbled) is never used: it is removed and rebuilt, with a note naming the file. So an unchanged key never
    yields other ids than tokenising again would.
  * Ranks: under torchrun the node's local rank 0 checks the entry and builds a missing or damaged one while
    the others wait at a barrier, then every rank maps it. A dataset without a fingerprint (a list of dicts) is
    tokenised in memory, uncached.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import numpy as np

from dflash.core.chat import content_of
from dflash.core.io import check_files, file_record, shared_mode, short_hash

from dflash.extract.data import ChatTokenizer, TokenizedData, check_usable, data_fingerprint, tokenize_dataset, tokenizer_fingerprint

FORMAT = 2  # 2: meta.json records the size and digest of every array file (entries of format 1 are not read)
ARRAY_FILES = ("ids.npy", "mask.npy", "offsets.npy", "sample_index.npy")
_COUNTS = ("total", "used", "truncated", "skipped_no_assistant", "skipped_too_long_prompt", "tokens",
           "supervised_tokens")


class FlatDocs:
    """Documents as views into flat arrays: docs[i] -> (ids int32, mask uint8) of document i."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray):
        self.ids, self.mask, self.offsets = ids, mask, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.mask[a:b]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class FlatTokenizedData(TokenizedData):
    """TokenizedData whose docs are a FlatDocs (lengths from the offsets, no per-document objects)."""

    @property
    def lengths(self) -> list[int]:
        return self.docs.lengths.tolist()


def cache_key(ds, source: str, chat_tok: ChatTokenizer, seq_len: int) -> str | None:
    fp = content_of(ds) or getattr(ds, "_fingerprint", None)
    if not fp:
        return None
    payload = json.dumps([FORMAT, fp, os.path.abspath(str(source)), len(ds), tokenizer_fingerprint(chat_tok.tokenizer),
                          chat_tok.fingerprint, int(seq_len)])
    return short_hash(payload, chars=24)


def _flatten(part: TokenizedData):
    lens = np.fromiter((len(i) for i, _ in part.docs), dtype=np.int64, count=len(part.docs))
    ids = np.concatenate([i for i, _ in part.docs]).astype(np.int32) if part.docs else np.zeros(0, np.int32)
    mask = np.concatenate([m for _, m in part.docs]).astype(np.uint8) if part.docs else np.zeros(0, np.uint8)
    return ids, mask, lens, np.asarray(part.sample_index, dtype=np.int64)


_JOB: dict = {}


def _work(args):
    """Worker: tokenise rows [lo, hi) of the dataset (inherited by fork) into npz part files under tmp."""
    lo, hi, tmp = args
    j = _JOB
    try:
        part = tokenize_dataset(j["ds"].select(range(lo, hi)), j["chat_tok"], j["seq_len"], j["source"],
                                progress=False, first_row=lo, allow_empty=True)
    except Exception as e:  # DataError names the row; re-raised in the parent
        return {"error": e}
    ids, mask, lens, sidx = _flatten(part)
    path = os.path.join(tmp, f"part-{lo:012d}.npz")
    np.savez(path, ids=ids, mask=mask, lens=lens, sidx=sidx)
    return {"path": path, "shortest_prompt": part.shortest_prompt, "n_tokens": len(ids), "n_docs": len(lens),
            **{k: getattr(part, k) for k in _COUNTS}}


def tokenize_parallel(ds, chat_tok: ChatTokenizer, seq_len: int, source: str, workers: int, out_dir: str) -> dict:
    """Tokenise all rows with `workers` processes; write the flat arrays + meta.json into out_dir (must exist)."""
    n = len(ds)
    workers = max(1, min(int(workers), n))
    bounds = np.linspace(0, n, workers * 4 + 1 if n >= workers * 4 else workers + 1).astype(int)
    jobs = [(int(a), int(b), out_dir) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    _JOB.update(ds=ds, chat_tok=chat_tok, seq_len=int(seq_len), source=source)
    try:
        if workers == 1:
            results = [_work(j) for j in jobs]
        else:
            with mp.get_context("fork").Pool(workers) as pool:
                results = pool.map(_work, jobs, chunksize=1)
    finally:
        _JOB.clear()
    for r in results:
        if "error" in r:
            raise r["error"]
    counts = {k: sum(r[k] for r in results) for k in _COUNTS}
    prompts = [r["shortest_prompt"] for r in results if r["shortest_prompt"] is not None]
    total_tokens = sum(r["n_tokens"] for r in results)
    ndocs = sum(r["n_docs"] for r in results)
    ids = np.lib.format.open_memmap(os.path.join(out_dir, "ids.npy"), "w+", np.int32, (total_tokens,))
    mask = np.lib.format.open_memmap(os.path.join(out_dir, "mask.npy"), "w+", np.uint8, (total_tokens,))
    offsets = np.zeros(ndocs + 1, np.int64)
    sidx = np.zeros(ndocs, np.int64)
    t = d = 0
    for r in results:  # one part in memory at a time: the parent's peak is a part, not the dataset
        p = dict(np.load(r["path"]))
        k, m = r["n_tokens"], r["n_docs"]
        ids[t:t + k], mask[t:t + k] = p["ids"], p["mask"]
        offsets[d + 1:d + m + 1] = t + np.cumsum(p["lens"])
        sidx[d:d + m] = p["sidx"]
        t, d = t + k, d + m
        os.remove(r["path"])
    ids.flush()
    mask.flush()
    del ids, mask
    np.save(os.path.join(out_dir, "offsets.npy"), offsets)
    np.save(os.path.join(out_dir, "sample_index.npy"), sidx)
    meta = {"format": FORMAT, "seq_len": int(seq_len), "source": str(source), "shortest_prompt": min(prompts, default=None),
            **counts}
    data = _load(out_dir, meta)
    meta["data_fingerprint"] = data_fingerprint(data)
    meta["files"] = file_record({name: os.path.join(out_dir, name) for name in ARRAY_FILES})
    meta["checksum"] = _meta_checksum(meta)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def _meta_checksum(meta: dict) -> str:
    return short_hash(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True))


def entry_problem(path: str) -> str | None:
    """None when the entry at `path` is whole (its meta.json reads, carries its own checksum, and every array file
    has the size and digest recorded at write), else what is wrong, naming the file."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return "meta.json: missing"
    except (OSError, ValueError) as e:
        return f"meta.json: not readable JSON ({e})"
    if not isinstance(meta, dict) or meta.get("checksum") != _meta_checksum(meta):
        return "meta.json: its fields differ from the checksum recorded when it was written"
    if meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        return f"meta.json: format {meta.get('format')!r}, expected {FORMAT}"
    return check_files(meta["files"], {name: os.path.join(path, name) for name in ARRAY_FILES})


def _load(path: str, meta: dict | None = None) -> FlatTokenizedData:
    if meta is None:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    docs = FlatDocs(np.load(os.path.join(path, "ids.npy"), mmap_mode="r"),
                    np.load(os.path.join(path, "mask.npy"), mmap_mode="r"), np.load(os.path.join(path, "offsets.npy")))
    out = FlatTokenizedData(seq_len=meta["seq_len"], shortest_prompt=meta["shortest_prompt"],
                            **{k: meta[k] for k in _COUNTS})
    out.docs = docs
    out.sample_index = np.load(os.path.join(path, "sample_index.npy"))  # int64 [n]
    out.fingerprint = meta.get("data_fingerprint")
    return out


def tokenize_cached(ds, chat_tok: ChatTokenizer, seq_len: int, source: str, cache_dir: str | None,
                    workers: int | None = None, dist=None, progress: bool = True) -> TokenizedData:
    """The dataset tokenised (module docstring): from the cache if present, else built once and cached."""
    workers = workers or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    key = cache_key(ds, source, chat_tok, seq_len) if cache_dir else None
    if key is None:
        if workers == 1 or len(ds) < 2 * workers or not hasattr(ds, "select"):
            return tokenize_dataset(ds, chat_tok, seq_len, source, progress=progress)
        with tempfile.TemporaryDirectory(prefix="dflash-tok-") as tmp:
            meta = tokenize_parallel(ds, chat_tok, seq_len, source, workers, tmp)
            data = _load(tmp, meta)
            data.docs = FlatDocs(np.array(data.docs.ids), np.array(data.docs.mask), data.docs.offsets)  # off the tmp dir
            check_usable(data, source)
            return data
    final = os.path.join(cache_dir, key)
    local_main = dist is None or int(os.environ.get("LOCAL_RANK", "0")) == 0
    if local_main and os.path.isdir(final):
        problem = entry_problem(final)
        if problem:
            print(f"extract: note: the tokenise cache entry {final} is damaged ({problem}); rebuilding it",
                  flush=True)
            aside = f"{final}.damaged-{os.getpid()}"
            os.rename(final, aside)  # out of the way at once (a reader elsewhere sees no entry, not a damaged one)
            shutil.rmtree(aside, ignore_errors=True)
    if local_main and not os.path.exists(os.path.join(final, "meta.json")):
        os.makedirs(cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=cache_dir)
        shared_mode(tmp)  # mkdtemp makes it 0700: the entry is for every user of a shared cache
        try:
            t0 = time.perf_counter()
            tokenize_parallel(ds, chat_tok, seq_len, source, workers, tmp)
            try:
                os.rename(tmp, final)
            except OSError:  # another node built the same entry first: its content is the same
                if not os.path.exists(os.path.join(final, "meta.json")):
                    raise
            print(f"extract: tokenised {len(ds)} conversations with {workers} processes in "
                  f"{time.perf_counter() - t0:.1f} s -> {final}", flush=True)  # once per job and node
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if dist is not None and dist.distributed:
        from dflash.core.dist import barrier  # lazy: this module stays torch-free (dist loads torch)

        barrier()
    data = _load(final)
    check_usable(data, source)
    return data
