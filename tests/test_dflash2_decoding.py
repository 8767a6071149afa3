"""Decoding with DFlash2 and sliding-window drafters, in float32 on a tiny Qwen3 target.

    a DFlash2 drafter drafts one block after a context exactly as the packed training forward computes that block
        (convolutions, window and all): the slot outputs of every anchor agree;
    the selector's greedy pass: each slot's draft is its best-scored candidate given the draft before it, the scores
        recomputed here from the selector's tensors; with a selector of weight it drafts otherwise than the argmax;
    speculative decoding with a DFlash2 drafter, and with a windowed DFlash drafter, gives the tokens of a plain HF
        greedy loop (tests/workload.py hf_greedy): lossless;
    the fixed-shape DFlash2 step (StaticDraft2, a CUDA graph on a GPU: tests/test_gpu.py) drafts every block of a
        decoding exactly as the eager step, and its one check against the eager step names a draft the selector
        would not choose.
"""

from __future__ import annotations

import random

import pytest
import torch

from dflash.core.target import load_causal_lm, load_tokenizer
from dflash.train.drafter.blocks import make_blocks
from dflash.train.evaluate.decode import speculative
from dflash.train.drafter.dflash2 import DFlash2Drafter
from dflash.train.evaluate.dflash2_drafting import DFlash2Proposer, greedy_selector_path
from dflash.train.evaluate.drafting import DFlashProposer
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig
from dflash.train.evaluate.verify import Target
from tests.tiny import make_tiny_target
from tests.workload import hf_greedy

BLOCK = 4
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("decode2") / "target")
    return {"model": load_causal_lm(path).eval(), "tok": load_tokenizer(path)}


def drafter(tiny, arch: str, window: int | None = 8, seed: int = 0):
    m = tiny["model"]
    over = dict(arch="dflash2", selector_rank=8, selector_top_k=4) if arch == "dflash2" else {}
    cfg = DrafterConfig.from_target(m.config, num_layers=2, layer_ids=LAYERS, block_size=BLOCK,
                                    mask_token_id=len(tiny["tok"]), sliding_window=window,
                                    layer_types=["sliding_attention", "full_attention"] if window else [], **over)
    d = (DFlash2Drafter if arch == "dflash2" else DFlashDrafter)(cfg)
    d.reset_parameters(seed=seed)
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():  # convolutions and selector away from their identity / small start: they count
        for name, p in d.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.copy_(p + 0.5 * torch.randn(p.shape, generator=g))
    d.set_target_head(m.get_input_embeddings().weight, m.get_output_embeddings().weight)
    return d.eval()


def test_dflash2_drafts_a_block_as_the_packed_training_forward_computes_it(tiny):
    d = drafter(tiny, "dflash2")
    T, N = 96, 10
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (1, T), generator=g)
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[0, :50], doc[0, 50:90] = 1, 2
    lm = (doc > 0).to(torch.uint8)
    hidden = torch.randn(1, T, len(LAYERS) * 64, generator=g)
    scores = torch.rand(1, T, generator=g)
    with torch.no_grad():
        h, _ = d.forward_slots(hidden, ids, lm, doc, scores, N)
        b = make_blocks(ids, lm, doc, scores, N, BLOCK, d.cfg.mask_token_id)
        checked = 0
        for n in range(N):
            a = int(b.anchors[0, n])
            start = int((doc[0] == doc[0, a]).nonzero()[0])
            cache = d.new_cache(1, T)
            d.extend_context(cache, hidden[:, start:a], b.ctx_positions[:, start:a])
            single = d.draft_states(cache, b.tokens[:, n], b.positions[:, n])
            torch.testing.assert_close(single[0], h[0, n], atol=1e-5, rtol=1e-5)
            checked += a - start > 8  # some with more context than the window
        assert checked >= 3


def test_the_greedy_selector_path_takes_each_slots_best_candidate_after_the_draft_before(tiny):
    d = drafter(tiny, "dflash2")
    g = torch.Generator().manual_seed(2)
    differs = 0
    for _ in range(20):
        h = torch.randn(BLOCK - 1, 64, generator=g)
        last = torch.randint(3, 300, (), generator=g)
        got = greedy_selector_path(d, h, last)
        W, sel = d.lm_head_weight, d.candidate_selector
        prev = int(last)
        for s in range(BLOCK - 1):
            logits = h[s] @ W.t()
            cands = logits.topk(4).indices
            bilinear = ((sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ h[s])) *
                        sel.successor_codebook[cands]).sum(-1)
            best = int(cands[(logits[cands] + bilinear).argmax()])
            assert int(got[s]) == best
            differs += best != int(logits.argmax())
            prev = best
    assert differs > 0  # the selector changed some drafts


@pytest.mark.parametrize("arch", ["dflash2", "dflash"])
def test_speculative_decoding_with_dflash2_or_windowed_drafters_is_lossless(tiny, arch):
    m = tiny["model"]
    t = Target(m, LAYERS)
    d = drafter(tiny, arch, window=4)
    proposer = DFlash2Proposer if arch == "dflash2" else DFlashProposer
    rng = random.Random(0)
    for n in (1, 6, 23):
        p = [rng.randrange(3, len(tiny["tok"])) for _ in range(n)]
        ref = hf_greedy(m, p, 24)
        assert speculative(t, proposer(d, 128), p, 24, set()).tokens == ref
        if arch == "dflash":  # the fixed-shape step (StaticDraft) with its window too
            assert speculative(t, proposer(d, 128, graph=True), p, 24, set()).tokens == ref


def recording(proposer):
    """The proposer, and the list each of its drafts is appended to."""
    drafts, propose = [], proposer.propose

    def recorded(seq, last, pos):
        out = propose(seq, last, pos)
        drafts.append([int(t) for t in out])
        return out

    proposer.propose = recorded
    return proposer, drafts


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.cxx)], ids=["plain", "compiled"])
def test_the_fixed_shape_dflash2_step_drafts_exactly_as_the_eager_one(tiny, compiled):
    """graph=True: StaticDraft2's step (on a GPU one CUDA graph; here the same code run eagerly) after the check
    against the eager step on the first whole verified block; every draft of a decoding equals the eager path's.
    compiled: the step through torch.compile first, as on a GPU (its selector's greedy pass and sliding window
    included)."""
    m = tiny["model"]
    t = Target(m, LAYERS)
    d = drafter(tiny, "dflash2", window=4)
    rng = random.Random(1)
    for n in (2, 9, 30) if not compiled else (30,):
        p = [rng.randrange(3, len(tiny["tok"])) for _ in range(n)]
        eager, eager_drafts = recording(DFlash2Proposer(d, 128))
        static, static_drafts = recording(DFlash2Proposer(d, 128, graph=True, compiled=compiled))
        ref = speculative(t, eager, p, 32, set()).tokens
        assert speculative(t, static, p, 32, set()).tokens == ref == hf_greedy(m, p, 32)
        assert static.graph_status == "static" and eager.graph_status == "off"
        assert static_drafts == eager_drafts and len(static_drafts) > 3
        assert static.static.compiled == compiled


def test_the_dflash2_step_check_names_a_draft_the_selector_would_not_choose(tiny):
    from dflash.train.evaluate.dflash2_drafting import selector_disagreement

    d = drafter(tiny, "dflash2")
    g = torch.Generator().manual_seed(4)
    h, last = torch.randn(BLOCK - 1, 64, generator=g), torch.tensor([7])
    with torch.no_grad():
        best = greedy_selector_path(d, h, last)
        assert selector_disagreement(d, best, h, last) is None
        scores = d.selector_scores(h[1:2], best[:1], (h[1:2] @ d.lm_head_weight.t()).topk(4).indices)
        worst = best.clone()
        worst[1] = (h[1] @ d.lm_head_weight.t()).topk(4).indices[scores[0].argmin()]
        assert "at slot 2" in selector_disagreement(d, worst, h, last)
