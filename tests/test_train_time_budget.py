"""`dflash train --time-budget` (train/fit/time_budget.py) on CPU, on the real cache and CLI of tests/test_train.py:

    the steps are decided from the step time measured over the probe (steps slowed by a known sleep): total =
        max(steps done, floor(budget / step time)), recorded in run.json and summary.json, one line printed, the
        training time near the budget; a validation inside the probe is not step time; the learning rate follows the
        provisional total up to the decision and the total in effect after it; a budget spent within the probe ends
        the run at the decision (logged, saved, final/)
    revisions: steps 3x slower during the probe than after it: the revisions at half and nine tenths of the total
        bring the training time to the budget (the decision alone: ~0.7 of it), each recorded and printed
    resume: a run killed before the decision measures again after its checkpoint; one killed after it keeps the
        recorded decision without a new probe, and replays a recorded revision at its step (the learning rate of
        every step as the uninterrupted run's)
    torchrun: two ranks decide one total (the slowest rank's step time)
    errors: a budget <= 0 or not a time, and --time-budget beside --max-steps / --epochs: one `error:` line each
"""

from __future__ import annotations

import json
import math
import subprocess
import time

import pytest

from dflash.train.fit.config import parse_duration
from dflash.train.fit.time_budget import REVISE_AT, TimeBudget, latest_span, latest_step_s, read_record, total_at
from dflash.train.fit.trainer import TrainConfig, lr_at
from tests.test_train import PY, REPO, _env, assert_clean_error, base, cli, env, kill_when, latest_step  # noqa: F401
from tests.test_train import logged_steps, metrics, ok, read_json


def slow_steps(monkeypatch, seconds: float, after: tuple[int, float] | None = None) -> None:
    """Every micro-step of an in-process run slowed by `seconds` (tests/workload.py slowed_steps, in this process);
    after = (step, s): by s instead from that optimizer step on."""
    import dflash.train.fit.trainer as t

    scores = t.Trainer.anchor_scores

    def slow(self, *a):
        time.sleep(after[1] if after is not None and self.step >= after[0] else seconds)
        return scores(self, *a)

    monkeypatch.setattr(t.Trainer, "anchor_scores", slow)


def follows_the_totals(run, rec: dict, provisional: int, cfg: TrainConfig) -> None:
    """Each logged step's learning rate is the schedule's with the total in effect before it: the provisional one up
    to the decision, then the decision's and each revision's (total_at)."""
    decided_at = rec["probe_steps"][1]
    for r in metrics(run):  # the record of step s is written after the update that used lr_at(s - 1)
        k = r["step"] - 1
        want = lr_at(k, provisional if k < decided_at else total_at(rec, k), cfg)
        assert r["lr"] == pytest.approx(want, rel=1e-12), r["step"]


def revised_as_due(rec: dict, probe: int) -> None:
    """Each revision at the first step past its share of the total before it, at least `probe` timed steps after the
    step time's start (the decision, or the revision before)."""
    total, since = rec["decided_steps"], rec["probe_steps"][1]
    for frac, r in zip(REVISE_AT, rec["revisions"]):
        assert r["step"] == max(math.ceil(frac * total), since + probe), (r, total, since)
        assert r["total_steps"] >= r["step"]
        total, since = r["total_steps"], r["step"]


def test_the_steps_are_decided_from_the_measured_step_time_and_the_schedule_follows(env, tmp_path, monkeypatch):
    from dflash.recipes.compare import train_time

    slow_steps(monkeypatch, 0.04)
    run, budget, lr, warm = tmp_path / "run", 1.6, 3e-3, 0.2
    out = ok(*base(env, run, "--time-budget", budget, "--time-budget-probe", 5, "--log-every", 1, "--save-every", 100,
                   "--lr", lr, "--warmup-ratio", warm))
    rec = read_json(run / "run.json")["time_budget"]
    assert rec["budget_s"] == budget and rec["probe_steps"] == [4, 8]  # after 3 warm-up steps, 5 timed
    assert 0.04 <= rec["step_s"] < 0.04 + 0.5
    decided = rec["decided_steps"]
    assert decided == max(8, math.floor(budget / rec["step_s"])) and decided > 8
    line = f"train: --time-budget 1.6 s: {1000 * rec['step_s']:.1f} ms a step over steps 4-8 -> {decided:,} steps"
    assert line in out
    # steady steps: revised at half and nine tenths of the total, each by a few steps at most
    assert len(rec["revisions"]) == 2
    revised_as_due(rec, 5)
    for r in rec["revisions"]:
        assert 0.04 <= r["step_s"] < 0.04 + 0.5 and 0 < r["spent_s"] < budget
        assert f"revised at step {r['step']}: {r['spent_s']:.1f} s spent" in out
    total = rec["total_steps"]
    assert total == rec["revisions"][-1]["total_steps"] and abs(total - decided) <= 0.3 * decided
    assert read_json(run / "run.json")["config"]["total_steps"] == total
    s = read_json(run / "summary.json")
    assert s["steps"] == s["steps_this_run"] == total and s["time_budget"] == rec
    assert [r["step"] for r in metrics(run)] == list(range(1, total + 1))
    assert 0.5 * budget < train_time(str(run))["train_s"] < 2 * budget  # the time it was given, roughly
    # the schedule: the provisional total (1 epoch) up to the decision after step 8, the totals in effect after it
    provisional = max(math.ceil(env["rows"] / 2), 8)
    cfg = TrainConfig(cache="c", target="t", out="o", lr=lr, warmup_ratio=warm)
    follows_the_totals(run, rec, provisional, cfg)
    assert any(lr_at(k, provisional, cfg) != lr_at(k, total, cfg) for k in range(8, total))  # two schedules

    # another budget for the finished run: decided again from the last recorded step time (no probe), trained on
    out = ok(*base(env, run, "--time-budget", 2 * budget, "--time-budget-probe", 5, "--log-every", 1, "--save-every",
                   100, "--lr", lr, "--warmup-ratio", warm))
    again = read_json(run / "run.json")["time_budget"]
    redecided = math.floor(2 * budget / latest_step_s(rec))
    assert again["budget_s"] == 2 * budget and again["decided_steps"] == redecided
    first, last = latest_span(rec)  # the steps of that step time: the last revision's, not the probe's
    assert again["step_s"] == latest_step_s(rec) and again["probe_steps"] == [first, last]
    assert "decided 1.6 s before; --time-budget 3.2 s:" in out and f"ms a step over steps {first}-{last}" in out
    assert all(r["step"] > total for r in again["revisions"])  # this process's own revisions
    s = read_json(run / "summary.json")
    assert s["steps"] == again["total_steps"] > total and s["steps_this_run"] == again["total_steps"] - total


def test_revisions_bring_the_training_time_to_the_budget_when_the_step_time_changes(env, tmp_path, monkeypatch):
    """Steps slowed by 0.1 s up to the probe's end (step 8), by 0.03 s after it: the decision alone (~18 steps) would
    train for ~0.7 of the budget; the revisions (more steps) bring it within 20%."""
    from dflash.recipes.compare import train_time

    slow_steps(monkeypatch, 0.1, after=(8, 0.03))
    run, budget = tmp_path / "run", 2.0
    ok(*base(env, run, "--time-budget", budget, "--time-budget-probe", 5, "--log-every", 1, "--save-every", 100))
    rec = read_json(run / "run.json")["time_budget"]
    assert rec["step_s"] >= 0.1 and len(rec["revisions"]) == 2
    revised_as_due(rec, 5)
    first = rec["revisions"][0]
    assert 0.03 <= first["step_s"] < 0.08  # the steps after the probe, not the probe's
    # more steps than decided; how many more depends on the machine's own step time beside the slowdowns (1.6x
    # at 0.03 s of its own, 1.4x at 0.05 s on a loaded machine), so the budget met below is the measure
    assert rec["total_steps"] > rec["decided_steps"]
    t = train_time(str(run))
    assert t["steps"] == rec["total_steps"] and abs(t["train_s"] / budget - 1) < 0.2, (t, rec)
    provisional = max(math.ceil(env["rows"] / 2), 8)
    follows_the_totals(run, rec, provisional, TrainConfig(cache="c", target="t", out="o"))


def test_validations_within_the_probe_are_not_step_time(env, tmp_path, monkeypatch):
    """A checkpoint (and its validation, slowed to 1 s) at step 5, inside the probe (steps 4-8): the step time the
    run decides on leaves it out (with it, ~0.2 s more a step)."""
    import dflash.train.fit.validate as validate

    slow_steps(monkeypatch, 0.02)
    called = validate.Validator.__call__

    def slow_validation(self, model):
        time.sleep(1.0)
        return called(self, model)

    monkeypatch.setattr(validate.Validator, "__call__", slow_validation)
    run = tmp_path / "run"
    ok(*base(env, run, "--time-budget", 0.5, "--time-budget-probe", 5, "--save-every", 5, "--log-every", 5,
             "--val-cache", env["cache"], "--val-rows", 2, "--val-max-new-tokens", 4))
    rec = read_json(run / "run.json")["time_budget"]
    assert rec["probe_steps"] == [4, 8] and 0.02 <= rec["step_s"] < 0.02 + 0.15
    assert [r["step"] for r in metrics(run) if "val_loss" in r][0] == 5  # it did validate inside the probe


def test_a_budget_spent_within_the_probe_ends_the_run_at_the_decision(env, tmp_path, monkeypatch):
    slow_steps(monkeypatch, 0.03)
    run = tmp_path / "run"
    ok(*base(env, run, "--time-budget", "0.05s", "--time-budget-probe", 3, "--log-every", 4, "--save-every", 100))
    rec = read_json(run / "run.json")["time_budget"]
    assert rec["probe_steps"] == [4, 6] and rec["total_steps"] == 6  # floor(0.05 / ~0.03) = 1 < the 6 done
    s = read_json(run / "summary.json")
    assert s["steps"] == 6 and (run / "final" / "model.safetensors").exists()
    assert [r["step"] for r in metrics(run)] == [4, 6]  # the last step logged, and checkpointed
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000006"


def test_a_resume_keeps_the_decided_total_and_one_before_the_decision_measures_again(env, tmp_path):
    """Steps slowed to ~0.1 s (tests/test_train.py THROTTLED) in the killed runs; the last rerun is unthrottled, ~10x
    faster: measuring again would choose ~10x the steps."""
    args = ["--time-budget", 2.5, "--time-budget-probe", 4, "--save-every", 3, "--log-every", 1, "--lr", 3e-3]
    run = tmp_path / "run"
    # 1. killed after its step-3 checkpoint, before the decision (after step 7): nothing recorded
    kill_when(base(env, run, *args), run, lambda r: latest_step(r) >= 3 and max(logged_steps(r), default=0) <= 6)
    assert read_record(str(run)) is None
    resume_at = latest_step(run)
    assert resume_at in (3, 6)
    # 2. the rerun measures again from where it resumed, and is killed right after deciding
    kill_when(base(env, run, *args), run, lambda r: read_record(str(r)) is not None)
    rec = read_record(str(run))
    assert rec["probe_steps"] == [resume_at + 4, resume_at + 7] and rec["step_s"] >= 0.1
    assert rec["total_steps"] == rec["decided_steps"] == max(resume_at + 7, math.floor(2.5 / rec["step_s"]))
    # 3. the same command, unthrottled: the recorded decision, no probe; where a revision falls due after its own
    #    warm-up and 4 timed steps, it revises the total from its own steps (~10x faster: more steps fill the budget)
    restart = latest_step(run)
    out = ok(*base(env, run, *args))
    said = [ln for ln in out.splitlines() if "--time-budget 2.5 s:" in ln and "revised" not in ln]
    assert len(said) == 1 and "(decided before" in said[0], out
    again = read_record(str(run))
    assert {k: again[k] for k in ("budget_s", "step_s", "probe_steps", "decided_steps")} == \
        {k: rec[k] for k in ("budget_s", "step_s", "probe_steps", "decided_steps")}
    assert all(r["step"] >= restart + 3 + 4 for r in again["revisions"])
    assert again["total_steps"] == (again["revisions"][-1]["total_steps"] if again["revisions"] else rec["total_steps"])
    assert not again["revisions"] or again["total_steps"] > rec["total_steps"]
    s = read_json(run / "summary.json")
    assert s["steps"] == again["total_steps"] and s["time_budget"] == again
    assert logged_steps(run) == list(range(1, again["total_steps"] + 1))  # no duplicates, no gaps
    # a rerun of the finished run changes nothing
    before = (run / "summary.json").read_bytes()
    assert "nothing to do" in ok(*base(env, run, *args))
    assert (run / "summary.json").read_bytes() == before


def test_a_resumed_process_replays_the_recorded_revisions_then_makes_the_rest(tmp_path):
    """TimeBudget on a clock of its own (0.1 s a step up to step 7, then 0.05 s): the killed process decides after
    its probe (steps 4-7), revises at half its total and is killed; the resumed one, from a checkpoint before that
    revision, has the decision's total there, takes the revision's at its step (not measured again), then makes the
    revision at nine tenths itself from its own steps and the time before it."""
    from dflash.train.fit.time_budget import TimeBudget

    (tmp_path / "run.json").write_text(json.dumps({"dflash": "train", "config": {}}))
    out = str(tmp_path)
    clock = {"t": 0.0}

    def run(tb: TimeBudget, first: int, last: int) -> dict[int, int]:
        changes = {}
        for step in range(first + 1, last + 1):
            clock["t"] += 0.1 if step <= 7 else 0.05
            got = tb.after_step(step, lambda: clock["t"], lambda x: x)
            if got is not None:
                changes[step] = got
        return changes

    a = TimeBudget(2.0, 4, out, True)
    assert a.resume(100) == 100 and a.start(0, 100) == 100
    changes = run(a, 0, 14)
    rec = read_record(out)
    assert rec["probe_steps"] == [4, 7] and rec["step_s"] == pytest.approx(0.1)
    assert changes[7] == rec["decided_steps"] == 20  # floor(2.0 / 0.1)
    (r,) = rec["revisions"]  # due at ceil(0.5 * 20) = 10, and 4 steps after the decision: 11
    assert r["step"] == 11 and r["step_s"] == pytest.approx(0.05) and r["spent_s"] == pytest.approx(0.9)
    assert changes[11] == r["total_steps"] == 11 + math.floor((2.0 - 0.9) / 0.05) == 33 == rec["total_steps"]
    # killed after step 14; resumed from the checkpoint of step 9 (before the revision)
    clock["t"] = 0.0
    b = TimeBudget(2.0, 4, out, True)
    assert b.resume(100) == 33 and b.total_at(9, 33) == 20  # the decision's total at step 9
    assert b.start(9, 20) == 20 and b.before_s == pytest.approx(9 * 0.05)
    changes = run(b, 9, 40)
    assert changes[11] == 33  # replayed, as the killed run had it
    second = read_record(out)["revisions"][1]  # due at ceil(0.9 * 33) = 30; its step time from step 12 (9 + 3) on
    assert second["step"] == 30 and second["step_s"] == pytest.approx(0.05)
    assert second["spent_s"] == pytest.approx(9 * 0.05 + 21 * 0.05)
    assert changes[30] == second["total_steps"] == 30 + math.floor((2.0 - 1.5) / 0.05) == 40
    assert set(changes) == {11, 30} and len(read_record(out)["revisions"]) == 2  # no third revision


def test_a_damaged_record_is_no_decision(tmp_path):
    good = {"budget_s": 60.0, "step_s": 0.15, "probe_steps": [4, 53], "total_steps": 400}
    for rec, whole in ((good, True), (dict(good, step_s=0), False), (dict(good, total_steps="400"), False),
                       (dict(good, probe_steps=[4]), False), ({k: v for k, v in good.items() if k != "budget_s"}, False),
                       ("400 steps", False)):
        (tmp_path / "run.json").write_text(json.dumps({"dflash": "train", "config": {}, "time_budget": rec}))
        assert (read_record(str(tmp_path)) == rec) == whole and (read_record(str(tmp_path)) is None) != whole
    revision = {"step": 200, "spent_s": 30.0, "step_s": 0.14, "total_steps": 420}
    for revisions, whole in (([revision], True), ([revision, dict(revision, step=380)], True), ("none", False),
                             ([dict(revision, spent_s=None)], False), ([revision, revision], False),
                             ([dict(revision, step=380), revision], False), ([dict(revision, total_steps=0)], False)):
        rec = dict(good, decided_steps=400, revisions=revisions)
        (tmp_path / "run.json").write_text(json.dumps({"dflash": "train", "config": {}, "time_budget": rec}))
        assert (read_record(str(tmp_path)) == rec) == whole, revisions
    (tmp_path / "run.json").write_text('{"dflash": "train", "conf')  # cut short
    assert read_record(str(tmp_path)) is None


def test_ranks_under_torchrun_decide_one_total(env, tmp_path):
    run = tmp_path / "run"
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dflash",
                        *map(str, base(env, run, "--time-budget", 0.6, "--time-budget-probe", 3, "--log-every", 1,
                                       "--save-every", 100))],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    rec = read_json(run / "run.json")["time_budget"]
    said = [ln for ln in p.stdout.splitlines() if ln.startswith("train: --time-budget 0.6 s:")]
    assert len([ln for ln in said if "revised" not in ln]) == 1  # rank 0's lines only
    assert len(said) == 1 + len(rec["revisions"])
    assert rec["decided_steps"] == max(6, math.floor(0.6 / rec["step_s"]))
    revised_as_due(rec, 3)  # every rank revised at the same steps (each revision is a collective: else a hang)
    assert read_json(run / "summary.json")["steps"] == rec["total_steps"]  # both ranks stopped there (else a hang)
    assert [r["step"] for r in metrics(run)] == list(range(1, rec["total_steps"] + 1))


def test_bad_budgets_are_refused_naming_the_flag(env, tmp_path):
    assert [parse_duration(x) for x in ("300", "300s", "90m", "1.5h", "2h", " 45 ")] == [300, 300, 5400, 5400, 7200, 45]
    assert parse_duration(None) is None
    out = tmp_path / "r"
    for bad in ("0", "-5", "0m", "soon", "5d", "nan"):
        code, _, err = cli(*base(env, out, "--time-budget", bad))
        assert_clean_error(code, err, "--time-budget", repr(bad))
    for other in (("--max-steps", 5), ("--epochs", 1)):
        code, _, err = cli(*base(env, out, "--time-budget", 60, *other))
        assert_clean_error(code, err, "--time-budget", other[0])
    code, _, err = cli(*base(env, out, "--time-budget", 60, "--time-budget-probe", 0))
    assert_clean_error(code, err, "--time-budget-probe", "got 0")
    preset = tmp_path / "p.yaml"
    for bad in ("-1", "'10 min'"):
        preset.write_text(f"train:\n  time_budget_s: {bad}\n")
        code, _, err = cli(*base(env, out, "--config", preset))
        assert_clean_error(code, err, "--time-budget", f"got {'-1' if bad == '-1' else repr('10 min')}",
                           f"set by --config {preset}")
    assert not out.exists()  # nothing was created for a refused run
    with pytest.raises(Exception, match="--time-budget"):
        TrainConfig(cache="c", target="t", out="o", time_budget_s=0.0)
    assert TrainConfig(cache="c", target="t", out="o", time_budget_s="90m").time_budget_s == 5400.0  # a preset's too
    assert parse_duration("1e3") == parse_duration(1000) == 1000.0


@pytest.mark.parametrize("recorded_span", [True, False])
def test_a_redecision_names_the_steps_its_step_time_was_measured_over(tmp_path, capsys, recorded_span):
    """Before: after a revision, a resume with another budget said "200.0 ms a step over steps 4-8", the revision's
    step time under the probe's steps. A revision recorded before revisions kept their steps: the steps since the
    probe (or the revision) before it."""
    run = tmp_path / "run"
    run.mkdir()
    revision = {"step": 100, "spent_s": 40.0, "step_s": 0.2, "total_steps": 400, **({"steps": [9, 100]}
                                                                                   if recorded_span else {})}
    rec = {"budget_s": 100.0, "step_s": 0.5, "probe_steps": [4, 8], "total_steps": 400, "decided_steps": 200,
           "revisions": [revision]}
    (run / "run.json").write_text(json.dumps({"dflash": "train", "config": {}, "time_budget": rec}))
    assert TimeBudget(200.0, 5, str(run), True).resume(10) == 1000
    out = capsys.readouterr().out
    assert "decided 100 s before; --time-budget 200 s: 200.0 ms a step over steps 9-100 -> 1,000 steps" in out, out
    assert read_record(str(run))["probe_steps"] == [9, 100]
