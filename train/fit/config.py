"""The settings of a training run: TrainConfig (each check names its flag), what identifies a run, its errors."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dflash.core.config import ConfigError, check, finite
from dflash.core.errors import DflashError


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
    arch: str = "dflash"  # dflash | dflash2 (train/drafter/dflash2.py: convolutions in the block and a candidate selector)
    drafter_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None
    # sliding-window draft layers: each sees the `draft_window` positions before its block's anchor (train/drafter/blocks.py);
    # every layer is sliding_attention unless draft_layer_types names each layer's kind
    draft_window: int | None = None
    draft_layer_types: list[str] | None = None
    # the drafter's attention and MLP where they are not the target's (a preset's, e.g. the published Qwen3.6-27B
    # drafter: 32 heads of 128 beside the target's 24 of 256): keys of DRAFTER_SHAPE_KEYS
    drafter_shape: dict | None = None
    # dflash2 only (speculators' defaults): the convolution's taps and channels per group, the selector's rank, the
    # candidates it reranks, and the weight of its loss
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_loss_alpha: float = 1.0
    # objective
    num_anchors: int = 512
    gamma: float = 7.0
    # batches and schedule
    batch_rows: int = 4
    grad_accum: int = 1
    max_steps: int | None = None
    epochs: float | None = None
    # train/fit/time_budget.py: the steps chosen so that training takes about this many seconds (max_steps / epochs then
    # give only the provisional total, before the decision), from the step time over `time_budget_probe` steps
    time_budget_s: float | str | None = None  # seconds, or "90m", "2h" (parse_duration)
    time_budget_probe: int = 50
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    # data order (dflash_cache.reader): epoch 0 reads windows of this many rows of the shard order (whole shards), each
    # shuffled; 0 = one permutation of the whole cache (a --follow run then waits for the whole cache)
    shuffle_window: int = 1024
    # train while `dflash extract` writes the cache (train/fit/follow.py); give up when it commits nothing for this long
    follow: bool = False
    follow_timeout: float = 1800.0
    # held-out validation (train/fit/validate.py): at every checkpoint and at the end
    val_cache: str | None = None
    val_rows: int = 64
    val_max_new_tokens: int = 0  # the decoding tau walks each held-out answer up to this many tokens (0 = all of it)
    # execution
    device: str = "auto"
    param_dtype: str = "auto"  # bfloat16 on GPU (as the peers), float32 on CPU
    attn: str = "auto"  # flex on GPU, split on CPU (train/drafter/attention.py); sdpa = the dense-mask reference
    compile: str = "auto"  # on (GPU), off (CPU), or force either
    compile_check: bool = True  # check the compiled step against an eager reference on the first batch
    compile_scope: str = "regions"  # train/fit/compile_step.py: regions (the loss's chunk compiled once) or step (one graph)
    compile_cache: str | None = None  # saved compile artifacts: None = RUN/compile, "off" = none
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

    # a flag given for one of these drops a preset's value of the other (dflash.core.config.build)
    EXCLUSIVE = (("max_steps", "epochs"),)

    def __post_init__(self):
        check(bool(self.cache), "cache", "is required (a cache written by `dflash extract`)")
        check(bool(self.target), "target", "is required (the same target model the cache was extracted from)")
        check(bool(self.out), "out", "is required (the run directory)")
        check(self.arch in ARCHS, "arch", f"must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        check(1 <= self.drafter_layers <= MAX_DRAFTER_LAYERS, "drafter_layers",
              f"must be in [1, {MAX_DRAFTER_LAYERS}], got {self.drafter_layers}")
        check(self.draft_window is None or 1 <= self.draft_window <= MAX_DRAFT_WINDOW, "draft_window",
              f"must be in [1, {MAX_DRAFT_WINDOW}] (positions before the anchor a sliding layer sees), got "
              f"{self.draft_window}")
        if self.drafter_shape is not None:
            shape = self.drafter_shape
            bad = sorted(set(shape) - set(DRAFTER_SHAPE_KEYS))
            check(not bad, "drafter_shape", f"unknown key(s) {', '.join(bad)} (known: {', '.join(DRAFTER_SHAPE_KEYS)})")
            for key in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
                v = shape.get(key)
                check(v is None or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 20),
                      "drafter_shape", f"{key} must be a positive integer, got {v!r}")
            theta = shape.get("rope_theta")
            check(theta is None or (isinstance(theta, (int, float)) and not isinstance(theta, bool) and 0 < theta < 1e12),
                  "drafter_shape", f"rope_theta must be a positive number, got {theta!r}")
            check(shape.get("rope_scaling") is None or isinstance(shape.get("rope_scaling"), dict), "drafter_shape",
                  "rope_scaling must be a mapping")
        if self.draft_layer_types is not None:
            kinds = self.draft_layer_types
            check(isinstance(kinds, list) and len(kinds) == self.drafter_layers, "draft_layer_types",
                  f"needs one entry per drafter layer ({self.drafter_layers}), got {kinds!r}")
            check(all(k in LAYER_TYPES for k in kinds), "draft_layer_types",
                  f"entries must be {' or '.join(LAYER_TYPES)}, got {kinds!r}")
            check("sliding_attention" not in kinds or self.draft_window is not None, "draft_layer_types",
                  "has sliding_attention layers: give --draft-window")
        check(self.conv_kernel_size >= 1, "conv_kernel_size", f"must be >= 1, got {self.conv_kernel_size}")
        check(self.conv_kernel_size <= self.block_size, "conv_kernel_size",
              f"must be <= --block-size {self.block_size}, got {self.conv_kernel_size}")
        check(self.conv_group_size >= 1, "conv_group_size", f"must be >= 1, got {self.conv_group_size}")
        check(self.selector_rank >= 1, "selector_rank", f"must be >= 1, got {self.selector_rank}")
        check(self.selector_top_k >= 1, "selector_top_k", f"must be >= 1, got {self.selector_top_k}")
        check(finite(self.selector_loss_alpha) and self.selector_loss_alpha >= 0, "selector_loss_alpha",
              f"must be a finite number >= 0, got {self.selector_loss_alpha}")
        check(2 <= self.block_size <= MAX_BLOCK_SIZE, "block_size",
              f"must be in [2, {MAX_BLOCK_SIZE}] (and fit the cache's rows), got {self.block_size}")
        check(self.num_anchors >= 1, "num_anchors", f"must be >= 1, got {self.num_anchors}")
        check(finite(self.gamma) and self.gamma > 0, "gamma", f"must be a finite number > 0, got {self.gamma}")
        check(self.batch_rows >= 1, "batch_rows", f"must be >= 1, got {self.batch_rows}")
        check(self.grad_accum >= 1, "grad_accum", f"must be >= 1, got {self.grad_accum}")
        check(self.max_steps is None or self.max_steps >= 1, "max_steps", f"must be >= 1, got {self.max_steps}")
        check(self.epochs is None or (finite(self.epochs) and self.epochs > 0), "epochs",
              f"must be a finite number > 0, got {self.epochs}")
        check(not (self.max_steps and self.epochs), "max_steps", "and --epochs are exclusive: give one")
        self.time_budget_s = parse_duration(self.time_budget_s)
        check(self.time_budget_probe >= 1, "time_budget_probe", f"must be >= 1 (steps), got {self.time_budget_probe}")
        check(finite(self.lr) and self.lr > 0, "lr", f"must be a finite number > 0, got {self.lr}")
        check(0 <= self.warmup_ratio < 1, "warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        check(finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay",
              f"must be a finite number >= 0, got {self.weight_decay}")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1", f"and beta2 must be in [0, 1), got {self.beta1}, "
              f"{self.beta2}")
        check(finite(self.grad_clip) and self.grad_clip > 0, "grad_clip",
              f"must be a finite number > 0, got {self.grad_clip}")
        # anchors are seeded by (seed * 1_000_003 + step) * 65_537, which must stay below 2**64 (trainer.anchor_scores)
        check(0 <= self.seed < 2**28, "seed", f"must be in [0, 2**28 = {2**28}), got {self.seed}")
        check(self.mask_token_id is None or self.mask_token_id >= 0, "mask_token_id",
              f"must be >= 0 (a token id of the target's vocabulary), got {self.mask_token_id}")
        check(self.param_dtype in ("auto", "bfloat16", "float32"), "param_dtype", "must be auto, bfloat16 or float32")
        check(self.attn in ("auto", "flex", "split", "sdpa"), "attn", "must be auto, flex, split or sdpa")
        check(self.compile in ("auto", "on", "off"), "compile", "must be auto, on or off")
        check(self.compile_scope in ("regions", "step"), "compile_scope", f"must be regions or step, got {self.compile_scope!r}")
        check(1 <= self.log_every <= MAX_LOG_EVERY, "log_every", f"must be in [1, {MAX_LOG_EVERY}], got {self.log_every}")
        check(self.save_every >= 1, "save_every", f"must be >= 1, got {self.save_every}")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
        check(self.loader_threads >= 1, "loader_threads", f"must be >= 1 (threads that decode the cache), got {self.loader_threads}")
        check(self.val_max_new_tokens >= 0, "val_max_new_tokens",
              f"must be >= 0 (0 = whole answers), got {self.val_max_new_tokens}")
        check(self.val_rows >= 0, "val_rows", f"must be >= 0 (0 = every row of --val-cache), got {self.val_rows}")
        check(self.prefetch >= 1, "prefetch", f"must be >= 1, got {self.prefetch}")
        check(self.shuffle_window >= 0, "shuffle_window",
              f"must be >= 0 (rows; 0 = one permutation of the whole cache), got {self.shuffle_window}")
        check(finite(self.follow_timeout) and self.follow_timeout > 0, "follow_timeout",
              f"must be a finite number > 0 (seconds), got {self.follow_timeout}")
        check(self.wandb_mode in (None, "online", "offline", "disabled"), "wandb_mode", "must be online, offline or disabled")


DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | float | None) -> float | None:
    """--time-budget's seconds from 300, "300", "300s", "90m", "1.5h" (None stays None); anything else, or a value
    <= 0, is a ConfigError naming --time-budget."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([smh]?)\s*", str(value))
        seconds = float(m.group(1)) * DURATION_UNITS[m.group(2)] if m else None
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"--time-budget expects a training time > 0: seconds, or a number with s, m or h (300, 90m, "
                          f"2h), got {value!r}", "time_budget_s")
    if seconds > MAX_TIME_BUDGET_S:
        raise ConfigError(f"--time-budget is at most {MAX_TIME_BUDGET_S / 86400:.0f} days ({MAX_TIME_BUDGET_S:.0f} s), "
                          f"got {value!r}", "time_budget_s")
    return seconds


MAX_TIME_BUDGET_S = 30 * 86400.0  # --time-budget's bound: a longer one is a typo (1e30), not a training run
# Bounds of the settings whose value sizes memory or a loop (a typo such as 99999999999999999999 must not reach torch):
MAX_DRAFTER_LAYERS = 256
MAX_BLOCK_SIZE = 4096  # and at most the cache's row length (checked when the cache is open: train/fit/trainer.py)
MAX_DRAFT_WINDOW = 2**31 - 1
MAX_LOG_EVERY = 1_000_000  # steps between logs; the window's per-step losses are kept on the device


ARCHS = ("dflash", "dflash2")
# DFlash2's own settings (`dflash train --conv-kernel-size` ...; the same keys in a preset's train section): a flag is
# refused with --arch dflash; a preset's values are unused there and said so (unused_dflash2_settings), so that one
# preset serves both archs (`dflash demo --compare dflash2` trains both from it)
DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_loss_alpha")
# the refusal of one given to another arch (after its flag's name)
DFLASH2_ONLY = ("is a setting of --arch dflash2 (the DFlash drafter has no block convolution or candidate selector): "
                "give --arch dflash2, or leave it out")
LAYER_TYPES = ("full_attention", "sliding_attention")
# what a preset's drafter_shape may set (train/drafter/model.py DrafterConfig fields; the rest follows the target)
DRAFTER_SHAPE_KEYS = ("num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rope_theta", "rope_scaling")


def draft_layer_types(cfg: TrainConfig) -> list[str] | None:
    """The drafter's per-layer attention kinds: draft_layer_types, else every layer sliding with --draft-window, else
    None (every layer full)."""
    if cfg.draft_layer_types is not None:
        return list(cfg.draft_layer_types)
    return ["sliding_attention"] * cfg.drafter_layers if cfg.draft_window is not None else None


# Settings that define a run: rerunning into RUN with other values is an error unless --overwrite.
IDENTITY = ("cache", "target", "drafter_layers", "block_size", "mask_token_id", "num_anchors", "gamma", "batch_rows",
            "grad_accum", "lr", "min_lr_ratio", "warmup_ratio", "weight_decay", "beta1", "beta2", "grad_clip", "seed",
            "param_dtype", "attn", "shuffle_window", "arch", "draft_window", "draft_layer_types", "conv_kernel_size",
            "conv_group_size", "selector_rank", "selector_top_k", "selector_loss_alpha", "drafter_shape")
# what a run.json written before a setting existed is read as having (that run trained with it)
IDENTITY_DEFAULTS = {"arch": "dflash", "draft_window": None, "draft_layer_types": None, "drafter_shape": None,
                     "conv_kernel_size": 2,
                     "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16, "selector_loss_alpha": 1.0}


def unused_dflash2_settings(cfg: TrainConfig) -> list[str]:
    """The DFlash2 settings that cfg sets away from their defaults while training another arch (unused by it)."""
    if cfg.arch == "dflash2":
        return []
    fields = type(cfg).__dataclass_fields__
    return [name for name in DFLASH2_SETTINGS if getattr(cfg, name) != fields[name].default]
