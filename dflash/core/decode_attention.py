"""A decode attention kernel for the static decoder's batched one-token steps (Triton; CUDA, or Triton's
interpreter on a CPU for tests).

A step of regenerate's engine has one query token per row and G query heads per KV head, and its rows are of very
unequal lengths. flash attention's variable-length kernel reads only each row's own columns, but it computes a tile
of 128 query rows for the G (3 for SmolLM2) a (row, KV head) has, so at 1,024 rows it is bound by that arithmetic
(170 us a layer where the bytes take ~45 us at 4.8 TB/s; BENCHMARKS.md "Regeneration"). This kernel computes a
tile of 16 query rows (the G heads, padded) against blocks of BLOCK_N columns of the row's own keys and values, with
an online softmax in float32, so it reads each row's columns once at a small fraction of the arithmetic:

    program (row r, KV head h, split s): columns [s * chunk, min((s + 1) * chunk, length[r])) of r's slot
    q [n, Hkv, G, D], k and v [slots, Hkv, C, D] (the decoder's buffers, read in place), length [n] int32
    splits > 1 (few rows: too few programs for the GPU): each split writes its normalised output and its
    log-sum-exp, and `attend` combines them (weights softmax(lse) over the splits)

Head dims that are powers of two from 16 to 256; any G up to 16 (more: the tile grows to the next power of two).
"""

from __future__ import annotations

import torch

try:  # Triton ships with torch's CUDA wheels; a CPU-only install has none, and the decoder then uses other kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_N = 64  # columns per block of the loop
MIN_PROGRAMS = 512  # fewer (rows x KV heads) than this: the columns are split so that the GPU has this many programs
MIN_SPLIT_COLUMNS = 256  # a split reads at least this many columns


def supported(head_dim: int, groups: int) -> str | None:
    """None when the kernel can run this attention shape, else why not."""
    if triton is None:
        return "no Triton in this install"
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"head dim {head_dim} (powers of two from 16 to 256)"
    if groups < 1:
        return "no query heads"
    return None


def splits_for(rows_heads: int, span: int) -> int:
    """The splits of a step of rows_heads (row, KV head) programs over at most span columns: 1 when there are
    programs enough, else as many as bring them to MIN_PROGRAMS with MIN_SPLIT_COLUMNS columns or more each."""
    if rows_heads >= MIN_PROGRAMS:
        return 1
    by_columns = max(1, span // MIN_SPLIT_COLUMNS)
    return max(1, min(by_columns, -(-MIN_PROGRAMS // rows_heads)))


if triton is not None:
    @triton.jit
    def _decode_kernel(Q, K, V, LEN, O, LSE, scale, chunk, stride_kr, stride_kh, SPLITS: tl.constexpr,
                       HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(LEN + r)
        lo = s * chunk
        hi = tl.minimum(lo + chunk, length)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        q = tl.load(Q + ((r * HK + h) * G + g[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0)
        off = r.to(tl.int64) * stride_kr + h.to(tl.int64) * stride_kh  # a cache of several GB passes int32
        k_base = K + off
        v_base = V + off
        m = tl.full([GP], float("-inf"), tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for start in range(lo, hi, BN):
            cols = start + tl.arange(0, BN)
            valid = cols < hi
            k = tl.load(k_base + cols[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k)) * scale
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            den = den * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        some = den > 0
        out = acc / tl.where(some, den, 1.0)[:, None]
        row = ((r * HK + h) * SPLITS + s) * G + g
        tl.store(O + row[:, None] * D + d[None, :], out.to(O.dtype.element_ty), mask=g[:, None] < G)
        if SPLITS > 1:
            tl.store(LSE + row, tl.where(some, m + tl.log(tl.where(some, den, 1.0)), float("-inf")), mask=g < G)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, span: int,
           scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v of q [n, Hkv, G, D] (one token per row, G query heads per KV head) over the first
    length[r] columns of row r's k, v [slots, Hkv, C, D] (contiguous in their last two dims; length int32 [n], each
    in 1..span). Returns [n, Hkv, G, D] in q's dtype."""
    n, hk, G, D = q.shape
    q = q.contiguous()
    splits = splits_for(n * hk, span)
    chunk = -(-(-(-span // splits)) // BLOCK_N) * BLOCK_N
    gp = max(16, triton.next_power_of_2(G))
    if splits == 1:
        out = torch.empty_like(q)
        _decode_kernel[(n, hk, 1)](q, k, v, length, out, out, scale, chunk, k.stride(0), k.stride(1), SPLITS=1,
                                   HK=hk, G=G, GP=gp, D=D, BN=BLOCK_N)
        return out
    part = torch.empty((n, hk, splits, G, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, hk, splits, G), dtype=torch.float32, device=q.device)
    _decode_kernel[(n, hk, splits)](q, k, v, length, part, lse, scale, chunk, k.stride(0), k.stride(1),
                                    SPLITS=splits, HK=hk, G=G, GP=gp, D=D, BN=BLOCK_N)
    w = torch.softmax(lse, dim=2)  # a split with no columns has lse -inf: weight 0 (split 0 always has columns)
    return (part * w[..., None]).sum(2).to(q.dtype)
