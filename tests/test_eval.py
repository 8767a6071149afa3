"""Speculative decoding: acceptance logic on hand-built proposers, losslessness, n-gram lookup, the CLI."""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny import chat_rows, make_tiny_target, write_jsonl  # noqa: E402

from dflash.train.evaluate.decode import Decode, NgramProposer, greedy, speculative
from dflash.train.evaluate.drafting import DFlashProposer
from dflash.train.evaluate.verify import Target, crop_cache
from dflash.train.evaluate.eval import summarize
from dflash.train.drafter.checkpoint import save_drafter  # noqa: E402
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_target(str(tmp_path_factory.mktemp("eval") / "target"), arch="qwen3", num_layers=6, hidden=64)


@pytest.fixture(scope="module")
def model(target_dir):
    from dflash.core.target import load_causal_lm

    return load_causal_lm(target_dir, dtype=torch.float32)


PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [200, 201, 5, 200, 201]]


class Oracle:
    """Proposes the target's own greedy continuation (right) or something else (wrong)."""

    needs_hidden = False

    def __init__(self, block_size, truth: list[int], prompt_len: int, right: bool, vocab: int):
        self.block_size, self.truth, self.p, self.right, self.vocab = block_size, truth, prompt_len, right, vocab
        self.name = "oracle"

    def start(self, hidden):
        pass

    def observe(self, hidden, start, count=None):
        pass

    def propose(self, seq, last, pos):
        nxt = self.truth[pos + 1 - self.p: pos + self.block_size - self.p]
        return nxt if self.right else [(t + 1) % self.vocab for t in nxt]


@pytest.mark.parametrize("B", [4, 8])
def test_always_right_gives_tau_B_and_always_wrong_gives_1(model, B):
    t = Target(model, None)
    V = model.config.vocab_size
    for prompt in PROMPTS:
        m = 4
        max_new = 1 + m * B  # the prefill's token, then m full blocks
        truth = greedy(t, prompt, max_new + B, eos=set()).tokens
        right = speculative(t, Oracle(B, truth, len(prompt), True, V), prompt, max_new, eos=set())
        assert right.accept_lengths == [B] * m and right.tau == B
        assert right.tokens == truth[:max_new]
        wrong = speculative(t, Oracle(B, truth, len(prompt), False, V), prompt, max_new, eos=set())
        assert wrong.tau == 1.0 and set(wrong.accept_lengths) == {1}
        assert wrong.tokens == truth[:max_new]  # still lossless: every step keeps the target's own token
        assert wrong.steps == max_new - 1


def test_dflash_and_ngram_are_lossless(model, target_dir):
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(model.config, num_layers=2, layer_ids=[1, 3], block_size=6,
                                    mask_token_id=model.config.vocab_size - 1)
    d = DFlashDrafter(cfg).float()
    d.reset_parameters(std=0.05, seed=1)
    d.set_target_head(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    t = Target(model, cfg.target_layer_ids)
    eos = {int(model.config.eos_token_id)} if model.config.eos_token_id is not None else set()
    for prompt in PROMPTS:
        ref = greedy(t, prompt, 40, eos)
        for prop in (DFlashProposer(d, 200), NgramProposer(6, 3)):
            out = speculative(t, prop, prompt, 40, eos)
            assert out.tokens == ref.tokens, prop.name
            assert all(1 <= a <= 6 for a in out.accept_lengths)
            assert sum(out.accept_lengths) >= len(out.tokens) - 1


def test_dflash_proposer_drafts_what_the_drafter_predicts(model):
    """The block is [last, MASK...] at positions pos..pos+B-1 after the prompt's hidden states."""
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(model.config, num_layers=1, layer_ids=[2], block_size=4,
                                    mask_token_id=model.config.vocab_size - 1)
    d = DFlashDrafter(cfg).float()
    d.set_target_head(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    t = Target(model, cfg.target_layer_ids)
    t.reset()
    prompt = PROMPTS[0]
    logits, hidden = t.forward(torch.tensor([prompt]), 0, hidden=True)
    p = DFlashProposer(d, 64)
    p.start(hidden)
    draft = p.propose(prompt, 9, len(prompt)).tolist()  # on the device: no host sync to build the block
    with torch.inference_mode():
        cache = d.new_cache(1, 64)
        d.extend_context(cache, hidden, torch.arange(len(prompt))[None])
        block = torch.tensor([[9, cfg.mask_token_id, cfg.mask_token_id, cfg.mask_token_id]])
        want = d.draft_block(cache, block, torch.arange(len(prompt), len(prompt) + 4)[None]).argmax(-1)[0].tolist()
    assert draft == want and len(draft) == 3


def test_ngram_lookup():
    p = NgramProposer(block_size=4, ngram_max=3)
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3], 3, 8) == [9, 9, 1]  # longest match: the trigram 1 2 3
    assert p.propose([5, 6, 7, 5], 5, 4) == [6, 7, 5]  # unigram match
    assert p.propose([1, 2, 3, 4], 4, 4) == []  # nothing to look up
    assert p.propose([7, 1, 8, 7, 2, 9, 7], 7, 7) == [2, 9, 7]  # the latest earlier occurrence wins


def test_crop_cache_keeps_a_prefix(model):
    from transformers import DynamicCache

    t = Target(model, None)
    t.reset()
    t.forward(torch.tensor([PROMPTS[1]]), 0, hidden=False)
    assert t.cache.get_seq_length() == len(PROMPTS[1])
    crop_cache(t.cache, 4)
    assert t.cache.get_seq_length() == 4
    crop_cache(t.cache, 10)  # never grows
    assert t.cache.get_seq_length() == 4
    assert isinstance(t.cache, DynamicCache)


def test_summary_histogram_and_slot_rates():
    ds = [Decode([1] * 7, accept_lengths=[4, 1, 2]), Decode([1] * 4, accept_lengths=[3, 1])]
    s = summarize("x", ds, 4)
    assert s["tau"] == pytest.approx(11 / 5)
    assert s["accept_length_hist"] == [2, 1, 1, 1]
    assert s["slot_accept_rate"] == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert s["tau_per_prompt"] == pytest.approx([7 / 3, 2.0])


def test_eval_cli_reports_tau_speed_losslessness_and_plot(target_dir, tmp_path, model):
    cfg = DrafterConfig.from_target(model.config, num_layers=1, layer_ids=[1, 3], block_size=4,
                                    mask_token_id=model.config.vocab_size - 1)
    d = DFlashDrafter(cfg)
    save_drafter(d, str(tmp_path / "drafter"), dtype=torch.float32)
    data = write_jsonl(str(tmp_path / "p.jsonl"), chat_rows(5, seed=4))
    out = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "-m", "dflash", "eval", "--target", target_dir, "--drafter",
                        str(tmp_path / "drafter"), "--data", data, "--max-prompts", "3", "--max-new-tokens", "12",
                        "--json", str(out), "--plot", str(tmp_path / "acc.png"), "--no-progress"],
                       cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dflash drafter" in r.stdout and "n-gram lookup" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["prompts"] == 3 and rep["block_size"] == 4 and rep["dtype"] == "float32"
    for k in ("dflash", "ngram"):
        assert rep[k]["outputs_identical"] == 3 and rep[k]["output_match_rate"] == 1.0  # lossless in float32
        assert 1.0 <= rep[k]["tau"] <= 4.0 and len(rep[k]["slot_accept_rate"]) == 3
    assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rep["draft_graph"] == "off"  # the default: a CUDA graph on a GPU only
    forced = subprocess.run([sys.executable, "-m", "dflash", "eval", "--target", target_dir, "--drafter",
                             str(tmp_path / "drafter"), "--data", data, "--max-prompts", "2", "--max-new-tokens", "12",
                             "--draft-graph", "--json", str(tmp_path / "forced.json"), "--no-progress"],
                            cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert forced.returncode == 0, forced.stderr[-2000:]
    rep2 = json.loads((tmp_path / "forced.json").read_text())
    assert rep2["draft_graph"] == "static" and rep2["dflash"]["outputs_identical"] == 2  # fixed shapes, no graph on CPU
    bad = subprocess.run([sys.executable, "-m", "dflash", "eval", "--target", target_dir, "--drafter",
                          str(tmp_path / "nope"), "--data", data], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0


def test_target_alone_runs_the_same_loop_and_matches_an_independent_greedy_decode(model):
    """greedy() is speculative() with a zero-length draft; its output is HF's own greedy decoding."""
    t = Target(model, None)
    for prompt in PROMPTS:
        ours = greedy(t, prompt, 12, eos=set(), margins=True)
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            ref = []
            for _ in range(12):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                ref.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert ours.tokens == ref
        assert ours.accept_lengths == [1] * 11 and ours.steps == 11  # one 1-token verify per token
        assert len(ours.margins) == 12 and all(m >= 0 for m in ours.margins)
        assert ours.seconds >= ours.prefill_s + ours.verify_s * 0.5 and ours.draft_s >= 0


def test_differences_are_classified_by_the_margin_at_the_first_differing_token():
    from dflash.train.evaluate.eval import classify_differences

    ref = [Decode([1, 2, 3], margins=[5.0, 0.1, 4.0]), Decode([1, 2, 3], margins=[5.0, 6.0, 4.0]),
           Decode([7, 7], margins=[1.0, 1.0])]
    out = [Decode([1, 9, 3], margins=[5.0, 0.2, 4.0]), Decode([1, 2, 8], margins=[5.0, 6.0, 3.0]),
           Decode([7, 7], margins=[1.0, 1.0])]
    c = classify_differences(ref, out, tie_margin=0.5)
    assert (c["differing"], c["near_tie"], c["suspect"]) == (2, 1, 1)
    assert c["cases"][0] == {"prompt": 0, "first_diff": 1, "margin_target": 0.1, "margin_spec": 0.2, "kind": "near_tie"}
    assert c["cases"][1]["first_diff"] == 2 and c["cases"][1]["kind"] == "suspect"


def test_a_row_ending_with_a_user_turn_is_a_prompt_with_its_history():
    from dflash.train.evaluate.eval import prompt_messages

    u1, a1, u2 = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                  {"role": "user", "content": "how are you"})
    assert prompt_messages([u1, a1, u2], 0, "x") == [u1, a1, u2]  # history up to the turn to answer
    assert prompt_messages([u1, a1, u2, a1], 0, "x") == [u1]  # a finished conversation: its first turn
    with pytest.raises(Exception, match="row 3"):
        prompt_messages([a1], 3, "x")


def test_static_draft_forward_equals_the_eager_one_and_stays_lossless(model):
    """StaticDraft (fixed shapes: the whole context cache under a mask; a CUDA graph on a GPU) drafts what
    draft_block drafts, and a proposer using it reuses one cache across prompts without leaking context."""
    from dflash.train.evaluate.drafting import StaticDraft

    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(model.config, num_layers=2, layer_ids=[1, 3], block_size=5,
                                    mask_token_id=model.config.vocab_size - 1)
    d = DFlashDrafter(cfg).float()
    d.reset_parameters(std=0.2, seed=3)
    d.set_target_head(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    t = Target(model, cfg.target_layer_ids)
    t.reset()
    P = len(PROMPTS[1])
    _, hidden = t.forward(torch.tensor([PROMPTS[1] + [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]]), 0, hidden=True)
    with torch.inference_mode():
        eager = d.new_cache(1, 64)
        fixed = d.new_cache(1, 64 + 5)
        fixed.max_len = 64
        with pytest.raises(ValueError, match="slack"):
            StaticDraft(d, eager, capture=True)
        for c in (eager, fixed):
            d.extend_context(c, hidden[:, :P], torch.arange(P)[None])
        static = StaticDraft(d, fixed, capture=True)  # no capture on a CPU: the same step, eagerly
        # (last, pos, the verified block's start and accepted count); None: nothing new since the last step
        for last, pos, start, count in ((7, P + 2, P, 2), (123, P + 2, None, 0), (5, P + 7, P + 2, 5),
                                        (9, P + 8, P + 7, 1)):
            block = torch.tensor([[last] + [cfg.mask_token_id] * 4])
            if start is not None:
                d.extend_context(eager, hidden[:, start:start + count], torch.arange(start, start + count)[None])
            want = d.draft_block(eager, block, torch.arange(pos, pos + 5)[None])
            got = static(last, pos, None if start is None else hidden[:, start:start + 5], start)
            assert got.tolist() == want.argmax(-1)[0].tolist()
            assert fixed.length == eager.length == pos
            for i in range(len(d.layers)):  # the confirmed context is the eager one; the rest is never read
                assert torch.allclose(fixed.k[i][:, :, :pos], eager.k[i][:, :, :pos], atol=1e-6)
            assert fixed.pos[0, :pos].tolist() == list(range(pos))
    eos = {int(model.config.eos_token_id)} if model.config.eos_token_id is not None else set()
    eager, fixed = DFlashProposer(d, 200), DFlashProposer(d, 200, graph=True)
    drafts = {"eager": [], "fixed": []}
    for name, prop in (("eager", eager), ("fixed", fixed)):
        inner = prop.propose
        prop.propose = lambda seq, last, pos, inner=inner, log=drafts[name]: log.append(
            inner(seq, last, pos).tolist()) or torch.tensor(log[-1])
    for prompt in PROMPTS:  # the fixed proposer's cache is reused prompt after prompt
        a = speculative(t, eager, prompt, 30, eos)
        b = speculative(t, fixed, prompt, 30, eos)
        assert b.tokens == a.tokens == greedy(t, prompt, 30, eos).tokens
        assert b.accept_lengths == a.accept_lengths
    assert drafts["fixed"] == drafts["eager"] and len(drafts["eager"]) > 20
    assert fixed.graph_status == "static" and eager.graph_status == "off"


def test_decode_attention_equals_the_models_own_and_steps_aside_for_windows(tmp_path, model):
    """Target's decode attention (no mask tensor: causal to the bottom right, GQA in place) gives the logits
    and captured layers of the model's own sdpa for a prefill, one-token steps and a multi-token verify after
    a cache; a model with a sliding window keeps its own attention."""
    from transformers import AutoModelForCausalLM, MistralConfig

    own = Target(model, [1, 3], attention="model")
    assert own.attention == "sdpa"
    steps = [(0, PROMPTS[1]), (9, [4]), (10, [8, 2, 9, 1, 7, 7, 3, 5]), (18, [6])]
    ref = []
    own.reset()
    for start, ids in steps:
        ref.append(own.forward(torch.tensor([ids]), start, hidden=True))
    assert Target(model, None).attention == "sdpa"  # auto: only where the flash kernel runs it (not a CPU)
    fast = Target(model, [1, 3], attention="decode")
    assert fast.attention == "dflash_decode"
    fast.reset()
    for (start, ids), (lr, hr) in zip(steps, ref):
        lf, hf = fast.forward(torch.tensor([ids]), start, hidden=True)
        assert torch.allclose(lf, lr, atol=1e-5) and torch.allclose(hf, hr, atol=1e-5)
    crop_cache(fast.cache, 12)  # a rejected draft: the verify after a crop sees only the kept positions
    crop_cache(own.cache, 12)
    for t in (own, fast):
        t.logits = t.forward(torch.tensor([[5, 6, 7]]), 12, hidden=False)[0]
    assert torch.allclose(fast.logits, own.logits, atol=1e-5)
    Target(model, None, attention="model")  # leaves the shared model as it found it
    assert model.config._attn_implementation == "sdpa"

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    windowed = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    t = Target(windowed, None, attention="decode")
    assert t.attention == "sdpa"


def test_a_static_draft_may_differ_from_the_eager_one_only_by_near_ties():
    from dflash.train.evaluate.drafting import draft_disagreement

    logits = torch.tensor([[20.0, 19.9, 3.0], [1.0, 8.0, 7.999], [0.0, -5.0, 0.3]])
    assert draft_disagreement(torch.tensor([0, 1, 2]), logits) is None
    assert draft_disagreement(torch.tensor([1, 2, 2]), logits) is None  # 0.1 of 20 and 0.001 of 8: ties
    why = draft_disagreement(torch.tensor([0, 1, 0]), logits)  # 0.3 apart at a top logit of 0.3: not a tie
    assert why is not None and "slot 3" in why
    assert draft_disagreement(torch.tensor([2, 1, 2]), logits) is not None  # 17 apart
