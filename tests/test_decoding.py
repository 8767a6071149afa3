"""Eval decoding against an independent reference, in float32 on a tiny Qwen3 target.

`dflash eval` reports tau and checks losslessness against its own greedy loop, which shares the target
wrapper (train/evaluate/verify.py Target) with speculative decoding: a bug there makes both wrong and equal. Here the
reference is tests/workload.py hf_greedy, a loop straight over the HF model that recomputes the whole
sequence every token (no KV cache, nothing of train/evaluate/decode.py or verify.py). Covered:

    greedy() and speculative() (DFlash drafter, n-gram lookup) give the reference's tokens, prompts of
        several lengths, with and without an end-of-sequence id;
    partial acceptance: a proposer that drafts the reference's next j tokens then wrong ones, j varying per
        step, gets exactly j + 1 tokens per step and the reference's output;
    an end-of-sequence token inside an accepted block: the output stops at it (the accepted tokens after it
        are dropped), as the reference does;
    the drafter's context after acceptances: at every draft, its context cache holds exactly the positions
        before the anchor, with keys/values equal to those built from scratch from an independent HF
        forward of the confirmed text (output_hidden_states);
    training helps: a drafter trained briefly (real regenerate -> extract -> train) on the tiny target's own
        outputs decodes held-out prompts with a tau clearly above the untrained drafter's.
"""

from __future__ import annotations

import random

import pytest
import torch
from click.testing import CliRunner

from dflash.cli import main as cli_main
from dflash.core.target import load_causal_lm, load_tokenizer
from dflash.train.drafter.checkpoint import load_drafter
from dflash.train.evaluate.decode import NgramProposer, greedy, speculative
from dflash.train.evaluate.drafting import DFlashProposer
from dflash.train.evaluate.verify import Target
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig
from tests.tiny import chat_rows, make_tiny_target, write_jsonl
from tests.workload import hf_greedy

BLOCK = 4
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    path = make_tiny_target(root / "target")
    model = load_causal_lm(path).eval()
    tok = load_tokenizer(path)
    return {"path": path, "model": model, "tok": tok, "root": root}


def drafter_for(tiny, seed: int = 0) -> DFlashDrafter:
    m = tiny["model"]
    cfg = DrafterConfig.from_target(m.config, num_layers=1, layer_ids=LAYERS, block_size=BLOCK,
                                    mask_token_id=len(tiny["tok"]))
    d = DFlashDrafter(cfg)
    d.reset_parameters(seed=seed)
    d.set_target_head(m.get_input_embeddings().weight, m.get_output_embeddings().weight)
    return d.eval()


def prompts(tiny, lengths=(1, 6, 23), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, len(tiny["tok"])) for _ in range(n)] for n in lengths]


class Oracle:
    """Drafts the reference continuation's next tokens: the first `schedule[step]` right, the rest wrong."""

    name, needs_hidden = "oracle", False

    def __init__(self, prompt: list[int], ref: list[int], schedule: list[int], vocab: int):
        self.text, self.schedule, self.vocab, self.steps = prompt + ref, schedule, vocab, 0
        self.block_size = BLOCK

    def start(self, hidden) -> None:
        pass

    def observe(self, hidden, start, count=None) -> None:
        pass

    def propose(self, seq, last, pos):
        assert seq == self.text[:pos + 1] and last == self.text[pos]  # the loop's own view of the text
        right = self.schedule[self.steps % len(self.schedule)]
        self.steps += 1
        true = self.text[pos + 1:pos + BLOCK]
        return [t if i < right else (t + 1) % self.vocab for i, t in enumerate(true)]


@pytest.mark.parametrize("attention", ["model", "decode"])
def test_greedy_and_speculative_equal_an_independent_hf_loop(tiny, attention):
    """Both target attentions (HF's sdpa; the eval's on a GPU: causal to the bottom right, no mask) and the
    drafter's eager and fixed-shape steps decode what a plain HF loop decodes."""
    m = tiny["model"]
    t = Target(m, LAYERS, attention=attention)

    def hf_greedy_own(*args):  # the reference always runs HF's own sdpa
        m.config._attn_implementation, mine = "sdpa", m.config._attn_implementation
        try:
            return hf_greedy(m, *args)
        finally:
            m.config._attn_implementation = mine

    d = drafter_for(tiny)
    for p in prompts(tiny):
        ref = hf_greedy_own(p, 20)
        assert greedy(t, p, 20, set()).tokens == ref
        for prop in (DFlashProposer(d, 128), DFlashProposer(d, 128, graph=True), NgramProposer(BLOCK, 3)):
            assert speculative(t, prop, p, 20, set()).tokens == ref, prop.name
        eos = {ref[7]}  # an end-of-sequence id the target emits: everything stops at its first occurrence
        ref_eos = hf_greedy_own(p, 20, eos)
        assert ref_eos == ref[:ref.index(ref[7]) + 1]
        assert greedy(t, p, 20, eos).tokens == ref_eos
        assert speculative(t, DFlashProposer(d, 128), p, 20, eos).tokens == ref_eos
    Target(tiny["model"], LAYERS, attention="model")  # the shared model back to HF's sdpa for the other tests


def test_partial_acceptance_takes_exactly_the_right_prefix_plus_the_bonus(tiny):
    t = Target(tiny["model"], LAYERS)
    V = tiny["model"].config.vocab_size
    schedule = [0, 2, 1, 3, 3, 0, 1, 2]
    for p in prompts(tiny, seed=1):
        max_new = 30
        ref = hf_greedy(tiny["model"], p, max_new + BLOCK)
        dec = speculative(t, Oracle(p, ref, schedule, V), p, max_new, set())
        assert dec.tokens == ref[:max_new]
        want, n = [], 1  # the prefill gives the first token; each step accepts `right` drafts + the bonus
        while n < max_new:
            want.append(schedule[len(want) % len(schedule)] + 1)
            n += want[-1]
        assert dec.accept_lengths == want
        assert dec.tau == pytest.approx(sum(want) / len(want))


def test_an_end_of_sequence_token_inside_an_accepted_block_ends_the_output(tiny):
    t = Target(tiny["model"], LAYERS)
    V = tiny["model"].config.vocab_size
    found = 0
    for p in prompts(tiny, lengths=(2, 5, 9, 14, 31), seed=2):
        ref = hf_greedy(tiny["model"], p, 40)
        # all-right drafts: the steps accept tokens 1-4, 5-8, ...; an eos at index m = 4s + 2 sits inside a block
        for m in range(2, 30, 4):
            if ref[m] not in ref[:m]:
                break
        else:
            continue
        found += 1
        eos = {ref[m]}
        want = hf_greedy(tiny["model"], p, 40, eos)
        assert want == ref[:m + 1]
        dec = speculative(t, Oracle(p, ref, [BLOCK - 1], V), p, 40, eos)
        assert dec.tokens == want, (m, dec.tokens, want)
        assert dec.accept_lengths[-1] == BLOCK  # the eos came inside a fully accepted block
        assert len(dec.accept_lengths) == (m - 1) // BLOCK + 1  # ... and decoding stopped there (no steps after
        # the end: they would count in tau)
        assert sum(dec.accept_lengths) + 1 > len(want)  # ... that went past it: the rest was dropped
        assert greedy(t, p, 40, eos).tokens == want
    assert found >= 2, "no prompt gave a usable end-of-sequence position"


def scratch_context(tiny, d: DFlashDrafter, text: list[int]):
    """The drafter's context cache for `text` built from scratch: an independent HF forward's hidden states."""
    with torch.inference_mode():
        hs = tiny["model"](input_ids=torch.tensor([text]), output_hidden_states=True).hidden_states
        hidden = torch.cat([hs[i + 1] for i in LAYERS], -1)
        cache = d.new_cache(1, len(text) + 1)
        d.extend_context(cache, hidden, torch.arange(len(text))[None])
    return cache


@pytest.mark.parametrize("graph", [False, True])
def test_the_drafters_context_after_acceptances_is_the_confirmed_text(tiny, graph):
    """graph=True: the fixed-shape step (StaticDraft, eager on a CPU) writes every verified block whole and
    masks what was not accepted; the context it drafts from must be the same."""
    t = Target(tiny["model"], LAYERS)
    V = tiny["model"].config.vocab_size
    d = drafter_for(tiny, seed=4)

    class Forced(DFlashProposer):
        """The real DFlash proposer (its observe path, its draft call), with oracle drafts so that the
        steps accept 0..3 tokens; records the drafter's context at every draft."""

        def __init__(self, oracle: Oracle):
            super().__init__(d, 128, graph=graph)
            self.oracle, self.seen = oracle, []

        def propose(self, seq, last, pos):
            super().propose(seq, last, pos)
            c = self.cache
            self.seen.append((pos, c.length, c.pos[0, :c.length].clone(), [k[:, :, :c.length].clone() for k in c.k],
                              [v[:, :, :c.length].clone() for v in c.v]))
            return self.oracle.propose(seq, last, pos)

    for p in prompts(tiny, lengths=(4, 17), seed=3):
        ref = hf_greedy(tiny["model"], p, 24 + BLOCK)
        prop = Forced(Oracle(p, ref, [2, 0, 3, 1], V))
        dec = speculative(t, prop, p, 24, set())
        assert dec.tokens == ref[:24] and max(dec.accept_lengths) > 1
        assert prop.graph_status == ("static" if graph else "off")
        full = scratch_context(tiny, d, p + ref)
        for pos, length, cpos, ks, vs in prop.seen:
            assert length == pos and cpos.tolist() == list(range(pos))  # everything before the anchor, nothing else
            for i in range(len(ks)):
                assert torch.allclose(ks[i], full.k[i][:, :, :pos], atol=1e-5), (pos, i)
                assert torch.allclose(vs[i], full.v[i][:, :, :pos], atol=1e-5), (pos, i)


@pytest.mark.cxx
def test_the_compiled_static_draft_step_drafts_as_the_uncompiled_one(tiny, monkeypatch, capsys):
    """StaticDraft(compiled=True), a GPU's default before the capture: the step through torch.compile drafts what
    the uncompiled step drafts, decoding stays lossless; should it fail to compile, it runs uncompiled, said once."""
    from dflash.train.evaluate import drafting
    from tests.test_dflash2_decoding import recording

    t = Target(tiny["model"], LAYERS)
    d = drafter_for(tiny, seed=4)

    def run(compiled):
        prop, drafts = recording(DFlashProposer(d, 128, graph=True, compiled=compiled))
        for p in prompts(tiny, lengths=(4, 17), seed=5):  # one proposer: its step compiles once
            assert speculative(t, prop, p, 24, set()).tokens == greedy(t, p, 24, set()).tokens
        assert prop.graph_status == "static"
        return prop, drafts

    plain, want = run(False)
    compiled, got = run(True)
    assert got == want and len(got) > 6 and compiled.static.compiled and not plain.static.compiled

    def broken(fn):
        def call():
            from torch._dynamo.exc import Unsupported
            raise Unsupported("no")
        return call

    monkeypatch.setattr(drafting, "_compiled", broken)
    capsys.readouterr()
    fallen, got = run(True)
    assert got == want and not fallen.static.compiled
    assert capsys.readouterr().out.count("the drafter's step failed to compile (Unsupported: no)") == 1


# ------------------------------------------------------------------------------------------------ training helps


def mean_tau(t: Target, d: DFlashDrafter, ps: list[list[int]], max_new: int) -> float:
    lens = [a for p in ps for a in speculative(t, DFlashProposer(d, 512), p, max_new, set()).accept_lengths]
    return sum(lens) / len(lens)


def make_speakable_target(path) -> str:
    """The tiny target, unable to emit a token whose text does not tokenize back to it (a lone byte of a
    multi-byte character, a special token, an id beyond the tokenizer): its LM-head rows are zeroed, so their
    logit is 0 while the best of the others is positive. A random model's greedy text is mostly such tokens
    otherwise, and text regenerated from them (`dflash regenerate` stores text) would not be what it said."""
    make_tiny_target(path)
    model, tok = load_causal_lm(str(path)), load_tokenizer(str(path))
    special = set(tok.all_special_ids)
    bad = [i for i in range(model.config.vocab_size)
           if i in special or i >= len(tok) or tok(tok.decode([i]), add_special_tokens=False)["input_ids"] != [i]]
    with torch.no_grad():
        model.get_output_embeddings().weight[bad] = 0
    model.save_pretrained(str(path))
    return str(path)


@pytest.mark.slow
def test_a_briefly_trained_drafter_decodes_with_a_higher_tau_than_an_untrained_one(tiny):
    root = tiny["root"]
    target = make_speakable_target(root / "speakable")
    tok = load_tokenizer(target)
    tiny = {**tiny, "path": target, "model": load_causal_lm(target).eval(), "tok": tok}
    run = CliRunner().invoke
    data = write_jsonl(root / "prompts.jsonl", chat_rows(96, seed=21, turns=(1, 1)))
    r = run(cli_main, ["regenerate", "--target", target, "--data", data, "--out", str(root / "regen"),
                       "--max-new-tokens", "40", "--no-progress"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = run(cli_main, ["extract", "--target", target, "--data", str(root / "regen"), "--out", str(root / "cache"),
                       "--seq-len", "256", "--layers", ",".join(map(str, LAYERS)), "--no-progress"],
            catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = run(cli_main, ["train", "--cache", str(root / "cache"), "--target", target, "--out", str(root / "run"),
                       "--drafter-layers", "1", "--block-size", str(BLOCK), "--num-anchors", "32", "--batch-rows", "4",
                       "--max-steps", "600", "--lr", "3e-3", "--log-every", "100", "--no-progress"],
            catch_exceptions=False)
    assert r.exit_code == 0, r.output

    trained = load_drafter(str(root / "run" / "final"), dtype=torch.float32).eval()
    trained.set_target_head(tiny["model"].get_input_embeddings().weight, tiny["model"].get_output_embeddings().weight)
    untrained = drafter_for(tiny, seed=0)
    assert untrained.cfg.mask_token_id == trained.cfg.mask_token_id
    held = []  # held-out prompts, rendered as eval renders them
    for row in chat_rows(6, seed=99, turns=(1, 1)):
        held.append(tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=True,
                                            return_dict=False))
    t = Target(tiny["model"], LAYERS)
    tau_trained, tau_untrained = mean_tau(t, trained, held, 32), mean_tau(t, untrained, held, 32)
    print(f"tau: trained {tau_trained:.3f}, untrained {tau_untrained:.3f}")
    assert tau_trained >= tau_untrained + 0.5, (tau_trained, tau_untrained)
