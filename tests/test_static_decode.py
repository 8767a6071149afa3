"""The static-cache decoder (dflash/core/static_decode.py) against the HF model it runs, in float32 on CPU.

On a GPU every step of it is a CUDA-graph replay; the graph replays exactly the kernels of the eager call made
here, so the numbers are checked on CPU (tests/test_gpu.py replays the graphs). Covered:

    prefill and steps of 1 and of several tokens per row, rows at different positions in one step, give the HF
        model's own logits and hidden states (Qwen3 with q/k norms, Llama with tied embeddings; grouped KV heads);
    a step's stale columns (a rejected draft's keys, written past the confirmed length) are never attended to;
    speculative decoding through StaticTarget (the eval's target on a GPU) gives the independent HF loop's tokens
        for the target alone, the DFlash drafter, n-gram lookup (drafts shorter than a block, padded) and a
        partial-acceptance oracle;
    models it cannot run are named (a sliding window), and the callers keep the HF forward.
"""

from __future__ import annotations

import random

import pytest
import torch

from dflash.core.static_decode import StaticDecoder, unsupported
from dflash.core.target import load_causal_lm, load_tokenizer
from dflash.train.evaluate.decode import NgramProposer, greedy, speculative
from dflash.train.evaluate.drafting import DFlashProposer
from dflash.train.evaluate.verify import StaticTarget
from tests.test_decoding import BLOCK, LAYERS, Oracle, drafter_for, prompts
from tests.tiny import make_tiny_target
from tests.workload import hf_greedy


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"static-{request.param}")
    path = make_tiny_target(root / "target", arch=request.param)
    model = load_causal_lm(path).eval()
    return {"path": path, "model": model, "tok": load_tokenizer(path), "root": root}


def hf_outputs(model, ids: list[int], layers: list[int]):
    """logits [L, V] and the captured layers [L, K*H] of one sequence, from the HF model (no cache)."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states  # embeddings, then each layer's output (the last one after the final norm)
    return out.logits[0], torch.cat([hs[i + 1][0] for i in layers], -1)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.cxx)], ids=["modules", "fused"])
def test_prefill_and_steps_equal_the_hf_forward(tiny, fused):
    """fused: the step's layers through the compiled functions (fused_layers), as on a GPU by default."""
    m = tiny["model"]
    V = m.config.vocab_size
    rng = random.Random(0)
    seqs = [[rng.randrange(3, V) for _ in range(n)] for n in (10, 14, 30)]
    L = m.config.num_hidden_layers
    layers = [1, 3, L - 1]  # the last layer is captured after the final norm
    dec = StaticDecoder(m, slots=3, max_len=64, layer_ids=layers, bucket=16, fused=fused)
    assert dec.fused == fused
    prompt_lens = [3, 7, 20]
    w = max(prompt_lens)
    ids = torch.zeros(3, w, dtype=torch.long)
    for r, (s, n) in enumerate(zip(seqs, prompt_lens)):
        ids[r, :n] = torch.tensor(s[:n])
    logits, hidden = dec.prefill(ids, torch.arange(3), torch.tensor(prompt_lens))
    for r, (s, n) in enumerate(zip(seqs, prompt_lens)):
        ref_logits, ref_hidden = hf_outputs(m, s[:n], layers)
        torch.testing.assert_close(logits[r, 0], ref_logits[n - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[r, :n], ref_hidden, atol=1e-4, rtol=1e-4)
    # one-token steps, each row at its own position, then a 3-token step
    pos = list(prompt_lens)
    for _ in range(2):
        step_ids = torch.tensor([[s[p]] for s, p in zip(seqs, pos)])
        logits, hidden = dec.step(step_ids, torch.tensor(pos), max(pos) + 1)
        for r, (s, p) in enumerate(zip(seqs, pos)):
            ref_logits, ref_hidden = hf_outputs(m, s[:p + 1], layers)
            torch.testing.assert_close(logits[r, 0], ref_logits[p], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[r, 0], ref_hidden[p], atol=1e-4, rtol=1e-4)
        pos = [p + 1 for p in pos]
    step_ids = torch.tensor([s[p:p + 3] for s, p in zip(seqs, pos)])
    logits, hidden = dec.step(step_ids, torch.tensor(pos), max(pos) + 3)
    for r, (s, p) in enumerate(zip(seqs, pos)):
        ref_logits, ref_hidden = hf_outputs(m, s[:p + 3], layers)
        torch.testing.assert_close(logits[r], ref_logits[p:p + 3], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[r], ref_hidden[p:p + 3], atol=1e-4, rtol=1e-4)


def flash_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale, seqused_k):
    """What torch's flash-attention forward computes with variable lengths (its CUDA kernel's contract): sequence b
    is queries q[cu_q[b]:cu_q[b+1]] against keys and values k, v[cu_k[b] : cu_k[b] + seqused_k[b]], non-causal
    here; q, k, v [total, heads, D]. A CPU stand-in, so the decoder's lengths and offsets are checked without a
    GPU (tests/test_gpu.py runs the kernel itself)."""
    assert dropout == 0.0 and not causal and q.shape[1] == k.shape[1] == 1
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        qs, n_k = q[cu_q[b]:cu_q[b + 1], 0].float(), int(seqused_k[b])
        assert 1 <= n_k <= max_k and cu_q[b + 1] - cu_q[b] <= max_q and int(cu_k[b]) + n_k <= k.shape[0]
        ks, vs = k[cu_k[b]:cu_k[b] + n_k, 0].float(), v[cu_k[b]:cu_k[b] + n_k, 0].float()
        out[cu_q[b]:cu_q[b + 1], 0] = (torch.softmax(qs @ ks.T * scale, -1) @ vs).to(q.dtype)
    flash_varlen_reference.calls += 1
    return out, None, None, None, None


def varlen_steps_equal_the_spanned_ones(m, kernel: str, fused: bool = False) -> None:
    """A decoder whose batched one-token steps read each row's own columns with `kernel` against one whose steps
    attend over the span: the same logits and hidden states over 3 steps, both the HF forward's, for rows of very
    unequal lengths whose slots hold stale columns past them (a row that was longer before). Also run with the Triton
    kernel in its interpreter (tests/test_decode_attention.py)."""
    from dflash.core import static_decode as sd

    V = m.config.vocab_size
    n = sd.VARLEN_MIN_ROWS + 1
    rng = random.Random(3)
    lens = [rng.randrange(1, 40) for _ in range(n)]
    ids = torch.tensor([[rng.randrange(3, V) for _ in range(max(lens))] for _ in range(n)])
    decs = [StaticDecoder(m, slots=n + 2, max_len=64, layer_ids=[1], bucket=16, fused=fused, varlen=on)
            for on in (kernel, False)]
    assert decs[0].varlen_step(n, 1) and not decs[0].varlen_step(n - 2, 1) and not decs[0].varlen_step(n, 2)
    assert not decs[1].varlen_step(n, 1)
    for d in decs:
        d.prefill(torch.randint(3, V, (n, 60)), torch.arange(n))  # stale columns: every slot filled to 60 first
        d.prefill(ids, torch.arange(n), torch.tensor(lens))
    pos, seqs = torch.tensor(lens), [ids[r, :lens[r]].tolist() for r in range(n)]
    for t in range(3):
        step = torch.randint(3, V, (n, 1), generator=torch.Generator().manual_seed(t))
        (a, ha), (b, hb) = (d.step(step, pos, int(pos.max()) + 1) for d in decs)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ha, hb, atol=1e-4, rtol=1e-4)
        for r in range(n):
            seqs[r].append(int(step[r, 0]))
        for r in (0, lens.index(min(lens)), lens.index(max(lens))):  # and both are the HF forward's
            ref, ref_h = hf_outputs(m, seqs[r], [1])
            torch.testing.assert_close(a[r, 0], ref[-1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ha[r, 0], ref_h[-1], atol=1e-4, rtol=1e-4)
        pos = pos + 1


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.cxx)], ids=["modules", "fused"])
def test_a_batched_step_reading_each_rows_own_columns_equals_the_spanned_one(tiny, fused, monkeypatch):
    """A one-token step over >= VARLEN_MIN_ROWS rows (regenerate's decode) can read each row's own columns through
    the variable-length kernel (flash's, here its CPU stand-in): varlen_steps_equal_the_spanned_ones."""
    from dflash.core import static_decode as sd

    flash_varlen_reference.calls = 0
    monkeypatch.setattr(sd, "_flash_varlen", flash_varlen_reference)
    varlen_steps_equal_the_spanned_ones(tiny["model"], "flash", fused)
    assert flash_varlen_reference.calls == 3 * tiny["model"].config.num_hidden_layers


def test_stale_columns_past_the_confirmed_length_are_never_read(tiny):
    """A verify writes a whole block; after a rejection, the next step starts inside it and must see only the
    confirmed tokens, whatever the rejected ones were."""
    m = tiny["model"]
    V = m.config.vocab_size
    s = [random.Random(1).randrange(3, V) for _ in range(12)]
    dec = StaticDecoder(m, slots=1, max_len=32, bucket=8)
    dec.prefill(torch.tensor([s[:6]]), torch.tensor([0]))
    dec.step(torch.tensor([[s[6], 1, 2, 3]]), torch.tensor([6]), 10)  # a block of which only s[6] is kept
    logits, _ = dec.step(torch.tensor([[s[7]]]), torch.tensor([7]), 8)
    ref, _ = hf_outputs(m, s[:8], [0])
    torch.testing.assert_close(logits[0, 0], ref[7], atol=1e-4, rtol=1e-4)


def test_speculative_decoding_through_the_static_target_equals_the_hf_loop(tiny):
    m = tiny["model"]
    d = drafter_for(tiny)
    V = m.config.vocab_size
    for p in prompts(tiny):
        t = StaticTarget(m, LAYERS, max_len=len(p) + 40, block_size=BLOCK)
        ref = hf_greedy(m, p, 20)
        assert greedy(t, p, 20, set()).tokens == ref
        for prop in (DFlashProposer(d, 128), DFlashProposer(d, 128, graph=True), NgramProposer(BLOCK, 3)):
            assert speculative(t, prop, p, 20, set()).tokens == ref, prop.name
        eos = {ref[7]}
        assert speculative(t, DFlashProposer(d, 128), p, 20, eos).tokens == ref[:ref.index(ref[7]) + 1]
        long_ref = hf_greedy(m, p, 20 + BLOCK)
        dec = speculative(t, Oracle(p, long_ref, [0, 2, 1, 3], V), p, 20, set())
        assert dec.tokens == ref


def test_prepare_runs_every_step_shape_a_decode_then_takes(tiny):
    """StaticTarget.prepare (eval calls it before its timings) runs every step a decode can take, so that the timed
    decodes capture and compile nothing: the steps of the target alone, DFlash and n-gram lookup over prompts whose
    decodes cross several span buckets add no shape to what prepare ran."""
    m = tiny["model"]
    d = drafter_for(tiny)
    ps = prompts(tiny)
    t = StaticTarget(m, LAYERS, max_len=max(len(p) for p in ps) + 40, block_size=BLOCK, graphs=False)
    t.dec.bucket = 8  # several spans for these short prompts (max_len is a multiple of 8 too)
    assert t.prepare() == len(t.dec.shapes) == 2 * (t.dec.max_len // 8)
    ran = set(t.dec.shapes)
    for p in ps:
        for prop in (None, DFlashProposer(d, 128), NgramProposer(BLOCK, 3)):
            greedy(t, p, 40, set()) if prop is None else speculative(t, prop, p, 40, set())
    assert t.dec.shapes == ran and len({span for _, _, span, _ in ran}) > 2
    assert t.prepare() == 0


@pytest.mark.cxx
def test_the_fused_layers_serve_every_decoder_of_a_process_with_a_few_variants(tmp_path):
    """fused_layers' compiled functions are shared by every StaticDecoder of a process: steps of one row or several,
    of one token or a block, at every span bucket, of decoders of other sizes and lengths, compile a handful of
    variants, and a decoder of a new size and length (a new eval's target) compiles none. torch stops a function at
    8 variants by default; before the shapes were symbolic and the cache's layout one, the GPU recipe's eval hit it
    (each span, each decoder length was a variant of its own)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    from dflash.core import static_decode as sd

    m = load_causal_lm(make_tiny_target(tmp_path / "t", arch="llama", num_layers=2)).eval()
    V = m.config.vocab_size
    post = sd._layer_post.__code__

    def decode_everything(slots: int, max_len: int) -> None:
        dec = StaticDecoder(m, slots=slots, max_len=max_len, bucket=32, graphs=False, fused=True)
        for n in sorted({1, slots}):
            for q in (1, 8):
                for end in range(q + 1, dec.max_len + 1, 29):
                    dec.step(torch.randint(3, V, (n, q)), torch.full((n,), end - q), end)

    decode_everything(1, 100)
    decode_everything(3, 230)  # several rows in a larger decoder
    before = len(entries(post))
    decode_everything(1, 170)  # a new length: no new variant
    decode_everything(3, 300)
    assert len(entries(post)) == before


def test_a_fused_layer_that_fails_to_compile_falls_back_to_the_modules_once(tiny, monkeypatch, capsys):
    """Should the fused layers fail to compile (a compiler error), the step is computed again with the HF modules'
    layers (the same logits), the process says so once, and its later decoders do not fuse; an error of any other
    kind still stops the step."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from dflash.core import static_decode as sd

    m = tiny["model"]
    V = m.config.vocab_size
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(0))

    def broken(error):
        def call(*args):
            raise error
        return lambda: (call, call, call)

    ref = StaticDecoder(m, slots=2, max_len=32, bucket=8, fused=False)
    ref.prefill(ids[:, :8], torch.tensor([0, 1]))
    want, _ = ref.step(ids[:, 8:11], torch.tensor([8, 8]), 11)
    monkeypatch.setattr(sd, "_FUSED_FAILED", None)
    monkeypatch.setattr(sd, "fused_layers", broken(ValueError("not the compiler")))
    dec = StaticDecoder(m, slots=2, max_len=32, bucket=8, fused=True)
    dec.prefill(ids[:, :8], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="not the compiler"):
        dec.step(ids[:, 8:11], torch.tensor([8, 8]), 11)
    assert dec.fused and sd._FUSED_FAILED is None
    monkeypatch.setattr(sd, "fused_layers", broken(FailOnRecompileLimitHit("recompile limit")))
    got, _ = dec.step(ids[:, 8:11], torch.tensor([8, 8]), 11)
    torch.testing.assert_close(got, want)
    assert not dec.fused and "FailOnRecompileLimitHit: recompile limit" == sd._FUSED_FAILED
    assert not StaticDecoder(m, slots=2, max_len=32, bucket=8, fused=True).fused
    dec.step(ids[:, 11:12], torch.tensor([11, 11]), 12)
    assert capsys.readouterr().out.count("the fused layers failed to compile") == 1


def test_unsupported_models_are_named(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    model = MistralForCausalLM(cfg)
    assert unsupported(model) == "a sliding window"
    with pytest.raises(ValueError, match="cannot run this model: a sliding window"):
        StaticDecoder(model, slots=1, max_len=16)
