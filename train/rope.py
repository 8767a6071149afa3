"""Rotary position embeddings of the drafter, with Qwen3's numerics (rotate-half; cos/sin from float32 math, then
cast): the settings read from an HF config (transformers 4.x and 5.x), the inverse frequencies (default, linear
and llama3 scaling), and their application. train/model.py re-exports them."""

from __future__ import annotations

import math

import torch


def _rope_of(c) -> dict:
    """RoPE settings of an HF config, for transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters)."""
    rp = getattr(c, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return dict(rp)
    out = {"rope_theta": getattr(c, "rope_theta", 10000.0)}
    rs = getattr(c, "rope_scaling", None)
    if isinstance(rs, dict):
        out.update(rs)
    return out


def rope_inv_freq(cfg) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] of a DrafterConfig's (head_dim, rope_theta, rope_scaling)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    else:
        from dflash.train.model import DrafterError

        raise DrafterError(f"drafter config: rope_scaling type {kind!r} is not supported (default, linear, llama3)")
    return inv.float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [..., L] -> cos, sin [..., L, head_dim] (float32 math, then cast)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, L, d]; cos/sin [b, L, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]
