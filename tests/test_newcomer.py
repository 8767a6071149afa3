"""What a newcomer meets in the first minutes, minus the demo's own run time (the demo end to end is in test_surfaces):

  * progress bars give an honest ETA from the start: the rate behind it is timed after a warm-up (EtaRate), so slow
    first units do not make it hours; regenerate's bar counts the generated tokens against their estimated total
    (tests/test_progress.py);
  * every demo stage prints its place and expected share of the demo, scaled by the work asked for;
  * a rerun of a finished demo prints the stored tables in seconds and changes no file; other settings rerun it;
  * the caches the demo's stages would write under HOME (datasets, matplotlib) go under the workdir;
  * train's last line names its rate (the last window and its steps) and the drafter's path as this command names
    it, also when a finished run's summary is replayed; the demo summary names the run mean and the last window;
  * the demo's last lines name its outputs as --workdir names them (the drafter, the eval report, the plot, the
    summary), each a path that exists; the plot's legend names the prompts its tau is over, and each set's tau;
  * the CPU demo's duration is one figure in the code, README, BENCHMARKS, its first line and --help.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash.cli import main as cli_main
from dflash.core.progress import Bar, EtaRate
from dflash.recipes.cpu import cpu_paths, cpu_settings, cpu_stage_plan, first_line
from dflash.recipes.demo import CPU_STAGE_SECONDS, DemoConfig, cpu_demo_time
from dflash.recipes.stages import StagePlan, stored_result, train_rates
from dflash.recipes.run_demo import demo_outputs, format_outputs
from dflash.recipes.summary import format_cpu_summary
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ the ETA


def test_the_eta_is_timed_after_the_warm_up():
    # a stage of 100 units: the first takes 60 s (a compile, a first prefill), the others 1 s each: 159 s in all
    r = EtaRate(warmup=1)
    r.observe(0, 0.0)
    assert r.eta(0, 100, 30.0) is None  # nothing timed yet: no ETA rather than a wrong one
    r.observe(1, 60.0)
    assert r.eta(1, 100, 60.5) is None  # the warm-up just ended: no unit after it yet
    r.observe(11, 70.0)
    assert r.eta(11, 100, 70.0) == pytest.approx(89.0)  # 89 units left at 1/s: the truth
    # tqdm's own rate (units since the start over the time since the start) would have said 11/70 units/s here:
    assert (100 - 11) / (11 / 70.0) > 5 * 89
    resumed = EtaRate(warmup=3, initial=40)  # a resumed bar: the warm-up counts from where it starts
    for n, t in ((40, 0.0), (41, 50.0), (43, 52.0), (53, 62.0)):
        resumed.observe(n, t)
    assert resumed.rate(53, 62.0) == pytest.approx(1.0) and resumed.eta(53, 100, 62.0) == pytest.approx(47.0)
    with pytest.raises(ValueError):
        EtaRate(warmup=-1)


def test_the_bar_shows_no_eta_during_the_warm_up_then_the_timed_one():
    now = [1000.0]
    out = io.StringIO()
    bar = Bar(total=100, file=out, mininterval=0, warmup=1, unit="step")
    bar._time = lambda: now[0]
    bar.start_t = bar.last_print_t = now[0]
    now[0] += 60.0
    bar.update(1)
    assert "<?," in str(bar)  # the first unit took 60 s: no ETA yet (tqdm's own would say 1:39:00)
    now[0] += 10.0
    bar.update(10)
    assert "<01:29," in str(bar) and "1.00step/s" in str(bar)  # 89 left at the timed 1 step/s
    bar.close()
    # warmup 0 (extraction on a CPU: a few large batches, no kernels to build): timed from the start
    now[0] = 0.0
    bar = Bar(total=4, file=out, mininterval=0, warmup=0, unit="batch")
    assert bar.eta_rate.mark is not None and bar.eta_rate.mark[0] == 0  # timed from its creation
    bar._time = lambda: now[0]
    bar.eta_rate.mark = (0, 0.0)  # the same mark, on this test's clock
    bar.start_t = bar.last_print_t = 0.0
    now[0] = 30.0
    bar.update(3)
    assert "<00:10," in str(bar)  # 1 batch left at 10 s a batch, from the first update on
    bar.close()


# ------------------------------------------------------------------------------------------------ regenerate's bar


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("newcomer") / "target")


def test_regenerate_bar_counts_the_generated_tokens_and_ends_at_their_number(tiny_target, tmp_path, capsys):
    from dflash.extract.generation.regenerate import RegenerateConfig, run_regenerate

    target = tiny_target
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(6, seed=2, turns=(1, 2)))
    s = run_regenerate(RegenerateConfig(target=target, data=data, out=str(tmp_path / "out"), max_new_tokens=6,
                                        batch_size=4, device="cpu", progress=True))
    turns = s["counts"]["turns"]
    err = capsys.readouterr().err.replace("\r", "\n")
    last = [ln for ln in err.splitlines() if ln.startswith("regenerate (generated tokens") and "|" in ln][-1]
    done, total = map(float, re.search(r"\| ([\d.]+)/([\d.]+) \[", last).groups())
    # the tokens generated; the estimated total ends at their number
    assert done == total == s["counts"]["generated_tokens"] <= turns * 6, last
    assert f"{s['counts']['conversations']}/6 conv" in last and "real tok/s" in last and "budget slots/s" in last


# ------------------------------------------------------------------------------------------------ demo stages


def test_each_cpu_stage_has_its_share_of_the_demo():
    plan = cpu_stage_plan(DemoConfig().cpu())
    assert list(plan.seconds) == ["prepare target", "regenerate", "extract", "train", "eval"]
    assert plan.seconds == pytest.approx(CPU_STAGE_SECONDS)  # the defaults: as measured
    assert sum(plan.share(n) for n in plan.seconds) == pytest.approx(1.0)
    assert plan.line("extract") == "demo: [3/5] extract  (~9% of the demo)"
    assert plan.line("train") == "demo: [4/5] train  (~42% of the demo)"
    # more steps: training's share grows; the dataset's own replies: no regenerate stage
    longer = cpu_stage_plan(DemoConfig(train_steps=640).cpu())
    assert longer.seconds["train"] == pytest.approx(4 * CPU_STAGE_SECONDS["train"])
    assert longer.share("train") > plan.share("train")
    no_mt_bench = cpu_stage_plan(DemoConfig(out_of_source_prompts=0).cpu())  # 16 prompts to evaluate of 20
    assert no_mt_bench.seconds["eval"] == pytest.approx(CPU_STAGE_SECONDS["eval"] * 16 / 20)
    original = cpu_stage_plan(DemoConfig(responses="original").cpu())
    assert "regenerate" not in original.seconds and original.line("eval").startswith("demo: [4/4] eval ")
    assert StagePlan({"a": 0.0, "b": 0.0}).share("a") == 0.5


# ------------------------------------------------------------------------------------------------ a finished demo


@pytest.fixture(scope="module")
def eval_report(tmp_path_factory):
    """A real eval report (run_eval on a tiny target and an untrained tiny drafter)."""
    from dflash.train.drafter.checkpoint import save_drafter
    from dflash.train.evaluate.eval import EvalConfig, run_eval
    from dflash.train.drafter.model import DFlashDrafter, DrafterConfig
    from dflash.core.target import load_causal_lm

    root = tmp_path_factory.mktemp("report")
    target = make_tiny_target(str(root / "target"), arch="qwen3", num_layers=4, hidden=64)
    model = load_causal_lm(target, dtype=torch.float32)
    cfg = DrafterConfig.from_target(model.config, num_layers=1, layer_ids=[1, 2], block_size=4,
                                    mask_token_id=model.config.vocab_size - 1)
    save_drafter(DFlashDrafter(cfg), str(root / "drafter"), dtype=torch.float32)
    data = write_jsonl(str(root / "p.jsonl"), chat_rows(3, seed=4))
    return run_eval(EvalConfig(target=target, drafter=str(root / "drafter"), data=data, max_new_tokens=8,
                               device="cpu", progress=False, warmup_prompts=0))


def _finished_workdir(work: Path, report: dict, cfg: DemoConfig) -> dict[str, str]:
    """A workdir as a finished CPU demo leaves it: its eval report, its summary (and the other folders' files)."""
    paths = cpu_paths(str(work), cfg.responses)
    for d in ("target", "regenerated", "cache", "run"):
        os.makedirs(paths[d], exist_ok=True)
        Path(paths[d], "marker").write_text(d)
    Path(paths["eval"]).write_text(json.dumps(report))
    hist = [{"step": 20, "step_ms": 100.0, "ctx_tokens_per_s": 100.0, "loss": 5.0, "tau_expected": 1.1},
            {"step": 40, "step_ms": 50.0, "ctx_tokens_per_s": 200.0, "loss": 4.0, "tau_expected": 1.2}]
    summary = {"config": {**cfg.__dict__}, "settings": cpu_settings(cfg), "finished_at": "2026-12-01 10:00",
               "tokens_extracted": 1234, "cache_bytes": 5_000_000, "cache_bytes_per_token": 4051.0,
               "extract_tokens_per_s": 400.0, **train_rates(hist), "final_loss": 4.0, "train_expected_tau": 1.2,
               "tau_dflash": report["dflash"]["tau"], "tau_ngram": report["ngram"]["tau"],
               "speedup_dflash": report["dflash"]["speedup"], "speedup_ngram": report["ngram"]["speedup"],
               "lossless": f"{report['dflash']['outputs_identical']}/{report['prompts']}",
               "eval_prompts": report["prompts"], "timings_s": {"prepare target": 19.0, "eval": 100.0}, "plot": None}
    Path(paths["summary"]).write_text(json.dumps(summary, indent=2))
    return paths


def _tree(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_rerun_of_a_finished_demo_prints_the_stored_result_and_changes_nothing(tmp_path, eval_report):
    from dflash.train.evaluate.eval import format_report

    work = tmp_path / "demo"
    paths = _finished_workdir(work, eval_report, DemoConfig(recipe="cpu").cpu())
    before = _tree(work)
    t = time.perf_counter()
    r = CliRunner().invoke(cli_main, ["demo", "--recipe", "cpu", "--workdir", str(work)], catch_exceptions=False)
    took = time.perf_counter() - t
    assert r.exit_code == 0, r.output
    assert _tree(work) == before  # not a byte, not an mtime
    assert took < 10, took  # seconds: nothing ran
    assert (f"demo: already done: the stored result of 2026-12-01 10:00 ({paths['summary']}); delete that file to "
            f"measure again, or delete {work} to start over") in r.output
    assert format_report(eval_report) in r.output and "tau: dflash drafter" in r.output
    assert "[1/5]" not in r.output and not any(ln.startswith(("regenerate:", "extract:", "train:", "eval:"))
                                               for ln in r.output.splitlines())  # no stage ran
    # the result of other settings is not this one; a summary without its settings (an older demo) neither
    assert stored_result(paths["summary"], cpu_settings(DemoConfig(recipe="cpu", train_steps=7).cpu()), "settings",
                         [paths["eval"]]) is None
    assert stored_result(paths["summary"], cpu_settings(DemoConfig(recipe="cpu").cpu()), "settings",
                         [str(work / "missing.json")]) is None
    s = json.loads(Path(paths["summary"]).read_text())
    del s["settings"]
    Path(paths["summary"]).write_text(json.dumps(s))
    assert stored_result(paths["summary"], cpu_settings(DemoConfig(recipe="cpu").cpu()), "settings",
                         [paths["eval"]]) is None


def test_the_demo_summary_names_the_run_mean_and_the_last_window():
    # windows of 20 steps: 100 ctx tok/s in the first (the warm-up), then 400 (20 x 50 ms) and 200 (20 x 100 ms)
    hist = [{"step": 20, "step_ms": 500.0, "ctx_tokens_per_s": 100.0},
            {"step": 40, "step_ms": 50.0, "ctx_tokens_per_s": 400.0},
            {"step": 60, "step_ms": 100.0, "ctx_tokens_per_s": 200.0}]
    r = train_rates(hist)
    # the run mean is tokens over time after the first window: (400 x 1 s + 200 x 2 s) / 3 s, not (400 + 200) / 2
    assert r["train_tokens_per_s"] == pytest.approx(800 / 3)
    assert r["train_tokens_per_s_steps"] == [21, 60] and r["train_last_window_steps"] == [41, 60]
    assert r["train_tokens_per_s_last_window"] == 200.0
    s = {"config": {"responses": "regenerate"}, "tokens_extracted": 1, "cache_bytes": 1, "cache_bytes_per_token": 1,
         "extract_tokens_per_s": 1.0, **r, "final_loss": 1.0, "tau_dflash": 1.0, "tau_ngram": 1.0,
         "speedup_dflash": 1.0, "speedup_ngram": 1.0, "lossless": "1/1", "timings_s": {}}
    assert "training                      267 ctx tok/s (run mean, steps 21-60; last window, steps 41-60: 200)" \
        in format_cpu_summary(s)
    one = train_rates(hist[:1])  # a single window: it is the mean and the last
    assert one["train_tokens_per_s"] == 100.0 and one["train_tokens_per_s_steps"] == [1, 20]
    assert "(run mean, steps 1-20)" in format_cpu_summary({**s, **one})


# ------------------------------------------------------------------------------------------------ files under HOME


def test_the_demo_caches_go_under_the_workdir_not_home(tmp_path):
    """In a fresh process with HOME an empty folder: a dataset loaded within caches_under writes nothing under HOME,
    its cache is under WORKDIR/caches, and so are matplotlib's config and cache (where eval's plot would write its
    font list); the environment and datasets' config are restored after."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    data = write_jsonl(str(tmp_path / "chats.jsonl"), chat_rows(4, seed=1))
    code = f"""
import datasets.config, os
from dflash.core.chat import load_chat_dataset
from dflash.recipes.stages import caches_under
before = datasets.config.HF_DATASETS_CACHE
with caches_under({str(work)!r}) as tok:
    assert len(load_chat_dataset({data!r})) == 4
    import matplotlib
    print(tok, matplotlib.get_configdir(), matplotlib.get_cachedir())
assert datasets.config.HF_DATASETS_CACHE == before and "MPLCONFIGDIR" not in os.environ
"""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME",
                                                             "XDG_CONFIG_HOME", "MPLCONFIGDIR")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    mpl = str(work / "caches" / "matplotlib")
    assert p.stdout.split() == [str(work / "caches" / "tokenized"), mpl, mpl]
    assert [str(x) for x in home.rglob("*")] == []
    assert any((work / "caches" / "datasets").rglob("*.arrow"))


# ------------------------------------------------------------------------------------------------ train's last line


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory, tiny_target):
    from dflash.extract.run import ExtractConfig, run_extract

    root = tmp_path_factory.mktemp("newcomer-train")
    target = tiny_target
    data = write_jsonl(root / "chat.jsonl", chat_rows(12, seed=3))
    run_extract(ExtractConfig(target=target, data=data, out=str(root / "cache"), seq_len=128, rows_per_shard=8,
                              device="cpu", progress=False, tokenize_cache="off"))
    return root, target


def test_trains_last_line_names_its_window_and_the_drafter_as_this_command_names_it(tiny_cache, tmp_path,
                                                                                       monkeypatch):
    root, target = tiny_cache
    monkeypatch.chdir(tmp_path)
    args = ["train", "--cache", str(root / "cache"), "--target", str(target), "--drafter-layers", "1",
            "--block-size", "4", "--num-anchors", "8", "--batch-rows", "2", "--max-steps", "6", "--log-every", "2",
            "--save-every", "6", "--no-progress", "--device", "cpu"]
    first = CliRunner().invoke(cli_main, args + ["--out", "run"], catch_exceptions=False)
    assert first.exit_code == 0, first.output
    line = [ln for ln in first.output.splitlines() if ln.startswith("train: step 6:")][-1]
    assert "ctx tok/s (last window, steps 5-6)" in line and line.endswith("drafter -> run/final")
    # the rerun finds the run finished and replays its summary: the drafter's path is the one this command gives
    again = CliRunner().invoke(cli_main, args + ["--out", str(tmp_path / "run")], catch_exceptions=False)
    assert again.exit_code == 0 and "nothing to do" in again.output, again.output
    line = [ln for ln in again.output.splitlines() if ln.startswith("train: step 6:")][-1]
    assert line.endswith(f"drafter -> {tmp_path / 'run' / 'final'}") and "(last window, steps 5-6)" in line


def test_the_cpu_demo_duration_is_one_measured_figure_stated_alike_everywhere():
    """Before: README said 7 min 37 s, the first line about 8 min, --help 6-9 minutes, a comment 8 min 15 s."""
    figure = cpu_demo_time()
    assert figure == "7 min 32 s" and cpu_demo_time({"a": 59.6}) == "1 min 0 s"
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in CPU_STAGE_SECONDS.items())
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"{figure} on an idle 2-core machine (2026-12-02: {stages};" in readme
    assert f"`demo: [3/5] extract ({cpu_stage_plan(DemoConfig().cpu()).line('extract').split('(')[1]}`" in readme
    line = first_line(cpu_stage_plan(DemoConfig().cpu()))
    assert f"{figure} on an idle 2-core CPU as measured" in line
    help_text = " ".join(CliRunner().invoke(cli_main, ["demo", "--help"]).output.split())
    assert f"The CPU recipe took {figure} on an idle 2-core CPU" in help_text
    assert not re.search(r"\d+-\d+ minutes|about \d+ min on an idle", help_text + line)
    # BENCHMARKS' CPU demo row states the same figure (before: 7 min 37 s there, 7 min 32 s in README)
    bench = " ".join((REPO / "BENCHMARKS.md").read_text().split())
    row = next(ln for ln in (REPO / "BENCHMARKS.md").read_text().splitlines() if "| the CPU demo (" in ln)
    assert f"{figure} on an idle 2-core machine" in row and f"`CPU_STAGE_SECONDS`" in bench, row
    assert set(re.findall(r"\d+ min \d+ s", row)) == {figure}, row


def test_the_demos_last_lines_name_its_outputs_and_each_exists(tmp_path, eval_report, monkeypatch):
    """Before: the demo ended on its summary table; README said the drafter was in run/final (it is in
    run-regenerate/final). Its last lines now name the drafter, the eval report, the plot and the summary, as
    --workdir names them, also when a rerun prints the stored result."""
    monkeypatch.chdir(tmp_path)
    cfg = DemoConfig(recipe="cpu", workdir="work/demo").cpu()
    paths = _finished_workdir(tmp_path / "work" / "demo", eval_report, DemoConfig(recipe="cpu").cpu())
    os.makedirs(os.path.join(paths["run"], "final"))
    Path(paths["plot"]).write_bytes(b"\x89PNG\r\n\x1a\n")
    r = CliRunner().invoke(cli_main, ["demo", "--recipe", "cpu", "--workdir", cfg.workdir], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    last = r.output.rstrip().splitlines()[-4:]
    named = [ln.split()[-1] for ln in last]
    assert [ln.split()[1] for ln in last] == ["drafter", "eval", "plot", "summary"], last
    assert named == ["work/demo/run-regenerate/final", "work/demo/eval-regenerate.json",
                     "work/demo/acceptance-regenerate.png", "work/demo/summary-regenerate.json"], last
    assert all(ln.startswith("demo: ") for ln in last) and all(os.path.exists(p) for p in named)
    assert "\n".join(last) in (REPO / "README.md").read_text()  # README shows them as printed
    # a file that is not there is not named
    os.remove(paths["plot"])
    assert [w for w, _ in demo_outputs("work/demo", "cpu")] == ["drafter", "eval report", "summary"]
    assert format_outputs([]) == ""


def test_the_demos_last_lines_for_the_gpu_recipe_name_each_run(tmp_path):
    work = tmp_path / "demo-gpu"
    for rel in ("run/final/config.json", "run/eval-bfloat16.json", "run/eval-float32.json", "run/acceptance-bfloat16.png",
                "run-dflash2/final/config.json", "run-dflash2/eval-bfloat16.json", "summary.json"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text("x")
    got = demo_outputs(str(work), "gpu")
    assert [(w, os.path.relpath(p, work)) for w, p in got] == [
        ("drafter", "run/final"), ("eval report", "run/eval-bfloat16.json"), ("eval report", "run/eval-float32.json"),
        ("plot", "run/acceptance-bfloat16.png"), ("drafter (dflash2)", "run-dflash2/final"),
        ("eval report (dflash2)", "run-dflash2/eval-bfloat16.json"), ("summary", "summary.json")]
    assert format_outputs(got).splitlines()[0] == f"demo: {'drafter':<21}  {work / 'run' / 'final'}"


def test_the_plots_legend_names_the_prompts_its_tau_is_over(eval_report, tmp_path):
    """Before: the CPU demo's plot said "dflash (tau 1.45)", over all 20 prompts, where the summary and README quote
    1.64, the 16 held-out chitchat prompts'. The legend now names the prompts and gives each set's tau."""
    from dflash.train.evaluate.eval import acceptance_label, plot_acceptance

    d = eval_report["dflash"]
    assert acceptance_label(d) == f"dflash: tau {d['tau']:.2f} over all {eval_report['prompts']} prompts"
    sets = {"in-source": {"prompts": 16, "dflash": {"tau": 1.64}, "ngram": {"tau": 1.14}},
            "out-of-source": {"prompts": 4, "dflash": {"tau": 1.12}, "ngram": {"tau": 1.10}}}
    r = {"name": "dflash", "tau": 1.45, "prompts": 20}
    assert acceptance_label(r, sets) == "dflash: tau 1.45 over all 20 prompts; in-source (16) 1.64, out-of-source (4) 1.12"
    plot_acceptance(str(tmp_path / "a.png"), [eval_report["dflash"], eval_report["ngram"]], 4, sets)
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------------------ the documents


def _links(md: Path) -> list[tuple[str, str]]:
    """(target file, anchor) of each relative markdown link in md, the file resolved against md's folder."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        out.append((str((md.parent / path).resolve()) if path else str(md.resolve()), anchor))
    return out


def _anchors(md: Path) -> set[str]:
    """GitHub's anchors of md's headings: lower case, punctuation but - and _ dropped, spaces as -."""
    heads = re.findall(r"^#+ (.+)$", md.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_is_a_guide_with_the_two_commands_first_and_the_reference_in_docs():
    """Before: 283 lines, no command on the first screen, the reference (flags, recipe, guarantees, cache format)
    inline. Now the two commands within the first 25 lines, README within ~150, every docs/ page linked from it, and
    every relative link in README, BENCHMARKS and docs/ names a file (and heading) that exists."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 155, len(lines)
    first = "\n".join(lines[:25])
    assert "make demo" in first and "make test" in first
    assert "**τ** (tau)" in first  # the headline figure is defined before it is used
    readme = "\n".join(lines)
    assert "**zlab**" in readme
    pages = sorted((REPO / "docs").glob("*.md"))
    linked = {t for t, _ in _links(REPO / "README.md")}
    assert pages and all(str(p.resolve()) in linked for p in pages), [p.name for p in pages]
    for md in [REPO / "README.md", REPO / "BENCHMARKS.md", *pages]:
        for target, anchor in _links(md):
            assert os.path.exists(target), (md.name, target)
            if anchor and target.endswith(".md"):
                assert anchor in _anchors(Path(target)), (md.name, target, anchor)
