"""Decoding today's target families: `eval`, `regenerate` and `prompts` on hybrid (Gated DeltaNet + full attention:
Qwen3.5 text, its ForConditionalGeneration layout, Qwen3.5-MoE) and gpt-oss (sliding window of 8 with sinks,
alternating with full attention, experts) targets. CPU, float32, tiny random targets (tests/tiny.py
make_tiny_family); the reference is tests/workload.py hf_greedy over transformers' own model as a user loads it
(the multimodal class for its layout): no cache, no dflash code. Covered, for each family:

- speculative decoding with partial acceptance (a proposer that drafts the reference's next j tokens then wrong
  ones, j = 0..3 by step; and an untrained DFlash drafter) gives the reference's tokens, and after it the linear
  layers' conv and recurrent states equal those of a fresh prefill of the confirmed text: the rollback took them
  back to the accepted prefix, not only the KV cache; outputs run past the sliding window;
- `eval` (run_eval, an untrained drafter) reports tau, every output identical to the target's, and says once that
  the eager decoder runs, and why;
- the batch decoder of `regenerate` / `prompts` (extract/generation/kind_engine.py via generate): prompts of several lengths
  (left padding), a batch of 2 refilled as rows finish (caches stacked and compacted), greedy = the reference;
  `regenerate` writes the target's greedy answers; the prompts sampler's greedy rows are the target's greedy text
  and its sampled rows do not depend on the batch size;
- an unsupported layer kind (LFM2's "conv") is one `error:` line naming it in prompts, regenerate and eval.
"""

from __future__ import annotations

import glob
import json
import os
import random

import pytest
import torch

from dflash.core.decode_state import layer_state, recorded_states
from dflash.core.hybrid import layer_kinds
from dflash.core.target import load_causal_lm, load_tokenizer
from dflash.extract.generation.generate import generate
from dflash.train.drafter.checkpoint import save_drafter
from dflash.train.evaluate.decode import greedy, speculative
from dflash.train.evaluate.drafting import DFlashProposer
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig
from dflash.train.evaluate.verify import Target
from tests.test_trust import cli, error_line
from tests.tiny import FAMILIES, chat_rows, make_tiny_family, make_tiny_tokenizer, write_jsonl
from tests.workload import hf_greedy

BLOCK = 4
LAYERS = [1, 2]
WINDOW = 8


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid_decoding")


@pytest.fixture(scope="module")
def targets(work):
    return {f: make_tiny_family(work / f, f, num_layers=4, seed=i, sliding_window=WINDOW)
            for i, f in enumerate(FAMILIES)}


_MODELS: dict = {}


def models(targets, family):
    """(dflash's model: load_causal_lm, transformers' own as a user loads it: the reference), loaded once."""
    if family not in _MODELS:
        import transformers as tf

        path = targets[family]
        cls = tf.Qwen3_5ForConditionalGeneration if family == "qwen3_5_vl" else tf.AutoModelForCausalLM
        ref = cls.from_pretrained(path, dtype=torch.float32, use_kernels=False,
                                  attn_implementation="eager" if family == "gpt_oss" else "sdpa").eval()
        _MODELS[family] = (load_causal_lm(path, dtype=torch.float32).eval(), ref)
    return _MODELS[family]


def drafter_for(model, seed=0) -> DFlashDrafter:
    cfg = DrafterConfig.from_target(model.config, num_layers=1, layer_ids=LAYERS, block_size=BLOCK,
                                    mask_token_id=model.config.get_text_config().vocab_size - 1)
    d = DFlashDrafter(cfg)
    d.reset_parameters(seed=seed)
    d.set_target_head(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return d.eval()


class Oracle:
    """Drafts the reference continuation's next tokens: the first `schedule[step]` right, the rest wrong."""

    name, needs_hidden, block_size = "oracle", False, BLOCK

    def __init__(self, prompt, ref, schedule, vocab):
        self.text, self.schedule, self.vocab, self.steps = prompt + ref, schedule, vocab, 0

    def start(self, hidden):
        pass

    def observe(self, hidden, start, count=None):
        pass

    def propose(self, seq, last, pos):
        right = self.schedule[self.steps % len(self.schedule)]
        self.steps += 1
        return [t if i < right else (t + 1) % self.vocab for i, t in enumerate(self.text[pos + 1:pos + BLOCK])]


def prompts_of(n_tokens, seed=0, vocab=200):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in n_tokens]


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_decoding_rolls_every_layer_back_to_the_accepted_prefix(targets, family):
    model, ref_model = models(targets, family)
    t = Target(model, LAYERS)
    assert t.by_kind
    V = model.config.get_text_config().vocab_size
    schedule = [0, 2, 1, 3, 2]
    p = prompts_of([11], seed=1)[0]
    max_new = 18  # prompt + output past the window of 8
    ref = hf_greedy(ref_model, p, max_new + BLOCK)
    assert greedy(t, p, max_new, set()).tokens == ref[:max_new]
    dec = speculative(t, Oracle(p, ref, schedule, V), p, max_new, set())
    assert dec.tokens == ref[:max_new]
    want, n = [], 1
    while n < max_new:
        want.append(schedule[len(want) % len(schedule)] + 1)
        n += want[-1]
    assert dec.accept_lengths == want  # every step but the full ones cut its verify short
    assert speculative(t, DFlashProposer(drafter_for(model), 128), p, max_new, set()).tokens == ref[:max_new]

    # the state the rollbacks left equals a fresh prefill of the confirmed text, layer by layer
    dec = speculative(t, Oracle(p, ref, schedule, V), p, max_new, set())
    length = t.length
    fresh = Target(model, None)
    fresh.reset()
    fresh.forward(torch.tensor([(p + ref)[:length]]), 0, hidden=False)
    assert recorded_states(t.cache) == 0  # nothing of a verify's record outlives its rollback
    kinds = layer_kinds(model.config)
    for i, kind in enumerate(kinds):
        if kind == "linear_attention":
            for got, exp in zip(layer_state(t.cache, i), layer_state(fresh.cache, i)):
                torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)
        else:
            layer, exp = t.cache.layers[i], fresh.cache.layers[i]
            assert layer.keys.shape == exp.keys.shape  # a sliding layer keeps its last W - 1 keys only
            torch.testing.assert_close(layer.keys, exp.keys, rtol=1e-4, atol=1e-5)
            if kind == "sliding_attention":
                assert layer.keys.shape[2] == WINDOW - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_is_lossless_and_reports_tau(targets, family, work, capsys):
    from dflash.train.evaluate.eval import EvalConfig, run_eval

    model, _ = models(targets, family)
    drafter = work / f"drafter-{family}"
    save_drafter(drafter_for(model, seed=3), str(drafter), dtype=torch.float32)
    data = write_jsonl(work / "eval.jsonl", chat_rows(3, seed=4))
    rep = run_eval(EvalConfig(target=targets[family], drafter=str(drafter), data=data, max_prompts=2,
                              max_new_tokens=12, warmup_prompts=0, device="cpu", progress=False))
    for k in ("dflash", "ngram"):
        assert rep[k]["outputs_identical"] == 2 and rep[k]["token_match_rate"] == 1.0, k  # lossless in float32
        assert 1.0 <= rep[k]["tau"] <= BLOCK and rep[k]["steps"] >= 1
    assert rep["target_attention"] == ("eager" if family == "gpt_oss" else "sdpa") and not rep["target_graph"]
    said = [ln for ln in capsys.readouterr().out.splitlines() if "the eager decoder" in ln]
    kind = "sliding_attention" if family == "gpt_oss" else "linear_attention"
    assert said == [f"eval: {kind} layers: the eager decoder (no CUDA graphs: not on a CUDA device)"]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_generation_equals_the_targets_own(targets, family):
    """Left padding, a batch of 2 refilled one row at a time (a refill's cache stacked beside the running rows',
    finished rows compacted away), prompts longer than the window: every row is the reference's greedy text."""
    model, ref_model = models(targets, family)
    ps = prompts_of([3, 12, 5, 9], seed=2)
    budgets = [10, 4, 7, 6]
    res = generate(model, ps, eos_ids=[], max_new_tokens=budgets, batch_size=2, refill=1, engine="eager")
    for p, n, r in zip(ps, budgets, res):
        assert r.tokens == hf_greedy(ref_model, p, n), len(p)


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_regenerate_writes_the_targets_greedy_answers(targets, family, work, capsys):
    """Every assistant turn of multi-turn conversations is the target's greedy answer to the conversation so far
    (earlier answers its own); on Qwen3.5 a turn may go on in its row (--continue-turns: continuation ids fed), with
    --no-target-graph (a GPU would take its static decoder), which the line naming the eager decoder says."""
    from dflash.extract.generation.regenerate import RegenerateConfig, run_regenerate

    model, ref_model = models(targets, family)
    tok = load_tokenizer(targets[family])
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    data = write_jsonl(work / "regen.jsonl", chat_rows(4, seed=6, turns=(2, 2)))
    out = work / f"regen-{family}"
    run_regenerate(RegenerateConfig(target=targets[family], data=str(data), out=str(out), max_new_tokens=8,
                                    batch_size=2, part_size=4, progress=False, device="cpu",
                                    continue_turns=family == "qwen3_5",
                                    target_graph=False if family == "qwen3_5" else None))
    said = [ln for ln in capsys.readouterr().out.splitlines() if "the eager decoder" in ln]
    why = "--no-target-graph" if family == "qwen3_5" else "not on a CUDA device"
    assert len(said) == 1 and said[0].startswith("regenerate: ") and said[0].endswith(f"(no CUDA graphs: {why})")
    rows = [json.loads(ln) for f in sorted(glob.glob(os.path.join(out, "data", "part-*.jsonl"))) for ln in open(f)]
    assert len(rows) == 4
    turns = 0
    for r in rows:
        msgs = r["messages"]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            text = tok.apply_chat_template(msgs[:i], add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            ref = hf_greedy(ref_model, ids, 8, eos)
            ref = ref[:-1] if ref[-1] in eos else ref
            assert m["content"] == tok.decode(ref, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            turns += 1
    assert turns > len(rows)  # some conversations have two answers


@pytest.mark.parametrize("family", ["qwen3_5_moe", "gpt_oss"])
def test_the_prompts_sampler_decodes_the_targets_text(targets, family):
    from dflash.extract.generation.prompts import Sampler

    _, ref_model = models(targets, family)
    s = Sampler(targets[family], device="cpu", dtype="float32", batch_size=2)
    greedy_rows = s.rows(0, 3, {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": 0})
    ref = hf_greedy(ref_model, s.ids, 8, s.eos)
    want = s.tokenizer.decode(ref, skip_special_tokens=True)
    assert [r["text"] for r in greedy_rows] == [want] * 3
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 5}
    assert s.rows(0, 5, sampled) == Sampler(targets[family], device="cpu", dtype="float32",
                                            batch_size=3).rows(0, 5, sampled)


def test_an_unsupported_layer_kind_is_one_error_line_in_each_command(work):
    import transformers as tf

    bad = str(work / "lfm2")
    tok = make_tiny_tokenizer()
    cfg = tf.Lfm2Config(vocab_size=len(tok) + 16, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2,
                        layer_types=["full_attention", "conv", "full_attention", "conv"])
    tf.Lfm2ForCausalLM(cfg).save_pretrained(bad)
    tok.save_pretrained(bad)
    data = write_jsonl(work / "few.jsonl", chat_rows(2, seed=3))
    runs = {
        "prompts": ("prompts", "--target", bad, "--out", work / "p-never", "--num", 2, "--device", "cpu",
                    "--no-progress"),
        "regenerate": ("regenerate", "--target", bad, "--data", data, "--out", work / "r-never", "--no-progress"),
        "eval": ("eval", "--target", bad, "--drafter", work, "--data", data, "--no-progress"),
    }
    for name, args in runs.items():
        line = error_line(*cli(*args), "'conv'", "layer 1 of lfm2")
        assert line.startswith("error: --target"), (name, line)
    assert not os.path.exists(work / "p-never") and not os.path.exists(work / "r-never")
