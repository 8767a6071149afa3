"""The GPU recipe's comparison (`dflash demo --compare dflash2`, dflash/recipes/compare.py) end to end on CPU, on a
tiny random target and a tiny copy of the preset:

  * both caches hold the target's last hidden state; the DFlash drafter (run/) and the DFlash2 drafter
    (run-dflash2/) train from the same cache with the same schedule for the same training time: DFlash its
    compare_max_steps, DFlash2 with --time-budget = DFlash's training time (its run records the budget and the steps
    it decided from its step time), each validating on the validation cache at every checkpoint;
  * both are evaluated by the same eval (the same prompts, in source and MT-Bench, in bf16 with n-gram lookup and in
    float32), and the summary's side-by-side figures are those of their eval reports and trainer summaries;
  * a rerun prints the stored result and changes no file; a run SIGKILLed in the DFlash2 training (after DFlash's
    stages) resumes that training from its checkpoint and does only what is left;
  * with `follow` (the shipped preset's), DFlash's trainer follows the extraction for the comparison's steps and
    its waits for shards are out of its training time;
  * the verdict says how the training times compare and which models ran as CUDA graphs;
  * --compare is refused for the CPU recipe, a bad `compare` in the preset names the field, and the stage plan adds
    the DFlash2 stages with shares that fit ~25 minutes.
"""

import json
import math
import statistics

import pytest

from tests.test_demo_gpu_recipe import TINY_RECIPE
from tests.workload import slowed_steps

COMPARE_RECIPE = TINY_RECIPE.replace("recipe:\n", """recipe:
  compare_max_steps: 8
  heldout_source: mt_bench
  heldout_source_prompts: 2
  later_dtype_prompts: 3
""").replace("eval_dtypes: [float32]", "eval_dtypes: [bfloat16, float32]").replace("""train:
""", """train:
  selector_rank: 8
  selector_top_k: 4
  time_budget_probe: 2
""").replace("  save_every: 3\n", "  save_every: 2\n").replace("  max_steps: 6\n", "  max_steps: 10\n")


def budget_steps(run) -> tuple[dict, int]:
    """DFlash2's time-budget decision (RUN/run.json) and its total: decided after 3 warm-up steps and a probe of 2,
    at least 5 steps, else the budget over the measured step time; then the total of its last revision, if any
    (train/fit/time_budget.py; tests/test_train_time_budget.py tests them)."""
    rec = json.loads((run / "run.json").read_text())["time_budget"]
    assert rec["probe_steps"][1] - rec["probe_steps"][0] == 1
    assert rec["decided_steps"] == max(rec["probe_steps"][1], math.floor(rec["budget_s"] / rec["step_s"]))
    assert rec["total_steps"] == (rec["revisions"][-1]["total_steps"] if rec["revisions"] else rec["decided_steps"])
    return rec, rec["total_steps"]


def schedule_steps(total: int) -> tuple[list[int], list[int]]:
    """(the logged steps, the validated ones) of a run of `total` steps with log_every 3 and save_every 2."""
    logged = [k for k in range(1, total + 1) if k % 3 == 0 or k % 2 == 0 or k == total]
    return logged, [k for k in logged if k % 2 == 0 or k == total]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    from dflash.recipes.gpu import run_gpu_demo
    from tests.tiny import make_tiny_target

    root = tmp_path_factory.mktemp("compare")
    preset = root / "tiny.yaml"
    preset.write_text(COMPARE_RECIPE)
    target = make_tiny_target(root / "target")
    work = root / "w"
    s = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False, target=str(target),
                     compare="dflash2")
    return {"summary": s, "work": work, "preset": preset, "target": target}


def test_both_drafters_train_from_one_cache_and_the_summary_is_their_reports(compared):
    import dflash_cache

    s, work = compared["summary"], compared["work"]
    assert all(dflash_cache.open(str(work / name)).last_hidden for name in ("cache", "cache-valid"))
    c = s["compare"]
    assert c["arch"] == "dflash2" and c["steps"] == 8 and c["preset_steps"] == 10
    assert c["fewer_steps_than_preset"]
    runs = {"dflash": work / "run", "dflash2": work / "run-dflash2"}
    # equal training time: DFlash2's budget is DFlash's training time, its steps what that time bought
    rec, n2 = budget_steps(runs["dflash2"])
    assert rec["budget_s"] == round(c["train"]["dflash"]["train_s"], 3) and rec["probe_steps"] == [4, 5]
    assert c["time_budget"] == rec == json.loads((runs["dflash2"] / "summary.json").read_text())["time_budget"]
    assert c["same_steps"] == (n2 == 8)
    for name, run in runs.items():
        steps = 8 if name == "dflash" else n2
        doc = json.loads((run / "run.json").read_text())
        rj = doc["config"]
        assert rj["arch"] == name and rj["cache"] == str(work / "cache")
        assert rj["val_cache"] == str(work / "cache-valid")
        assert rj["max_steps"] == 8 and rj["lr"] == 3.0e-3 and rj["warmup_ratio"] == 0.04  # (DFlash2: provisional)
        assert rj["total_steps"] == steps
        assert rj["time_budget_s"] == (None if name == "dflash" else rec["budget_s"])
        assert ("time_budget" in doc) == (name == "dflash2")
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        logged, validated = schedule_steps(steps)
        assert [r["step"] for r in recs if "val_tau_decode" in r] == validated  # its own validation at every checkpoint
        trainer = json.loads((run / "summary.json").read_text())
        t = c["train"][name]
        assert t["steps"] == t["steps_timed"] == steps and not t["resumed"]
        assert t["wall_s"] == trainer["elapsed_s"] and t["train_s"] == pytest.approx(
            trainer["elapsed_s"] - t["compile_s"] - t["follow_waited_s"] - sum(r.get("val_s", 0) for r in recs))
        assert t["train_s_all"] == t["train_s"]
        assert t["step_ms"] == pytest.approx(1000 * t["train_s"] / steps)
        assert [r["step"] for r in recs] == logged  # logged windows (log_every 3, save_every 2)
        assert t["step_ms_median_window"] == statistics.median(r["step_ms"] for r in recs[1:])  # the first: warm-up
    assert c["train_time_ratio"] == pytest.approx(c["train"]["dflash2"]["train_s"] / c["train"]["dflash"]["train_s"])
    assert c["equal_training_time"] == (abs(c["train_time_ratio"] - 1) <= 0.10)
    last_val = [json.loads(x) for x in (runs["dflash2"] / "metrics.jsonl").read_text().splitlines()][-1]
    assert s["dflash2"]["train"]["val_tau_decode"] == last_val["val_tau_decode"]
    assert s["train"]["val_tau_decode"] != s["dflash2"]["train"]["val_tau_decode"] or s["train"]["val_loss"] != s[
        "dflash2"]["train"]["val_loss"]  # two drafters, two validations
    # the side-by-side figures are each drafter's eval report's
    for dtype in ("bfloat16", "float32"):
        reports = {n: json.loads((run / f"eval-{dtype}.json").read_text()) for n, run in runs.items()}
        assert reports["dflash"]["prompts"] == reports["dflash2"]["prompts"] == (5 if dtype == "bfloat16" else 3)
        assert reports["dflash2"]["draft_graph"] == reports["dflash"]["draft_graph"] == "off"  # a CPU: eager
        for n, ev in reports.items():
            side, ins, oos = c["eval"][dtype][n], ev["sets"]["in-source"], ev["sets"].get("out-of-source")
            assert side["tau_in_source"] == ins["dflash"]["tau"]
            assert side["speedup_in_source"] == ins["dflash"]["speedup"]
            assert side["identical"] == f"{ev['dflash']['outputs_identical']}/{ev['prompts']}"
            assert side["target_graph"] is False and "both models eager" in side["graphs"]
            if dtype == "bfloat16":  # n-gram lookup and MT-Bench in the first dtype's eval
                assert side["tau_over_ngram_in_source"] == ins["tau_over_ngram"] == pytest.approx(
                    ins["dflash"]["tau"] / ins["ngram"]["tau"])
                assert side["tau_out_of_source"] == oos["dflash"]["tau"] and oos["prompts"] == 2
                assert side["tau_over_ngram_out_of_source"] == oos["tau_over_ngram"] == pytest.approx(
                    oos["dflash"]["tau"] / oos["ngram"]["tau"])
                assert side["speedup_out_of_source"] == oos["dflash"]["speedup"]
        # the same prompts for both: the same sets and categories, the target's same outputs
        assert {k: g["prompts"] for k, g in reports["dflash"]["sets"].items()} == {
            k: g["prompts"] for k, g in reports["dflash2"]["sets"].items()}
        assert reports["dflash"]["target_tokens"] == reports["dflash2"]["target_tokens"]
    assert c["lossless_float32"] == {"dflash": True, "dflash2": True}  # greedy decoding is lossless in float32
    assert s["dflash2"]["eval"]["float32"]["identical"] == "3/3" and s["eval"]["float32"]["identical"] == "3/3"
    bf = c["eval"]["bfloat16"]
    for key, winner in c["wins"].items():
        a, b = bf["dflash"][key], bf["dflash2"][key]
        assert winner == ("tie" if a == b else "dflash2" if b > a else "dflash")
    assert set(c["wins"]) == {"tau_in_source", "tau_out_of_source", "speedup_in_source", "speedup_out_of_source"}
    # the stages ran in the plan's order, with their timings
    assert list(s["timings_s"])[-6:] == ["train", "eval bfloat16", "eval float32", "train dflash2",
                                         "eval bfloat16 dflash2", "eval float32 dflash2"]


def test_the_printed_table_and_the_stored_rerun(compared, capsys):
    from dflash.recipes.gpu import run_gpu_demo

    s, work = compared["summary"], compared["work"]
    files = {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in work.rglob("*") if f.is_file()}
    capsys.readouterr()
    stored = run_gpu_demo(str(work), preset=str(compared["preset"]), device="cpu", progress=False,
                          target=str(compared["target"]), compare="dflash2")
    out = capsys.readouterr().out
    assert stored == json.loads(json.dumps(s, default=str))
    assert "demo: already done" in out and "run-dflash2/eval-*.json" in out
    heads = [ln for ln in out.splitlines() if ln.endswith(".json:")]  # each drafter's reports, named
    assert heads == [f"{work / r}/eval-{dt}.json:" for r in ("run", "run-dflash2") for dt in ("bfloat16", "float32")]
    assert {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in work.rglob("*") if f.is_file()} == files
    bf = s["compare"]["eval"]["bfloat16"]
    row = next(ln for ln in out.splitlines() if ln.startswith("tau on MT-Bench (bfloat16)"))
    assert row.split()[-2:] == [f"{bf['dflash']['tau_out_of_source']:.2f}", f"{bf['dflash2']['tau_out_of_source']:.2f}"]
    row = next(ln for ln in out.splitlines() if ln.startswith("speed-up vs target alone, in source"))
    assert row.split()[-2:] == [f"{bf[n]['speedup_in_source']:.2f}x" for n in ("dflash", "dflash2")]
    rec, n2 = budget_steps(work / "run-dflash2")
    assert (f"dflash 8 steps (fewer than the recipe's 10: compare_max_steps); dflash2 {n2} steps, what its time budget "
            f"bought ({rec['budget_s']:.1f} s, dflash's training time, at {1000 * rec['step_s']:.1f} ms a step"
            + "".join(f"; revised at step {v['step']} at {1000 * v['step_s']:.1f} ms" for v in rec["revisions"])
            + ")") in out
    row = next(ln for ln in out.splitlines() if ln.startswith("time budget (--time-budget)"))
    assert row.split()[-3:] == ["-", f"{rec['budget_s']:.1f}", "s"]
    assert "dflash2's training time" in out and "dflash2: speed-ups with both models eager" in out


# the demo in a child process, its training steps slowed (0.2 s each) so that it can be killed between two of them
KILLABLE = slowed_steps(0.2) + """
from dflash.recipes.gpu import run_gpu_demo
run_gpu_demo(sys.argv[1], preset=sys.argv[2], device="cpu", progress=False, target=sys.argv[3], compare="dflash2")
"""


def test_a_run_killed_in_dflash2s_training_resumes_with_what_is_left(compared, tmp_path, capsys):
    """DFlash's stages done (the finished workdir less its DFlash2 run and summary), the demo is SIGKILLed after
    the DFlash2 run's first checkpoint: the rerun resumes that training from it, evaluates DFlash2, reuses DFlash's
    reports, and its summary has both and the killed run's time."""
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from dflash.recipes.gpu import run_gpu_demo
    from dflash.train.fit.run_dir import latest_checkpoint
    from tests.test_train import REPO, _env

    work = tmp_path / "w"
    shutil.copytree(compared["work"], work)
    shutil.rmtree(work / "run-dflash2")
    (work / "summary.json").unlink()
    dflash_reports = {p: p.read_bytes() for p in (work / "run").glob("eval-*.json")}
    run2 = work / "run-dflash2"
    p = subprocess.Popen([sys.executable, "-c", KILLABLE, str(work), str(compared["preset"]), str(compared["target"])],
                         cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    try:
        while latest_checkpoint(str(run2)) is None:
            assert p.poll() is None, f"the demo ended before it could be killed: {p.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, "the demo did not get there in time"
            time.sleep(0.005)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=30)
        p.stderr.close()
    assert p.returncode == -signal.SIGKILL and not (run2 / "final").exists()
    capsys.readouterr()
    again = run_gpu_demo(str(work), preset=str(compared["preset"]), device="cpu", progress=False,
                         target=str(compared["target"]), compare="dflash2")
    out = capsys.readouterr().out
    assert "run-dflash2/checkpoints/step_00000002 at step 2" in out  # resumed from its checkpoint
    assert {p: p.read_bytes() for p in (work / "run").glob("eval-*.json")} == dflash_reports  # reused
    assert "] train dflash2  (~" in out and "] eval float32 dflash2  (~" in out and "] eval float32  (~" not in out
    assert set(again["timings_s"]) >= {"train dflash2", "eval bfloat16 dflash2", "eval float32 dflash2"}
    assert "eval bfloat16" not in again["timings_s"]
    first = compared["summary"]["compare"]
    assert again["compare"]["eval"]["bfloat16"]["dflash"] == first["eval"]["bfloat16"]["dflash"]
    t = again["compare"]["train"]["dflash2"]
    rec, n2 = budget_steps(run2)  # killed before its decision: measured again after the resume, the same budget
    assert rec["probe_steps"] == [6, 7] and rec["budget_s"] == first["time_budget"]["budget_s"]
    assert t["steps"] == n2 and t["steps_timed"] == n2 - 2 and t["resumed"]  # the time of the steps this run made
    assert t["train_s_all"] == pytest.approx(t["step_ms"] * n2 / 1000)  # all its steps at this run's rate
    assert [r[0] for r in again["dflash2"]["train"]["val_curve"]] == schedule_steps(n2)[1]  # the killed run's kept
    assert again["compare"]["lossless_float32"]["dflash2"]
    assert len(again["all_runs"]) == len(compared["summary"]["all_runs"]) + 2  # the killed run counted, and this
    # the same workdir without --compare: its caches hold the last hidden state, one error before any stage
    from dflash.core.config import ConfigError

    with pytest.raises(ConfigError, match="--workdir .*cache/ was extracted with the target's last hidden state"):
        run_gpu_demo(str(work), preset=str(compared["preset"]), device="cpu", progress=False,
                     target=str(compared["target"]))


def test_with_follow_the_dflash_trainer_follows_the_extraction_for_the_comparisons_steps(tmp_path, capsys):
    """The shipped preset's path: DFlash's trainer a child process beside the extraction (compare_max_steps passed to
    it), its waits for shards taken out of its training time; DFlash2's trained after it, in this process."""
    from dflash.recipes.gpu import run_gpu_demo
    from tests.tiny import make_tiny_target

    preset = tmp_path / "tiny.yaml"
    preset.write_text(COMPARE_RECIPE.replace("recipe:\n", "recipe:\n  follow: true\n"))
    work = tmp_path / "w"
    s = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False,
                     target=str(make_tiny_target(tmp_path / "target")), compare="dflash2")
    out = capsys.readouterr().out
    assert "[train] train: drafter" in out and out.index("] extract  (~") < out.index("] train dflash2  (~")
    assert s["follow"]["trainer_wall_s"] > 0
    trainer = json.loads((work / "run" / "summary.json").read_text())
    t = s["compare"]["train"]
    assert trainer["steps"] == t["dflash"]["steps"] == 8  # compare_max_steps
    rec, n2 = budget_steps(work / "run-dflash2")
    assert t["dflash2"]["steps"] == n2 and rec["budget_s"] == round(t["dflash"]["train_s"], 3)  # waits left out
    assert t["dflash"]["follow_waited_s"] == trainer["follow"]["waited_s"]  # the child followed the extraction
    assert t["dflash2"]["follow_waited_s"] == 0
    assert "follow" not in json.loads((work / "run-dflash2" / "summary.json").read_text())  # alone, after
    assert s["compare"]["lossless_float32"] == {"dflash": True, "dflash2": True}


def test_compare_is_the_gpu_recipes_and_checked(tmp_path):
    from dflash.core.config import ConfigError
    from dflash.recipes.demo import DemoConfig
    from dflash.recipes.run_demo import run_demo
    from dflash.recipes.gpu import gpu_stage_plan
    from dflash.recipes.gpu_config import GpuRecipe, load_recipe

    with pytest.raises(ConfigError, match="--compare"):
        run_demo(DemoConfig(recipe="cpu", compare="dflash2", workdir=str(tmp_path / "w")))
    assert not (tmp_path / "w").exists()
    with pytest.raises(Exception, match="compare"):
        GpuRecipe(compare="medusa")
    with pytest.raises(Exception, match="compare.max.steps"):
        GpuRecipe(compare_max_steps=-1)
    # the plan: DFlash's stages, then the compared drafter's, with their estimated shares; the shipped comparison
    # trains DFlash compare_max_steps (5,000 of the recipe's 7,500) and DFlash2 for DFlash's training time (5,000 x
    # 53 ms) at 2.8x the step (1,786 steps: validations at 1,500 and at the end, 16 s x 0.9), plus its 41 s first call
    assert load_recipe("demo-gpu").compare_max_steps == 5000
    plain, both = gpu_stage_plan("demo-gpu"), gpu_stage_plan("demo-gpu", {}, "dflash2")
    assert list(both.seconds)[len(plain.seconds):] == ["train dflash2", "eval bfloat16 dflash2", "eval float32 dflash2"]
    assert both.seconds["train"] == pytest.approx(plain.seconds["train"] * 5000 / 7500)
    assert both.seconds["train dflash2"] == pytest.approx(41 + 5000 * 0.053 + 2 * 16 * 0.9)
    assert both.seconds["extract"] == pytest.approx(plain.seconds["extract"] * 1.2)
    given = gpu_stage_plan("demo-gpu", {"max_steps": 7500}, "dflash2")  # steps given: they win
    assert given.seconds["train"] == pytest.approx(plain.seconds["train"])
    assert given.seconds["train dflash2"] == pytest.approx(41 + 7500 * 0.053 + 2 * 16 * 0.9)
    # the shipped comparison fits one H200 machine's 30 minutes with its start and the model's upload (~18 by the
    # estimates; 7,500 steps would be ~23)
    assert sum(both.seconds.values()) < 20 * 60 < sum(given.seconds.values())


def test_the_verdict_says_how_much_slower_and_which_models_ran_as_graphs(compared):
    """As on a GPU where DFlash2's static step failed its check: the target and DFlash's drafter in CUDA graphs,
    DFlash2's drafter eager, its step 1.6x."""
    import copy

    from dflash.recipes.compare import format_compare

    c = copy.deepcopy(compared["summary"]["compare"])
    c.update(train_time_ratio=1.62, equal_training_time=False, step_time_ratio=1.6)
    for n, graph in (("dflash", "graph"), ("dflash2", "eager")):
        c["eval"]["bfloat16"][n].update(target_graph=True, draft_graph=graph)
    out = format_compare(c)
    row = next(ln for ln in out.splitlines() if ln.startswith("CUDA graphs"))
    assert row.split()[-4:] == ["target", "+", "drafter", "target"]  # dflash: both; dflash2: the target only
    assert "dflash2's training time 1.62x dflash's: not equal (within 10%); its step 60% slower" in out
    # a summary written before equal training time (same steps, no budget, no train_s_all) still reads
    for t in c["train"].values():
        del t["train_s_all"], t["time_budget"]
    c["time_budget"] = None
    out = format_compare(c)
    assert "both drafters 8 steps (fewer than the recipe's 10: compare_max_steps)" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("training time"))
    assert row.split()[-2:] == [f"{c['train']['dflash2']['train_s']:.1f}", "s"]
