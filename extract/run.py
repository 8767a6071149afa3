"""`dflash extract`: chat data -> packed rows of T tokens -> frozen target -> committed cache shards.

One process per GPU (torchrun); the shards are split over the global ranks by real tokens (greedy
longest-processing-time, extract/assign.py: the same partition on every rank), so `--nnodes` spreads a
job over machines that share the cache's filesystem or object store. Every rank tokenises and
packs the whole dataset identically (deterministic), then runs only its shards, in the order a trainer that
follows the cache reads them first (dflash_cache.shard_order; `dflash train --follow`). The plan (rows and
shards) is in the cache's root from its creation on, so such a trainer knows the final size.

The GPU never waits on the disk: each forward writes the captured layers into one of two device
buffers; with --hidden-dtype fp8/fp4 it is quantised there, on the device, into a second pair of
device buffers (bytes + scales: the host copy moves half or a quarter of the bf16 bytes); a side
stream copies it asynchronously into a pinned host buffer (one per shard in flight); when a shard's
last copy has landed (polled with event.query() from this, the only
CUDA thread), the shard goes to the cache writer, whose threads compress, checksum and write it.
The main thread blocks only when every host buffer is still being written (disk-bound). Each batch's token ids
reach the GPU by a non-blocking copy from pinned memory, so the host queues the next forward while the current
one runs (a blocking copy would make it wait for the GPU at every batch: _rows_to_device).
"""

from __future__ import annotations

import os
import queue
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import dflash_cache
import dflash_cache.basis
from dflash.core import progress
from dflash.core.chat import load_chat_dataset
from dflash.core.config import check
from dflash.core.dist import barrier, compute_init, print0, resolve_dtype
from dflash.core.hybrid import check_layer_kinds
from dflash.core.layers import default_layer_ids
from dflash.core.paths import output_lock
from dflash.core.target import TargetError, load_config, load_tokenizer, target_info, text_config, validate_layer_ids
from dflash.core.weights import compare_full, fingerprint
from dflash_cache import CacheSpec, CacheWriter, quant
from dflash_cache.store import Store
from dflash_cache.writer import existing_root

from dflash.extract import basis_fit
from dflash.extract.assign import assign_shards, shard_real_tokens, writer_threads_per_rank
from dflash.extract.data import ChatTokenizer, data_fingerprint, tokenizer_fingerprint
from dflash.extract.pack import materialize, pack, pack_stats
from dflash.extract.target import PackedTarget
from dflash.extract.tokenize_cache import tokenize_cached


@dataclass
class ExtractConfig:
    target: str = ""
    data: str = ""
    out: str = ""
    split: str = "train"
    max_samples: int | None = None
    seq_len: int = 2048
    layers: list[int] | None = None  # None: DFlash's rule (num_context_layers ids from 1 to L-3)
    num_context_layers: int | None = None  # None: 5, or every id of the rule's range for a shallower target
    rows_per_shard: int = 0  # 0: about 512 MB of hidden states per shard
    batch_rows: int = 0  # rows per target forward; 0: ~16k tokens (~4k on a CPU: plan_sizes)
    dtype: str = "auto"  # bfloat16 on GPU, float32 on CPU
    attn: str = "auto"  # flex (GPU) or sdpa
    codec: str = "zstd"  # measured: ~1.27x on bf16 hidden states at >5 GB/s on 16 cores; lz4 only ~1.06x
    hidden_dtype: str = "bf16"  # bf16 | fp8 | fp4 (dflash_cache.quant: quantised on the device before the copy)
    # also the target's last hidden state (after its final norm): what `dflash train --arch dflash2` learns the target's
    # distribution from; H values more per token (dflash_cache/format.py), and the target's last layers run
    last_hidden: bool = False
    # the context features stored on their own basis of this many directions (0: as they are); extract/basis_fit.py
    basis_rank: int = 0
    basis_from: str | None = None  # a cache whose basis this one is stored on (instead of fitting one)
    basis_fit_tokens: int = 65536  # row tokens of the plan the basis is fitted on (dflash_cache.basis.FIT_TOKENS)
    writer_threads: int | None = None  # None: this process's cores / extraction ranks on the node
    host_buffers: int = 3
    chat_template: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    compile: str = "auto"  # a compiled, checked target forward (extract/compiled.py): on for GPU; off = eager
    tokenize_workers: int = 0  # 0: this process's cores
    tokenize_cache: str | None = None  # None: $DFLASH_TOKENIZE_CACHE or ~/.cache/dflash/tokenized; "off": none
    overwrite: bool = False
    device: str = "auto"
    progress: bool = True

    def __post_init__(self):
        check(bool(self.target), "target", "is required (a local HF model directory or .gguf file)")
        check(bool(self.data), "data", "is required (a json/jsonl/parquet file, a directory, or a save_to_disk dataset)")
        check(bool(self.out), "out", "is required (the cache path or URL)")
        check(self.seq_len >= 16, "seq_len", f"must be >= 16, got {self.seq_len}")
        check(self.max_samples is None or self.max_samples > 0, "max_samples", "must be positive")
        check(self.num_context_layers is None or self.num_context_layers >= 1, "num_context_layers", "must be >= 1")
        check(self.rows_per_shard >= 0, "rows_per_shard", f"must be >= 0 (0: about 512 MB per shard), got {self.rows_per_shard}")
        check(self.batch_rows >= 0, "batch_rows", f"must be >= 0 (0: about 16k tokens per forward), got {self.batch_rows}")
        check(self.dtype in ("auto", "bfloat16", "float32"), "dtype", f"must be auto, bfloat16 or float32, got {self.dtype!r}")
        check(self.attn in ("auto", "flex", "sdpa"), "attn", f"must be auto, flex or sdpa, got {self.attn!r}")
        check(self.codec in dflash_cache.format.CODECS, "codec", f"must be one of {list(dflash_cache.format.CODECS)}")
        check(self.hidden_dtype in quant.CLI_NAMES, "hidden_dtype",
              f"must be one of {', '.join(quant.CLI_NAMES)}, got {self.hidden_dtype!r}")
        check(self.writer_threads is None or self.writer_threads >= 1, "writer_threads", f"must be >= 1, got {self.writer_threads}")
        check(self.compile in ("auto", "on", "off"), "compile", f"must be auto, on or off, got {self.compile!r}")
        check(self.tokenize_workers >= 0, "tokenize_workers", f"must be >= 0 (0: every core), got {self.tokenize_workers}")
        check(self.host_buffers >= 1, "host_buffers", f"must be >= 1, got {self.host_buffers}")
        check(self.basis_rank >= 0, "basis_rank", f"must be >= 0 (0: the features as they are), got {self.basis_rank}")
        check(self.basis_fit_tokens >= 1, "basis_fit_tokens", f"must be >= 1, got {self.basis_fit_tokens}")
        check(not ((self.basis_rank or self.basis_from) and self.hidden_dtype == "fp4"), "hidden_dtype",
              "fp4 does not store features on a basis (--basis-rank/--basis-from): use fp8 or bf16")


def plan_sizes(cfg: ExtractConfig, row_bytes: int, cpu: bool = False) -> tuple[int, int]:
    """(batch_rows, rows_per_shard): ~16k tokens per forward, ~512 MB per shard, shard = whole batches of 16k tokens.
    On a CPU (cpu=True) the default forward is the largest divisor of that batch with at most ~4k tokens: a CPU's
    throughput is the same, and the progress bar (updated per forward) shows an ETA after 1/4 as much work (the demo's
    cache is a handful of 16k-token batches); the shards stay the same."""
    batch = cfg.batch_rows or max(1, 16384 // cfg.seq_len)
    if cfg.rows_per_shard:
        return min(batch, cfg.rows_per_shard), cfg.rows_per_shard
    shard = batch * max(1, round((512 << 20) / (batch * row_bytes)))
    if cpu and not cfg.batch_rows:
        batch = max(d for d in range(1, batch + 1) if batch % d == 0 and (d == 1 or d * cfg.seq_len <= 4096))
    return batch, shard


def run_extract(cfg: ExtractConfig) -> dict[str, Any]:
    """The command; rank 0 holds the output's lock throughout (one writer per cache: dflash_cache.lock)."""
    dist = compute_init(cfg.device)
    with output_lock(cfg.out, "extract", dist.is_main, precheck=_refuse_non_cache):
        return _run_extract(cfg, dist)


def _refuse_non_cache(out: str) -> None:
    """An --out that exists and is not a dflash cache (a file, a user's folder) is never written into."""
    existing_root(Store(out), out)


def _run_extract(cfg: ExtractConfig, dist) -> dict[str, Any]:
    dev = dist.device
    dtype = resolve_dtype(cfg.dtype, dev)
    attn = cfg.attn if cfg.attn != "auto" else ("flex" if dev.type == "cuda" else "sdpa")
    show = cfg.progress and dist.is_main

    # 1. what to capture
    hf_cfg = load_config(cfg.target)
    tc = text_config(hf_cfg)
    if cfg.layers is not None:
        layer_ids = validate_layer_ids(cfg.layers, tc.num_hidden_layers, cfg.target)
    else:
        L, K = tc.num_hidden_layers, cfg.num_context_layers
        if K is not None and K > max(1, L - 3):
            raise TargetError(f"--num-context-layers {K}: the default rule picks distinct layer ids from 1 to L-3 = {L - 3} "
                              f"of {cfg.target} ({L} layers): at most {max(1, L - 3)}; or name them with --layers")
        try:
            default = default_layer_ids(tc.num_hidden_layers, K or 5)
        except ValueError as e:  # a target too shallow for the rule: a clear error naming the flag, not a traceback
            raise TargetError(f"--layers: {e}") from e
        layer_ids = validate_layer_ids(default, tc.num_hidden_layers, cfg.target)
    if cfg.last_hidden:  # the target's last layer after the context layers (dflash_cache/format.py)
        last = tc.num_hidden_layers - 1
        if last in layer_ids:
            raise TargetError(f"--last-hidden: the context layers {layer_ids} already hold the last layer ({last}) of "
                              f"{cfg.target}: pick --layers below it")
        layer_ids = [*layer_ids, last]
    check_layer_kinds(hf_cfg, f"--target {cfg.target}", max(layer_ids) + 1)  # before any work (core/hybrid.py)
    H = tc.hidden_size

    # 2. the data, tokenised with the target's chat template and packed (identically on every rank)
    tokenizer = load_tokenizer(cfg.target)
    chat_tok = ChatTokenizer(tokenizer, cfg.chat_template_kwargs, chat_template=cfg.chat_template)
    ds = load_chat_dataset(cfg.data, split=cfg.split, max_samples=cfg.max_samples)
    data = tokenize_cached(ds, chat_tok, cfg.seq_len, cfg.data, _tokenize_cache_dir(cfg), cfg.tokenize_workers or None,
                           dist=dist, progress=show)
    lengths = data.lengths
    plan = pack(lengths, cfg.seq_len)
    pstats = pack_stats(plan, lengths, cfg.seq_len)
    hidden_dtype = quant.resolve(cfg.hidden_dtype)
    why = quant.check_shape(hidden_dtype, H)
    if why:
        raise TargetError(f"--hidden-dtype {cfg.hidden_dtype}: {why}")
    row_bytes = cfg.seq_len * len(layer_ids) * H * 2  # shard sizes stay those of bf16 (same rows per shard)
    batch_rows, rows_per_shard = plan_sizes(cfg, row_bytes, cpu=dev.type == "cpu")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    # 3. the cache (rank 0 creates or checks it; a changed setting is an error unless --overwrite)
    info = {
        "target": target_info(cfg.target, hf_cfg).as_dict(),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "chat_template_fingerprint": chat_tok.fingerprint,
        "data_fingerprint": getattr(data, "fingerprint", None) or data_fingerprint(data),
        "data": {"path": os.path.abspath(cfg.data), "split": cfg.split, "max_samples": cfg.max_samples,
                 **data.counts(), "packing_padding_fraction": round(pstats.padding_fraction, 6)},
        "extraction": {"dtype": str(dtype).replace("torch.", ""), "attn": attn, "pad_id": int(pad_id)},
        "run": {"batch_rows": batch_rows, "world": dist.world, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    weights = _weights_record(cfg, tc) if dist.is_main else None
    if weights is not None:
        info["weights"] = weights
    if dist.is_main:
        _same_inputs_moved(cfg, info)
    target = None
    context_width = (len(layer_ids) - cfg.last_hidden) * H
    basis_p, basis_rec = None, {}
    if dist.is_main and (cfg.basis_rank or cfg.basis_from or not cfg.overwrite):  # extract/basis_fit.py
        def fit():
            nonlocal target
            target = PackedTarget(cfg.target, layer_ids, device=dev, dtype=dtype, attn=attn)
            print0(f"extract: fitting a basis of rank {cfg.basis_rank} for the {context_width} context features")
            return basis_fit.fit_basis(target, plan, data.docs, cfg.seq_len, pad_id, batch_rows, dev,
                                       width=context_width, stored_layers=len(layer_ids), hidden_size=H,
                                       rank=cfg.basis_rank, fit_tokens=cfg.basis_fit_tokens)

        basis_p, basis_rec = basis_fit.resolve_on_main(
            cfg, None if cfg.overwrite else existing_root(Store(cfg.out), cfg.out), width=context_width,
            hidden_size=H, layer_ids=layer_ids[:len(layer_ids) - cfg.last_hidden],
            config_hash=info["target"].get("config_hash"), fit=fit)
    spec = CacheSpec(seq_len=cfg.seq_len, hidden_size=H, layer_ids=layer_ids, num_rows=len(plan),
                     rows_per_shard=rows_per_shard, codec=cfg.codec, hidden_dtype=hidden_dtype, info=info,
                     last_hidden=cfg.last_hidden, basis=basis_rec)
    threads = cfg.writer_threads or writer_threads_per_rank()
    if dist.is_main:
        writer = CacheWriter(cfg.out, spec, overwrite=cfg.overwrite, threads=threads, writer_id=f"rank{dist.rank}",
                             basis=basis_p)
        if writer.kept:  # --overwrite removed the old cache only: a user's files in the directory stay
            print0(f"extract: --overwrite kept {len(writer.kept)} entries dflash did not write: {', '.join(writer.kept)}")
    barrier()
    if not dist.is_main:
        recorded = dflash_cache.open(cfg.out, allow_incomplete=True).metadata.get("info", {}).get("weights")
        if recorded is not None:  # rank 0 hashed the target and checked it; the other ranks adopt its record
            info["weights"] = recorded
        _same_inputs_moved(cfg, info, say=lambda _: None)  # as rank 0 did (it said so)
        basis_p, basis_rec = basis_fit.resolve_on_rank(cfg.out)  # the P rank 0 fitted or kept, from the root
        spec = CacheSpec(seq_len=cfg.seq_len, hidden_size=H, layer_ids=layer_ids, num_rows=len(plan),
                         rows_per_shard=rows_per_shard, codec=cfg.codec, hidden_dtype=hidden_dtype, info=info,
                         last_hidden=cfg.last_hidden, basis=basis_rec)
        writer = CacheWriter(cfg.out, spec, threads=threads, writer_id=f"rank{dist.rank}")
    shard_tokens = shard_real_tokens(plan, lengths, rows_per_shard)
    mine = assign_shards(shard_tokens, dist.world)[dist.rank]
    # in the order a trainer following the cache reads them first (dflash_cache.reader.shard_order)
    rank_of = {s: k for k, s in enumerate(dflash_cache.shard_order(spec.num_shards))}
    todo = sorted((s for s in mine if s not in writer.committed), key=rank_of.__getitem__)
    print0(f"extract: {data.summary()}")
    ctx = getattr(tc, "max_position_embeddings", None)
    beyond = sum(1 for n in lengths if n > ctx) if isinstance(ctx, int) and ctx > 0 else 0
    if beyond:  # positions restart in each conversation: only one longer than the context runs past it
        print0(f"extract: note: {beyond} conversations are longer than the target's context (max_position_embeddings "
               f"{ctx} of {cfg.target}; --seq-len {cfg.seq_len}): past {ctx} tokens their hidden states come from "
               f"positions it was not trained on; a --seq-len of at most {ctx} cuts them there")
    print0(f"extract: {len(plan)} rows of {cfg.seq_len} tokens ({100 * pstats.padding_fraction:.2f}% padding), "
           f"{spec.num_shards} shards of {rows_per_shard} rows; layers {layer_ids} of {tc.num_hidden_layers}; "
           f"{len(mine) - len(todo)} of this rank's {len(mine)} shards already committed")

    t0 = time.perf_counter()
    done_tokens, load_s, tail_s = 0, 0.0, 0.0
    summary_compile: dict[str, Any] = {"compiled": False, "why": f"--compile {cfg.compile}" if todo else "nothing to do"}
    if todo:
        target = target or PackedTarget(cfg.target, layer_ids, device=dev, dtype=dtype, attn=attn)
        load_s = time.perf_counter() - t0
        if cfg.compile == "on" or (cfg.compile == "auto" and dev.type == "cuda"):
            target, summary_compile = _compiled_target(target, spec, plan, data.docs, pad_id, todo[0], batch_rows, dev)
        t0 = time.perf_counter()  # tokens/s counts forwards + committed writes, not loading the model
        try:
            done_tokens, last_batch_t = _extract_shards(cfg, spec, plan, data.docs, pad_id, todo, target, writer,
                                                        batch_rows, dev, show, basis_p)
        except BaseException:
            writer.abort()  # drop queued shards (they would only fail again); committed ones stay
            raise
    writer.close()
    if todo:
        tail_s = time.perf_counter() - last_batch_t
    elapsed = time.perf_counter() - t0
    barrier()
    all_tokens, slowest = done_tokens, elapsed
    if dist.distributed:  # the job's throughput: every rank's tokens over the slowest rank's time
        t = torch.tensor([float(done_tokens), elapsed], dtype=torch.float64, device=dev)
        tot = t.clone()
        torch.distributed.all_reduce(tot[:1])
        torch.distributed.all_reduce(t[1:], op=torch.distributed.ReduceOp.MAX)
        all_tokens, slowest = int(tot[0].item()), float(t[1].item())
    summary = {
        "rows": len(plan), "shards": spec.num_shards, "layer_ids": layer_ids, "seq_len": cfg.seq_len,
        "padding_fraction": pstats.padding_fraction, "data": data.counts(), "elapsed_s": elapsed, "load_s": load_s,
        "tail_s": tail_s,  # from the last batch on the host to the job's end: its shard's encoding and write
        "tokens_this_rank": done_tokens, "tokens_per_s_this_rank": done_tokens / elapsed if elapsed > 0 else 0.0,
        "shards_this_rank": len(mine), "assigned_tokens_this_rank": int(shard_tokens[mine].sum()) if mine else 0,
        "writer_threads": threads, "compile": summary_compile,
        "bytes_written_this_rank": writer.bytes_written, "raw_bytes_this_rank": writer.raw_bytes,
        "ranks": dist.world, "tokens_all_ranks": all_tokens, "slowest_rank_s": slowest,
        "tokens_per_s_all_ranks": all_tokens / slowest if slowest > 0 else 0.0,
    }
    if dist.is_main:
        c = dflash_cache.open(cfg.out, allow_incomplete=True)
        summary.update(cache_complete=c.complete, real_tokens=c.real_tokens)
        print0(f"extract: wrote {done_tokens:,} real tokens on rank 0 in {elapsed:.1f} s "
               f"({summary['tokens_per_s_this_rank']:,.0f} tok/s); cache {'complete' if c.complete else 'INCOMPLETE'}: "
               f"{len(c)} rows, {c.real_tokens:,} real tokens -> {cfg.out}")
        if not todo and mine:
            print0(f"extract: nothing to do: every shard was already committed (not re-read: `dflash cache verify "
                   f"{cfg.out}` checks every byte, and --repair un-commits bad shards for the next run to redo)")
    return summary


def _weights_record(cfg: ExtractConfig, tc) -> dict | None:
    """The content fingerprint of the target's weights for the cache's root (info.weights), checked against the
    existing cache on resume: other weights are an error naming the tensor. None for a cache written before
    fingerprints were recorded (resumed without the check, with a note)."""
    fp = fingerprint(cfg.target, tied=bool(getattr(tc, "tie_word_embeddings", False)))
    existing = None if cfg.overwrite else existing_root(Store(cfg.out), cfg.out)
    if existing is None:
        return fp.as_dict()
    recorded = (existing.get("info") or {}).get("weights")
    if recorded is None:
        print0(f"extract: note: {cfg.out} records no content fingerprint of its target's weights (written by an older "
               f"dflash): cannot check that the new shards come from the same weights as the old ones")
        return None
    diff = compare_full(recorded, fp)
    if diff:
        raise TargetError(f"--target {cfg.target}: the cache {cfg.out} was extracted from other weights ({diff}); "
                          "resume with the target it was started with, or pass --overwrite to start over")
    return fp.as_dict()


def _same_inputs_moved(cfg: ExtractConfig, info: dict, say=print0) -> None:
    """Resuming a cache whose data or target now lies at another path: their content is what the cache depends on
    (data_fingerprint, the weights' digest), so the same content moved is the same input. The cache keeps the paths it
    recorded (its root is written once), said in a note; other content at the new path is refused as before."""
    existing = None if cfg.overwrite else existing_root(Store(cfg.out), cfg.out)
    old = (existing or {}).get("info") or {}
    if not isinstance(old, dict):
        return
    moved = []
    data_was = (old.get("data") or {}).get("path") if isinstance(old.get("data"), dict) else None
    if data_was and data_was != info["data"]["path"] and old.get("data_fingerprint") == info["data_fingerprint"]:
        moved.append(f"--data {info['data']['path']} (recorded: {data_was})")
        info["data"]["path"] = data_was
    target_was = (old.get("target") or {}).get("name_or_path") if isinstance(old.get("target"), dict) else None
    digest = (old.get("weights") or {}).get("digest") if isinstance(old.get("weights"), dict) else None
    if (target_was and target_was != info["target"].get("name_or_path") and digest
            and digest == (info.get("weights") or {}).get("digest")
            and old["target"].get("config_hash") == info["target"].get("config_hash")):
        moved.append(f"--target {info['target']['name_or_path']} (recorded: {target_was})")
        info["target"]["name_or_path"] = target_was
    if moved:
        say(f"extract: note: {' and '.join(moved)}: another path, the same content (fingerprints equal): "
               f"resuming {cfg.out}, which keeps the paths it recorded")


def _extract_shards(cfg, spec, plan, docs, pad_id, todo, target, writer, batch_rows, dev, show,
                    basis_p=None) -> tuple[int, float]:
    """Runs the forwards of `todo`'s shards and hands each shard to the writer; returns the real tokens done and
    the time (perf_counter) at which the last batch's hidden states were on the host. basis_p: the cache's basis P
    (the context features are projected onto it on the device, extract/basis_fit.py)."""
    T, W = spec.seq_len, spec.row_width
    context_width = len(spec.context_layer_ids) * spec.hidden_size
    basis_t = torch.from_numpy(basis_p).to(dev) if basis_p is not None else None
    cuda = dev.type == "cuda"
    free: queue.Queue[int] = queue.Queue()
    # what is stored per token: hidden (bf16, fp8 bytes or packed fp4) and, quantised, its scales
    hidden_t, scales_t = quant.torch_dtypes(spec.hidden_dtype)
    stored = [(spec.stored_width, hidden_t)] + ([(spec.scale_width, scales_t)] if spec.quantized else [])
    slots = [[torch.empty(spec.rows_per_shard, T, w, dtype=dt, pin_memory=cuda) for w, dt in stored]
             for _ in range(cfg.host_buffers)]
    for i in range(len(slots)):
        free.put(i)
    gbufs = [torch.empty(batch_rows, T, W, dtype=torch.bfloat16, device=dev) for _ in range(2 if cuda else 1)]
    qbufs = [[torch.empty(batch_rows, T, w, dtype=dt, device=dev) for w, dt in stored] for _ in gbufs] \
        if spec.quantized else None
    copy_stream = torch.cuda.Stream(dev) if cuda else None
    copied: list[torch.cuda.Event | None] = [None] * len(gbufs)
    pending: list[tuple[int, int, dict, Any]] = []  # (shard, slot, arrays, event of its last copy)
    total = sum(len(docs[d][0]) for s in todo for r in _row_range(spec, s) for d in plan[r])
    # the ETA's rate is timed after the first batch on a GPU (it builds the kernels); on a CPU, where a few large
    # batches may be all there is, from the start
    bar = progress.bar(show, total=total, unit="tok", unit_scale=True, desc="extract", warmup=1 if cuda else 0)
    done = 0
    nbatch = 0

    def submit(item):
        shard, slot, arrays, _ = item
        n = arrays["input_ids"].shape[0]
        writer.submit_shard(shard, arrays["input_ids"], arrays["loss_mask"], arrays["doc_ids"], slots[slot][0][:n],
                            on_done=lambda fut, slot=slot: free.put(slot),
                            hidden_scales=slots[slot][1][:n] if spec.quantized else None)

    def flush(block: bool):
        while pending and (block or pending[0][3] is None or pending[0][3].query()):
            if pending[0][3] is not None:
                pending[0][3].synchronize()
            submit(pending.pop(0))

    try:
        for shard in todo:
            start, n = spec.shard_rows(shard)
            arrays = materialize(plan, docs, T, pad_id, start, start + n)
            flush(block=False)
            try:
                slot = free.get_nowait()
            except queue.Empty:
                flush(block=True)
                while True:  # the writer is behind (disk-bound): wait for a buffer, surfacing write errors
                    writer.raise_errors()
                    try:
                        slot = free.get(timeout=1.0)
                        break
                    except queue.Empty:
                        continue
            host = slots[slot]
            for i in range(0, n, batch_rows):
                j = min(n, i + batch_rows)
                # on GPU a short last batch is padded with all-padding rows: every forward has one shape
                # (no recompiles of the flex kernels); on CPU that would only cost time
                rows = batch_rows if cuda else j - i
                ids, pos, doc, doc_host = _rows_to_device(arrays, i, j, rows, pad_id, dev)
                b = nbatch % len(gbufs)
                if cuda and copied[b] is not None:
                    torch.cuda.current_stream(dev).wait_event(copied[b])  # its previous copy must be done
                out = gbufs[b][:rows]
                target.run(ids, pos, doc, out, doc_host=doc_host)
                if nbatch == 0:  # every kernel this job runs is now built (fixed shapes)
                    _release_compile_workers()
                feats = out[: j - i]
                if basis_t is not None:  # z = P x on the device (float32), the last hidden state kept as it is
                    feats = dflash_cache.basis.project(feats, basis_t, context_width)
                    feats = feats if spec.quantized else feats.to(torch.bfloat16)
                src = [feats]
                if spec.quantized:  # on the device, before the copy: the host gets bytes + scales
                    src = [qb[: j - i] for qb in qbufs[b]]
                    groups = spec.feature_width // spec.scale_group
                    for buf, q in zip(src, quant.quantize(feats, spec.hidden_dtype, groups)):
                        buf.copy_(q)
                if cuda:
                    ready = torch.cuda.current_stream(dev).record_event()
                    copy_stream.wait_event(ready)
                    with torch.cuda.stream(copy_stream):
                        for h, d in zip(host, src):
                            h[i:j].copy_(d, non_blocking=True)
                        copied[b] = copy_stream.record_event()
                else:
                    for h, d in zip(host, src):
                        h[i:j].copy_(d)
                nbatch += 1
                real = int(np.count_nonzero(arrays["doc_ids"][i:j]))
                done += real
                bar.update(real)
            pending.append((shard, slot, arrays, copied[(nbatch - 1) % len(gbufs)] if cuda else None))
        flush(block=True)  # waits for the last copy to the host
        last_batch_t = time.perf_counter()
        writer.wait()
    finally:
        bar.close()
    return done, last_batch_t


def _release_compile_workers() -> None:
    """Stops inductor's compile worker processes once the job's kernels are built. Inductor starts one per core
    at its first compile (here: the compiled target, or the eager forward's flex kernel) and keeps them for a
    minute after the last; they hold memory and, while they start, every core, which the compression threads
    need. On a GPU nothing compiles after the first batch (every batch there has one shape); a later compile
    (a CPU job's short last batch) would start them again."""
    ac = sys.modules.get("torch._inductor.async_compile")
    if ac is not None:
        ac.shutdown_compile_workers()


def _compiled_target(target, spec, plan, docs, pad_id, shard, batch_rows, dev):
    """The checked compiled forward (extract/compiled.py) or, on disagreement, the eager one; and the report."""
    from dflash.extract.compiled import compiled_or_eager

    start, n = spec.shard_rows(shard)
    rows = min(n, batch_rows)
    arrays = materialize(plan, docs, spec.seq_len, pad_id, start, start + rows)
    rows = batch_rows if dev.type == "cuda" else rows  # the shape the job runs
    first = _rows_to_device(arrays, 0, len(arrays["input_ids"]), rows, pad_id, dev)[:3]
    runner, report = compiled_or_eager(target, first)
    if report["compiled"]:
        worst = max(c / t for c, t in zip(report["err_compiled_vs_ref"], report["tolerance"]))
        print0(f"extract: compiled target forward checked against eager on the first batch ({report['reference']}): "
               f"agree (worst layer at {worst:.2f} of its tolerance; {report['seconds']:.0f} s)")
    else:
        print0(f"extract: {report['why']}; running eagerly")
    return runner, report


def _tokenize_cache_dir(cfg: ExtractConfig) -> str | None:
    if cfg.tokenize_cache == "off":
        return None
    if cfg.tokenize_cache:
        return cfg.tokenize_cache
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflash", "tokenized")
    return os.environ.get("DFLASH_TOKENIZE_CACHE") or default


def _rows_to_device(arrays: dict, i: int, j: int, rows: int, pad_id: int, dev: torch.device) -> tuple:
    """(input ids, positions, doc ids) of rows i:j, padded to `rows` rows, as int64 tensors on dev, and the doc ids'
    host copy (a linear-attention target lays out its conversations from it: dflash/core/hybrid.py DocLayout).

    On a GPU the copy goes through pinned memory and does not block: a blocking host-to-device copy synchronises
    the stream (torch waits for the copy, which waits for every kernel queued before it), so the host would sit
    idle until the previous forward ended and only then build this batch's mask and launch it, leaving the GPU
    idle for that long at every batch. Pinned blocks are reused only after their copy has run (torch's caching
    host allocator records it)."""
    host = np.stack([_pad_rows(arrays[k][i:j], rows, pad).astype(np.int64, copy=False)
                     for k, pad in (("input_ids", pad_id), ("position_ids", 0), ("doc_ids", 0))])
    t = torch.from_numpy(host)
    if dev.type == "cuda":
        t = t.pin_memory().to(dev, non_blocking=True)
    return (*t.unbind(0), torch.from_numpy(host[2]))


def _pad_rows(a: np.ndarray, rows: int, value: int) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.full((rows - a.shape[0],) + a.shape[1:], value, dtype=a.dtype)])


def _row_range(spec: CacheSpec, shard: int) -> range:
    start, n = spec.shard_rows(shard)
    return range(start, start + n)
