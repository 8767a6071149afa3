"""The static decoder of hybrid targets (dflash/core/static_hybrid.py: Gated DeltaNet + gated full attention, what
`eval`, `regenerate` and `prompts` run in CUDA graphs on a GPU by default) against transformers' own model,
float32 on CPU, tiny random Qwen3.5 targets (tests/tiny.py make_tiny_family; the multimodal layout as transformers
builds it). A GPU step replays exactly the kernels of the eager call made here (tests/test_gpu.py replays the
graphs). Covered:

    prefill of right-padded prompts and steps of 1 and of several tokens per row, rows at different positions, give
        the HF forward's logits and captured layers, for the text class and the ForConditionalGeneration layout;
    a recorded verify then accept(keep) (per row, a device tensor, or one int) leaves each row's conv windows and
        recurrent states equal to decoding only the kept tokens, and decoding on from there equals the HF forward;
    speculative decoding through StaticTarget (eval's target on a GPU) with partial acceptances (an oracle, n-gram
        lookup, an untrained DFlash drafter) and `eval` itself on the static target are lossless;
    the slot engine of regenerate / prompts (refills, a compaction that moves rows and their states, a request too
        long for a slot decoded by the hybrid's eager engine beside it) decodes the target's greedy text;
    on a GPU a hybrid takes its static decoder by default, as a dense target does (--no-target-graph: eager);
    Qwen3.5-MoE and gpt-oss stay on the eager path, named by unsupported().
"""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest
import torch

from dflash.core.static import static_decoder, unsupported
from dflash.core.static_decode import StaticDecoder
from dflash.core.static_hybrid import HybridDecoder
from dflash.core.target import load_causal_lm
from dflash.extract.generation.generate import generate
from dflash.extract.generation.slot_engine import SlotEngine
from dflash.extract.generation.engine import Request
from dflash.train.evaluate.decode import NgramProposer, greedy, speculative
from dflash.train.evaluate.drafting import DFlashProposer
from dflash.train.evaluate.verify import StaticTarget
from tests.test_hybrid_decoding import BLOCK, LAYERS, Oracle, drafter_for, prompts_of
from tests.tiny import chat_rows, make_tiny_family, write_jsonl
from tests.workload import hf_greedy

FAMILIES = ("qwen3_5", "qwen3_5_vl")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid_static")


def long_memory(path: str, family: str) -> str:
    """The tiny target with decays of 0.77-0.97 a token (A in 0.02-0.2): random init draws A up to 16, whose state
    forgets a token at once, so a wrong state (a rollback or a move that missed it) would hardly show."""
    import transformers as tf

    cls = tf.Qwen3_5ForConditionalGeneration if family == "qwen3_5_vl" else tf.AutoModelForCausalLM
    m = cls.from_pretrained(path, dtype=torch.float32, use_kernels=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in m.modules():
            if hasattr(mod, "A_log") and hasattr(mod, "dt_bias"):
                mod.A_log.copy_(torch.empty(mod.A_log.shape).uniform_(0.02, 0.2, generator=gen).log())
    m.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def targets(work):
    return {f: long_memory(make_tiny_family(work / f, f, num_layers=4, seed=i + 7), f) for i, f in enumerate(FAMILIES)}


_MODELS: dict = {}


def models(targets, family):
    """(dflash's model: load_causal_lm, transformers' own as a user loads it), loaded once."""
    if family not in _MODELS:
        import transformers as tf

        cls = tf.Qwen3_5ForConditionalGeneration if family == "qwen3_5_vl" else tf.AutoModelForCausalLM
        _MODELS[family] = (load_causal_lm(targets[family], dtype=torch.float32).eval(),
                           cls.from_pretrained(targets[family], dtype=torch.float32, attn_implementation="sdpa",
                                                use_kernels=False).eval())
    return _MODELS[family]


def hf_outputs(model, ids: list[int], layers: list[int]):
    """logits [L, V] and the captured layers [L, K*H] of one sequence, from the HF model (no cache)."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states
    return out.logits[0], torch.cat([hs[i + 1][0] for i in layers], -1) if layers else None


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_steps_equal_the_hf_forward(targets, family):
    """On the transformers model itself (the multimodal class for its layout): right-padded prompts, one-token steps
    with each row at its own position, then a step of 3 tokens per row."""
    _, m = models(targets, family)
    dec = static_decoder(m, slots=3, max_len=64, layer_ids=[1, 3], bucket=16, max_q=4)
    assert isinstance(dec, HybridDecoder)
    V = m.config.get_text_config().vocab_size
    rng = random.Random(0)
    seqs = [[rng.randrange(3, V) for _ in range(40)] for _ in range(3)]
    lens = [3, 7, 20]
    ids = torch.zeros(3, max(lens), dtype=torch.long)
    for r, (s, n) in enumerate(zip(seqs, lens)):
        ids[r, :n] = torch.tensor(s[:n])
    logits, hidden = dec.prefill(ids, torch.arange(3), torch.tensor(lens))
    for r, (s, n) in enumerate(zip(seqs, lens)):
        ref_logits, ref_hidden = hf_outputs(m, s[:n], [1, 3])
        close(logits[r, 0], ref_logits[n - 1])
        close(hidden[r, :n], ref_hidden)
    pos = list(lens)
    for _ in range(2):
        logits, hidden = dec.step(torch.tensor([[s[p]] for s, p in zip(seqs, pos)]), torch.tensor(pos), max(pos) + 1)
        for r, (s, p) in enumerate(zip(seqs, pos)):
            ref_logits, ref_hidden = hf_outputs(m, s[:p + 1], [1, 3])
            close(logits[r, 0], ref_logits[p])
            close(hidden[r, 0], ref_hidden[p])
        pos = [p + 1 for p in pos]
    logits, hidden = dec.step(torch.tensor([s[p:p + 3] for s, p in zip(seqs, pos)]), torch.tensor(pos), max(pos) + 3)
    for r, (s, p) in enumerate(zip(seqs, pos)):
        ref_logits, ref_hidden = hf_outputs(m, s[:p + 3], [1, 3])
        close(logits[r], ref_logits[p:p + 3])
        close(hidden[r], ref_hidden[p:p + 3])


def test_a_verify_then_accept_equals_decoding_only_the_kept_tokens(targets):
    m, _ = models(targets, "qwen3_5")
    V = m.config.vocab_size
    rng = random.Random(1)
    seqs = [[rng.randrange(3, V) for _ in range(40)] for _ in range(3)]
    n0 = 9
    prompt = torch.tensor([s[:n0] for s in seqs])
    q, keep = 6, [2, 1, 6]
    a = static_decoder(m, slots=3, max_len=64, bucket=16, max_q=q)
    b = static_decoder(m, slots=3, max_len=64, bucket=16, max_q=q)
    for d in (a, b):
        d.prefill(prompt, torch.arange(3))
    # a: one verify of q tokens per row, the drafts after the kept ones wrong, then keep[r] of them
    block = torch.tensor([s[n0:n0 + q] for s in seqs])
    block[:, 3:] = (block[:, 3:] + 1) % V
    a.step(block, torch.full((3,), n0), n0 + q)
    a.accept(torch.tensor(keep), n=3)
    # b: the kept tokens only, one at a time (a row past its own keep steps on a slot copy that is put back)
    for t in range(max(keep)):
        saved = (b.conv.clone(), b.rec.clone())
        b.step(block[:, t:t + 1], torch.full((3,), n0 + t), n0 + t + 1)
        done = torch.tensor([t >= k for k in keep])
        b.conv[:, done], b.rec[:, done] = saved[0][:, done], saved[1][:, done]
    close(a.conv, b.conv)
    close(a.rec, b.rec)
    # decoding on from each row's kept prefix equals the HF forward on it
    text = [s[:n0] + block[r, :k].tolist() for r, (s, k) in enumerate(zip(seqs, keep))]
    pos = torch.tensor([len(t) for t in text])
    logits, _ = a.step(torch.tensor([[s[p]] for s, p in zip(seqs, pos.tolist())]), pos, int(pos.max()) + 1)
    for r, (t, s) in enumerate(zip(text, seqs)):
        close(logits[r, 0], hf_outputs(m, t + [s[len(t)]], [])[0][-1])
    # one int for every row; a step of one token records nothing unless asked
    a.step(block[:, :4], pos + 1, int(pos.max()) + 5)
    a.accept(4, n=3)
    with pytest.raises(ValueError, match="max_q"):
        static_decoder(m, slots=1, max_len=32, bucket=16, max_q=1).step(block[:1, :2], torch.zeros(1, dtype=torch.long),
                                                                        2, record=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_decoding_through_the_static_target_is_lossless(targets, family):
    """The eval's GPU target on CPU (graphs off, the same code): partial acceptances roll the linear states back."""
    m, ref_model = models(targets, family)
    p = prompts_of([11], seed=3)[0]
    max_new = 20
    ref = hf_greedy(ref_model, p, max_new + BLOCK)
    t = StaticTarget(m, LAYERS, max_len=64, block_size=BLOCK, graphs=False)
    assert t.dec.recurrent and t.prepare() > 0
    assert greedy(t, p, max_new, set()).tokens == ref[:max_new]
    schedule = [0, 2, 1, 3, 2]
    dec = speculative(t, Oracle(p, ref, schedule, m.config.get_text_config().vocab_size), p, max_new, set())
    assert dec.tokens == ref[:max_new]
    want, n = [], 1
    while n < max_new:
        want.append(schedule[len(want) % len(schedule)] + 1)
        n += want[-1]
    assert dec.accept_lengths == want  # every step but the full ones rolled back
    for prop in (NgramProposer(BLOCK), DFlashProposer(drafter_for(m), 128)):
        assert speculative(t, prop, p, max_new, set()).tokens == ref[:max_new]


def test_eval_on_the_static_target_is_lossless(targets, work, monkeypatch, capsys):
    """run_eval with the static target it takes on a GPU (forced here on CPU, graphs off): every output identical."""
    from dflash.train.drafter.checkpoint import save_drafter
    from dflash.train.evaluate import eval as ev

    m, _ = models(targets, "qwen3_5")
    drafter = work / "drafter"
    save_drafter(drafter_for(m, seed=3), str(drafter), dtype=torch.float32)
    data = write_jsonl(work / "eval.jsonl", chat_rows(3, seed=4))
    made = []

    def on_cpu(cfg, model, layer_ids, max_len, block_size):
        made.append(StaticTarget(model, layer_ids, max_len=max_len, block_size=block_size, graphs=False))
        return made[-1]

    monkeypatch.setattr(ev, "static_target", on_cpu)
    rep = ev.run_eval(ev.EvalConfig(target=targets["qwen3_5"], drafter=str(drafter), data=data, max_prompts=2,
                                    max_new_tokens=12, warmup_prompts=0, device="cpu", progress=False))
    assert rep["target_graph"] and isinstance(made[0].dec, HybridDecoder)
    for k in ("dflash", "ngram"):
        assert rep[k]["outputs_identical"] == 2 and rep[k]["token_match_rate"] == 1.0, k
    assert "the eager decoder" not in capsys.readouterr().out


def test_the_slot_engine_decodes_the_targets_greedy_text(targets):
    """regenerate's and prompts' engine on the hybrid: refills into freed slots (batch 2), then 16 slots whose busy
    rows move down (a compaction: their states move with them) and one request too long for a slot (the hybrid's
    eager engine beside the slots decodes it)."""
    m, ref_model = models(targets, "qwen3_5")
    ps = prompts_of([3, 12, 5, 9], seed=2)
    budgets = [10, 4, 7, 6]
    res = generate(m, ps, eos_ids=[], max_new_tokens=budgets, batch_size=2, refill=1, engine="static")
    for p, n, r in zip(ps, budgets, res):
        assert r.tokens == hf_greedy(ref_model, p, n), len(p)
    ps = prompts_of([4 + (i * 5) % 13 for i in range(11)] + [40], seed=5)
    budgets = [2 + (i * 7) % 13 for i in range(11)] + [12]  # the last: 52 positions, more than a slot's 48
    eng = SlotEngine(m, eos_ids=set(), slots=16, max_len=48, prefill_tokens=1024, refill=1, bucket=16)
    assert isinstance(eng.dec, HybridDecoder)
    for i, (p, n) in enumerate(zip(ps, budgets)):
        eng.add(Request(p, n, key=i))
    out = {}
    while eng.busy:
        for r in eng.step():
            out[r.key] = r.tokens
    assert eng.compactions >= 1 and eng.overflowed == 1
    for i, (p, n) in enumerate(zip(ps, budgets)):
        assert out[i] == hf_greedy(ref_model, p, n), i


def test_experts_and_sliding_windows_stay_on_the_eager_path(work):
    for family in ("qwen3_5_moe", "gpt_oss"):
        m = load_causal_lm(make_tiny_family(work / family, family, num_layers=4), dtype=torch.float32)
        assert unsupported(m) is not None
        with pytest.raises(ValueError, match="cannot run"):
            static_decoder(m, slots=1, max_len=32)
    with pytest.raises(ValueError, match="HybridDecoder"):
        StaticDecoder(load_causal_lm(make_tiny_family(work / "text", "qwen3_5", num_layers=4)), slots=1, max_len=32)


class OnGpu:
    """A model as the choice of decoder sees it on a GPU: its parameters report a CUDA device, the rest is the model's
    (nothing runs on it)."""

    def __init__(self, model):
        self.wrapped = model

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    def parameters(self):
        yield SimpleNamespace(device=torch.device("cuda"))


def test_on_a_gpu_a_hybrid_takes_the_static_decoder_by_default(targets, work, monkeypatch):
    """--target-graph left unset, a Qwen3.5 / 3.6 hybrid (either layout) on a GPU takes its static decoder as a dense
    target takes StaticDecoder: eval's StaticTarget, and the slot engine of regenerate, prompts and generate (all ask
    graphs_unsupported); --no-target-graph keeps the eager path, and so does a CPU. Qwen3.5-MoE and gpt-oss stay
    eager, the reason named, and --target-graph on them is an error naming it."""
    from dflash.train.drafter.model import DrafterError
    from dflash.core.static import graphs_unsupported
    from dflash.train.evaluate import eval as ev
    from tests.tiny import make_tiny_target

    monkeypatch.setattr(ev, "StaticTarget", lambda model, *a, **kw: ("static", model))

    def choose(model, flag):
        return ev.static_target(SimpleNamespace(target_graph=flag), model, LAYERS, 64, BLOCK)

    dense = load_causal_lm(make_tiny_target(work / "dense", num_layers=2), dtype=torch.float32)
    for m in [models(targets, f)[0] for f in FAMILIES] + [dense]:
        assert graphs_unsupported(m) == "not on a CUDA device" and choose(m, None) is None
        gpu = OnGpu(m)
        assert graphs_unsupported(gpu) is None
        assert choose(gpu, None) == choose(gpu, True) == ("static", gpu) and choose(gpu, False) is None
    for family in ("qwen3_5_moe", "gpt_oss"):
        gpu = OnGpu(load_causal_lm(make_tiny_family(work / f"{family}-gpu", family, num_layers=4),
                                   dtype=torch.float32))
        why = graphs_unsupported(gpu)
        assert why is not None and why.startswith("decoder layers of type ") and choose(gpu, None) is None
        with pytest.raises(DrafterError, match=re.escape(f"--target-graph: the target cannot decode in CUDA graphs "
                                                         f"here ({why})")):
            choose(gpu, True)
