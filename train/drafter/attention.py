"""Packed block attention without the dense mask (the eager path; `attn="split"`, the CPU default).

What it computes is exactly what `dense_block_mask` + SDPA computes (train/drafter/blocks.py): the B queries of
block n attend to
  * the context keys j with j < anchor_n and doc[j] == doc[anchor_n] (and, in a sliding layer,
    query position - context position of j < window), and
  * the B keys of their own block, bidirectionally,
and to nothing else. The dense path scores every block query against all T context keys and all N*B
block keys, `[R, heads, N*B, T + N*B]`: with the training defaults (T 2048, 512 anchors, B 16) the
block-to-block part alone is 8192 x 8192 per head and row, 99.8% of it masked.

Here the two parts are computed apart and merged exactly in one softmax:
  * own block:  scores `[R, nkv, rep, N, B, B]` (a batched matmul per block; nothing masked),
  * context:    scores of a chunk of consecutive blocks of one row against the key range it can see,
                `[first key of any chunk block's document, largest anchor of the chunk)` (in a sliding layer from
                no earlier than the smallest anchor - window). Anchors are sorted, so a chunk's range is about its
                documents' prefix (or its window), not the row.
  * merge:      with m = the larger of both parts' row maxima (a constant: the result does not depend
                on it), out = (e_ctx @ v_ctx + e_blk @ v_blk) / (sum e_ctx + sum e_blk), e = exp(s - m).
                Every query sees at least its own block, so the denominator is >= 1.
Cost: the work grows with N * B * (the context each block sees + B), not with N*B * (T + N*B); so does the
memory the backward keeps (each chunk's probabilities). Each chunk is one autograd.Function with a hand-written
backward (flash attention's formulas on the saved probabilities: about half the ops of autograd's, which
matters on CPU where the chunks are small). CHECKPOINT = True recomputes the probabilities in the backward
instead (less memory, ~1.6x the time). Rows and chunks are taken apart with unbind/split, never sliced out
of the whole tensors (a slice's backward writes a zero tensor of the whole input per chunk).

Under torch.compile (the trainer's compiled step, or CPU compile tests), the key ranges would be data-
dependent shapes, so one chunk over the whole context is traced instead (same formula, static shapes).

Shapes: q [R, nh, N*B, d]; k_ctx, v_ctx [R, nkv, T, d]; k_blk, v_blk [R, nkv, N*B, d]; out [R, nh, N*B, d].
Scores are computed in float32 whatever the input dtype (the output is cast back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_BLOCKS = 16  # blocks per chunk: small enough that a chunk's key range is about its own blocks' context
CHUNK_BYTES = 64 << 20  # and at most ~64 MiB of float32 scores per chunk (context part)
MANUAL_BACKWARD = True  # _ChunkAttention (eager); False: autograd through _chunk_attention
CHECKPOINT = False  # recompute each chunk's scores in the backward (less memory, ~1.6x the time)


@dataclass
class SplitMask:
    """What the split attention needs to know of the blocks (instead of a dense mask)."""

    anchors: torch.Tensor  # [R, N] sorted token index of each block's anchor
    anchor_doc: torch.Tensor  # [R, N] document id of the anchor
    doc_ids: torch.Tensor  # [R, T] document id per context token (0 = padding)
    positions: torch.Tensor  # [R, N, B] absolute (in-document) positions of the block's queries
    ctx_positions: torch.Tensor  # [R, T] in-document positions of the context
    window: int | None  # sliding window of the layer, or None


def split_mask(blocks, doc_ids: torch.Tensor, window: int | None) -> SplitMask:
    """The split attention's view of a batch's blocks (model.Blocks) for a layer with `window`."""
    return SplitMask(blocks.anchors, blocks.anchor_doc, doc_ids, blocks.positions, blocks.ctx_positions, window)


def _key_ranges(mask: SplitMask, chunk: int) -> list[list[tuple[int, int]]]:
    """Per row, per chunk of `chunk` consecutive blocks, the context key range [lo, hi) any of its queries can
    see: lo = the first occurrence of any chunk block's document (in a sliding layer, not before anchor - window),
    hi = the chunk's largest anchor; at least one key wide (an empty range is masked whole)."""
    anchors, adoc, doc = mask.anchors, mask.anchor_doc.long(), mask.doc_ids.long()
    R, T = doc.shape
    N = anchors.shape[1]
    ndoc = int(doc.max()) + 1 if doc.numel() else 1
    idx = torch.arange(T, device=doc.device).expand(R, T)
    first = torch.full((R, max(ndoc, int(adoc.max()) + 1)), T, dtype=torch.long, device=doc.device)
    first = first.scatter_reduce(1, doc, idx, reduce="amin")
    lo_n = first.gather(1, adoc)  # [R, N] first key of the anchor's document
    if mask.window is not None:  # and no key more than `window` before the anchor
        lo_n = torch.maximum(lo_n, anchors.long() - mask.window)
    nchunks = -(-N // chunk)
    pad = nchunks * chunk - N
    lo = torch.nn.functional.pad(lo_n, (0, pad), value=T).view(R, nchunks, chunk).amin(2)
    hi = torch.nn.functional.pad(anchors.long(), (0, pad), value=0).view(R, nchunks, chunk).amax(2)
    out = []
    for lo_r, hi_r in zip(lo.tolist(), hi.tolist()):
        out.append([(min(a, T - 1), max(b, min(a, T - 1) + 1)) for a, b in zip(lo_r, hi_r)])
    return out


def _visible(anchors, adoc, doc, qpos, cpos, lo: int, window):
    """bool [R, n, 1 or B, kr]: which context keys lo..lo+kr-1 the chunk's queries see."""
    j = torch.arange(lo, lo + doc.shape[1], device=doc.device)
    see = ((j[None, None, :] < anchors[..., None]) & (doc[:, None, :] == adoc[..., None]))[:, :, None, :]
    if window is not None:  # the window positions before the anchor (qpos[..., 0]), the same for the whole block
        see = see & (qpos[..., :1, None] - cpos[:, None, None, :] <= window)
    return see


def _chunk_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, adoc, doc, qpos, cpos, lo: int, window):
    """One chunk: q [R, nkv, rep, n, B, d] (already scaled by d**-0.5); k_ctx/v_ctx [R, nkv, kr, d] (keys lo..);
    k_blk/v_blk [R, nkv, n, B, d]; anchors/adoc [R, n]; doc/cpos [R, kr]; qpos [R, n, B]."""
    R, nkv, rep, n, B, d = q.shape
    kr = k_ctx.shape[2]
    see = _visible(anchors, adoc, doc, qpos, cpos, lo, window)  # [R, n, 1 or B, kr]
    s_ctx = (q.reshape(R, nkv, rep * n * B, d) @ k_ctx.transpose(-1, -2)).view(R, nkv, rep, n, B, kr)
    s_ctx = s_ctx.masked_fill(~see[:, None, None], float("-inf"))
    s_blk = q @ k_blk[:, :, None].transpose(-1, -2)  # [R, nkv, rep, n, B, B]
    m = torch.maximum(s_ctx.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True)).detach()
    e_ctx, e_blk = torch.exp(s_ctx - m), torch.exp(s_blk - m)
    num = (e_ctx.view(R, nkv, rep * n * B, kr) @ v_ctx).view(R, nkv, rep, n, B, d) + e_blk @ v_blk[:, :, None]
    den = e_ctx.sum(-1, keepdim=True) + e_blk.sum(-1, keepdim=True)
    return num / den


class _ChunkAttention(torch.autograd.Function):
    """_chunk_attention with a hand-written backward (flash attention's, on the saved probabilities): half the
    ops of autograd's and only e_ctx, e_blk, den and out kept per chunk."""

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, see):
        R, nkv, rep, n, B, d = q.shape
        kr = k_ctx.shape[2]
        s_ctx = (q.reshape(R, nkv, rep * n * B, d) @ k_ctx.transpose(-1, -2)).view(R, nkv, rep, n, B, kr)
        s_ctx.masked_fill_(~see[:, None, None], float("-inf"))
        s_blk = q @ k_blk[:, :, None].transpose(-1, -2)  # [R, nkv, rep, n, B, B]
        m = torch.maximum(s_ctx.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True))
        e_ctx, e_blk = s_ctx.sub_(m).exp_(), s_blk.sub_(m).exp_()
        den = e_ctx.sum(-1, keepdim=True) + e_blk.sum(-1, keepdim=True)
        e_ctx.div_(den)
        e_blk.div_(den)  # now the probabilities
        out = (e_ctx.view(R, nkv, rep * n * B, kr) @ v_ctx).view(R, nkv, rep, n, B, d) + e_blk @ v_blk[:, :, None]
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, e_ctx, e_blk, out)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k_ctx, v_ctx, k_blk, v_blk, p_ctx, p_blk, out = ctx.saved_tensors
        R, nkv, rep, n, B, d = q.shape
        kr = k_ctx.shape[2]
        g = g.contiguous()
        dsum = (g * out).sum(-1, keepdim=True)  # [R, nkv, rep, n, B, 1]
        g2 = g.view(R, nkv, rep * n * B, d)
        pc2 = p_ctx.view(R, nkv, rep * n * B, kr)
        dv_ctx = pc2.transpose(-1, -2) @ g2
        ds_ctx = (g2 @ v_ctx.transpose(-1, -2)).view_as(p_ctx).sub_(dsum).mul_(p_ctx)
        ds_blk = (g @ v_blk[:, :, None].transpose(-1, -2)).sub_(dsum).mul_(p_blk)  # [R, nkv, rep, n, B, B]
        dv_blk = (p_blk.transpose(-1, -2) @ g).sum(2)
        ds2 = ds_ctx.view(R, nkv, rep * n * B, kr)
        dq = (ds2 @ k_ctx).view_as(q) + ds_blk @ k_blk[:, :, None]
        dk_ctx = ds2.transpose(-1, -2) @ q.reshape(R, nkv, rep * n * B, d)
        dk_blk = (ds_blk.transpose(-1, -2) @ q).sum(2)
        return dq, dk_ctx, dv_ctx, dk_blk, dv_blk, None


def split_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask: SplitMask, chunk_blocks: int = CHUNK_BLOCKS,
                          chunk_bytes: int = CHUNK_BYTES):
    """Attention of packed block queries over [context before the anchor | own block] (module docstring)."""
    R, nh, NB, d = q.shape
    nkv, T = k_ctx.shape[1], k_ctx.shape[2]
    rep = nh // nkv
    N = mask.anchors.shape[1]
    B = NB // N
    dtype = q.dtype
    f32 = [t.float() for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
    qg = (f32[0] * d ** -0.5).view(R, nkv, rep, N, B, d)  # head h uses kv head h // rep (as repeat_interleave)
    kb, vb = (t.view(R, nkv, N, B, d) for t in f32[3:])
    kc, vc = f32[1], f32[2]
    anchors, adoc, doc = mask.anchors.long(), mask.anchor_doc.long(), mask.doc_ids.long()
    qpos, cpos = mask.positions, mask.ctx_positions
    if torch.compiler.is_compiling():  # static shapes: one chunk, the whole context
        out = _chunk_attention(qg, kc, vc, kb, vb, anchors, adoc, doc, qpos, cpos, 0, mask.window)
        return out.reshape(R, nh, NB, d).to(dtype)
    chunk = max(1, min(N, chunk_blocks, chunk_bytes // max(1, 4 * nh * B * T)))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_ctx, v_ctx, k_blk, v_blk))
    # rows and chunks taken apart with unbind/split (one gradient concatenation each), not sliced from the
    # whole tensors: a slice's backward writes a zero tensor of its input's full size, per chunk
    q_rows, kb_rows, vb_rows, kc_rows, vc_rows = (t.unbind(0) for t in (qg, kb, vb, kc, vc))
    rows = []
    for r, ranges in enumerate(_key_ranges(mask, chunk)):  # rows apart: their documents differ
        i = slice(r, r + 1)
        q_c, kb_c, vb_c = q_rows[r].split(chunk, dim=2), kb_rows[r].split(chunk, dim=1), vb_rows[r].split(chunk, dim=1)
        outs = []
        for c, (lo, hi) in enumerate(ranges):
            s = slice(c * chunk, min(N, (c + 1) * chunk))
            args = (q_c[c][None], kc_rows[r][None, :, lo:hi], vc_rows[r][None, :, lo:hi], kb_c[c][None], vb_c[c][None],
                    anchors[i, s], adoc[i, s], doc[i, lo:hi], qpos[i, s], cpos[i, lo:hi], lo, mask.window)
            if grad and CHECKPOINT:
                outs.append(checkpoint(_chunk_attention, *args, use_reentrant=False))
            elif MANUAL_BACKWARD:
                outs.append(_ChunkAttention.apply(*args[:5], _visible(*args[5:])))
            else:
                outs.append(_chunk_attention(*args))
        rows.append(torch.cat(outs, dim=3))
    return torch.cat(rows, dim=0).reshape(R, nh, NB, d).to(dtype)
