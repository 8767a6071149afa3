"""The drafter and its objective: masks, the packed forward vs. single blocks, gradients, checkpoints."""

import dataclasses
import json

import pytest
import torch

from dflash.core.layers import default_layer_ids
from dflash.train.drafter.blocks import dense_block_mask, document_positions, make_blocks, make_blocks_opaque
from dflash.train.drafter.checkpoint import load_drafter, save_drafter
from dflash.train.drafter.loss import block_loss, slot_weights
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig

T = 96


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = DrafterConfig.named("tiny", **kw)
    m = DFlashDrafter(cfg).float()
    m.reset_parameters(std=0.1, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    m.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.5,
                      torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.5)
    return m


def batch(seed=0, R=2):
    """Two packed rows: doc 1 = [0, 40), doc 2 = [40, 80), padding after; prompts unsupervised."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (R, T), generator=g)
    doc = torch.zeros(R, T, dtype=torch.long)
    doc[:, :40], doc[:, 40:80] = 1, 2
    lm = torch.zeros(R, T, dtype=torch.uint8)
    lm[:, 8:40], lm[:, 50:80] = 1, 1
    hidden = torch.randn(R, T, 2 * 64, generator=g).to(torch.bfloat16)
    hidden[doc == 0] = 0
    scores = torch.rand(R, T, generator=g)
    return hidden, ids, lm, doc, scores


def test_default_layer_rule():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(6) == [1, 2, 3]  # too shallow for 5 distinct ids


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        DrafterConfig.named("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig.named("tiny", mask_token_id=10_000)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DrafterConfig.named("tiny", target_layer_ids=[7])
    with pytest.raises(ValueError, match="sliding_window"):
        DrafterConfig.named("tiny", layer_types=["sliding_attention", "full_attention"])


def test_document_positions_restart_per_document():
    doc = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0]])
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


def test_blocks_slots_labels_positions():
    hidden, ids, lm, doc, scores = batch()
    b = make_blocks(ids, lm, doc, scores, 16, 4, 511)
    pos = document_positions(doc)
    for r in range(2):
        for n in range(16):
            a = int(b.anchors[r, n])
            assert b.anchor_valid[r, n] == bool(lm[r, a] and lm[r, a + 1] and doc[r, a] == doc[r, a + 1] and doc[r, a] > 0)
            assert b.tokens[r, n, 0] == ids[r, a]  # slot 0 is the anchor itself
            assert (b.tokens[r, n, 1:] == 511).all()  # then MASK
            for k in range(4):
                assert b.positions[r, n, k] == pos[r, a] + k  # absolute position anchor+k
                if a + k < T:
                    assert b.labels[r, n, k] == ids[r, a + k]  # slot k predicts the token at anchor+k
                    want = k > 0 and bool(b.anchor_valid[r, n]) and doc[r, a + k] == doc[r, a] and bool(lm[r, a + k])
                    assert bool(b.label_valid[r, n, k]) == want
    assert (b.anchors.diff(dim=1) > 0).all()  # distinct, sorted


def test_anchor_sampling_only_valid_and_padded_when_scarce():
    hidden, ids, lm, doc, _ = batch()
    valid = torch.zeros_like(lm, dtype=torch.bool)
    valid[:, :-1] = lm[:, :-1].bool() & lm[:, 1:].bool() & (doc[:, :-1] == doc[:, 1:]) & (doc[:, :-1] > 0)
    n_valid = int(valid[0].sum())
    counts = torch.zeros(T)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        b = make_blocks(ids, lm, doc, torch.rand(2, T, generator=g), 8, 4, 511)
        assert valid.gather(1, b.anchors).all()  # fewer anchors than valid positions: all valid
        counts.index_add_(0, b.anchors[0], torch.ones(8))
    assert counts[~valid[0]].sum() == 0
    freq = counts[valid[0]] / 300
    assert freq.min() > 0.5 * 8 / n_valid and freq.max() < 1.7 * 8 / n_valid  # roughly uniform
    b = make_blocks(ids, lm, doc, torch.rand(2, T), T, 4, 511)  # more anchors than valid positions
    assert int(b.anchor_valid[0].sum()) == n_valid


def test_opaque_make_blocks_equals_make_blocks_eager_and_compiled():
    """The training step builds its blocks through one opaque op (inductor fused make_blocks wrongly into the
    8B-shaped step on the GPU): same fields, dtypes and values as make_blocks, eagerly, compiled, and on the
    op's own checks (schema, fake tensors, no aliasing)."""
    from dataclasses import fields

    from dflash.train.drafter.blocks import Blocks

    hidden, ids, lm, doc, scores = batch()
    args = (ids, lm, doc, scores, 12, 4, 511)
    ref = make_blocks(*args)
    for got in (make_blocks_opaque(*args), torch.compile(make_blocks_opaque, fullgraph=True, dynamic=False)(*args)):
        for f in fields(Blocks):
            a, b = getattr(got, f.name), getattr(ref, f.name)
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
    torch.library.opcheck(torch.ops.dflash.make_blocks.default, args)


def test_dense_mask_structure():
    hidden, ids, lm, doc, scores = batch()
    B = 4
    b = make_blocks(ids, lm, doc, scores, 12, B, 511)
    m = dense_block_mask(b, doc, None)[:, 0]  # [R, NB, T + NB]
    for r in range(2):
        for q in range(12 * B):
            n, a = q // B, int(b.anchors[r, q // B])
            ctx, blk = m[r, q, :T], m[r, q, T:]
            assert not ctx[a:].any()  # never the anchor's own hidden state or anything after it
            assert (ctx.nonzero().flatten() < a).all()
            assert (doc[r, ctx.nonzero().flatten()] == doc[r, a]).all()  # never another document
            assert ctx.sum() == ((doc[r, :a] == doc[r, a]).sum())  # the whole own-document prefix
            own = torch.zeros(12 * B, dtype=torch.bool)
            own[n * B:(n + 1) * B] = True
            assert torch.equal(blk, own)  # its own block, bidirectionally, and no other block


def test_blocks_are_isolated_behaviourally():
    """Perturbing what a block must not see leaves its logits unchanged (catches fake-good loss)."""
    m = tiny()
    hidden, ids, lm, doc, scores = batch()
    B, N = m.cfg.block_size, 10
    b = make_blocks(ids, lm, doc, scores, N, B, m.cfg.mask_token_id)

    def logits(h, i):
        with torch.no_grad():
            m.forward_train(h, i, lm, doc, scores, N)
            return _packed_logits(m, h, i, lm, doc, scores, N)

    base = logits(hidden, ids)
    r, n = 0, int(b.anchor_valid[0].nonzero()[3])
    a = int(b.anchors[r, n])
    # 1. the anchor's own hidden state and anything after it
    h2 = hidden.clone()
    h2[r, a:] += 3.0
    out = logits(h2, ids)
    assert torch.allclose(out[r, n], base[r, n], atol=1e-5)
    # ... while an earlier context position does matter
    h3 = hidden.clone()
    h3[r, a - 1] += 3.0
    assert not torch.allclose(logits(h3, ids)[r, n], base[r, n], atol=1e-3)
    # 2. another document's context
    other = (doc[r] != doc[r, a]) & (doc[r] > 0)
    h4 = hidden.clone()
    h4[r, other] += 3.0
    assert torch.allclose(logits(h4, ids)[r, n], base[r, n], atol=1e-5)
    # 3. another block's anchor token (anchors chosen from the same scores, so blocks stay put)
    other_anchor = int(b.anchors[r, (n + 1) % N])
    if other_anchor != a:
        i2 = ids.clone()
        i2[r, other_anchor] = (i2[r, other_anchor] + 1) % 500
        out = logits(hidden, i2)
        assert torch.allclose(out[r, n], base[r, n], atol=1e-5)


def _packed_logits(m, hidden, ids, lm, doc, scores, N):
    """The packed forward's logits (same code path as forward_train, before the loss)."""
    from dflash.train.drafter.model import rope_cos_sin

    cfg, R = m.cfg, ids.shape[0]
    B = cfg.block_size
    b = make_blocks(ids.long(), lm, doc, scores, N, B, cfg.mask_token_id)
    ctx = m.fuse_context(hidden)
    x = m.embed(b.tokens.view(R, N * B))
    qc, qs = rope_cos_sin(m.inv_freq, b.positions.view(R, N * B), x.dtype)
    cc, cs = rope_cos_sin(m.inv_freq, b.ctx_positions, x.dtype)
    mask = dense_block_mask(b, doc, None)
    for layer in m.layers:
        x = m._layer(layer, x, ctx, qc, qs, cc, cs, mask)
    return m.logits(x.view(R, N, B, -1)[:, :, 1:])


# flex eagerly on CPU is this test's point (its loss against the dense path's); torch warns that an eager flex call
# materialises every score, which is what the model's GPU path avoids by compiling it (train/drafter/blocks.py, _flex)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_packed_forward_equals_single_block_inference(impl):
    m = tiny()
    m.attn_impl = impl
    hidden, ids, lm, doc, scores = batch()
    N, B = 12, m.cfg.block_size
    b = make_blocks(ids, lm, doc, scores, N, B, m.cfg.mask_token_id)
    with torch.no_grad():
        packed = _packed_logits(m, hidden, ids, lm, doc, scores, N) if impl == "sdpa" else None
        loss, met = m.forward_train(hidden, ids, lm, doc, scores, N)
        if impl == "flex":  # same loss as the dense path
            m.attn_impl = "sdpa"
            ref, _ = m.forward_train(hidden, ids, lm, doc, scores, N)
            assert torch.allclose(loss, ref, atol=1e-5)
            return
        checked = 0
        for r in range(2):
            for n in range(N):
                if not b.anchor_valid[r, n]:
                    continue
                a = int(b.anchors[r, n])
                start = int((doc[r] == doc[r, a]).nonzero()[0])
                cache = m.new_cache(1, T)
                m.extend_context(cache, hidden[r:r + 1, start:a], b.ctx_positions[r:r + 1, start:a])
                single = m.draft_block(cache, b.tokens[r:r + 1, n], b.positions[r:r + 1, n])
                assert torch.allclose(single[0], packed[r, n], atol=1e-5), (r, n)
                checked += 1
        assert checked >= 10


def test_sliding_window_layers_match_single_blocks():
    m = tiny(layer_types=["sliding_attention", "full_attention"], sliding_window=7)
    hidden, ids, lm, doc, scores = batch()
    N, B = 8, m.cfg.block_size
    b = make_blocks(ids, lm, doc, scores, N, B, m.cfg.mask_token_id)
    with torch.no_grad():
        _, met = m.forward_train(hidden, ids, lm, doc, scores, N)
        from dflash.train.drafter.model import rope_cos_sin

        R = 2
        ctx = m.fuse_context(hidden)
        x = m.embed(b.tokens.view(R, N * B))
        qc, qs = rope_cos_sin(m.inv_freq, b.positions.view(R, N * B), x.dtype)
        cc, cs = rope_cos_sin(m.inv_freq, b.ctx_positions, x.dtype)
        for layer in m.layers:
            x = m._layer(layer, x, ctx, qc, qs, cc, cs, dense_block_mask(b, doc, layer.self_attn.window))
        packed = m.logits(x.view(R, N, B, -1)[:, :, 1:])
        for n in range(N):
            if not b.anchor_valid[0, n]:
                continue
            a = int(b.anchors[0, n])
            start = int((doc[0] == doc[0, a]).nonzero()[0])
            cache = m.new_cache(1, T)
            m.extend_context(cache, hidden[:1, start:a], b.ctx_positions[:1, start:a])
            single = m.draft_block(cache, b.tokens[:1, n], b.positions[:1, n])
            assert torch.allclose(single[0], packed[0, n], atol=1e-5)


def test_loss_weights_and_metrics_by_hand():
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[8], torch.exp(torch.tensor(-1.0)))
    # one block of B=4 (3 predicted slots); correct, correct, wrong -> accepted 2 -> tau 3
    from dflash.train.drafter.blocks import Blocks

    V = 5
    labels = torch.tensor([[[0, 1, 2, 3]]])
    logits = torch.full((1, 1, 3, V), -10.0)
    logits[0, 0, 0, 1] = 10  # right
    logits[0, 0, 1, 2] = 10  # right
    logits[0, 0, 2, 0] = 10  # wrong (label 3)
    ones = torch.ones(1, 1, 4, dtype=torch.bool)
    ones[..., 0] = False
    blk = Blocks(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), labels, labels, labels,
                 ones, torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
    loss, met = block_loss(logits, blk, gamma=7.0)
    assert torch.allclose(met["tau"], torch.tensor(3.0))
    assert met["slot_acc"].tolist() == [1.0, 1.0, 0.0]
    # the loss is the weighted mean of the per-slot CE
    ce = torch.nn.functional.cross_entropy(logits[0, 0], labels[0, 0, 1:], reduction="none")
    ww = slot_weights(4, 7.0)[1:]
    assert torch.allclose(loss, (ce * ww).sum() / ww.sum())


def test_gradients_reach_drafter_not_target_head():
    m = tiny()
    hidden, ids, lm, doc, scores = batch()
    loss, _ = m.forward_train(hidden, ids, lm, doc, scores, 12)
    loss.backward()
    names = {n for n, _ in m.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert not m.embed_weight.requires_grad and not m.lm_head_weight.requires_grad
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n


@pytest.mark.cxx
def test_compiles_without_graph_breaks():
    """fullgraph=True fails on .item(), nonzero or data-dependent shapes in the training forward."""
    m = tiny()
    hidden, ids, lm, doc, scores = batch()
    f = torch.compile(m.forward_train, fullgraph=True, dynamic=False)
    loss, met = f(hidden, ids, lm, doc, scores, 12)
    ref, _ = m.forward_train(hidden, ids, lm, doc, scores, 12)
    assert torch.allclose(loss, ref, atol=1e-4)


def test_overfits_a_tiny_batch():
    m = tiny()
    hidden, ids, lm, doc, scores = batch()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = None
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        loss, met = m.forward_train(hidden, ids, lm, doc, torch.rand(2, T, generator=g), 16)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.3 * first, (first, loss.item())
    assert met["tau"] > 1.5


def test_save_load_round_trip_and_servable_layout(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    m = tiny(layer_types=["sliding_attention", "full_attention"], sliding_window=32)
    save_drafter(m, str(tmp_path / "ckpt"), dtype=torch.float32)
    sd = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        want |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                                 "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                 "mlp.down_proj.weight")}
        want |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
    assert set(sd) == want  # no embedding or LM head in the checkpoint
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": 511, "sliding_window_non_causal": True}
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 2
    hf = AutoConfig.from_pretrained(str(tmp_path / "ckpt"))  # transformers reads it as a Qwen3 config
    assert hf.model_type == "qwen3" and hf.num_hidden_layers == 2 and hf.block_size == 4
    assert hf.dflash_config["mask_token_id"] == 511 and hf.sliding_window == 32
    m2 = load_drafter(str(tmp_path / "ckpt"))
    m2.set_target_head(m.embed_weight, m.lm_head_weight)
    hidden, ids, lm, doc, scores = batch()
    with torch.no_grad():
        a, _ = m.forward_train(hidden, ids, lm, doc, scores, 8)
        b, _ = m2.forward_train(hidden, ids, lm, doc, scores, 8)
    assert torch.equal(a, b)
    assert m2.cfg == m.cfg


def test_chunked_loss_equals_full_logits_reference():
    """The chunked linear-CE (no [slots, vocab] tensor) gives the reference loss, gradients and metrics."""
    import dflash.train.drafter.loss as tm

    m = tiny()
    hidden, ids, lm, doc, scores = batch()
    N, B, R = 12, m.cfg.block_size, 2
    b = make_blocks(ids, lm, doc, scores, N, B, m.cfg.mask_token_id)
    logits = _packed_logits(m, hidden, ids, lm, doc, scores, N)
    ref, ref_met = block_loss(logits, b, 7.0)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    for chunk in (5, 10_000):  # many chunks (uneven tail) and one
        m.zero_grad(set_to_none=True)
        orig = tm.ce_chunk
        tm.ce_chunk = lambda vocab, budget_bytes=0, c=chunk: c
        try:
            loss, met = m.forward_train(hidden, ids, lm, doc, scores, N)
        finally:
            tm.ce_chunk = orig
        loss.backward()
        assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
        for k in ("tau", "slot_acc", "slot_count", "weight"):
            assert torch.allclose(met[k], ref_met[k]), k
        for n, p in m.named_parameters():
            assert torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6), n


def test_rope_frequencies_stay_float32_in_a_bf16_drafter():
    """Casting the drafter to bf16 keeps its RoPE frequencies in float32, so its rotations at long positions are
    those of transformers' Qwen3 rotary embedding (what serving computes), not bf16-rounded ones."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash.train.drafter.model import rope_cos_sin, rope_inv_freq

    cfg = DrafterConfig.named("tiny", rope_theta=1_000_000.0)
    m = DFlashDrafter(cfg).to(torch.bfloat16)
    assert m.fc.weight.dtype == torch.bfloat16 and m.inv_freq.dtype == torch.float32
    assert torch.equal(m.inv_freq, rope_inv_freq(cfg))
    kw = dict(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim,
              num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings)
    try:  # transformers 5 names RoPE settings rope_parameters; 4.x, rope_theta
        hf_cfg = Qwen3Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    except TypeError:
        hf_cfg = Qwen3Config(**kw, rope_theta=cfg.rope_theta)
    rot = Qwen3RotaryEmbedding(hf_cfg)
    pos = torch.arange(2990, 3010)[None]
    want_cos, want_sin = rot(torch.zeros(1, 1, dtype=torch.bfloat16), pos)
    cos, sin = rope_cos_sin(m.inv_freq, pos, torch.bfloat16)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    bad_cos, _ = rope_cos_sin(m.inv_freq.to(torch.bfloat16), pos, torch.bfloat16)
    assert (bad_cos.float() - want_cos.float()).abs().max() > 0.1  # what the bf16 frequencies gave


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices")


def _random_packed(R, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (R, T), generator=g)
    lm = (torch.rand(R, T, generator=g) > 0.3).to(torch.uint8)
    doc = torch.zeros(R, T, dtype=torch.long)
    for r in range(R):
        cuts = sorted(torch.randint(1, T - 8, (3,), generator=g).tolist())
        for d, (a, b) in enumerate(zip([0, *cuts], [*cuts, T - 5])):
            doc[r, a:b] = d + 1
    return ids, lm, doc, torch.rand(R, T, generator=g)


# (rows, tokens, anchors, block, window): tile-aligned and not (queries and keys padded to 128), a sliding window
@pytest.mark.parametrize("R,T,N,B,window", [(2, 256, 16, 16, None), (3, 300, 12, 8, None), (2, 512, 40, 16, 64),
                                             (1, 1000, 24, 10, 100), (1, 2048, 64, 16, None)])
def test_flex_block_mask_equals_create_block_mask(R, T, N, B, window):
    """The training step's BlockMask (built without create_block_mask's slow-to-compile conversion) holds exactly what
    create_block_mask builds from the same mask_mod: every index tensor, dtype and shape, its lengths and tile."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.train.drafter.blocks import flex_block_mask

    ids, lm, doc, scores = _random_packed(R, T, seed=T)
    mine = flex_block_mask(make_blocks(ids, lm, doc, scores, N, B, 99), doc, window)
    ref = create_block_mask(mine.mask_mod, R, None, N * B, T + N * B, device="cpu")
    for f in BLOCK_MASK_FIELDS:
        a, b = getattr(mine, f), getattr(ref, f)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f
    assert (mine.seq_lengths, mine.BLOCK_SIZE) == (ref.seq_lengths, ref.BLOCK_SIZE)
    assert int(mine.kv_num_blocks.sum()) > 0
    if T >= 2048:  # long documents: whole tiles of context occur too
        assert int(mine.full_kv_num_blocks.sum()) > 0


@pytest.mark.cxx
def test_flex_block_mask_compiled_equals_eager():
    """Traced into a compiled graph (the step's case: mask_mod broadcast over the grid, the indices from the opaque
    op), the BlockMask's tensors equal the eager ones."""
    from dflash.train.drafter.blocks import flex_block_mask

    ids, lm, doc, scores = _random_packed(2, 300, seed=3)
    blocks = make_blocks(ids, lm, doc, scores, 12, 16, 99)

    def fields(anchors, anchor_doc, positions, ctx_positions, doc):
        b = dataclasses.replace(blocks, anchors=anchors, anchor_doc=anchor_doc, positions=positions,
                                ctx_positions=ctx_positions)
        bm = flex_block_mask(b, doc, 50)
        return tuple(getattr(bm, f) for f in BLOCK_MASK_FIELDS)

    args = (blocks.anchors, blocks.anchor_doc, blocks.positions, blocks.ctx_positions, doc)
    eager = fields(*args)
    torch._dynamo.reset()
    compiled = torch.compile(fields, fullgraph=True, dynamic=False)(*args)
    for f, a, b in zip(BLOCK_MASK_FIELDS, eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b), f


def test_windowed_flex_mask_reads_as_many_tiles_at_any_row_length():
    """A sliding layer's BlockMask keeps the tiles a block query reads flat in the row length: its window before the
    anchor and its own block, one document of 2,048 or of 8,192 tokens alike (full attention reads the whole
    prefix: 4x the tiles at 4x the length)."""
    from dflash.train.drafter.blocks import flex_block_mask

    def tiles(T: int, window: int | None) -> int:
        ids = torch.randint(0, 500, (1, T), generator=torch.Generator().manual_seed(0))
        doc, lm = torch.ones(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.uint8)
        scores = torch.zeros(1, T)
        scores[0, T - 600:T - 500] = 1.0  # 16 anchors near the end of the row: the longest prefixes
        bm = flex_block_mask(make_blocks(ids, lm, doc, scores, 16, 16, 99), doc, window)
        return int((bm.kv_num_blocks + bm.full_kv_num_blocks).max())

    assert tiles(2048, 256) == tiles(8192, 256) <= 256 // 128 + 3  # the window's tiles (+ edges) and the block's
    assert tiles(8192, None) > 3 * tiles(2048, None)
