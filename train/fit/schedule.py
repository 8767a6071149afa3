"""The learning-rate schedule and the step's FLOPs, with the peak that MFU is measured against."""

from __future__ import annotations

import math

import torch

from dflash.train.fit.config import TrainConfig
from dflash.train.drafter.model import DrafterConfig


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


# Dense bf16 FLOP/s of one chip (datasheets), by a substring of torch.cuda.get_device_name; first match wins.
# The H200's was measured here at ~790e12 on an 8192^3 matmul.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def peak_flops(device: torch.device) -> float | None:
    """The chip's dense bf16 peak (PEAK_BF16_FLOPS), or None for a CPU or a chip not in the table (then the
    trainer reports no MFU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)
