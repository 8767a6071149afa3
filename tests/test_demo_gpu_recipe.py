"""The GPU recipe's data preparation (dflash/recipes/gpu.py) and its preset, on CPU, without a GPU:

  * the split is by conversation, deterministic, ~heldout_percent; no conversation is on both sides;
  * every user turn of a training conversation is kept with its history (one multi-turn sample), up to
    max_turns, ending on an assistant turn; roles alternate from the user;
  * eval prompts are held-out histories up to a user turn, at varied positions, never repeated;
  * configs/demo-gpu.yaml builds every stage's config (no unknown key), and the CLI refuses CPU-only flags.
"""

import json
import os
import random
import subprocess
import sys

import pytest

from dflash.recipes.gpu_config import GpuRecipe, load_recipe
from dflash.recipes.mix import eval_prompts, is_heldout, split_data, training_sample
from dflash.recipes.sources import as_messages, dialogues

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_chitchat(n: int, seed: int = 0) -> dict:
    """chitchat's layout: {id: {"messages": [turn, ...]}}, a turn = one sender's messages."""
    rng = random.Random(seed)
    out = {}
    for c in range(n):
        turns = []
        for t in range(rng.choice([1, 2, 3, 6, 11, 24])):
            turns.append([{"text": f"c{c} t{t} m{m}", "sender": "ab"[t % 2]} for m in range(rng.randint(1, 3))])
        out[f"conv-{c:04d}-{rng.random():.6f}"] = {"messages": turns}
    return out


def test_dialogues_join_a_turns_messages_and_stop_at_an_empty_turn():
    raw = {"a": {"messages": [[{"text": " hi "}, {"text": "there"}], [{"text": "yo"}], [{"text": " "}], [{"text": "x"}]]},
           "b": {"messages": []}}
    assert dialogues(raw) == [("a", ["hi\nthere", "yo"]), ("b", [])]


def test_heldout_split_is_by_conversation_deterministic_and_about_the_percentage():
    keys = [f"k{i}" for i in range(4000)]
    held = [k for k in keys if is_heldout(k, 5.0)]
    assert 0.04 < len(held) / len(keys) < 0.06
    assert held == [k for k in keys if is_heldout(k, 5.0)]  # no randomness
    assert set(held) <= {k for k in keys if is_heldout(k, 10.0)}  # a larger share contains the smaller


def test_training_samples_keep_every_user_turn_with_its_history():
    turns = [f"t{i}" for i in range(7)]
    s = training_sample(turns, 0)
    assert [m["content"] for m in s] == turns[:6]  # the trailing user turn has no answer to learn
    assert [m["role"] for m in s] == ["user", "assistant"] * 3
    assert [m["content"] for m in training_sample(turns, 4)] == turns[:4]
    assert [m["content"] for m in training_sample(turns, 5)] == turns[:4]  # ends on an assistant turn
    assert training_sample(["only a user"], 16) is None


def test_split_has_no_overlap_and_prompts_are_heldout_histories_at_varied_turns():
    raw = fake_chitchat(600)
    recipe = GpuRecipe(heldout_percent=10, max_turns=8, eval_prompts=40, history="target")
    samples, prompts, counts, valid = split_data(raw, recipe)
    convs = dict(dialogues(raw))
    cid = {t[0]: k for k, ts in convs.items() for t in [ts[:1]] if ts}  # first turn text -> conversation

    def conv_of(msgs):
        return cid[msgs[0]["content"]]

    train_ids = {conv_of(s) for s in samples}
    held_ids = {conv_of(p) for p in prompts}
    assert train_ids and held_ids and not (train_ids & held_ids)
    assert all(is_heldout(k, 10) for k in held_ids) and not any(is_heldout(k, 10) for k in train_ids)
    # every training conversation with an answered user turn is there, all its turns up to max_turns
    want = {k for k, ts in convs.items() if not is_heldout(k, 10) and len(ts) >= 2}
    assert train_ids == want and counts["train_samples"] == len(want)
    for s in samples:
        ts = convs[conv_of(s)]
        n = min(len(ts), 8) // 2 * 2
        assert [m["content"] for m in s] == ts[:n] and s[-1]["role"] == "assistant"
    assert counts["assistant_turns"] == sum(len(s) // 2 for s in samples)
    assert counts["assistant_turns_cut_by_max_turns"] == sum(len(convs[k]) // 2 for k in want) - counts["assistant_turns"]
    # prompts: a held-out history up to an answered user turn (within max_turns), unique, positions vary
    assert len(prompts) == 40
    keys = set()
    for p in prompts:
        ts = convs[conv_of(p)]
        assert p == as_messages(ts[: len(p)]) and p[-1]["role"] == "user" and len(p) <= 8 and len(p) < len(ts)
        keys.add((conv_of(p), len(p)))
    assert len(keys) == 40
    assert len({len(p) for p in prompts}) >= 3
    assert split_data(raw, recipe)[1] == prompts  # deterministic
    # the validation samples: every held-out conversation with an answer, cut like the training ones
    valid_ids = {conv_of(v) for v in valid}
    assert valid_ids == {k for k, ts in convs.items() if is_heldout(k, 10) and len(ts) >= 2} >= held_ids
    assert not (valid_ids & train_ids) and counts["validation_samples"] == len(valid)
    for v in valid:
        ts = convs[conv_of(v)]
        assert [m["content"] for m in v] == ts[: min(len(ts), 8) // 2 * 2] and v[-1]["role"] == "assistant"


def test_dataset_history_gives_one_sample_per_user_turn_with_the_datas_own_history():
    raw = fake_chitchat(300)
    target = GpuRecipe(heldout_percent=10, max_turns=8, eval_prompts=20, history="target")
    data = GpuRecipe(heldout_percent=10, max_turns=8, eval_prompts=20, history="dataset")
    st, pt, ct, vt = split_data(raw, target)
    sd, pd, cd, vd = split_data(raw, data)
    assert pd == pt  # the eval prompts do not depend on it
    assert cd["train_conversations_used"] == ct["train_conversations_used"] == len(st)
    # each conversation sample of "target" becomes its prefixes ending on each answer, in order
    assert sd == [s[: j + 2] for s in st for j in range(0, len(s), 2)]
    assert vd == [s[: j + 2] for s in vt for j in range(0, len(s), 2)]
    assert cd["assistant_turns"] == ct["assistant_turns"] == len(sd)
    assert cd["assistant_turns_cut_by_max_turns"] == ct["assistant_turns_cut_by_max_turns"]
    with pytest.raises(Exception, match="history"):
        GpuRecipe(history="human")
    # history_messages keeps the last N messages of the history before each user turn; still one sample per turn
    win = GpuRecipe(heldout_percent=10, max_turns=8, eval_prompts=20, history="dataset", history_messages=2)
    sw, pw, cw, vw = split_data(raw, win)
    assert sw == [s[max(0, j - 2): j + 2] for s in st for j in range(0, len(s), 2)]
    assert vw == [s[max(0, j - 2): j + 2] for s in vt for j in range(0, len(s), 2)]
    assert pw == pt and all(x[0]["role"] == "user" and len(x) <= 4 for x in sw) and len(sw) == len(sd)
    for bad in (-2, 3):
        with pytest.raises(Exception, match="history.messages"):
            GpuRecipe(history_messages=bad)
    with pytest.raises(Exception, match="history.messages"):
        GpuRecipe(history="target", history_messages=4)


def test_eval_max_turns_limits_the_prompts_not_the_training_samples():
    raw = fake_chitchat(600)
    base = GpuRecipe(heldout_percent=10, max_turns=8, eval_prompts=40)
    short = GpuRecipe(heldout_percent=10, max_turns=8, eval_max_turns=4, eval_prompts=40)
    s8, p8, _, _ = split_data(raw, base)
    s4, p4, _, _ = split_data(raw, short)
    assert s4 == s8  # training keeps max_turns
    assert max(len(p) for p in p8) > 4 >= max(len(p) for p in p4)  # prompts end on user turn 1 or 2
    assert {len(p) for p in p4} == {1, 3}
    with pytest.raises(Exception, match="eval.max.turns"):
        GpuRecipe(eval_max_turns=-1)


def test_too_few_heldout_prompts_is_an_error_naming_the_setting():
    with pytest.raises(ValueError, match="eval_prompts"):
        split_data(fake_chitchat(30), GpuRecipe(heldout_percent=5, max_turns=4, eval_prompts=500))


def test_eval_prompts_take_later_turns_in_later_rounds():
    held = [("a", ["u0", "a0", "u1", "a1", "u2", "a2"]), ("b", ["u0", "a0"])]
    ps = eval_prompts(held, 4, 0)
    assert sorted(len(p) for p in ps) == [1, 1, 3, 5]  # a: turns 0, 2, 4 (all answered); b: turn 0


def test_the_preset_builds_every_stage_config():
    from dflash.core.config import build
    from dflash.extract.generation.regenerate import RegenerateConfig
    from dflash.extract.run import ExtractConfig
    from dflash.train.evaluate.eval import EvalConfig
    from dflash.train.fit.trainer import TrainConfig

    r = load_recipe("demo-gpu")
    assert r.eval_dtypes[0] == "bfloat16" and "float32" in r.eval_dtypes
    build(RegenerateConfig, "demo-gpu", "regenerate", {"target": "t", "data": "d", "out": "o"})
    build(ExtractConfig, "demo-gpu", "extract", {"target": "t", "data": "d", "out": "o"})
    t = build(TrainConfig, "demo-gpu", "train", {"cache": "c", "target": "t", "out": "o"})
    assert t.block_size in (8, 16) and 1 <= t.drafter_layers <= 5
    build(EvalConfig, "demo-gpu", "eval", {"target": "t", "drafter": "d", "data": "p"})


def test_the_3x_preset_scales_the_data_stages_and_stores_its_caches_on_a_basis():
    """configs/demo-gpu-3x.yaml: every stage's config builds; its caches are on a basis of rank H in fp8; its mix
    makes 2.72x the measured preset's samples (self prompts / self's share), and the stage plan scales the data's
    stages by that (self prompts by the prompts), the training after the extraction by what the trainer had left,
    and the rest stays: ~20 minutes on one H200, estimated."""
    from dflash.core.config import build
    from dflash.extract.generation.regenerate import RegenerateConfig
    from dflash.extract.run import ExtractConfig
    from dflash.recipes.gpu import GPU_STAGE_SECONDS, gpu_stage_plan
    from dflash.recipes.gpu_config import data_scale

    r, base = load_recipe("demo-gpu-3x"), load_recipe("demo-gpu")
    build(RegenerateConfig, "demo-gpu-3x", "regenerate", {"target": "t", "data": "d", "out": "o"})
    e = build(ExtractConfig, "demo-gpu-3x", "extract", {"target": "t", "data": "d", "out": "o"})
    assert (e.basis_rank, e.hidden_dtype, e.basis_from) == (576, "fp8", None)
    assert data_scale(base) == 1.0 and data_scale(r) == pytest.approx((184320 / 0.69) / (49152 / 0.5))
    assert list(r.sources)[0] == "self" and sum(r.sources.values()) == pytest.approx(1.0)
    plan, one = gpu_stage_plan("demo-gpu-3x").seconds, gpu_stage_plan("demo-gpu").seconds
    assert one == {k: GPU_STAGE_SECONDS[k] for k in one}  # the measured preset: as measured
    k = data_scale(r)
    assert plan["regenerate"] == pytest.approx(134 * k) and plan["extract"] == pytest.approx(62 * k)
    assert plan["self prompts"] == pytest.approx(46 * 184320 / 49152)
    assert plan["train"] == pytest.approx(469 + 62 - 62 * k)  # the trainer's time beside the longer extraction
    assert all(plan[s] == one[s] for s in ("prepare target", "validation data", "eval bfloat16", "eval float32"))
    assert 18 * 60 < sum(plan.values()) < 22 * 60


def test_cli_refuses_a_cpu_only_flag_for_the_gpu_recipe(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash", "demo", "--recipe", "gpu", "--train-prompts", "50",
                        "--workdir", str(tmp_path / "w")], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and "--train-prompts" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "w").exists()


def test_demo_config_resolves_the_recipe_and_keeps_the_cpu_sizes():
    from dflash.recipes.demo import CPU_SIZES, DemoConfig

    c = DemoConfig(recipe="cpu").cpu()
    assert (c.train_prompts, c.eval_prompts, c.train_steps, c.drafter_layers) == tuple(
        CPU_SIZES[k] for k in ("train_prompts", "eval_prompts", "train_steps", "drafter_layers"))
    assert c.workdir == "work/demo" and c.block_size == 4
    assert DemoConfig(recipe="cpu", train_steps=7).cpu().train_steps == 7
    assert DemoConfig(device="cpu").resolved_recipe() == "cpu"
    assert DemoConfig(recipe="gpu", device="cpu").resolved_recipe() == "gpu"
    with pytest.raises(ValueError, match="recipe"):
        DemoConfig(recipe="tpu")


TINY_RECIPE = """
recipe:
  heldout_percent: 5
  max_turns: 6
  max_conversations: 24
  validation_conversations: 12
  eval_prompts: 3
  eval_max_new_tokens: 12
  eval_dtypes: [float32]
regenerate:
  max_new_tokens: 10
  batch_size: 16
  part_size: 16
extract:
  seq_len: 256
  num_context_layers: 3
train:
  drafter_layers: 1
  block_size: 4
  num_anchors: 16
  batch_rows: 2
  max_steps: 6
  lr: 3.0e-3
  log_every: 3
  save_every: 3
eval:
  ngram_max: 3
  warmup_prompts: 0
"""


@pytest.mark.parametrize("history", ["target", "dataset"])
def test_the_recipe_end_to_end_on_cpu_with_a_held_out_validation_cache(tmp_path, history, capsys):
    """run_gpu_demo's stages on a tiny random target and a tiny copy of the preset: training data and the
    validation cache come from disjoint conversations, train validates on the latter at every checkpoint, and the
    summary carries its figures; a rerun resumes every stage. history "dataset": one sample per user turn, only
    its answer the target's (the earlier ones kept, weight 0, not trained on)."""
    import dflash_cache
    from dflash.recipes.gpu import run_gpu_demo
    from tests.tiny import make_tiny_target

    preset = tmp_path / "tiny.yaml"
    preset.write_text(TINY_RECIPE.replace("recipe:\n", f"recipe:\n  history: {history}\n"))
    target = make_tiny_target(tmp_path / "target")
    work = tmp_path / "w"
    s = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False, target=str(target))
    d = s["data"]
    assert d["train_conversations_used"] == 24 and d["validation_conversations"] == 12 and d["history"] == history
    regen = [json.loads(x) for f in sorted((work / "regenerated" / "data").glob("part-*.jsonl"))
             for x in f.read_text().splitlines()]
    if history == "target":
        assert d["train_samples"] == 24 and d["validation_samples"] == 12
        assert not any("weight" in m for r in regen for m in r["messages"])
    else:  # a sample per answered user turn (max_turns 6: up to 3), earlier answers kept as context
        assert d["train_samples"] == d["assistant_turns"] > 24 and d["validation_samples"] > 12
        assert len(regen) == d["train_samples"]
        for r in regen:
            answers = [m for m in r["messages"] if m["role"] == "assistant"]
            assert all(m.get("weight") == 0 for m in answers[:-1]) and answers[-1]["weight"] == 1
    train_rows = [json.loads(x) for x in (work / "data" / "train.jsonl").read_text().splitlines()]
    valid_rows = [json.loads(x) for x in (work / "data" / "valid.jsonl").read_text().splitlines()]
    assert len(valid_rows) == d["validation_samples"]
    first_user = lambda rows: {r["messages"][0]["content"] for r in rows}  # noqa: E731
    assert not (first_user(train_rows) & first_user(valid_rows))
    val = dflash_cache.open(str(work / "cache-valid"))
    assert val.complete and len(val) >= 1
    assert val.layer_ids == dflash_cache.open(str(work / "cache")).layer_ids
    recs = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "val_tau_expected" in r] == [3, 6]
    t = s["train"]
    assert t["val_curve"] == [[r["step"], r["val_tau_decode"], r["val_tau_expected"]] for r in recs if "val_tau_expected" in r]
    assert t["val_tau_expected"] == t["val_curve"][-1][2] and 1.0 <= t["val_tau_expected"] <= 4.0
    assert t["val_tau_decode"] == t["val_curve"][-1][1] and 1.0 <= t["val_tau_decode"] <= 4.0
    assert s["eval"]["float32"]["identical"] == "3/3"
    assert "validation data" in s["timings_s"]

    assert [r["stages_s"] for r in s["all_runs"]] == [{k: round(v, 1) for k, v in s["timings_s"].items()}]

    # a rerun finds it finished: it prints the stored result and changes no file
    files = {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in work.rglob("*") if f.is_file()}
    first = capsys.readouterr().out
    assert "demo: [3/7] regenerate  (~" in first and "demo: [7/7] eval float32  (~" in first  # each stage's line
    stored = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False, target=str(target))
    assert stored == json.loads(json.dumps(s, default=str))
    assert "demo: already done: the stored result of" in capsys.readouterr().out
    assert {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in work.rglob("*") if f.is_file()} == files
    assert any((work / "caches" / "datasets").rglob("*.arrow")) and any((work / "caches" / "tokenized").iterdir())
    # without its eval report, a rerun resumes every stage (only the eval is left to do)
    (work / "run" / "eval-float32.json").unlink()
    again = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False, target=str(target))
    assert again["eval"]["float32"]["identical"] == s["eval"]["float32"]["identical"] and again["train"]["steps"] == 6
    # the rerun keeps the first run's figures (its own regenerated and trained nothing) and adds its time
    assert again["regenerate"] == s["regenerate"] and again["train"]["val_curve"] == t["val_curve"]
    assert len(again["all_runs"]) == 2 and again["all_runs"][0] == s["all_runs"][0]
    assert again["wall_s_all_runs"] == pytest.approx(sum(r["wall_s"] for r in again["all_runs"]))
    assert json.loads((work / "time.json").read_text())["runs"] == again["all_runs"]
