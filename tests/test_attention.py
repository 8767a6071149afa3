"""The split block attention (train/drafter/attention.py) against the dense-mask SDPA reference, in float32.

Covered: outputs and gradients (q, context k/v, block k/v) equal to `attend(..., dense_block_mask, "sdpa")`
for several shapes (MHA and GQA, block sizes, chunk sizes from 1 block to all), rows with padding and a
row of padding only, anchors forced onto document starts (no context at all), documents of one token,
a sliding window; the key ranges a chunk reads cover every key the dense mask lets it see; the traced
(compiled) formula equals the chunked one; and the drafter's whole loss and parameter gradients equal
between attn_impl "split" and "sdpa", with full and sliding layers.
"""

from __future__ import annotations

import pytest
import torch

from dflash.train.drafter.attention import _key_ranges, _chunk_attention, split_block_attention, split_mask
from dflash.train.drafter.blocks import attend, dense_block_mask, make_blocks
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig


def _rows(R, T, doc_lens, seed, pad_row=False, starts=False):
    """ids, loss mask, doc ids, anchor scores of R packed rows; documents of the given lengths then padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (R, T), generator=g)
    doc = torch.zeros(R, T, dtype=torch.long)
    for r in range(R):
        at = 0
        for i, n in enumerate(doc_lens[r % len(doc_lens)]):
            doc[r, at:at + n] = i + 1
            at += n
    if pad_row:
        doc[-1] = 0
    lm = (doc > 0).to(torch.uint8)
    scores = torch.rand(R, T, generator=g)
    if starts:  # prefer anchors on the first token of each document
        first = torch.ones_like(doc, dtype=torch.bool)
        first[:, 1:] = doc[:, 1:] != doc[:, :-1]
        scores = torch.where(first & (doc > 0), scores + 2, scores)
    return ids, lm, doc, scores


def _both(R, T, N, B, nh, nkv, d, doc_lens, window=None, chunk_blocks=4, seed=0, **kw):
    ids, lm, doc, scores = _rows(R, T, doc_lens, seed, **kw)
    blocks = make_blocks(ids, lm, doc, scores, N, B, 0)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(R, nh, N * B, d, generator=g, requires_grad=True)
    kc, vc = (torch.randn(R, nkv, T, d, generator=g, requires_grad=True) for _ in range(2))
    kb, vb = (torch.randn(R, nkv, N * B, d, generator=g, requires_grad=True) for _ in range(2))
    ins = [q, kc, vc, kb, vb]
    up = torch.randn(R, nh, N * B, d, generator=g)

    def run(fn):
        out = fn()
        grads = torch.autograd.grad((out * up).sum(), ins)
        return out.detach(), grads

    dense = run(lambda: attend(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2),
                               dense_block_mask(blocks, doc, window), "sdpa"))
    split = run(lambda: split_block_attention(q, kc, vc, kb, vb, split_mask(blocks, doc, window),
                                              chunk_blocks=chunk_blocks))
    return dense, split, blocks, doc


def _assert_same(dense, split):
    torch.testing.assert_close(split[0], dense[0], rtol=1e-5, atol=1e-5)
    for name, gs, gd in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), split[1], dense[1]):
        torch.testing.assert_close(gs, gd, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("R,T,N,B,nh,nkv,d,chunk", [
    (2, 64, 8, 4, 4, 4, 8, 3),      # MHA, a chunk size that does not divide N
    (2, 96, 12, 4, 4, 2, 16, 1),    # GQA 2:1, one block per chunk
    (3, 128, 16, 8, 6, 2, 8, 16),   # GQA 3:1, one chunk of all blocks
    (1, 80, 10, 2, 2, 1, 4, 4),     # MQA, block 2
])
def test_split_equals_dense(R, T, N, B, nh, nkv, d, chunk):
    doc_lens = [[T // 3, T // 4, T // 5], [T // 2, 7], [1, 2, T // 3, 5]]  # then padding up to T
    dense, split, _, _ = _both(R, T, N, B, nh, nkv, d, doc_lens, chunk_blocks=chunk)
    _assert_same(dense, split)


def test_split_equals_dense_padding_row_and_document_starts():
    dense, split, blocks, doc = _both(3, 64, 10, 4, 4, 2, 8, [[1, 20, 1, 15], [30, 30]], pad_row=True,
                                      starts=True, chunk_blocks=2)
    at_start = blocks.anchors == 0
    at_start |= doc.gather(1, (blocks.anchors - 1).clamp(min=0)) != blocks.anchor_doc
    assert at_start[:2].any(), "the test must put anchors on document starts (blocks with no context)"
    assert not blocks.anchor_valid[2].any(), "the last row is padding only"
    _assert_same(dense, split)


@pytest.mark.parametrize("window", [1, 5, 17])
def test_split_equals_dense_sliding_window(window):
    dense, split, _, _ = _both(2, 96, 12, 4, 4, 2, 8, [[40, 30, 20], [90]], window=window, chunk_blocks=5)
    _assert_same(dense, split)


def test_key_ranges_cover_what_the_dense_mask_sees():
    R, T, N, B = 3, 128, 24, 4
    ids, lm, doc, scores = _rows(R, T, [[30, 50, 20], [5, 100], [128]], seed=3)
    blocks = make_blocks(ids, lm, doc, scores, N, B, 0)
    dense = dense_block_mask(blocks, doc, None)[:, 0, :, :T]  # [R, N*B, T]
    for chunk in (1, 5, 24):
        ranges = _key_ranges(split_mask(blocks, doc, None), chunk)
        assert len(ranges) == R and all(len(x) == -(-N // chunk) for x in ranges)
        seen = dense.view(R, N, B, T).any(2)  # [R, N, T]
        for r in range(R):
            for c, (lo, hi) in enumerate(ranges[r]):
                s = slice(c * chunk, (c + 1) * chunk)
                keys = seen[r, s].any(0).nonzero().flatten()
                if len(keys):
                    assert lo <= int(keys.min()) and int(keys.max()) < hi
                firsts = [int(seen[r, n].nonzero().min()) for n in range(N)[s] if seen[r, n].any()]
                if len(firsts) == len(range(N)[s]):  # every block has context: lo is the earliest key any sees
                    assert lo == min(firsts)
                # and no further than the chunk's largest anchor
                assert hi == max(int(blocks.anchors[r, s].max()), lo + 1)


def test_traced_formula_equals_chunked():
    """Under torch.compile the whole context is one chunk (static shapes): that formula equals the chunked one."""
    R, T, N, B, nh, nkv, d = 2, 64, 8, 4, 4, 2, 8
    ids, lm, doc, scores = _rows(R, T, [[20, 30]], seed=5)
    blocks = make_blocks(ids, lm, doc, scores, N, B, 0)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(R, nh, N * B, d, generator=g)
    kc, vc = torch.randn(R, nkv, T, d, generator=g), torch.randn(R, nkv, T, d, generator=g)
    kb, vb = torch.randn(R, nkv, N * B, d, generator=g), torch.randn(R, nkv, N * B, d, generator=g)
    m = split_mask(blocks, doc, None)
    whole = _chunk_attention((q * d ** -0.5).view(R, nkv, nh // nkv, N, B, d), kc, vc, kb.view(R, nkv, N, B, d),
                             vb.view(R, nkv, N, B, d), blocks.anchors, blocks.anchor_doc, doc, blocks.positions,
                             blocks.ctx_positions, 0, None).reshape(R, nh, N * B, d)
    torch.testing.assert_close(whole, split_block_attention(q, kc, vc, kb, vb, m, chunk_blocks=3))


@pytest.mark.parametrize("sliding", [False, True])
def test_drafter_loss_and_grads_split_equal_sdpa(sliding):
    over = dict(num_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                sliding_window=6) if sliding else {}
    cfg = DrafterConfig.named("tiny", **over)
    m = DFlashDrafter(cfg)
    m.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(1)
    m.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
                      torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    R, T, N = 2, 96, 16
    ids, lm, doc, scores = _rows(R, T, [[30, 25, 31], [60, 20]], seed=2)
    hidden = torch.randn(R, T, cfg.num_context_layers * cfg.hidden_size, generator=g)
    out = {}
    for impl in ("sdpa", "split"):
        m.attn_impl = impl
        m.zero_grad(set_to_none=True)
        loss, metrics = m.forward_train(hidden, ids, lm, doc, scores, N)
        loss.backward()
        out[impl] = (loss.detach(), metrics["tau"], {n: p.grad.clone() for n, p in m.named_parameters()})
    torch.testing.assert_close(out["split"][0], out["sdpa"][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out["split"][1], out["sdpa"][1])
    for n, gd in out["sdpa"][2].items():
        torch.testing.assert_close(out["split"][2][n], gd, rtol=1e-4, atol=1e-6, msg=lambda s: f"{n}: {s}")
