"""Blocks and their attention masks: anchors and block tokens from a packed batch, and who sees whom.

`make_blocks` draws, per row, `num_anchors` anchors among positions t where t and t+1 are supervised and in
the same (real) document, and builds each block `[x_a, MASK, ..., MASK]` with its labels (the token at
anchor+k), their validity and the in-document positions. `make_blocks_opaque` is the same as one opaque
custom op for the compiled step. The masks say what a block's queries see: the context strictly before
their anchor in their own document (in a sliding layer only the `window` positions before the anchor,
anchor - window <= j < anchor, for every query of the block) and their own block bidirectionally (speculators'
`sliding_window_non_causal`, which the checkpoint records), as a dense bool mask for SDPA (`dense_block_mask`) or a
flex_attention BlockMask (`flex_block_mask`); `attend` runs either. No function here syncs with the host.

Shapes (R rows, T tokens, N anchors, B block): input_ids/loss_mask/doc_ids/anchor_scores [R, T]
    -> Blocks (anchors [R, N], tokens/positions/labels [R, N, B], ctx_positions [R, T])
    -> dense mask bool [R, 1, N*B, T + N*B] (True = attend) or a BlockMask of the same logical shape.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

_compiled_flex = None


def _flex(q):
    """flex_attention; outside a compiled region on GPU, its compiled kernel. Called eagerly, flex falls
    back to an unfused reference that materialises every score (44 GiB at the 8B training shape)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if not q.is_cuda or torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def attend(q, k, v, mask, impl: str):
    """q [b, nh, Lq, d]; k/v [b, nkv, Lk, d]; mask: bool [b, 1, Lq, Lk] (sdpa) or a BlockMask (flex)."""
    gqa = q.shape[1] != k.shape[1]
    if impl == "flex":
        return _flex(q)(q, k, v, block_mask=mask, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document (restarting at 0), [R, T]; no host sync."""
    R, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(R, T)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.cummax(torch.where(is_start, idx, torch.zeros_like(idx)), dim=1).values
    return idx - start


@dataclass
class Blocks:
    """Everything the packed training forward derives from a batch (fixed shapes)."""

    anchors: torch.Tensor  # [R, N] token index of each anchor (sorted)
    anchor_valid: torch.Tensor  # [R, N] bool
    tokens: torch.Tensor  # [R, N, B] block input ids
    positions: torch.Tensor  # [R, N, B] absolute (in-document) positions
    labels: torch.Tensor  # [R, N, B] token at anchor+k
    label_valid: torch.Tensor  # [R, N, B] bool (slot 0 never valid)
    ctx_positions: torch.Tensor  # [R, T]
    anchor_doc: torch.Tensor  # [R, N]


def anchor_positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """[R, T] bool: the positions a block may anchor at: t and t+1 supervised, in the same (real) document."""
    lm = loss_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] > 0)
    return valid


def make_blocks(input_ids, loss_mask, doc_ids, anchor_scores, num_anchors: int, block_size: int,
                mask_token_id: int) -> Blocks:
    R, T = input_ids.shape
    B, dev = block_size, input_ids.device
    lm = loss_mask.bool()
    valid = anchor_positions(loss_mask, doc_ids)
    scores = torch.where(valid, anchor_scores.float(), torch.full_like(anchor_scores.float(), -1.0))
    top = scores.topk(num_anchors, dim=1).indices  # uniform among valid positions (random scores)
    anchors = top.sort(dim=1).values
    anchor_valid = valid.gather(1, anchors)
    k = torch.arange(B, device=dev)
    idx = anchors[..., None] + k  # [R, N, B]
    in_row = idx < T
    idx_c = idx.clamp(max=T - 1)
    flat = idx_c.view(R, -1)
    labels = input_ids.gather(1, flat).view(R, -1, B)
    anchor_doc = doc_ids.gather(1, anchors)
    same_doc = doc_ids.gather(1, flat).view(R, -1, B) == anchor_doc[..., None]
    sup = lm.gather(1, flat).view(R, -1, B)
    label_valid = in_row & same_doc & sup & anchor_valid[..., None] & (k > 0)
    ctx_pos = document_positions(doc_ids)
    positions = ctx_pos.gather(1, anchors)[..., None] + k
    tokens = torch.full_like(labels, mask_token_id)
    tokens[..., 0] = input_ids.gather(1, anchors)
    return Blocks(anchors, anchor_valid, tokens, positions, labels, label_valid, ctx_pos, anchor_doc)


@torch.library.custom_op("dflash::make_blocks", mutates_args=(), schema=(
    "(Tensor input_ids, Tensor loss_mask, Tensor doc_ids, Tensor anchor_scores, SymInt num_anchors, "
    "SymInt block_size, SymInt mask_token_id) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _make_blocks_op(input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, block_size, mask_token_id):
    b = make_blocks(input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, block_size, mask_token_id)
    return tuple(getattr(b, f.name).clone() for f in fields(Blocks))  # own storage: no output may alias


@_make_blocks_op.register_fake
def _(input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, block_size, mask_token_id):
    R, T = input_ids.shape
    N, B = num_anchors, block_size
    e = input_ids.new_empty
    i64, b8 = torch.int64, torch.bool
    return (e(R, N, dtype=i64), e(R, N, dtype=b8), e(R, N, B, dtype=input_ids.dtype), e(R, N, B, dtype=i64),
            e(R, N, B, dtype=input_ids.dtype), e(R, N, B, dtype=b8), e(R, T, dtype=i64), e(R, N, dtype=doc_ids.dtype))


def make_blocks_opaque(input_ids, loss_mask, doc_ids, anchor_scores, num_anchors: int, block_size: int,
                       mask_token_id: int) -> Blocks:
    """make_blocks as one opaque op inside torch.compile: its aten kernels run as they do eagerly (and are
    captured in the step's CUDA graph); inductor neither regenerates nor fuses them. With make_blocks traced
    into the step's graph, the compiled Qwen3-8B-shaped step (4 x 3072 tokens, 512 anchors; torch 2.11, H200)
    computed wrong gradients, though make_blocks compiled on its own is exact (every output, rows of 512 to 8,192
    tokens); built through this op the step matches eager (BENCHMARKS.md, "Compiled step")."""
    return Blocks(*_make_blocks_op(input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, block_size,
                                   mask_token_id))


def dense_block_mask(blocks: Blocks, doc_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [R, 1, N*B, T + N*B]: context strictly before the own anchor in the own document; own block."""
    R, T = doc_ids.shape
    N, B = blocks.anchors.shape[1], blocks.tokens.shape[-1]
    qa = blocks.anchors.repeat_interleave(B, dim=1)  # [R, NB] anchor of each query
    qdoc = blocks.anchor_doc.repeat_interleave(B, dim=1)
    j = torch.arange(T, device=doc_ids.device)
    ctx = (j[None, None, :] < qa[..., None]) & (doc_ids[:, None, :] == qdoc[..., None])
    if window is not None:  # the window positions before the anchor (same document: positions differ as indices)
        apos = blocks.positions[..., 0].repeat_interleave(B, dim=1)  # [R, NB] anchor position of each query
        ctx = ctx & (apos[..., None] - blocks.ctx_positions[:, None, :] <= window)
    qb = torch.arange(N * B, device=doc_ids.device) // B
    own = (qb[:, None] == qb[None, :]).expand(R, N * B, N * B)
    return torch.cat([ctx, own], dim=-1)[:, None]


def flex_block_mask(blocks: Blocks, doc_ids: torch.Tensor, window: int | None):
    R, T = doc_ids.shape
    N, B = blocks.anchors.shape[1], blocks.tokens.shape[-1]
    anchors, adoc, ctx_pos = blocks.anchors, blocks.anchor_doc, blocks.ctx_positions
    apos = blocks.positions[..., 0]  # [R, N] in-document position of each anchor

    def mask_mod(b, h, q, kv):
        n = q // B
        a = anchors[b, n]
        kc = torch.clamp(kv, max=T - 1)
        ctx_ok = (kv < a) & (doc_ids[b, kc] == adoc[b, n])
        if window is not None:
            ctx_ok = ctx_ok & (apos[b, n] - ctx_pos[b, kc] <= window)
        own = (kv - T) // B == n
        return torch.where(kv < T, ctx_ok, own)

    return block_mask(mask_mod, R, N * B, T + N * B, doc_ids.device)


SPARSE_BLOCK = 128  # flex_attention's tile (its _DEFAULT_SPARSE_BLOCK_SIZE)


def block_mask(mask_mod, R: int, Q: int, KV: int, device):
    """The BlockMask create_block_mask(mask_mod, R, None, Q, KV) builds, equal field for field, built so that a
    compiled step needs no slow kernel for it. mask_mod is evaluated once over the whole (padded) grid by
    broadcasting (b [R,1,1], q [1,Q',1], kv [1,1,KV']); inside a compiled graph that fuses into one reduction per
    128x128 tile (the grid is never stored), eagerly it holds R*Q'*KV' bools. The tiles' sparse indices (a stable
    descending argsort of each tile row, and of each tile column for the backward) come from one opaque op running
    its aten kernels: traced by inductor, create_block_mask's own conversion (a scatter of the indices into a dense
    tile grid) became one Triton kernel that took 174 s to build on an H200 at the Qwen3-8B training shape, 85% of
    the step's first compiled call on a fresh machine (BENCHMARKS.md, "First compiled step")."""
    from torch.nn.attention.flex_attention import BlockMask

    S = SPARSE_BLOCK
    Qp, KVp = -(-Q // S) * S, -(-KV // S) * S
    b = torch.arange(R, device=device).view(R, 1, 1)
    q = torch.arange(Qp, device=device).view(1, Qp, 1)
    kv = torch.arange(KVp, device=device).view(1, 1, KVp)
    h = torch.zeros((), dtype=torch.long, device=device)
    inside = (q < Q) & (kv < KV)  # the padding is outside the mask, as create_block_mask pads it
    m = (mask_mod(b, h, q.clamp(max=Q - 1), kv.clamp(max=KV - 1)) & inside).expand(R, Qp, KVp)
    counts = m.reshape(R, 1, Qp // S, S, KVp // S, S).sum(dim=(3, 5), dtype=torch.int32)
    kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx = _block_indices_op(counts, S * S)
    return BlockMask(seq_lengths=(Q, KV), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=fkv_num,
                     full_kv_indices=fkv_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=fq_num,
                     full_q_indices=fq_idx, BLOCK_SIZE=(S, S), mask_mod=mask_mod)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] 0/1 -> per row: how many ones, and the column indices with the ones first (in order)."""
    num = dense.sum(dim=-1, dtype=torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()
    return num, idx


@torch.library.custom_op("dflash::block_mask_indices", mutates_args=(), schema=(
    "(Tensor counts, SymInt full) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _block_indices_op(counts, full):
    """counts [R, 1, QB, KVB] (attended elements per tile) -> a BlockMask's eight index tensors: kv_num_blocks,
    kv_indices (partial tiles), the same for full tiles, then q_num_blocks, q_indices and the full ones (the
    transposed grids). All int32, each in its own storage."""
    partial = ((counts > 0) & (counts < full)).to(torch.int32)
    whole = (counts == full).to(torch.int32)
    grids = (partial, whole, partial.transpose(-2, -1), whole.transpose(-2, -1))
    return tuple(t for grid in grids for t in _ordered(grid))


@_block_indices_op.register_fake
def _(counts, full):
    R, H, QB, KVB = counts.shape
    e = counts.new_empty
    i32 = torch.int32
    return (e(R, H, QB, dtype=i32), e(R, H, QB, KVB, dtype=i32), e(R, H, QB, dtype=i32), e(R, H, QB, KVB, dtype=i32),
            e(R, H, KVB, dtype=i32), e(R, H, KVB, QB, dtype=i32), e(R, H, KVB, dtype=i32), e(R, H, KVB, QB, dtype=i32))
