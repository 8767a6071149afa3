"""dflash regenerate: the generator is exact, the dataset keeps its structure, parts resume after a kill."""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from dflash.core.chat import DataError, load_chat_dataset
from dflash.core.config import ConfigError
from dflash.core.target import TargetError, load_causal_lm, load_tokenizer
from dflash.extract.generation.regenerate import (
    META_NAME,
    Engine,
    RegenerateConfig,
    Request,
    committed_parts,
    generate,
    read_meta,
    run_regenerate,
    sample,
    uniforms,
)
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def model(tiny):
    return load_causal_lm(tiny)


def _reference(model, prompt, max_new, eos):
    """Greedy decoding of one sequence, one token per forward, no padding: what batching must reproduce."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
        pos = len(prompt)
        while True:
            t = int(logits.argmax())
            out.append(t)
            if t in eos or len(out) >= max_new:
                return out, t in eos
            logits = model(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[pos]]), cache=cache,
                           use_cache=True).logits[0, -1]
            pos += 1


def _prompts(model, n, seed=0, lo=1, hi=40):
    rng = random.Random(seed)
    V = model.config.vocab_size
    return [[rng.randrange(3, V) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ----------------------------------------------------------------------------------------------------------------
# the generator


def test_greedy_batched_equals_single_sequence(model):
    """Left padding, refills and rows leaving at different steps (EOS or their own max-new-tokens) change nothing."""
    rng = random.Random(1)
    prompts = _prompts(model, 23)
    max_new = [rng.randint(1, 30) for _ in prompts]
    free_run = [_reference(model, p, n, set())[0] for p, n in zip(prompts, max_new)]
    common = Counter(t for out in free_run for t in out[2:])
    eos = {t for t, _ in common.most_common(3)}  # tokens these prompts do produce: several rows stop early
    refs = [_reference(model, p, n, eos) for p, n in zip(prompts, max_new)]
    assert sum(stop for _, stop in refs) >= 3

    eng = Engine(model, eos_ids=eos, batch_size=5, max_batch_tokens=300, prefill_tokens=64, refill=1)
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        eng.add(Request(p, n, key=i, priority=(-len(p), i)))
    results, sizes = {}, []
    while eng.busy:
        for r in eng.step():
            results[r.key] = r
        sizes.append(len(eng.rows))
    assert eng.prefills > 4 and len(set(sizes)) > 3  # the batch was refilled and shrank many times
    for i, (ref, stop) in enumerate(refs):
        r = results[i]
        assert r.stopped == stop
        assert r.tokens + ([ref[-1]] if stop else []) == ref, f"prompt {i} (length {len(prompts[i])})"
        assert r.generated == len(ref) and r.truncated == (not stop)


def test_turns_that_go_on_in_their_row_equal_a_fresh_prefill_of_the_whole_context(model):
    """Engine(follow=...): a finished turn continues in its row with the caller's ids (fed one per step, nothing
    sampled kept), then generates again. Every later turn equals greedy decoding of prompt + earlier answers + fed
    ids from scratch, whether the turn stopped at an end id or was cut, and whether the budget let it continue
    (refused: the caller queues the context as a new prompt)."""
    from dflash.extract.generation.generate import Continuation

    rng = random.Random(7)
    prompts = _prompts(model, 14, seed=7, hi=30)
    free_run = [_reference(model, p, 10, set())[0] for p in prompts]
    eos = {t for t, _ in Counter(t for out in free_run for t in out[2:]).most_common(2)}
    V = model.config.vocab_size
    turns = {i: [rng.randint(2, 9) for _ in range(rng.randint(1, 3))] for i in range(len(prompts))}  # max new per turn
    feeds = {(i, k): [rng.randrange(3, V) for _ in range(rng.randint(1, 6))] for i in turns for k in range(3)}
    for budget in (100_000, 120):  # the second refuses some continuations
        ctx = {i: list(p) for i, p in enumerate(prompts)}
        turn = dict.fromkeys(ctx, 0)
        got: dict[tuple, list[int]] = {}
        fed_turns = fed_ids = 0

        def follow(res):
            i = res.key
            if turn[i] + 1 >= len(turns[i]):
                return None
            return Continuation(feeds[(i, turn[i])], turns[i][turn[i] + 1])

        eng = Engine(model, eos_ids=eos, batch_size=4, max_batch_tokens=budget, prefill_tokens=64, refill=1,
                     follow=follow)
        for i, p in ctx.items():
            eng.add(Request(p, turns[i][0], key=i, priority=(-len(p), i)))
        while eng.busy:
            for r in eng.step():
                i = r.key
                want, stop = _reference(model, ctx[i], turns[i][turn[i]], eos)
                assert r.tokens + ([want[-1]] if stop else []) == want and r.stopped == stop, (budget, i, turn[i])
                got[(i, turn[i])] = r.tokens
                if turn[i] + 1 < len(turns[i]):
                    if r.continued:
                        fed_turns, fed_ids = fed_turns + 1, fed_ids + len(feeds[(i, turn[i])])
                    ctx[i] = ctx[i] + r.tokens + feeds[(i, turn[i])]
                    turn[i] += 1
                    if not r.continued:
                        eng.add(Request(ctx[i], turns[i][turn[i]], key=i, priority=(0, i)))
                else:
                    assert not r.continued
        assert len(got) == sum(len(t) for t in turns.values())
        assert eng.continued == fed_turns and eng.forced_tokens == fed_ids
        assert eng.continued >= (8 if budget > 1000 else 1)
        if budget < 1000:
            assert eng.refused >= 1 and eng.continued + eng.refused == len(got) - len(turns)


def test_finished_rows_wait_for_one_compaction_and_change_nothing(model):
    """A finished row stays in the batch (its tokens ignored) until a quarter of the batch has finished: fewer cache
    copies than finished rows, and every output still equals the single-sequence greedy one."""
    rng = random.Random(5)
    prompts = _prompts(model, 30, seed=5)
    max_new = [rng.randint(1, 24) for _ in prompts]
    free_run = [_reference(model, p, n, set())[0] for p, n in zip(prompts, max_new)]
    eos = {t for t, _ in Counter(t for out in free_run for t in out[2:]).most_common(3)}
    refs = [_reference(model, p, n, eos) for p, n in zip(prompts, max_new)]
    eng = Engine(model, eos_ids=eos, batch_size=16, max_batch_tokens=1 << 16, prefill_tokens=1024)
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        eng.add(Request(p, n, key=i, priority=(-len(p), i)))
    results, dead_seen = {}, 0
    while eng.busy:
        for r in eng.step():
            results[r.key] = r
        dead_seen = max(dead_seen, eng.dead)
    assert dead_seen >= 2 and eng.compactions < len(prompts) // 2
    for i, (ref, stop) in enumerate(refs):
        r = results[i]
        assert r.tokens + ([ref[-1]] if stop else []) == ref and r.stopped == stop, f"prompt {i}"
        assert r.generated == len(ref)
    assert eng.generated == sum(len(ref) for ref, _ in refs)  # ignored tokens of finished rows are not counted


def test_the_engine_counts_padding_and_copies(model):
    """The counters behind regenerate's "engine work" line: prompt columns prefilled with their left padding, cache
    columns a decode step attends against the real tokens among them, token columns copied by a stack."""
    eng = Engine(model, eos_ids=set(), batch_size=4, max_batch_tokens=1 << 16, prefill_tokens=1024, refill=1)
    eng.add(Request([5, 6, 7], 4, key=0, priority=(0,)))
    eng.add(Request([5, 6, 7, 8, 9], 4, key=1, priority=(1,)))
    eng.step()  # one prefill of both (width 5), then one decode step
    assert (eng.prefills, eng.prompt_tokens, eng.prefill_columns) == (1, 8, 10)
    assert eng.decode_columns == 2 * 6 and eng.decode_real_columns == (3 + 1) + (5 + 1)
    assert eng.copied_columns == 0  # the first prefill is the batch: nothing to copy
    eng.add(Request([9, 9], 4, key=2, priority=(2,)))
    eng.step()  # stacked beside the two rows (6 columns wide after one decode step): 3 rows x 6 columns copied
    assert eng.prefill_columns == 10 + 2 and eng.copied_columns == 3 * 6
    assert eng.decode_columns == 12 + 3 * 7 and eng.decode_real_columns == 10 + (4 + 1) + (6 + 1) + (2 + 1)

    # a refill of several prefill chunks (at most 3 padded tokens each: one prompt a chunk) is stacked once
    eng = Engine(model, eos_ids=set(), batch_size=8, max_batch_tokens=1 << 16, prefill_tokens=3, refill=1)
    eng.add(Request([5, 6, 7], 4, key=0, priority=(0,)))
    eng.step()
    assert (eng.prefills, eng.copied_columns) == (1, 0)
    for i, p in enumerate(([1, 2], [3], [4, 5, 6])):
        eng.add(Request(p, 4, key=i + 1, priority=(i + 1,)))
    eng.step()  # three chunks beside the 4-column batch: one stack of 4 rows x 4 columns
    assert (eng.prefills, eng.copied_columns) == (4, 4 * 4)


def test_sampling_is_reproducible_and_independent_of_batching(model):
    prompts = _prompts(model, 9, seed=2, hi=25)
    kw = dict(eos_ids=set(), max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3)
    one = generate(model, prompts, batch_size=1, **kw)
    many = generate(model, prompts, batch_size=4, refill=1, prefill_tokens=48, **kw)
    assert [r.tokens for r in one] == [r.tokens for r in many]
    assert [r.tokens for r in generate(model, prompts, batch_size=4, **kw)] == [r.tokens for r in one]
    other = generate(model, prompts, batch_size=4, **{**kw, "seed": 4})
    assert [r.tokens for r in other] != [r.tokens for r in one]
    greedy = generate(model, prompts, eos_ids=set(), max_new_tokens=12, batch_size=4)
    tiny_nucleus = generate(model, prompts, batch_size=4, **{**kw, "top_p": 1e-6})  # the nucleus is the argmax
    assert [r.tokens for r in tiny_nucleus] == [r.tokens for r in greedy]


def test_sample_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(20000, 1)
    u = torch.from_numpy(uniforms([7] * 20000, range(20000)))
    for T, top_p in ((1.0, 1.0), (0.5, 1.0), (1.0, 0.8)):
        got = torch.bincount(sample(logits, T, top_p, u), minlength=5).double() / 20000
        p = torch.softmax(logits[0].double() / T, -1)
        if top_p < 1:  # the smallest prefix of the sorted probabilities holding top_p
            keep = (p.cumsum(-1) - p) < top_p
            p = p * keep / (p * keep).sum()
        assert torch.allclose(got, p, atol=0.012), (T, top_p, got, p)
    assert sample(logits[:3], 0.0, 0.5, None).tolist() == [0, 0, 0]


# ----------------------------------------------------------------------------------------------------------------
# the command


def _cfg(tiny, data, out, **kw):
    kw.setdefault("max_new_tokens", 12)
    kw.setdefault("part_size", 4)
    return RegenerateConfig(target=tiny, data=str(data), out=str(out), progress=False, **kw)


def _read_parts(out):
    rows = []
    for f in sorted(glob.glob(os.path.join(out, "data", "part-*.jsonl"))):
        with open(f, encoding="utf-8") as fh:
            rows += [json.loads(line) for line in fh]
    return rows


def _snapshot(out):
    files = sorted(glob.glob(os.path.join(out, "data", "*")) + glob.glob(os.path.join(out, "data", ".*")))
    return {os.path.basename(f): open(f, encoding="utf-8").read() for f in files}


def test_continued_turns_write_the_same_dataset_as_new_prompts(tiny, tmp_path):
    """--continue-turns (the default) and --no-continue-turns regenerate the same text; with continuation, later
    turns feed only the ids between the turns instead of prefilling their history again. One-token answers: the
    random tiny model's longer answers rarely decode and re-encode to the same ids, which continuation requires."""
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(30, seed=5, turns=(2, 4)))
    runs = {}
    for on in (True, False):
        out = tmp_path / f"out-{on}"
        runs[on] = run_regenerate(_cfg(tiny, data, out, max_new_tokens=1, batch_size=8, part_size=8,
                                       continue_turns=on))
        runs[on]["rows"] = {r["source_row"]: r["messages"] for r in _read_parts(out)}
    on, off = runs[True], runs[False]
    assert on["rows"] == off["rows"] and len(on["rows"]) == 30
    assert on["counts"] == off["counts"]
    e_on, e_off = on["engine_this_rank"], off["engine_this_rank"]
    assert e_off["continued_turns"] == 0 and e_off["prompt_tokens"] == off["counts"]["prompt_tokens"]
    assert e_on["continued_turns"] >= 20 and e_on["continuations_refused"] == 0
    assert e_on["prompt_tokens"] + e_on["continuation_tokens"] < 0.75 * e_off["prompt_tokens"]
    with pytest.raises(ConfigError, match="--continue-turns"):  # a resume must not mix the two
        run_regenerate(_cfg(tiny, data, tmp_path / "out-True", max_new_tokens=1, batch_size=8, part_size=8,
                            continue_turns=False))


def test_structure_is_kept_and_turns_see_the_targets_own_answers(tiny, model, tmp_path):
    rows = chat_rows(10, seed=5, turns=(1, 3))
    rows[1] = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"},
                                 {"from": "gpt", "value": "old 1"}, {"from": "human", "value": "And then?"},
                                 {"from": "gpt", "value": "old 2"}]}
    rows[2] = {"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "no user first"},
                            {"role": "user", "content": "late"}, {"role": "assistant", "content": "x"}]}
    rows[3] = {"messages": [{"role": "user", "content": "only a prompt"}]}
    rows[4] = {"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                            {"role": "user", "content": "trailing user turn"}]}
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    out = tmp_path / "out"
    summary = run_regenerate(_cfg(tiny, data, out))
    got = {r["source_row"]: r["messages"] for r in _read_parts(out)}
    eng = summary["engine_this_rank"]  # where the generation's time went, for the benchmarks
    assert eng["decode_steps"] >= 1 and eng["prefills"] >= 1
    # a turn goes on in its row only when the next prompt's ids extend the row's (this random tiny model's answers
    # mostly do not survive decode + encode); prefilled + fed ids never exceed what new prompts would have prefilled
    assert eng["prompt_tokens"] + eng["continuation_tokens"] <= summary["counts"]["prompt_tokens"]
    assert set(eng["seconds"]) == {"prefill", "decode", "batch_edit"}
    assert sorted(got) == [r for r in range(10) if r != 2]  # row 2 has no user turn before its first answer

    tok = load_tokenizer(tiny)
    for r, msgs in got.items():
        if r == 1:
            src = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                   {"role": "assistant"}, {"role": "user", "content": "And then?"}, {"role": "assistant"}]
        elif r == 3:
            src = [{"role": "user", "content": "only a prompt"}, {"role": "assistant"}]  # an answer is appended
        else:
            src = rows[r]["messages"]
        assert [m["role"] for m in msgs] == [m["role"] for m in src], r
        for m, s in zip(msgs, src):
            if m["role"] != "assistant":
                assert m["content"] == s["content"]
        # every assistant turn is the target's greedy answer to the conversation so far, earlier answers its own
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            ids = tok.apply_chat_template(msgs[:i], add_generation_prompt=True, tokenize=False)
            ids = tok(ids, add_special_tokens=False)["input_ids"]
            ref, stop = _reference(model, ids, 12, {tok.convert_tokens_to_ids("<|im_end|>")})
            assert m["content"] == tok.decode(ref[:-1] if stop else ref, skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False), (r, i)
    assert got[4][-1] == {"role": "user", "content": "trailing user turn"}

    meta = read_meta(str(out))
    n_turns = sum(m["role"] == "assistant" for msgs in got.values() for m in msgs)
    c = meta["counts"]
    assert meta["complete"] and meta["parts"] == 3 and summary["counts"] == c
    assert c["rows"] == 10 and c["conversations"] == 9 and c["skipped_no_user_turn"] == 1 and c["turns"] == n_turns
    assert c["truncated"] <= n_turns and c["generated_tokens"] <= 12 * n_turns
    assert meta["target"]["name_or_path"] == os.path.abspath(tiny) and meta["settings"]["max_new_tokens"] == 12
    assert "Only the last assistant turn" not in (out / "README.md").read_text()  # every answer is the target's

    # readable by extract's loader, by `datasets` from the folder (dataset card) and from the part files
    import datasets

    assert len(load_chat_dataset(str(out))) == 9
    hf = str(tmp_path / "hf")  # datasets caches a folder by its name: keep other runs' "out" out of it
    assert len(datasets.load_dataset(str(out), split="train", cache_dir=hf)) == 9
    assert len(datasets.load_dataset("json", data_files=str(out / "data" / "*.jsonl"), split="train",
                                     cache_dir=hf)) == 9


def test_truncated_and_empty_generations_are_counted(tmp_path):
    rows = chat_rows(6, seed=7, turns=(1, 2))
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    turns = sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    tiny = make_tiny_target(tmp_path / "t")
    out = tmp_path / "a"
    run_regenerate(_cfg(tiny, data, out, max_new_tokens=3, stop_at_eos=False))
    c = read_meta(str(out))["counts"]
    assert c["turns"] == turns and c["truncated"] == turns and c["generated_tokens"] == 3 * turns

    # a target whose first token is always an end-of-sequence id: every answer is empty, none truncated
    mute = make_tiny_target(tmp_path / "mute")
    m = load_causal_lm(mute)
    m.model.norm.weight.data.zero_()  # all logits 0: argmax is token 0, made an eos id below
    m.generation_config.eos_token_id = [m.config.eos_token_id, 0]
    m.save_pretrained(mute)
    out = tmp_path / "b"
    run_regenerate(_cfg(mute, data, out))
    c = read_meta(str(out))["counts"]
    assert c["turns"] == turns and c["empty"] == turns and c["truncated"] == 0 and c["generated_tokens"] == turns
    assert all(m["content"] == "" for r in _read_parts(out) for m in r["messages"] if m["role"] == "assistant")


def test_kill_then_rerun_gives_the_uninterrupted_dataset(tiny, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(24, seed=11, turns=(1, 2)))
    args = ["--target", tiny, "--data", data, "--max-new-tokens", "16", "--part-size", "2", "--batch-size", "1",
            "--no-progress"]
    ref = tmp_path / "uninterrupted"
    run_regenerate(_cfg(tiny, data, ref, max_new_tokens=16, part_size=2, batch_size=8))

    out = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "regenerate", *args, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    deadline = time.time() + 120
    while not committed_parts(str(out)) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    done = committed_parts(str(out))
    assert 1 <= len(done) < 12, "the kill should land after the first part and before the last"
    assert not read_meta(str(out))["complete"]
    with pytest.raises(DataError, match="unfinished"):
        load_chat_dataset(str(out))
    (out / "data" / ".part-00011.jsonl.tmp-12345").write_text('{"messages": "half a part"')  # a torn write

    run_regenerate(_cfg(tiny, data, out, max_new_tokens=16, part_size=2, batch_size=5))  # other batching: same text
    assert _snapshot(out) == _snapshot(ref)
    rows = _read_parts(out)
    assert sorted(r["source_row"] for r in rows) == list(range(24))  # none lost, none twice
    assert read_meta(str(out))["counts"] == read_meta(str(ref))["counts"]


def test_changed_settings_are_refused_unless_overwrite(tiny, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(5, seed=3))
    out = tmp_path / "out"
    run_regenerate(_cfg(tiny, data, out))
    before = _snapshot(out)
    run_regenerate(_cfg(tiny, data, out, batch_size=2, seed=9))  # batching and a greedy run's seed change nothing
    assert _snapshot(out) == before
    with pytest.raises(ConfigError, match="--temperature: .*temperature=0.0.*temperature=0.7.*--overwrite"):
        run_regenerate(_cfg(tiny, data, out, temperature=0.7))
    with pytest.raises(ConfigError, match="--max-new-tokens"):
        run_regenerate(_cfg(tiny, data, out, max_new_tokens=5))
    with pytest.raises(ConfigError, match="--chat-template-kwargs"):
        run_regenerate(_cfg(tiny, data, out, chat_template_kwargs={"enable_thinking": False}))
    run_regenerate(_cfg(tiny, data, out, temperature=0.7, overwrite=True))
    meta = read_meta(str(out))
    assert meta["complete"] and meta["settings"]["temperature"] == 0.7 and _snapshot(out) != before

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not yours")
    with pytest.raises(ConfigError, match="--out: .* is not a dflash regenerate output"):
        run_regenerate(_cfg(tiny, data, tmp_path / "mine", overwrite=True))
    assert (tmp_path / "mine" / "notes.txt").exists()


def test_bad_input_is_a_clear_error(tiny, tmp_path):
    from click.testing import CliRunner

    from dflash.cli import main

    out = tmp_path / "out"
    with pytest.raises(DataError, match="does not exist"):
        run_regenerate(_cfg(tiny, tmp_path / "missing.jsonl", out))
    bad = write_jsonl(tmp_path / "bad.jsonl", [*chat_rows(2), {"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"bad.jsonl, row 2: messages\[0\]\.role 'robot' is unknown"):
        run_regenerate(_cfg(tiny, bad, out))
    assert committed_parts(str(out)) == set()  # every row is checked before anything is generated
    cols = write_jsonl(tmp_path / "cols.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match="no 'messages'"):
        run_regenerate(_cfg(tiny, cols, tmp_path / "o2"))
    nouser = write_jsonl(tmp_path / "nouser.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(DataError, match="no conversation could be regenerated"):
        run_regenerate(_cfg(tiny, nouser, tmp_path / "o3"))
    assert not (tmp_path / "o3").exists()
    with pytest.raises(TargetError, match="not found"):
        run_regenerate(_cfg(str(tmp_path / "no-model"), bad, tmp_path / "o4"))
    with pytest.raises(ConfigError, match="--top-p"):
        _cfg(tiny, bad, out, top_p=0.0)

    res = CliRunner().invoke(main, ["regenerate", "--target", tiny, "--data", str(bad), "--out", str(tmp_path / "o5")])
    assert res.exit_code == 2 and "error:" in res.output and "row 2" in res.output
    assert not (tmp_path / "o5").exists()  # nothing is written before the input is checked
    res = CliRunner().invoke(main, ["regenerate", "--target", tiny, "--data", str(bad), "--out", str(out),
                                    "--max-new-tokens", "0"])
    assert res.exit_code == 2 and "--max-new-tokens must be >= 1" in res.output


def test_extract_reads_a_regenerated_dataset(tiny, tmp_path):
    import dflash_cache
    from click.testing import CliRunner

    from dflash.cli import main

    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(6, seed=13))
    out, cache = tmp_path / "regen", tmp_path / "cache"
    res = CliRunner().invoke(main, ["regenerate", "--target", tiny, "--data", str(data), "--out", str(out),
                                    "--max-new-tokens", "10", "--part-size", "4", "--no-progress",
                                    "--chat-template-kwargs", "enable_thinking=false"])
    assert res.exit_code == 0, res.output
    assert json.loads((out / META_NAME).read_text())["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
    res = CliRunner().invoke(main, ["extract", "--target", tiny, "--data", str(out), "--out", str(cache),
                                    "--seq-len", "256"])
    assert res.exit_code == 0, res.output
    c = dflash_cache.open(str(cache))
    assert c.complete and c.real_tokens > 0
    assert "6 conversations: 6 used" in res.output



def test_default_engine_budget_counts_the_stack_transient():
    """The default KV budget leaves room for a slab's headroom and the stack of a prefill (peak ~2.5x)."""
    from transformers import LlamaConfig

    from dflash.extract.generation.generate import kv_bytes_per_token, plan_engine

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    per = kv_bytes_per_token(cfg, torch.float32)
    assert per == 2 * 3 * 2 * 16 * 4
    batch, tokens, prefill = plan_engine(cfg, torch.float32, torch.device("cpu"))
    assert (batch, prefill) == (32, 2048)
    # CPU: 4 GiB of KV at the peak, which is 2.5x the admitted tokens
    assert tokens == (4 << 30) * 2 // (5 * per)
    assert 2.5 * tokens * per <= 4 << 30
    assert plan_engine(cfg, torch.float32, torch.device("cpu"), max_batch_tokens=1000)[1] == 1000


def test_turns_last_answers_the_datas_own_history_and_extract_trains_on_that_answer_only(tiny, model, tmp_path):
    """--turns last: only the last assistant turn is the target's (its greedy answer to the history as the data has
    it); the earlier answers stay verbatim, marked weight 0; `dflash extract` supervises exactly the last answer."""
    import dflash_cache
    from click.testing import CliRunner

    from dflash.cli import main
    from dflash.extract.data import ChatTokenizer

    rows = [{"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "human answer one"},
                          {"role": "user", "content": "u2"}, {"role": "assistant", "content": "human answer two"}]},
            {"messages": [{"role": "user", "content": "just one"}, {"role": "assistant", "content": "x"}]},
            {"messages": [{"role": "user", "content": "a prompt only"}]}]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    out = tmp_path / "out"
    summary = run_regenerate(_cfg(tiny, data, out, turns="last"))
    assert summary["counts"]["turns"] == 3 and read_meta(str(out))["settings"]["turns"] == "last"
    assert "Only the last assistant turn of each row is the target's" in (out / "README.md").read_text()
    got = {r["source_row"]: r["messages"] for r in _read_parts(out)}
    tok = load_tokenizer(tiny)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    for r, msgs in got.items():
        src = rows[r]["messages"]
        *history, last = msgs
        assert history == [dict(m, weight=0) if m["role"] == "assistant" else m for m in src[: len(history)]], r
        text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        ref, stop = _reference(model, tok(text, add_special_tokens=False)["input_ids"], 12, eos)
        assert last == {"role": "assistant", "content": tok.decode(ref[:-1] if stop else ref, skip_special_tokens=False,
                                                                   clean_up_tokenization_spaces=False), "weight": 1}, r
    # resuming with the other setting is refused, naming the flag
    with pytest.raises(ConfigError, match="--turns"):
        run_regenerate(_cfg(tiny, data, out))

    # extract: the loss mask covers the last answer (+ end of turn) only
    cache = tmp_path / "cache"
    res = CliRunner().invoke(main, ["extract", "--target", tiny, "--data", str(out), "--out", str(cache),
                                    "--seq-len", "256", "--num-context-layers", "2"])
    assert res.exit_code == 0, res.output
    ct = ChatTokenizer(tok)
    msgs = got[0]
    ids, mask = ct.encode(msgs)
    plain_ids, plain_mask = ct.encode([{k: v for k, v in m.items() if k != "weight"} for m in msgs])
    assert ids == plain_ids and sum(mask) < sum(plain_mask)
    prefix = tok(tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    assert not any(mask[: len(prefix)]) and all(mask[len(prefix): len(ids) - 1])  # the answer and its end of turn
    c = dflash_cache.open(str(cache))
    sup = sum(int(c[i]["loss_mask"].sum()) for i in range(len(c)))
    assert sup == sum(sum(ct.encode(m)[1]) for m in got.values())


def test_turns_last_parts_of_one_turn_and_of_several_read_as_one_dataset(tiny, tmp_path):
    """A first part of one-turn conversations (nothing kept at weight 0) and a later one of longer ones: every part's
    rows have the same keys (the target's answer says weight 1), so the folder reads as one dataset (datasets reads
    it with the first part's columns: a weight only in later parts failed to cast)."""
    rows = [{"messages": [{"role": "user", "content": "only this"}]},
            {"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "kept"},
                          {"role": "user", "content": "u2"}, {"role": "assistant", "content": "rewritten"}]}]
    out = tmp_path / "out"
    run_regenerate(_cfg(tiny, write_jsonl(tmp_path / "chats.jsonl", rows), out, turns="last", part_size=1))
    ds = load_chat_dataset(str(out))
    assert [[m.get("weight") for m in r["messages"] if m["role"] == "assistant"] for r in ds] == [[1], [0, 1]]


def test_weight_must_be_0_or_1_on_an_assistant_message(tmp_path):
    from dflash.core.chat import to_messages

    ok = to_messages({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a",
                                                                         "weight": 0}]}, 0, "d")
    assert ok[1] == {"role": "assistant", "content": "a", "weight": 0}
    one = to_messages({"messages": [{"role": "user", "content": "u", "weight": None},
                                    {"role": "assistant", "content": "a", "weight": 1}]}, 0, "d")
    assert one == [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    for bad in ({"role": "assistant", "content": "a", "weight": 0.5}, {"role": "user", "content": "u", "weight": 0},
                {"role": "assistant", "content": "a", "weight": True}):
        with pytest.raises(DataError, match=r"d, row 3: messages\[0\]\.weight"):
            to_messages({"messages": [bad]}, 3, "d")


def test_prompts_are_taken_longest_first_across_a_window_of_parts(tiny, tmp_path, monkeypatch):
    """The rows decoding together have similar lengths when the prompts of a window of parts are ordered longest first
    (SORT_WINDOW_BATCHES batches; one part at a time before): the batch's padded columns drop, the text does not
    change and every part is written."""
    import dflash.extract.generation.regenerate as regen

    rows = chat_rows(48, seed=9, turns=(1, 1))
    for i, r in enumerate(rows):  # every fourth prompt long: one in each part of 4
        if i % 4 == 0:
            r["messages"][0]["content"] = " ".join([r["messages"][0]["content"]] * 12)
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    runs = {}
    for batches in (0, 4):  # 0: a window of one part (max(1, 0)), as before
        monkeypatch.setattr(regen, "SORT_WINDOW_BATCHES", batches)
        out = tmp_path / f"out-{batches}"
        res = run_regenerate(_cfg(tiny, data, out, max_new_tokens=6, batch_size=4, part_size=4, stop_at_eos=False))
        runs[batches] = (res["engine_this_rank"], {r["source_row"]: r["messages"] for r in _read_parts(out)})
    (one, text_one), (window, text_window) = runs[0], runs[4]
    assert text_window == text_one and len(text_one) == 48
    assert len(glob.glob(os.path.join(tmp_path / "out-4", "data", "part-*.jsonl"))) == 12
    waste = lambda e: e["decode_columns"] / e["decode_real_columns"]  # noqa: E731
    assert waste(window) < 0.7 * waste(one), (waste(window), waste(one))
