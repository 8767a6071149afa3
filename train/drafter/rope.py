"""Rotary position embeddings of the drafter, with Qwen3's numerics (rotate-half; cos/sin from float32 math, then
cast): the settings read from an HF config (transformers 4.x and 5.x), the inverse frequencies (default, linear
llama3 and YaRN scaling), and their application. train/drafter/model.py re-exports them."""

from __future__ import annotations

import math

import torch

from dflash.train.drafter.errors import DrafterError


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
    elif kind == "yarn":
        return _yarn(cfg, rs)[0]
    else:
        raise DrafterError(f"drafter config: rope_scaling type {kind!r} is not supported (default, linear, llama3, "
                           "yarn)")
    return inv.float()


def rope_attention_factor(cfg) -> float:
    """The factor YaRN applies to cos and sin (1.0 for every other kind)."""
    rs = cfg.rope_scaling or {}
    return _yarn(cfg, rs)[1] if rs.get("rope_type", rs.get("type")) == "yarn" else 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg, rs: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it (gpt-oss's RoPE): inverse frequencies blended between
    the scaled and unscaled ones over a ramp of dimensions set by beta_fast/beta_slow, and the attention factor."""
    d, base = cfg.head_dim, cfg.rope_theta
    factor = rs.get("factor") or cfg.max_position_embeddings / rs["original_max_position_embeddings"]
    original = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
    attention = rs.get("attention_factor")
    if attention is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations):
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    return inv.float(), float(attention)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """positions [..., L] -> cos, sin [..., L, head_dim] (float32 math, times YaRN's attention factor `scale`, then
    cast)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, L, d]; cos/sin [b, L, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]
