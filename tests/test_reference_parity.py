"""dflash's windowed DFlash drafter and its DFlash2 drafter against the reference, speculators 0.9.0 (PyPI,
`speculators.models.dflash` / `.dflash2`), with the same weights on the same packed row, in float32 on CPU.

What is compared (tolerance: 2e-5 absolute on logits and scores, 1e-5 relative on losses; float32 sums in other
orders differ by ~1e-6):
  * sliding-window DFlash (every layer `sliding_attention`, window 6 < the documents, so it cuts): the draft logits
    of slots 1..B-1, and the loss. dflash's DFlash objective is cross-entropy on the data's tokens normalised by the
    slot weights; the reference's `loss_function` with its `ce_loss` on the same labels divides by the supervised
    slots instead: the two are compared through that one factor.
  * DFlash2 (convolutions with random weights, not the identity they start as): the draft logits, the selector's
    scores of the training candidates, and the loss (KL to the target's distribution + the selector loss, the
    reference's default objective, gamma 4).
Each comparison must also fail on a deliberate change: the window one position wider; a convolution tap read one
slot further back; the selector's predecessor ids one slot off.

The row: two documents each opening with 8 unsupervised prompt tokens, then padding; blocks never run past the
row, and a block that runs into the next document meets only unsupervised tokens, so dflash's label rule (same
document and supervised) and the reference's (supervised) agree. The reference draws its anchors with
torch.randperm: it is handed dflash's anchors instead (its select_anchors replaced).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("speculators", reason="the reference (pip install --no-deps speculators==0.9.0, see Makefile)")

import speculators.models.dflash.core as spec_core  # noqa: E402
from speculators.losses import dflash_loss_decay, loss_function  # noqa: E402
from speculators.losses.eager import ce_loss, kl_div_loss, tv_loss  # noqa: E402

import dflash.train.drafter.dflash2 as d2  # noqa: E402
from dflash.train.drafter.dflash2 import DFlash2Drafter  # noqa: E402
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig  # noqa: E402

ATOL = 2e-5
RTOL_LOSS = 1e-5
WINDOW = 6
N_ANCHORS = 12


def _config(arch: str, window: int | None) -> DrafterConfig:
    over = dict(layer_types=["sliding_attention"] * 2, sliding_window=window) if window else {}
    if arch == "dflash2":
        over.update(arch="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    return DrafterConfig.named("tiny", **over)


def _reference(cfg: DrafterConfig):
    from transformers import Qwen3Config

    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    tl = Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     vocab_size=cfg.vocab_size, num_hidden_layers=cfg.num_layers, rms_norm_eps=cfg.rms_norm_eps,
                     rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                     layer_types=cfg.layer_types, sliding_window=cfg.sliding_window,
                     use_sliding_window=cfg.sliding_window is not None)
    tl._attn_implementation = "eager"  # a dense float mask from the same mask_mod: runs on CPU
    common = dict(transformer_layer_config=tl, draft_vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                  aux_hidden_state_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id,
                  sliding_window_non_causal=cfg.sliding_window_non_causal)
    if cfg.arch == "dflash2":
        return DFlash2DraftModel(DFlash2SpeculatorConfig(
            **common, conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
            selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k))
    return DFlashDraftModel(DFlashSpeculatorConfig(**common))


def _pair(arch: str, window: int | None, seed: int = 0):
    """(dflash drafter, reference model, final-norm weight of the 'target') with the same random weights."""
    cfg = _config(arch, window)
    mine = (DFlash2Drafter if arch == "dflash2" else DFlashDrafter)(cfg)
    mine.reset_parameters(seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # norms, convolutions and the selector away from their small initial values: they count
        for name, p in mine.named_parameters():
            if "norm" in name or "conv" in name or "candidate_selector" in name:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
    embed, head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.5 for _ in range(2))
    mine.set_target_head(embed, head)
    ref = _reference(cfg)
    missing, _ = ref.load_state_dict(mine.state_dict(), strict=False)
    assert set(missing) == {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    final_norm = 1 + 0.2 * torch.randn(cfg.hidden_size, generator=g)
    with torch.no_grad():
        ref.embed_tokens.weight.copy_(embed)
        ref.lm_head.weight.copy_(head)
        ref.verifier_lm_head.weight.copy_(head)
        ref.verifier_norm.weight.copy_(final_norm)
    return mine.eval(), ref.eval(), cfg


def _row(cfg: DrafterConfig, seed: int = 1):
    """One packed row (module docstring) with random context and last-layer states, and dflash's blocks."""
    T, docs, prompt = 80, (36, 34), 8
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size - 1, (1, T), generator=g)
    doc = torch.zeros(1, T, dtype=torch.long)
    lm = torch.zeros(1, T, dtype=torch.long)
    start = 0
    for i, n in enumerate(docs):
        doc[0, start:start + n] = i + 1
        lm[0, start + prompt:start + n] = 1
        start += n
    hidden = torch.randn(1, T, cfg.num_context_layers * cfg.hidden_size, generator=g)
    last = torch.randn(1, T, cfg.hidden_size, generator=g) * 2  # the target's last layer, before its final norm
    scores = torch.rand(1, T, generator=g)
    return dict(ids=ids, doc=doc, lm=lm, hidden=hidden, last=last, scores=scores)


def _run_reference(ref, cfg, row, blocks, monkeypatch, gamma: float):
    anchors, valid = blocks.anchors[0], blocks.anchor_valid[0]
    monkeypatch.setattr(spec_core, "select_anchors", lambda loss_mask, n, block_size: (anchors.clone(), valid.clone()))
    kw = dict(hidden_states=row["hidden"], input_ids=row["ids"], loss_mask=row["lm"],
              verifier_last_hidden_states=row["last"], document_ids=row["doc"] - 1,  # the reference's padding: -1
              position_ids=blocks.ctx_positions)
    with torch.no_grad():
        hidden, logits, targets, mask, idx = ref._backbone_forward(**kw, max_anchors=N_ANCHORS)
        out = dict(hidden=hidden, logits=logits, targets=targets, mask=mask, idx=idx)
        if cfg.arch == "dflash2":
            from speculators.models.dflash2.metrics import selector_training_candidates

            pred_ids = ref._predecessor_ids(row["ids"], idx).reshape(1, -1)
            cands = logits.topk(cfg.selector_top_k, dim=-1).indices
            train_cands, _, _ = selector_training_candidates(cands, targets.argmax(-1))
            out["cands"] = train_cands
            out["scores"] = ref.candidate_selector.score_candidates(logits, hidden, pred_ids, train_cands)
            _, out["loss"], _ = ref(**kw, loss_config={"kl_div": (kl_div_loss, 1.0)}, tv_loss_fn=tv_loss, gamma=gamma,
                                    max_anchors=N_ANCHORS)
    return out


def _run_mine(mine, cfg, row, ref, gamma: float):
    """dflash's slot logits [N, B-1, V], and (DFlash2) its selector scores and loss; the target's final states are
    what `dflash extract --last-hidden` stores: its last layer after the final norm (the reference's verifier_norm)."""
    with torch.no_grad():
        target_final = ref.verifier_norm(row["last"])
        wide = torch.cat([row["hidden"], target_final], -1) if cfg.arch == "dflash2" else row["hidden"]
        h, blocks = mine.forward_slots(wide, row["ids"], row["lm"], row["doc"], row["scores"], N_ANCHORS)
        out = dict(logits=h[0] @ mine.lm_head_weight.t())
        if cfg.arch == "dflash2":
            w = d2.slot_weights(cfg.block_size, gamma)[1:] * blocks.label_valid[..., 1:].float()
            _, scores, cands, *_ = mine.slot_terms(h, blocks, target_final, w)
            B = cfg.block_size
            out.update(scores=scores.view(N_ANCHORS, B - 1, -1), cands=cands.view(N_ANCHORS, B - 1, -1))
            out["loss"], _ = mine.forward_train(wide, row["ids"], row["lm"], row["doc"], row["scores"], N_ANCHORS,
                                                gamma=gamma)
        else:
            out["loss"], out["met"] = mine.forward_train(wide, row["ids"], row["lm"], row["doc"], row["scores"],
                                                         N_ANCHORS, gamma=gamma)
    return out, blocks


def _differences(arch: str, window: int | None, monkeypatch, gamma: float = 4.0) -> dict[str, float]:
    """Largest differences between dflash and the reference: logits, (DFlash2) scores, loss (relative)."""
    mine, ref, cfg = _pair(arch, window)
    row = _row(cfg)
    got, blocks = _run_mine(mine, cfg, row, ref, gamma)
    assert bool(blocks.anchor_valid.all()) and int(blocks.label_valid.sum()) > 2 * N_ANCHORS
    want = _run_reference(ref, cfg, row, blocks, monkeypatch, gamma)
    B = cfg.block_size
    ref_logits = want["logits"].view(N_ANCHORS, B, -1)[:, 1:]
    diff = {"logits": float((got["logits"] - ref_logits).abs().max())}
    assert torch.equal(want["mask"].view(N_ANCHORS, B)[:, 1:].bool(), blocks.label_valid[0, :, 1:])
    if arch == "dflash2":
        ref_cands = want["cands"].view(N_ANCHORS, B, -1)[:, 1:]
        same = torch.equal(got["cands"], ref_cands)  # else the scores are of other candidates: no agreement
        diff["scores"] = float((got["scores"] - want["scores"].view(N_ANCHORS, B, -1)[:, 1:]).abs().max()) \
            if same else float("inf")
        diff["loss"] = abs(float(got["loss"]) - float(want["loss"])) / abs(float(want["loss"]))
    else:  # the reference's CE on the same labels, divided by the supervised slots instead of the weights
        labels = torch.nn.functional.one_hot(row["ids"][0, want["idx"]], cfg.vocab_size).float()[None] * 50
        pos = (torch.arange(N_ANCHORS * B) % B)[None]
        decay = lambda p, **_: dflash_loss_decay(p, gamma=gamma)  # noqa: E731
        ref_loss = loss_function(want["logits"], labels, want["mask"], pos, loss_fn=ce_loss, decay_fn=decay)
        mask = want["mask"].float()
        weights = (mask * decay(pos.float())).sum()
        mine_as_ref = float(got["loss"]) * float(weights) / (float(mask.sum()) + 1e-5)
        diff["loss"] = abs(mine_as_ref - float(ref_loss)) / abs(float(ref_loss))
    return diff


def _agree(diff: dict[str, float]) -> bool:
    return all(v <= (RTOL_LOSS if k == "loss" else ATOL) for k, v in diff.items())


def test_windowed_dflash_equals_the_reference_and_a_wider_window_does_not(monkeypatch):
    diff = _differences("dflash", WINDOW, monkeypatch)
    assert _agree(diff), diff
    full = _differences("dflash", None, monkeypatch)  # the full-attention drafter agrees too
    assert _agree(full), full
    mine, ref, cfg = _pair("dflash", WINDOW)
    wider = _pair("dflash", WINDOW + 1)[0]
    wider.load_state_dict(mine.state_dict())
    row = _row(cfg)
    got, blocks = _run_mine(wider, cfg, row, ref, 4.0)
    want = _run_reference(ref, cfg, row, blocks, monkeypatch, 4.0)
    off = float((got["logits"] - want["logits"].view(N_ANCHORS, cfg.block_size, -1)[:, 1:]).abs().max())
    assert off > 100 * ATOL, off


def test_dflash2_equals_the_reference(monkeypatch):
    diff = _differences("dflash2", WINDOW, monkeypatch)
    assert _agree(diff), diff
    full = _differences("dflash2", None, monkeypatch)
    assert _agree(full), full


def test_dflash2_parity_fails_on_a_shifted_tap_or_off_by_one_predecessors(monkeypatch):
    exact = d2.block_conv

    def tap_shifted(x, delta, base, block_size):  # tap t >= 1 reads slot s - t - 1: one slot too far back
        k = base.shape[0]
        wider = torch.cat([base[:1], torch.zeros_like(base[:1]), base[1:]])[:k + 1]
        d = torch.cat([delta[..., :1, :], torch.zeros_like(delta[..., :1, :]), delta[..., 1:, :]], -2)[..., :k + 1, :]
        return exact(x, d, wider, block_size)

    with monkeypatch.context() as m:
        m.setattr(d2, "block_conv", tap_shifted)
        diff = _differences("dflash2", WINDOW, monkeypatch)
    assert diff["logits"] > 100 * ATOL and diff["loss"] > 100 * RTOL_LOSS, diff

    with monkeypatch.context() as m:  # the token at the slot itself instead of the one before it
        m.setattr(DFlash2Drafter, "predecessor_ids",
                  staticmethod(lambda blocks: blocks.labels[..., 1:].reshape(-1)))
        diff = _differences("dflash2", WINDOW, monkeypatch)
    assert diff["logits"] <= ATOL  # the drafter itself is untouched
    assert diff["scores"] > 100 * ATOL and diff["loss"] > 100 * RTOL_LOSS, diff


def test_dflash2_gradients_equal_the_reference(monkeypatch):
    """The backward too (the chunked KL and the candidates' logits have hand-written gradients): every trained
    tensor's gradient of the loss equals the reference's (relative 1e-4 of its largest entry)."""
    mine, ref, cfg = _pair("dflash2", WINDOW)
    row = _row(cfg)
    target_final = ref.verifier_norm(row["last"]).detach()
    wide = torch.cat([row["hidden"], target_final], -1)
    loss, _ = mine.forward_train(wide, row["ids"], row["lm"], row["doc"], row["scores"], N_ANCHORS, gamma=4.0)
    loss.backward()
    blocks = mine.prepare(row["ids"], row["lm"], row["doc"], row["scores"], N_ANCHORS)[0]
    anchors, valid = blocks.anchors[0], blocks.anchor_valid[0]
    monkeypatch.setattr(spec_core, "select_anchors", lambda loss_mask, n, block_size: (anchors.clone(), valid.clone()))
    _, ref_loss, _ = ref(hidden_states=row["hidden"], input_ids=row["ids"], loss_mask=row["lm"],
                         verifier_last_hidden_states=row["last"], document_ids=row["doc"] - 1,
                         position_ids=blocks.ctx_positions, loss_config={"kl_div": (kl_div_loss, 1.0)},
                         tv_loss_fn=tv_loss, gamma=4.0, max_anchors=N_ANCHORS)
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in mine.named_parameters():
        want = ref_params[name].grad
        assert p.grad is not None and want is not None, name
        scale = float(want.abs().max())
        assert scale > 0, name
        assert float((p.grad - want).abs().max()) <= 1e-4 * scale, name
        checked += 1
    assert checked == len(list(mine.parameters()))


def test_the_kl_in_chunks_equals_it_in_one():
    """_LinearKL chunk by chunk (the training shape: ~440 slots a chunk over a 152k vocabulary) equals one chunk:
    values, candidates and the gradient through both outputs."""
    g = torch.Generator().manual_seed(3)
    n, H, V, k = 37, 16, 50, 4
    W = torch.randn(V, H, generator=g)
    t = torch.randn(n, H, generator=g)
    w = torch.rand(n, generator=g)
    pull = torch.randn(n, k, generator=g)
    out = {}
    for chunk in (n, 7):
        x = torch.randn(n, H, generator=torch.Generator().manual_seed(4)).requires_grad_()
        kl, unary, cands, pos, hit, tid, pred = d2._LinearKL.apply(x, t, W, w, k, chunk, d2.kl_chunk)
        (kl + (unary * pull).sum()).backward()
        out[chunk] = (kl.detach(), unary.detach(), cands, pos, hit, tid, pred, x.grad)
    for a, b in zip(out[n], out[7]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not bool(out[n][4].all())  # some slots' top-k missed the target's argmax: the injected candidate counts
