"""The drafter's decoder layer is transformers' Qwen3 decoder layer (litgpt-style parity, float32 on CPU).

With an empty context (a block whose anchor starts its document, or a draft with nothing cached), a DFlash
drafter layer is a Qwen3 decoder layer whose attention is bidirectional over the block. With the same
weights (the drafter's names are Qwen3's: what lets servers load a checkpoint), one drafter layer and
transformers' Qwen3DecoderLayer, given a bidirectional mask and Qwen3RotaryEmbedding at the block's
absolute positions, must give the same outputs -- through both of the drafter's paths:

    serving: DFlashDrafter.draft_block (logits of slots 1..B-1 with an empty context cache), and
    training: DFlashDrafter.forward_train with the one anchor at a document's first token (the loss over
        the block, recomputed from transformers' layer outputs with the same slot weights).

Norm weights and q/k norms are random (not ones), GQA (4 query heads over 2 key/value heads), positions far
from 0 so RoPE matters. Tolerance 1e-5: float32 over one layer, values O(1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.train.drafter.loss import slot_weights
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig

B = 8


def hf_config(cfg: DrafterConfig):
    from transformers import Qwen3Config

    kw = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
              vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings, attention_bias=False)
    try:  # transformers 5 names RoPE settings rope_parameters; 4.x, rope_theta
        c = Qwen3Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    except TypeError:
        c = Qwen3Config(**kw, rope_theta=cfg.rope_theta)
    c._attn_implementation = "eager"
    return c


@pytest.fixture(scope="module")
def pair():
    cfg = DrafterConfig.named("tiny", num_layers=1, block_size=B, rope_theta=10_000.0)
    assert cfg.num_heads != cfg.num_kv_heads  # GQA
    torch.manual_seed(0)
    d = DFlashDrafter(cfg).float()
    d.reset_parameters(std=0.1, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm weights: random, not ones
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    d.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
                      torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.3)
    d.eval()

    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    hc = hf_config(cfg)
    layer = Qwen3DecoderLayer(hc, layer_idx=0).float().eval()
    sd = {k[len("layers.0."):]: v for k, v in d.state_dict().items() if k.startswith("layers.0.")}
    assert set(sd) == set(layer.state_dict()), (sorted(sd), sorted(layer.state_dict()))
    layer.load_state_dict(sd)
    return d, layer, Qwen3RotaryEmbedding(hc)


def hf_block_hidden(pair, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """transformers' layer over the block [1, B] at positions start.., attention bidirectional."""
    d, layer, rot = pair
    x = F.embedding(tokens, d.embed_weight)
    pos = torch.arange(start, start + tokens.shape[1])[None]
    cos_sin = rot(x, pos)
    mask = torch.zeros(1, 1, tokens.shape[1], tokens.shape[1])  # additive: every key visible
    with torch.no_grad():
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return d.norm(out)


def test_draft_block_with_an_empty_context_is_a_qwen3_layer(pair):
    d = pair[0]
    g = torch.Generator().manual_seed(2)
    for start in (0, 5, 1234):
        tokens = torch.randint(0, d.cfg.vocab_size, (1, B), generator=g)
        tokens[0, 1:] = d.cfg.mask_token_id
        want = F.linear(hf_block_hidden(pair, tokens, start), d.lm_head_weight)[:, 1:]
        with torch.no_grad():
            got = d.draft_block(d.new_cache(1, 16), tokens, torch.arange(start, start + B)[None])
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())


def test_training_forward_with_an_empty_context_is_a_qwen3_layer(pair):
    d = pair[0]
    g = torch.Generator().manual_seed(3)
    T = 48
    ids = torch.randint(0, d.cfg.vocab_size, (1, T), generator=g)
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[0, :20], doc[0, 20:40] = 1, 2  # the anchor starts document 2: nothing before it is its context
    lm = (doc > 0).to(torch.uint8)
    hidden = torch.randn(1, T, d.cfg.num_context_layers * d.cfg.hidden_size, generator=g)
    scores = torch.zeros(1, T)
    scores[0, 20] = 1.0
    with torch.no_grad():
        loss, _ = d.forward_train(hidden, ids, lm, doc, scores, 1, 7.0)
    block = torch.full((1, B), d.cfg.mask_token_id)
    block[0, 0] = ids[0, 20]
    logits = F.linear(hf_block_hidden(pair, block, 0), d.lm_head_weight)[0, 1:]  # positions restart per document
    w = slot_weights(B, 7.0)[1:]
    want = (F.cross_entropy(logits, ids[0, 21:20 + B], reduction="none") * w).sum() / w.sum()
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
