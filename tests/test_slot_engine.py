"""The static-cache generation engine (extract/generation/slot_engine.py: regenerate's and prompts' engine on a GPU) against
single-sequence greedy decoding and against the eager Engine, in float32 on CPU (the same code a GPU replays as
CUDA graphs; tests/test_gpu.py replays them). Covered:

    greedy: slots that grow to the longest request, rows of every length leaving at different steps (end id or their own max-new-tokens), slots refilled
        many times, the tail moved into lower slots, and requests longer than a slot decoded beside it by the eager
        engine: every output equals one sequence decoded alone;
    turns that go on in their slot (follow) equal a fresh prefill of the whole context, and a continuation that
        would outgrow its slot is refused (the caller submits it again as a new prompt);
    sampling: the same text as the eager engine's, whatever the slots, part of the rows or batch.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dflash.core.target import load_causal_lm
from dflash.extract.generation.generate import Continuation, Request, generate
from dflash.extract.generation.slot_engine import SlotEngine, plan_slots
from tests.test_regenerate import _prompts, _reference
from tests.tiny import make_tiny_target


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_causal_lm(make_tiny_target(tmp_path_factory.mktemp("slots") / "target"))


def test_greedy_in_slots_equals_single_sequence(model):
    rng = random.Random(1)
    prompts = _prompts(model, 23)
    max_new = [rng.randint(1, 30) for _ in prompts]
    free_run = [_reference(model, p, n, set())[0] for p, n in zip(prompts, max_new)]
    eos = {t for t, _ in Counter(t for out in free_run for t in out[2:]).most_common(3)}
    refs = [_reference(model, p, n, eos) for p, n in zip(prompts, max_new)]
    assert sum(stop for _, stop in refs) >= 3
    # 16 slots of 48 positions (bucket 16): the longest requests (prompt + max new > 48) go to the eager engine
    eng = SlotEngine(model, eos_ids=eos, slots=16, max_len=48, prefill_tokens=64, refill=1, bucket=16, start_len=16)
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        eng.add(Request(p, n, key=i, priority=(-len(p), i)))
    results, widths = {}, []
    while eng.busy:
        for r in eng.step():
            results[r.key] = r
        if any(eng.slot_rows):
            widths.append(eng._width())
    assert eng.overflowed == sum(len(p) + n > 48 for p, n in zip(prompts, max_new)) >= 1
    # the counts regenerate reports are the slots' and the overflow engine's together: never more real columns
    # than columns read (the GPU recipe's line said "968,840,716 of them real tokens" of 967,080,966)
    assert eng.overflow.decode_columns > 0 and eng.decode_columns > eng.overflow.decode_columns
    assert 0 < eng.decode_real_columns <= eng.decode_columns
    assert eng.prefills > 2 and eng.compactions >= 1 and min(widths) < max(widths)
    assert eng.grows >= 1 and eng.max_len == 48  # from 32 positions (two buckets) to the longest request's 48
    for i, (ref, stop) in enumerate(refs):
        r = results[i]
        assert r.stopped == stop
        assert r.tokens + ([ref[-1]] if stop else []) == ref, f"prompt {i} (length {len(prompts[i])})"
        assert r.generated == len(ref)


def test_turns_that_go_on_in_their_slot_equal_a_fresh_prefill(model):
    rng = random.Random(7)
    prompts = _prompts(model, 14, seed=7, hi=30)
    free_run = [_reference(model, p, 10, set())[0] for p in prompts]
    eos = {t for t, _ in Counter(t for out in free_run for t in out[2:]).most_common(2)}
    V = model.config.vocab_size
    turns = {i: [rng.randint(2, 9) for _ in range(rng.randint(1, 3))] for i in range(len(prompts))}
    feeds = {(i, k): [rng.randrange(3, V) for _ in range(rng.randint(1, 6))] for i in turns for k in range(3)}
    ctx = {i: list(p) for i, p in enumerate(prompts)}
    turn = dict.fromkeys(ctx, 0)
    got = {}

    def follow(res):
        i = res.key
        if turn[i] + 1 >= len(turns[i]):
            return None
        return Continuation(feeds[(i, turn[i])], turns[i][turn[i] + 1])

    eng = SlotEngine(model, eos_ids=eos, slots=4, max_len=24, prefill_tokens=64, refill=1, follow=follow, bucket=8)
    for i, p in ctx.items():
        eng.add(Request(p, turns[i][0], key=i, priority=(-len(p), i)))
    while eng.busy:
        for r in eng.step():
            i = r.key
            want, stop = _reference(model, ctx[i], turns[i][turn[i]], eos)
            assert r.tokens + ([want[-1]] if stop else []) == want and r.stopped == stop, (i, turn[i])
            got[(i, turn[i])] = r.tokens
            if turn[i] + 1 < len(turns[i]):
                ctx[i] = ctx[i] + r.tokens + feeds[(i, turn[i])]
                turn[i] += 1
                if not r.continued:
                    eng.add(Request(ctx[i], turns[i][turn[i]], key=i, priority=(0, i)))
    assert len(got) == sum(len(t) for t in turns.values())
    assert eng.continued >= 3 and eng.refused >= 1  # 24 positions: the longest contexts cannot go on in place


def test_sampled_text_equals_the_eager_engines(model):
    prompts = _prompts(model, 9, seed=2, hi=25)
    kw = dict(eos_ids=set(), max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3)
    eager = [r.tokens for r in generate(model, prompts, batch_size=4, engine="eager", **kw)]
    assert [r.tokens for r in generate(model, prompts, batch_size=4, engine="static", **kw)] == eager
    assert [r.tokens for r in generate(model, prompts, batch_size=2, refill=1, engine="static", **kw)] == eager
    part = generate(model, prompts[3:], batch_size=3, engine="static", first_row=3, **kw)
    assert [r.tokens for r in part] == eager[3:]
    greedy = generate(model, prompts, eos_ids=set(), max_new_tokens=12, batch_size=4, engine="eager")
    assert [r.tokens for r in generate(model, prompts, eos_ids=set(), max_new_tokens=12, batch_size=4,
                                       engine="static")] == [r.tokens for r in greedy]


def test_the_slot_plan_fits_the_budget():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048)
    plan = plan_slots(cfg, None, batch_size=1024, max_batch_tokens=400_000)
    assert plan.slots == 1024 and plan.max_len == 768  # 400k * 2.5 * 0.9 / 1024 = 878 -> a multiple of 256
    assert plan.slots * plan.max_len <= 400_000 * 2.5 * 0.9
    small = plan_slots(cfg, None, batch_size=1024, max_batch_tokens=100_000)
    assert (small.slots, small.max_len) == (256, 768)  # halved until a slot holds two buckets
    assert (plan_slots(cfg, None, batch_size=1024, max_batch_tokens=4_000).slots,
            plan_slots(cfg, None, batch_size=1024, max_batch_tokens=4_000).max_len) == (16, 512)
    assert plan_slots(cfg, None, batch_size=1024, max_batch_tokens=1_000) is None  # 8 slots of < 512: eager
    capped = plan_slots(cfg, None, batch_size=8, max_batch_tokens=10_000_000)
    assert capped.max_len == 2048  # never past the model's context


def test_steps_read_each_rows_own_columns_where_few_of_the_spans_are_real(model, monkeypatch):
    """On a GPU a decode step whose rows' own columns are under VARLEN_MAX_SHARE of the span's reads only those
    (the decoder's variable-length attention); with flash's kernel, rows of equal length keep the spanned step,
    faster there (the Triton kernel is faster even then: its share is unbounded). Either
    way the text is a single sequence's. The kernel's CPU stand-in: tests/test_static_decode.py."""
    from dflash.core import static_decode as sd
    from dflash.extract.generation import slot_engine
    from tests.test_static_decode import flash_varlen_reference

    monkeypatch.setattr(sd, "varlen_kernel", lambda *a: "flash")
    monkeypatch.setattr(sd, "_flash_varlen", flash_varlen_reference)
    rng = random.Random(4)
    V = model.config.vocab_size
    same = [[rng.randrange(3, V) for _ in range(24)] for _ in range(8)]  # columns 24-31 of 32: >= 78% of the span
    for prompts, varlen in ((mixed_prompts(model, rng), True), (same, False)):
        flash_varlen_reference.calls = 0
        eng = decodes_single_sequences(model, prompts)
        assert eng.dec.varlen and (eng.varlen_steps > 0) == varlen
        assert flash_varlen_reference.calls == eng.varlen_steps * model.config.num_hidden_layers
    assert slot_engine.VARLEN_MAX_SHARE["flash"] < 25 / 32 and slot_engine.VARLEN_MAX_SHARE["triton"] > 1


def mixed_prompts(model, rng: random.Random) -> list[list[int]]:
    """12 prompts of 2-44 tokens: a decode step's rows then use well under VARLEN_MAX_SHARE["flash"] of its span."""
    V = model.config.vocab_size
    return [[rng.randrange(3, V) for _ in range(n)] for n in (2, 3, 40, 4, 5, 38, 2, 6, 3, 44, 2, 5)]


def decodes_single_sequences(model, prompts: list[list[int]]) -> SlotEngine:
    """A 16-slot engine's greedy text of each prompt (8 new tokens) equals the prompt decoded alone; the engine is
    returned for its counts. Also run with the Triton kernel in its interpreter (tests/test_decode_attention.py)."""
    eng = SlotEngine(model, eos_ids=set(), slots=16, max_len=64, prefill_tokens=1024, refill=1, bucket=16)
    for i, p in enumerate(prompts):
        eng.add(Request(p, 8, key=i, priority=(0, i)))
    results = {}
    while eng.busy:
        for r in eng.step():
            results[r.key] = r
    for i, p in enumerate(prompts):
        assert results[i].tokens == _reference(model, p, 8, set())[0], f"prompt {i}"
    return eng


def test_prompts_are_padded_as_row_by_row():
    """slot_engine.padded (a prefill's ids built at once) gives the row-by-row tensor and the lengths."""
    import torch

    from dflash.extract.generation.slot_engine import padded

    rng = random.Random(7)
    prompts = [[rng.randrange(1, 50_000) for _ in range(rng.randint(1, 40))] for _ in range(37)]
    width = max(map(len, prompts)) + 3
    ids, lens = padded(prompts, width, pad=-1)
    want = torch.full((len(prompts), width), -1, dtype=torch.long)
    for i, p in enumerate(prompts):
        want[i, :len(p)] = torch.tensor(p)
    assert torch.equal(ids, want) and lens.tolist() == list(map(len, prompts))


def test_a_run_that_all_overflows_counts_the_columns_it_read(model):
    """Every request longer than a slot: the eager engine beside the slots decodes them all, and its columns are the
    run's (before, the run reported its real columns against 0 columns read)."""
    prompts = _prompts(model, 4)
    eng = SlotEngine(model, eos_ids=set(), slots=2, max_len=16, prefill_tokens=64, refill=1, bucket=16, start_len=16)
    for i, p in enumerate(prompts):
        eng.add(Request(p, 20, key=i, priority=(-len(p), i)))
    while eng.busy:
        eng.step()
    assert eng.overflowed == len(prompts)
    assert 0 < eng.decode_real_columns <= eng.decode_columns and eng.prefill_columns > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_booking_each_step_one_step_late_changes_no_output(model, temperature):
    """The pipelined engine launches step k+1 before it books step k's tokens; rows that ended in step k are decoded
    once more and that token dropped; a prefill or a compaction books the step in flight first. Its outputs equal the
    engine that books every step at once, token for token, greedy and sampled."""
    rng = random.Random(5)
    prompts = _prompts(model, 29, seed=5, hi=30)
    max_new = [rng.randint(1, 24) for _ in prompts]
    free_run = [_reference(model, p, 24, set())[0] for p in prompts]
    eos = {t for t, _ in Counter(t for out in free_run for t in out[2:]).most_common(3)}

    def run(pipeline):
        eng = SlotEngine(model, eos_ids=eos, slots=16, max_len=64, prefill_tokens=96, refill=2, bucket=16,
                         temperature=temperature, top_p=0.9, pipeline=pipeline)
        for i, (p, n) in enumerate(zip(prompts, max_new)):
            eng.add(Request(p, n, key=i, rng_key=1000 + i, priority=(-len(p), i)))
        results, late = {}, 0
        while eng.busy:
            for r in eng.step():
                assert r.key not in results
                results[r.key] = (r.tokens, r.stopped, r.generated)
            late += eng._inflight is not None
        return eng, results, late

    eng, got, late = run(True)
    ref_eng, want, never = run(False)
    assert eng.pipeline and not ref_eng.pipeline and never == 0
    assert late >= eng.steps - eng.prefills - eng.compactions - 1 > 10  # almost every step was booked one step late
    assert got == want and len(got) == len(prompts)
    assert sum(stopped for _, stopped, _ in got.values()) >= 3 and eng.compactions >= 1 and eng.prefills > 2
    if temperature == 0.0:  # and each equals its sequence decoded alone
        for i, (p, n) in enumerate(zip(prompts, max_new)):
            ref, stop = _reference(model, p, n, eos)
            assert got[i][0] + ([ref[-1]] if stop else []) == ref and got[i][1] == stop


def test_turns_that_go_on_in_their_slot_book_every_step_at_once(model):
    eng = SlotEngine(model, eos_ids={1}, slots=4, max_len=32, prefill_tokens=64, bucket=8, follow=lambda res: None)
    assert not eng.pipeline
    with pytest.raises(ValueError, match="follow"):
        SlotEngine(model, eos_ids={1}, slots=4, max_len=32, prefill_tokens=64, bucket=8, follow=lambda res: None,
                   pipeline=True)
