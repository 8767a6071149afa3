"""`dflash train`: fixed-shape batches from the cache -> compiled CUDA-graph steps -> servable drafter.

One process per GPU under torchrun (data parallel: every rank holds the whole drafter, reads a
disjoint part of each epoch, and gradients are averaged with one all-reduce per step); a single
process on CPU for tests and the demo.

The step (nothing in it syncs with the host or changes shape):
    for each of grad_accum micro-batches:
        mark the CUDA-graph step; loss, metrics = compiled forward (anchors drawn on the device)
        loss.backward()                           # the compiled backward: also a CUDA graph
        copy/add the grads into one flat buffer, drop them (they live in the graph's memory pool)
        add the metrics (cloned) into device accumulators
    all-reduce the flat buffer (ranks > 1); clip; fused AdamW with a tensor learning rate
The host reads the accumulators only every --log-every steps (one sync), which is also where a
non-finite loss is caught; checkpoints are written only after such a check, so the last one is
always good. Anchor randomness is a function of (seed, step, a row's slot in the step's global batch): a
resumed run draws exactly what an uninterrupted one would have, and ranks x accumulation x batch rows
that make the same global batch draw the same anchors (see Trainer.anchor_scores).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

import dflash_cache
from dflash import progress
from dflash.config import ConfigError, check
from dflash.dist import atomic_json, barrier, compute_init, print0, resolve_dtype
from dflash.errors import DflashError

from .checkpoint import save_drafter
from .model import DFlashDrafter, DrafterConfig

# The compiled step passes its check when its first-batch loss and gradients are those of the eager step up to
# bf16 rounding. Measured at the Qwen3-8B shape on an H200: eager bf16 vs float32 differ by 1e-5 (loss) and
# 0.023 (gradients, relative L2 over all parameters); the faulty compiled graph differed by 7.5e-4 and 0.79.
CHECK_LOSS_RTOL = 1e-3
CHECK_GRAD_RTOL = 0.15

H200_PEAK_BF16 = 989e12  # dense bf16 FLOP/s, datasheet (measured here: ~790e12 on an 8192^3 matmul)


class TrainError(DflashError):
    """A run that cannot proceed; the message says why and what to do."""


class NonFiniteLoss(TrainError):
    pass


@dataclass
class TrainConfig:
    cache: str = ""
    target: str = ""
    out: str = ""
    # drafter
    drafter_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None
    # objective
    num_anchors: int = 512
    gamma: float = 7.0
    # batches and schedule
    batch_rows: int = 4
    grad_accum: int = 1
    max_steps: int | None = None
    epochs: float | None = None
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    # execution
    device: str = "auto"
    param_dtype: str = "auto"  # bfloat16 on GPU (as the peers), float32 on CPU
    attn: str = "auto"  # flex on GPU, split on CPU (train/attention.py); sdpa = the dense-mask reference
    compile: str = "auto"  # on (GPU), off (CPU), or force either
    compile_check: bool = True  # check the compiled step against an eager reference on the first batch
    loader_threads: int = 4
    prefetch: int = 4
    # bookkeeping
    log_every: int = 10
    save_every: int = 500
    keep_checkpoints: int = 2
    overwrite: bool = False
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    wandb_mode: str | None = None  # online / offline
    progress: bool = True

    def __post_init__(self):
        check(bool(self.cache), "cache", "is required (a cache written by `dflash extract`)")
        check(bool(self.target), "target", "is required (the same target model the cache was extracted from)")
        check(bool(self.out), "out", "is required (the run directory)")
        check(self.drafter_layers >= 1, "drafter_layers", f"must be >= 1, got {self.drafter_layers}")
        check(self.block_size >= 2, "block_size", f"must be >= 2, got {self.block_size}")
        check(self.num_anchors >= 1, "num_anchors", f"must be >= 1, got {self.num_anchors}")
        check(self.gamma > 0, "gamma", "must be > 0")
        check(self.batch_rows >= 1, "batch_rows", f"must be >= 1, got {self.batch_rows}")
        check(self.grad_accum >= 1, "grad_accum", f"must be >= 1, got {self.grad_accum}")
        check(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1")
        check(self.epochs is None or self.epochs > 0, "epochs", "must be > 0")
        check(not (self.max_steps and self.epochs), "max_steps", "and --epochs are exclusive: give one")
        check(self.lr > 0, "lr", "must be > 0")
        check(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check(self.grad_clip > 0, "grad_clip", "must be > 0")
        check(self.param_dtype in ("auto", "bfloat16", "float32"), "param_dtype", "must be auto, bfloat16 or float32")
        check(self.attn in ("auto", "flex", "split", "sdpa"), "attn", "must be auto, flex, split or sdpa")
        check(self.compile in ("auto", "on", "off"), "compile", "must be auto, on or off")
        check(self.log_every >= 1 and self.save_every >= 1, "log_every", "and --save-every must be >= 1")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
        check(self.loader_threads >= 1, "loader_threads", f"must be >= 1 (threads that decode the cache), got {self.loader_threads}")
        check(self.prefetch >= 1, "prefetch", f"must be >= 1, got {self.prefetch}")
        check(self.wandb_mode in (None, "online", "offline", "disabled"), "wandb_mode", "must be online, offline or disabled")


# Settings that define a run: rerunning into RUN with other values is an error unless --overwrite.
IDENTITY = ("cache", "target", "drafter_layers", "block_size", "mask_token_id", "num_anchors", "gamma", "batch_rows",
            "grad_accum", "lr", "min_lr_ratio", "warmup_ratio", "weight_decay", "beta1", "beta2", "grad_clip", "seed",
            "param_dtype", "attn")


# --------------------------------------------------------------------------------------------
# Target pieces: embedding, LM head, mask token
# --------------------------------------------------------------------------------------------


def load_target_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding weight, LM head weight) of the target, reading only those tensors when possible."""
    from extract.target import load_causal_lm, load_config, resolve_target, text_config

    d, gguf = resolve_target(path)
    cfg = text_config(load_config(path))
    if gguf is None:
        from safetensors import safe_open

        index = os.path.join(d, "model.safetensors.index.json")
        files = {}
        if os.path.exists(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(d, "model.safetensors")):
            with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
                files = {k: "model.safetensors" for k in f.keys()}

        def get(names):
            for n in names:
                if n in files:
                    with safe_open(os.path.join(d, files[n]), "pt") as f:
                        return f.get_tensor(n)
            return None

        emb = get(["model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight"])
        head = get(["lm_head.weight", "model.lm_head.weight"])
        if emb is not None and (head is not None or cfg.tie_word_embeddings):
            return emb, head if head is not None else emb
    model = load_causal_lm(path, dtype=torch.float32)
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()


def resolve_mask_token_id(tokenizer, vocab_size: int, override: int | None) -> int:
    """An id the target never produces: the first embedding row beyond the tokenizer (Qwen3: 151669),
    else a reserved special token that the chat template does not use; --mask-token-id overrides."""
    if override is not None:
        if not 0 <= override < vocab_size:
            raise ConfigError(f"--mask-token-id {override} is outside the target vocabulary [0, {vocab_size})")
        return override
    n = len(tokenizer)
    if vocab_size > n:
        return n
    template = str(getattr(tokenizer, "chat_template", "") or "")
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    special = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    special.update({i: tokenizer.convert_ids_to_tokens(i) for i in tokenizer.all_special_ids})
    cands = [i for i, tok in sorted(special.items()) if i not in used and tok and tok not in template and i < vocab_size]
    if not cands:
        raise ConfigError(f"the target's vocabulary ({vocab_size}) has no unused id for the mask token; pass --mask-token-id")
    return cands[-1]


# --------------------------------------------------------------------------------------------
# Schedule and FLOPs
# --------------------------------------------------------------------------------------------


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up to lr, then cosine down to lr * min_lr_ratio (step counts from 0)."""
    warm = max(1, int(round(cfg.warmup_ratio * total))) if cfg.warmup_ratio > 0 else 0
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def step_flops(c: DrafterConfig, rows: int, seq_len: int, anchors: int) -> float:
    """Matmul FLOPs of one training step on `rows` rows: trainable drafter x3, frozen LM head x2."""
    H, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    blk = rows * anchors * c.block_size
    ctx = rows * seq_len
    per_layer_blk = 2 * H * q * 2 + 2 * H * kv * 2 + 3 * 2 * H * c.intermediate_size
    per_layer_ctx = 2 * H * kv * 2
    drafter = c.num_layers * (blk * per_layer_blk + ctx * per_layer_ctx) + ctx * 2 * c.num_context_layers * H * H
    head = rows * anchors * (c.block_size - 1) * 2 * H * c.vocab_size
    return 3 * drafter + 2 * head


# --------------------------------------------------------------------------------------------
# Run directory, checkpoints
# --------------------------------------------------------------------------------------------


# What a run directory holds: RUN/run.json ({"dflash": "train", ...}) marks it as dflash's; --overwrite removes
# exactly these entries of such a directory (and never a directory without the marker).
RUN_MARKER = "run.json"
RUN_ENTRIES = ("run.json", "metrics.jsonl", "summary.json", "checkpoints", "final", "final.tmp", "wandb")


def _run_marker(out: str) -> dict | None:
    """RUN/run.json when it is a dflash train record, else None."""
    try:
        with open(os.path.join(out, RUN_MARKER)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("dflash") == "train" else None


def _describe_dir(out: str, entries: list[str]) -> str:
    if "zarr.json" in entries:
        return "a zarr store (a dflash cache?)"
    head = ", ".join(sorted(entries)[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    return f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'} not written by dflash train: {head}"


def check_out_path(cfg: TrainConfig) -> None:
    """Before anything is written: --out may be a new or empty directory or a dflash train run directory, never
    a file, a user's folder, a cache, nor anything holding or inside the cache this run reads."""
    from dflash.paths import check_output_dir, inside, is_url
    from dflash_cache.lock import LOCK_NAME

    check_output_dir(cfg.out, "out")
    if not is_url(cfg.cache) and (inside(cfg.cache, cfg.out) or inside(cfg.out, cfg.cache)):
        how = "is" if os.path.realpath(cfg.cache) == os.path.realpath(cfg.out) else (
            "contains" if inside(cfg.cache, cfg.out) else "lies inside")
        raise TrainError(f"--out {cfg.out} {how} the cache this run reads (--cache {cfg.cache}); "
                         "a run directory must be apart from its cache: choose another --out")
    if not os.path.isdir(cfg.out):
        return
    entries = [n for n in os.listdir(cfg.out) if not n.startswith(LOCK_NAME)]
    if entries and _run_marker(cfg.out) is None:
        raise TrainError(f"--out {cfg.out} is not a dflash run directory (it holds {_describe_dir(cfg.out, entries)}); "
                         "choose another --out (--overwrite only replaces a dflash train run directory, one with run.json)")


def _remove_run(out: str) -> None:
    """Remove what dflash train wrote in RUN (RUN_ENTRIES), nothing else (not the lock, not a user's file)."""
    for name in RUN_ENTRIES:
        p = os.path.join(out, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)


def check_run_dir(cfg: TrainConfig, resolved: dict[str, Any]) -> None:
    """RUN/run.json must describe the same run (else error, or start over with --overwrite)."""
    check_out_path(cfg)
    path = os.path.join(cfg.out, RUN_MARKER)
    old_doc = _run_marker(cfg.out)
    if old_doc is not None:
        old = old_doc.get("config", {})
        for k in IDENTITY:
            if json.dumps(old.get(k)) != json.dumps(resolved.get(k)):
                if cfg.overwrite:
                    _remove_run(cfg.out)
                    break
                raise TrainError(f"{cfg.out} holds a different run: setting '{k}' was {old.get(k)!r}, now "
                                 f"{resolved.get(k)!r}; use another --out, or --overwrite to start over")
    elif cfg.overwrite and os.path.isdir(cfg.out):
        _remove_run(cfg.out)
    os.makedirs(os.path.join(cfg.out, "checkpoints"), exist_ok=True)
    atomic_json(path, {"config": resolved, "dflash": "train"})


def latest_checkpoint(out: str) -> str | None:
    p = os.path.join(out, "checkpoints", "latest")
    if not os.path.exists(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    full = os.path.join(out, "checkpoints", name)
    return full if os.path.exists(os.path.join(full, "trainer.json")) else None


def drop_metrics_after(out: str, step: int) -> None:
    """Remove the records of steps > step from RUN/metrics.jsonl (they are about to be redone)."""
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= step]
        with open(metrics + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(metrics + ".tmp", metrics)


class DiskWriteError(TrainError):
    """A checkpoint file that could not be written (disk full, quota, file too large, I/O error)."""


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: itself, its cause/context (torch.save wraps it in a RuntimeError), or the
    `os error N` that safetensors puts in its message."""
    import re

    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, OSError):
            return e
        m = re.search(r"os error (\d+)", str(e))
        if m:
            n = int(m.group(1))
            return OSError(n, os.strerror(n))
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


class writing:
    """`with writing(file, last_good, cleanup):` turns an I/O failure while writing `file` into one DiskWriteError
    naming it and the last good checkpoint (which is left intact); `cleanup` (a partial directory) is removed."""

    def __init__(self, file: str, last_good: str | None, cleanup: str | None = None):
        self.file, self.last_good, self.cleanup = file, last_good, cleanup

    def __enter__(self):
        return self

    def __exit__(self, typ, e, tb):
        if e is None:
            return False
        err = _os_error(e)
        if err is None:
            return False  # not an I/O failure: the traceback is shown
        if self.cleanup:
            shutil.rmtree(self.cleanup, ignore_errors=True)
        import errno

        what = {errno.ENOSPC: "disk full", errno.EFBIG: "file too large for the filesystem or limit",
                errno.EDQUOT: "disk quota exceeded"}.get(err.errno, err.strerror or str(err))
        raise DiskWriteError(f"cannot write {self.file}: {what} (errno {err.errno}); the last good checkpoint "
                             f"{self.last_good or '(none yet)'} is intact: free space and rerun the same command to resume")


def save_checkpoint(out: str, step: int, model: DFlashDrafter, opt: torch.optim.Optimizer, state: dict, keep: int) -> str:
    """RUN/checkpoints/step_N (written under a temporary name, then renamed), then `latest` points to it.
    A failed write (disk full, ...) is a DiskWriteError naming the file; the previous checkpoint stays intact."""
    ck = os.path.join(out, "checkpoints")
    name = f"step_{step:08d}"
    tmp = os.path.join(ck, name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    last_good = latest_checkpoint(out)
    with writing(os.path.join(tmp, "model.safetensors"), last_good, cleanup=tmp):
        save_drafter(model, tmp, dtype=next(model.parameters()).dtype)
    with writing(os.path.join(tmp, "optimizer.pt"), last_good, cleanup=tmp):
        with open(os.path.join(tmp, "optimizer.pt"), "wb") as f:  # a file object: the OSError stays visible
            torch.save(opt.state_dict(), f)
    with writing(os.path.join(tmp, "trainer.json"), last_good, cleanup=tmp):
        atomic_json(os.path.join(tmp, "trainer.json"), state)
    final = os.path.join(ck, name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    with writing(os.path.join(ck, "latest"), last_good):
        with open(os.path.join(ck, "latest.tmp"), "w") as f:
            f.write(name)
        os.replace(os.path.join(ck, "latest.tmp"), os.path.join(ck, "latest"))
    olds = sorted(d for d in os.listdir(ck) if d.startswith("step_") and not d.endswith(".tmp"))
    for d in olds[:-keep]:
        shutil.rmtree(os.path.join(ck, d), ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------
# wandb (rank 0 only, optional, offline works without an account)
# --------------------------------------------------------------------------------------------


class _NoLog:
    def log(self, *a, **k):
        pass

    def finish(self):
        pass


def init_wandb(cfg: TrainConfig, resolved: dict, is_main: bool):
    if not cfg.wandb_project or not is_main:
        return _NoLog()
    if cfg.wandb_mode:
        os.environ["WANDB_MODE"] = cfg.wandb_mode
    try:
        import wandb
    except ImportError as e:
        raise TrainError("--wandb-project needs the wandb package (pip install wandb)") from e
    return wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=resolved, dir=cfg.out)


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.dist = compute_init(cfg.device)
        dev = self.dev = self.dist.device
        self.cuda = dev.type == "cuda"
        self.param_dtype = resolve_dtype(cfg.param_dtype, dev)
        self.attn = cfg.attn if cfg.attn != "auto" else ("flex" if self.cuda else "split")
        if self.attn == "flex" and not self.cuda:
            raise ConfigError(f"--attn flex needs a CUDA device (flex_attention has no backward on {dev.type}); "
                              "use --attn split (the default there) or sdpa")
        self.compiled = cfg.compile == "on" or (cfg.compile == "auto" and self.cuda)

        from extract.target import load_config, load_tokenizer, target_info, text_config

        hf = load_config(cfg.target)
        tc = text_config(hf)
        tinfo = target_info(cfg.target, hf)
        expect = {"hidden_size": tc.hidden_size, "target.config_hash": tinfo.config_hash}
        try:
            self.cache = dflash_cache.open(cfg.cache, expect=expect, threads=cfg.loader_threads)
        except dflash_cache.CacheMismatchError as e:
            raise TrainError(f"the cache does not belong to --target {cfg.target}: {e}") from e
        cache = self.cache
        if self.dist.is_main:  # the embedding and LM head this run takes from --target: the cache's own?
            from dflash.weights import check_roles

            note = check_roles(cache.metadata.get("info", {}).get("weights"), cfg.target, cfg.cache,
                               tied=bool(getattr(tc, "tie_word_embeddings", False)))
            if note:
                print0(f"train: {note}")
        tok = load_tokenizer(cfg.target)
        mask_id = resolve_mask_token_id(tok, tc.vocab_size, cfg.mask_token_id)
        self.dcfg = DrafterConfig.from_target(hf, num_layers=cfg.drafter_layers, layer_ids=cache.layer_ids,
                                              block_size=cfg.block_size, mask_token_id=mask_id)
        T = cache.seq_len
        if cfg.num_anchors >= T:
            raise ConfigError(f"--num-anchors {cfg.num_anchors} does not fit rows of {T} tokens (at most {T - 1})")
        if cfg.batch_rows * self.dist.world > len(cache):
            raise ConfigError(f"--batch-rows {cfg.batch_rows} x {self.dist.world} ranks needs at least "
                              f"{cfg.batch_rows * self.dist.world} rows; the cache has {len(cache)}")
        self.spe = cache.steps_per_epoch(cfg.batch_rows, self.dist.world)  # micro-batches per epoch per rank
        if cfg.max_steps:
            self.total_steps = cfg.max_steps
        else:
            self.total_steps = max(1, int(math.ceil((cfg.epochs or 1.0) * self.spe / cfg.grad_accum)))

        self.resolved = {**asdict(cfg), "cache": os.path.abspath(cfg.cache) if "://" not in cfg.cache else cfg.cache,
                         "target": os.path.abspath(cfg.target), "mask_token_id": mask_id,
                         "param_dtype": str(self.param_dtype).replace("torch.", ""), "attn": self.attn,
                         "drafter": self.dcfg.to_dict(), "world": self.dist.world, "total_steps": self.total_steps,
                         "cache_data_fingerprint": cache.metadata.get("info", {}).get("data_fingerprint")}
        if self.dist.is_main:
            check_run_dir(cfg, self.resolved)
        barrier()

        torch.manual_seed(cfg.seed)
        self.model = DFlashDrafter(self.dcfg, attn_impl=self.attn)
        self.model.reset_parameters(seed=cfg.seed)
        self.model.to(dev, self.param_dtype)
        emb, head = load_target_head(cfg.target)
        self.model.set_target_head(emb, head)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in self.params)
        self.grad_buf = torch.zeros(n, dtype=self.param_dtype, device=dev)
        self.grad_views, off = [], 0
        for p in self.params:
            self.grad_views.append(self.grad_buf[off:off + p.numel()].view_as(p))
            off += p.numel()
        self.lr_t = torch.tensor(cfg.lr, dtype=torch.float32, device=dev)
        self.opt = torch.optim.AdamW(self.params, lr=self.lr_t, betas=(cfg.beta1, cfg.beta2),
                                     weight_decay=cfg.weight_decay, fused=True)
        self.step = 0
        ck = latest_checkpoint(cfg.out)
        if ck:
            self._restore(ck)
        elif self.dist.is_main:  # a run killed before its first checkpoint starts over: forget what it logged
            drop_metrics_after(cfg.out, 0)
        fwd = self.model.forward_train
        if self.compiled:
            mode = "reduce-overhead" if self.cuda else None
            fwd = torch.compile(fwd, mode=mode, dynamic=False, fullgraph=True)
        self.fwd = fwd
        self.nparams = n
        self.flops = step_flops(self.dcfg, cfg.batch_rows * cfg.grad_accum, T, cfg.num_anchors)
        self.gen = torch.Generator(device=dev)
        self.check: dict[str, Any] | None = None

    def check_compiled(self, x: dict, scores: torch.Tensor) -> dict[str, Any]:
        """The compiled step against the eager one (attention through dense SDPA: no kernel shared with
        flex_attention, nothing compiled) on the same micro-batch: loss and gradients. On disagreement the
        run continues eagerly. A guard, not a formality: at the Qwen3-8B shape torch 2.11 once compiled this
        step into wrong gradients (fixed by model.make_blocks_opaque; BENCHMARKS.md, "Compiled step"), and a
        run must not learn from such a step silently."""
        cfg, model = self.cfg, self.model
        args = (x["hidden"], x["input_ids"], x["loss_mask"], x["doc_ids"], scores, cfg.num_anchors, cfg.gamma,
                x.get("hidden_scales"))

        def loss_and_grads(fn):
            loss, _ = fn(*args)
            loss.backward()
            grads = [p.grad.detach().clone() for p in self.params]
            for p in self.params:
                p.grad = None
            return float(loss.detach()), grads

        t0 = time.perf_counter()
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        loss_c, g_c = loss_and_grads(self.fwd)
        saved = model.attn_impl
        model.attn_impl = "sdpa"
        try:
            loss_e, g_e = loss_and_grads(model.forward_train)
            res: dict[str, Any] = {"ran": True}
        except torch.OutOfMemoryError:
            for p in self.params:
                p.grad = None
            torch.cuda.empty_cache()
            res = {"ran": False, "why": "the eager reference did not fit in memory"}
        finally:
            model.attn_impl = saved
        ok = True
        if res["ran"]:
            names = [n for n, p in model.named_parameters() if p.requires_grad]
            agree = grad_agreement(g_c, g_e, names)
            grad_err = agree["global_rel_err"]
            loss_err = abs(loss_c - loss_e) / max(abs(loss_e), 1e-6)
            ok = math.isfinite(loss_c) and loss_err <= CHECK_LOSS_RTOL and grad_err <= CHECK_GRAD_RTOL
            res.update(loss_compiled=loss_c, loss_eager=loss_e, loss_rel_err=loss_err, grad_rel_err=grad_err,
                       min_grad_cos=agree["min_cos"], min_grad_cos_param=agree["min_cos_param"])
        if self.dist.distributed:  # every rank goes on the same way (and each takes part, checked or not)
            flag = torch.tensor([1.0 if ok else 0.0], device=self.dev)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            ok = bool(flag.item() == 1.0)
        res.update(passed=ok, seconds=time.perf_counter() - t0)
        return res

    def verify_compiled(self, x: dict, scores: torch.Tensor) -> None:
        """Run check_compiled once, say what it found, and fall back to the eager step if it failed."""
        c = self.check = self.check_compiled(x, scores)
        if c["ran"]:
            print0(f"train: compiled step vs eager on the first batch: loss {c['loss_compiled']:.5f} vs "
                   f"{c['loss_eager']:.5f}, gradient error {c['grad_rel_err']:.3g} (lowest cosine "
                   f"{c['min_grad_cos']:.4f}, {c['min_grad_cos_param']}): {'agree' if c['passed'] else 'DISAGREE'}")
        else:
            print0(f"train: note: compiled-step check skipped: {c['why']}")
        if not c["passed"]:
            print0("train: WARNING: the compiled step disagrees with the eager one at this shape; continuing with the "
                   "eager step (slower, correct). --no-compile-check skips the check; --compile off skips compilation.")
            self.compiled = False
            self.fwd = self.model.forward_train
            self.release_compiled()

    def release_compiled(self) -> None:
        """Drop the compiled graphs and their CUDA-graph memory pool (the eager step needs that memory)."""
        import torch._dynamo

        torch._dynamo.reset()
        if self.cuda:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
            torch.cuda.empty_cache()

    def _restore(self, ck: str) -> None:
        from safetensors.torch import load_file

        sd = load_file(os.path.join(ck, "model.safetensors"), device=str(self.dev))
        self.model.load_state_dict(sd, strict=False)
        self.opt.load_state_dict(torch.load(os.path.join(ck, "optimizer.pt"), map_location=self.dev, weights_only=True))
        for g in self.opt.param_groups:  # keep our lr tensor (the schedule writes into it)
            g["lr"] = self.lr_t
        with open(os.path.join(ck, "trainer.json")) as f:
            st = json.load(f)
        self.step = int(st["step"])
        if int(st.get("total_steps", self.total_steps)) != self.total_steps:
            print0(f"train: note: this run now has {self.total_steps} steps (the checkpoint was written in a run of "
                   f"{st['total_steps']}); the learning-rate schedule is stretched from step {self.step} on")
        if self.dist.is_main:  # drop records logged after the checkpoint we resume from
            drop_metrics_after(self.cfg.out, self.step)
        print0(f"train: resumed from {ck} at step {self.step}")

    # -- data ---------------------------------------------------------------------------------
    def micro_batches(self, start_micro: int):
        """Endless micro-batches from micro-step `start_micro` on, epoch after epoch: one reader whose
        threads and pinned buffers outlive epochs and which decodes ahead across their boundaries."""
        cfg, d = self.cfg, self.dist
        epoch, within = divmod(start_micro, self.spe)
        m = start_micro
        for b in self.cache.batches(cfg.batch_rows, rank=d.rank, world=d.world, epoch=epoch, seed=cfg.seed,
                                    start_step=within, epochs=None, prefetch=cfg.prefetch,
                                    threads=cfg.loader_threads, pin_memory=self.cuda, check=True,  # CRC every chunk
                                    quantized=True):  # fp8/fp4 caches: bytes + scales, dequantised in the step
            yield m, b
            m += 1

    def anchor_scores(self, micro: int, rows: int, T: int) -> torch.Tensor:
        """This rank's anchor scores [rows, T] for micro-step `micro`: its slice of one draw per optimizer step,
        [grad_accum * world * rows, T] seeded by (seed, step), taken at global slot (a * world + rank) * rows
        for micro-batch a of the step. The reader gives rank r of micro-batch a the rows of that same slot
        (Cache.epoch_order), so a row's anchors depend on (seed, step, its slot in the step's global batch)
        only: two ranks with batch b, or accumulation 2 x batch b, draw the anchors of one process with batch
        2b (tests/test_ddp.py, tests/test_accum.py); a resumed run draws what an uninterrupted one draws. One
        process without accumulation draws what it always did (seed (seed * 1_000_003 + step) * 65_537)."""
        step, a = divmod(micro, self.cfg.grad_accum)
        world = self.dist.world
        self.gen.manual_seed((self.cfg.seed * 1_000_003 + step) * 65_537)
        scores = torch.rand(self.cfg.grad_accum * world * rows, T, generator=self.gen, device=self.dev)
        first = (a * world + self.dist.rank) * rows
        return scores[first:first + rows]

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg, dist, dev = self.cfg, self.dist, self.dev
        T = self.cache.seq_len
        B1 = self.dcfg.block_size - 1
        logger = init_wandb(cfg, self.resolved, dist.is_main)
        acc = {"loss": torch.zeros((), device=dev), "tau": torch.zeros((), device=dev),
               "slot_hits": torch.zeros(B1, device=dev), "slot_count": torch.zeros(B1, device=dev),
               "grad_norm": torch.zeros((), device=dev)}
        hist = torch.zeros(cfg.log_every * cfg.grad_accum, device=dev)  # per-micro-step losses since the last check
        hist_n = 0
        history: list[dict] = []
        data = self.micro_batches(self.step * cfg.grad_accum)
        bar = progress.bar(cfg.progress and dist.is_main, total=self.total_steps, initial=self.step, desc="train",
                           unit="step")
        t_window, wait_window, steps_window = time.perf_counter(), 0.0, 0
        t_start, wait_total, steps_done = time.perf_counter(), 0.0, 0
        prev = None  # (event, batch): pinned buffer to release once its copy has landed
        last_good = None
        compiles_at_warm = None
        import torch._dynamo as dynamo

        try:
            while self.step < self.total_steps:
                lr = lr_at(self.step, self.total_steps, cfg)
                self.lr_t.fill_(lr)
                for a in range(cfg.grad_accum):
                    t0 = time.perf_counter()
                    micro, batch = next(data)
                    wait = time.perf_counter() - t0
                    wait_window += wait
                    wait_total += wait
                    x = {k: batch[k].to(dev, non_blocking=True)
                         for k in ("hidden", "hidden_scales", "input_ids", "loss_mask", "doc_ids") if k in batch}
                    if self.cuda:
                        ev = torch.cuda.current_stream(dev).record_event()
                        if prev is not None:
                            prev[0].synchronize()
                            prev[1].release()
                        prev = (ev, batch)
                    scores = self.anchor_scores(micro, x["input_ids"].shape[0], T)
                    if self.compiled and cfg.compile_check and self.check is None:
                        self.verify_compiled(x, scores)
                    if self.compiled and self.cuda:
                        torch.compiler.cudagraph_mark_step_begin()
                    loss, met = self.fwd(x["hidden"], x["input_ids"], x["loss_mask"], x["doc_ids"], scores,
                                         cfg.num_anchors, cfg.gamma, x.get("hidden_scales"))
                    loss.backward()
                    grads = [p.grad for p in self.params]
                    if a == 0:
                        torch._foreach_copy_(self.grad_views, grads)
                    else:
                        torch._foreach_add_(self.grad_views, grads)
                    for p in self.params:
                        p.grad = None
                    acc["loss"] += met["loss"].detach()
                    acc["tau"] += met["tau"]
                    acc["slot_hits"] += met["slot_acc"] * met["slot_count"]
                    acc["slot_count"] += met["slot_count"]
                    hist[hist_n % hist.numel()] = met["loss"].detach()
                    hist_n += 1
                if cfg.grad_accum > 1:
                    self.grad_buf.mul_(1.0 / cfg.grad_accum)
                if dist.distributed:
                    torch.distributed.all_reduce(self.grad_buf, op=torch.distributed.ReduceOp.AVG)
                for p, g in zip(self.params, self.grad_views):
                    p.grad = g
                gn = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip, foreach=True)
                acc["grad_norm"] += gn.float()
                self.opt.step()
                for p in self.params:
                    p.grad = None
                self.step += 1
                steps_window += 1
                steps_done += 1
                bar.update(1)
                if self.compiled and self.step == min(3, self.total_steps):
                    compiles_at_warm = _compile_count()
                    dynamo.config.error_on_recompile = True  # a recompile after warm-up fails loudly
                is_log = self.step % cfg.log_every == 0 or self.step == self.total_steps
                is_save = self.step % cfg.save_every == 0 or self.step == self.total_steps
                if is_log or is_save:
                    if dist.distributed:  # the logged metrics are over all ranks' data, not rank 0's
                        flat = torch.cat([v.reshape(-1) for v in acc.values()])
                        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.AVG)
                        off = 0
                        for v in acc.values():
                            v.copy_(flat[off:off + v.numel()].view_as(v))
                            off += v.numel()
                    vals = {k: v.detach().cpu() for k, v in acc.items()}  # the one host sync
                    h = hist[: min(hist_n, hist.numel())].cpu()
                    if not torch.isfinite(h).all() or not math.isfinite(float(vals["grad_norm"])):
                        bad = int(torch.nonzero(~torch.isfinite(h))[0]) if not torch.isfinite(h).all() else 0
                        first = self.step - steps_window + bad // cfg.grad_accum + 1
                        raise NonFiniteLoss(
                            f"non-finite loss or gradient at step {first} (of {self.total_steps}); "
                            f"the last good checkpoint is {last_good or 'none (no checkpoint yet)'}")
                    now = time.perf_counter()
                    dt = now - t_window
                    nmicro = steps_window * cfg.grad_accum
                    rows = nmicro * cfg.batch_rows * dist.world
                    rec = {
                        "step": self.step, "lr": lr,
                        "loss": float(vals["loss"]) / nmicro,
                        "tau_expected": float(vals["tau"]) / nmicro,
                        "grad_norm": float(vals["grad_norm"]) / steps_window,
                        "slot_acc": (vals["slot_hits"] / vals["slot_count"].clamp(min=1)).tolist(),
                        "ctx_tokens_per_s": rows * T / dt,
                        "block_tokens_per_s": rows * cfg.num_anchors * self.dcfg.block_size / dt,
                        "step_ms": 1000 * dt / steps_window,
                        "data_wait_frac": wait_window / dt,
                        # per GPU: this rank's FLOPs over one chip's peak (every rank does the same work)
                        "mfu": (self.flops * steps_window / dt / H200_PEAK_BF16) if self.cuda else None,
                        "epoch": self.step * cfg.grad_accum / self.spe,
                    }
                    history.append(rec)
                    if dist.is_main:
                        bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau_expected']:.2f}",
                                        tok_s=f"{rec['ctx_tokens_per_s']:,.0f}", refresh=False)
                        logger.log({k: v for k, v in rec.items() if k != "slot_acc"} |
                                   {f"slot_acc/{i + 1}": a for i, a in enumerate(rec["slot_acc"])}, step=self.step)
                        with open(os.path.join(cfg.out, "metrics.jsonl"), "a") as f:
                            f.write(json.dumps(rec) + "\n")
                    for v in acc.values():
                        v.zero_()
                    hist_n = 0
                    t_window, wait_window, steps_window = time.perf_counter(), 0.0, 0
                if is_save and dist.is_main:
                    last_good = save_checkpoint(cfg.out, self.step, self.model, self.opt,
                                                {"step": self.step, "total_steps": self.total_steps,
                                                 "micro_step": self.step * cfg.grad_accum}, cfg.keep_checkpoints)
                if is_save:
                    barrier()
        finally:
            bar.close()
            if prev is not None:
                prev[1].release()
            data.close()  # stops the reader's threads
            dynamo.config.error_on_recompile = False
        elapsed = time.perf_counter() - t_start
        recompiles = (_compile_count() - compiles_at_warm) if compiles_at_warm is not None else 0
        if dist.is_main:
            self.save_final()
        barrier()
        logger.finish()
        out = {"steps": self.step, "history": history, "elapsed_s": elapsed, "steps_this_run": steps_done,
               "data_wait_frac": wait_total / elapsed if elapsed > 0 else 0.0, "recompiles_after_warmup": recompiles,
               "final": os.path.join(cfg.out, "final"), "params": self.nparams, "compiled": self.compiled,
               "compile_check": self.check}
        if dist.is_main:
            atomic_json(os.path.join(cfg.out, "summary.json"), out)
        return out

    def save_final(self) -> str:
        final = os.path.join(self.cfg.out, "final")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with writing(os.path.join(tmp, "model.safetensors"), latest_checkpoint(self.cfg.out), cleanup=tmp):
            save_drafter(self.model, tmp, dtype=torch.bfloat16)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final


def grad_agreement(grads: list[torch.Tensor], ref: list[torch.Tensor], names: list[str]) -> dict[str, Any]:
    """How far gradients are from reference ones: relative L2 error over all tensors together, and per tensor
    its relative error and cosine (the lowest cosine and whose it is, too)."""
    rows, num, den = [], 0.0, 0.0
    for n, g, r in zip(names, grads, ref):
        g, r = g.float().reshape(-1), r.float().reshape(-1)
        d, rn = float((g - r).norm()), float(r.norm())
        cos = float((g @ r) / (g.norm() * r.norm()).clamp(min=1e-30))
        rows.append({"param": n, "rel_err": d / max(rn, 1e-30), "cos": cos})
        num, den = num + d * d, den + rn * rn
    low = min(rows, key=lambda x: x["cos"])
    return {"global_rel_err": math.sqrt(num / max(den, 1e-30)), "min_cos": low["cos"], "min_cos_param": low["param"],
            "per_param": rows}


def _compile_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_train(cfg: TrainConfig) -> dict[str, Any]:
    """The command; rank 0 of the job holds the lock of --out throughout (one writer per run directory)."""
    from dflash.paths import output_lock

    with output_lock(cfg.out, "train", int(os.environ.get("RANK", 0)) == 0, precheck=lambda _: check_out_path(cfg)):
        return _run_train(cfg)


def _run_train(cfg: TrainConfig) -> dict[str, Any]:
    tr = Trainer(cfg)
    print0(f"train: drafter {tr.dcfg.num_layers} layers x {tr.dcfg.hidden_size} ({tr.nparams / 1e6:.1f}M trainable), "
           f"block {tr.dcfg.block_size}, {cfg.num_anchors} anchors/row, mask token {tr.dcfg.mask_token_id}; "
           f"{len(tr.cache)} rows of {tr.cache.seq_len} -> {tr.total_steps} steps of {cfg.batch_rows} rows x "
           f"{cfg.grad_accum} accum x {tr.dist.world} ranks; {'compiled' if tr.compiled else 'eager'} on {tr.dev}, "
           f"{tr.param_dtype}, attention {tr.attn}")
    out = tr.train()
    if out["history"]:
        last = out["history"][-1]
        print0(f"train: step {out['steps']}: loss {last['loss']:.4f}, expected tau {last['tau_expected']:.2f}, "
               f"{last['ctx_tokens_per_s']:,.0f} ctx tok/s, data wait {100 * out['data_wait_frac']:.1f}%, "
               f"recompiles after warm-up {out['recompiles_after_warmup']}; drafter -> {out['final']}")
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `dflash train`")
