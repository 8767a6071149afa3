"""`dflash train --time-budget SECONDS` (TrainConfig.time_budget_s): the run's number of optimizer steps chosen so
that its training steps take about SECONDS of training time.

Training time is what dflash/recipes/compare.py's train_time counts: the loop's wall time less the first compiled
call, the validations and the --follow waits for shards. With those left out, a run of N steps trains for about
N x (the steady step time), so SECONDS / (the steady step time) steps fill the budget.

How (TimeBudget, driven by the Trainer):
  * provisional total: the run starts with the total --max-steps or the epochs give (1 epoch when neither is set),
    raised to reach the probe's end; it shapes only the learning rate of the steps before the decision;
  * the probe: after the first WARMUP_STEPS steps of the process (the first compiled call, the CUDA graphs' recording
    and first replay: the steps after which the trainer also forbids recompiles), the next `time_budget_probe` steps
    (50 by default; fewer than ~20 measure noise) are timed on the device's clock (one sync at each end), less the
    validations and --follow waits among them: the steady step time;
  * the decision: total_steps = max(steps done, floor(SECONDS / step time)). It is not capped at the provisional
    total: the budget is what was asked for, and a preset's max_steps would otherwise cut it short without a word
    (`dflash demo --compare dflash2` gives DFlash2 whatever number of steps DFlash's training time buys). Under
    torchrun every rank takes the slowest rank's step time (one all-reduce of the max), so all decide one total;
  * the record: RUN/run.json's "time_budget" (the budget, the step time, the probe's steps, the decided total, the
    revisions and the total in effect) and its config.total_steps, written by rank 0 when decided or revised and
    carried over by check_run_dir. A resumed run, or one that starts over from step 0 after the decision, keeps the
    recorded decision and never probes again (it replays the revisions: below); a run stopped before the decision
    measures again. A resume with another --time-budget decides again from the last recorded step time (no new
    probe, the revisions dropped; the record then names the steps that step time was measured over), as a resume with another --max-steps stretches the schedule; one without
    --time-budget trains the steps --max-steps / --epochs give;
  * the revisions: a step time measured once, early, can be off for the whole run (DFlash2 on the H200: 172.5 ms over
    steps 4-53, then 163 ms a step by step 100 and 145 ms by step 1,000: the budget's steps trained in 0.87 of it).
    So when the run reaches half of its total, and again at nine tenths (REVISE_AT), it decides again: the training
    time spent so far (this process's, plus the steps before it at the last recorded step time), the step time since
    the last decision, and total = max(steps done, done + floor(time left / step time)). Each revision is recorded
    (run.json's "revisions": its step, the time spent, the step time and the steps it was measured over, the
    total) and printed. A resumed process
    replays the recorded revisions at their steps, so its learning rate is the one the killed run had, and makes
    the ones not yet recorded itself (after its own WARMUP_STEPS and at least `time_budget_probe` timed steps);
  * the learning-rate schedule lr_at(step, total) follows the total in effect (the decision's, then each
    revision's) from the next step on.

SECONDS is a number of seconds, or one with s, m or h (train/fit/config.py parse_duration: `90m`, `2h`), as a flag or in
a preset (time_budget_s). The CLI refuses --time-budget beside a --max-steps or --epochs flag (each would claim to
set the steps); a preset's max_steps / epochs stay the provisional total.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable

from dflash.core.dist import atomic_json, print0

from dflash.train.fit.run_dir import run_marker

# steps of a process before its probe: the first compiled call (step 1), the CUDA graphs' recording and first replay
WARMUP_STEPS = 3
REVISE_AT = (0.5, 0.9)  # fractions of the total in effect at which the decision is revised (module docstring)
RECORD_KEY = "time_budget"  # in RUN/run.json


def read_record(out: str) -> dict[str, Any] | None:
    """The decision recorded in RUN/run.json, or None (none yet, no readable run.json, or a record not whole)."""
    rec = (run_marker(out) or {}).get(RECORD_KEY)

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x > 0

    probe = rec.get("probe_steps") if isinstance(rec, dict) else None
    ok = (isinstance(rec, dict) and number(rec.get("budget_s")) and number(rec.get("step_s"))
          and count(rec.get("total_steps")) and count(rec.get("decided_steps", rec.get("total_steps")))
          and isinstance(probe, list) and len(probe) == 2 and all(isinstance(k, int) for k in probe))
    revisions = rec.get("revisions", []) if ok else None
    ok = ok and isinstance(revisions, list) and all(
        isinstance(r, dict) and count(r.get("step")) and count(r.get("total_steps")) and number(r.get("step_s"))
        and number(r.get("spent_s")) for r in revisions)
    ok = ok and [r["step"] for r in revisions] == sorted({r["step"] for r in revisions})  # increasing, no repeat
    return rec if ok else None  # a damaged record is no decision: the run measures again


def write_record(out: str, rec: dict[str, Any]) -> None:
    """RUN/run.json with the decision and its config.total_steps (rank 0)."""
    path = os.path.join(out, "run.json")
    with open(path) as f:
        doc = json.load(f)
    doc[RECORD_KEY] = rec
    doc.setdefault("config", {})["total_steps"] = rec["total_steps"]
    atomic_json(path, doc)


def steps_in(seconds: float, step_s: float) -> int:
    """The whole steps of step_s that fit in seconds (0 when none; a quotient a rounding short of a whole number
    counts as that number: (2.0 - 0.9) / 0.05 is 21.999999999999996 in floating point)."""
    return max(0, math.floor(seconds / step_s + 1e-9))


def steps_for(budget_s: float, step_s: float, done: int) -> int:
    """The total that fills budget_s at step_s a step, never fewer than the steps already done (nor than 1)."""
    return max(done, 1, steps_in(budget_s, step_s))


def describe(rec: dict[str, Any]) -> str:
    first, last = rec["probe_steps"]
    revised = "".join(f"; revised at step {r['step']:,} ({1000 * r['step_s']:.1f} ms a step, {r['spent_s']:.1f} s "
                      f"spent) -> {r['total_steps']:,}" for r in rec.get("revisions", []))
    return (f"--time-budget {rec['budget_s']:g} s: {1000 * rec['step_s']:.1f} ms a step over steps {first}-{last} "
            f"-> {rec.get('decided_steps', rec['total_steps']):,} steps{revised}")


def latest_step_s(rec: dict[str, Any]) -> float:
    """The last step time the record measured: its last revision's, else the probe's."""
    revisions = rec.get("revisions") or []
    return revisions[-1]["step_s"] if revisions else rec["step_s"]


def latest_span(rec: dict[str, Any]) -> list[int]:
    """The steps [first, last] the last recorded step time (latest_step_s) was measured over: its last revision's
    ("steps"; for a revision recorded without them, the steps since the revision or probe before it), else the
    probe's."""
    revisions = rec.get("revisions") or []
    if not revisions:
        return list(rec["probe_steps"])
    last = revisions[-1]
    steps = last.get("steps")
    if isinstance(steps, list) and len(steps) == 2 and all(isinstance(k, int) for k in steps):
        return list(steps)
    before = revisions[-2]["step"] if len(revisions) > 1 else rec["probe_steps"][1]
    return [before + 1, last["step"]]


def total_at(rec: dict[str, Any], step: int) -> int:
    """The total in effect after optimizer step `step`: the last revision made at or before it, else the decision's
    (also before the probe's end: a run that starts over after the decision takes it from step 0)."""
    total = rec.get("decided_steps", rec["total_steps"])
    for r in rec.get("revisions", []):
        if r["step"] <= step:
            total = r["total_steps"]
    return total


class TimeBudget:
    """The decision of one run (module docstring): `record` once decided (or recorded), else None while the probe
    runs. The Trainer calls resume (after check_run_dir), total_at (when it restores a checkpoint), start (before
    its loop) and after_step (after each step)."""

    def __init__(self, budget_s: float, probe: int, out: str, is_main: bool):
        self.budget_s, self.probe, self.out, self.is_main = budget_s, probe, out, is_main
        self.record: dict[str, Any] | None = None
        self.start_step: int | None = None  # the probe's first step (its clock starts after the step before)
        self.t0 = 0.0
        self.first_step = 0  # the step this process's loop began at
        self.before_s = 0.0  # the training time of the steps before first_step (estimated: module docstring)
        self.mark: tuple[int, float] | None = None  # (step, this process's training time): the next step time's start

    @property
    def pending(self) -> bool:
        return self.record is None

    def resume(self, provisional: int) -> int:
        """The total this process starts with: the recorded decision's latest total (decided again from its last
        step time when the budget changed), else the provisional total (the caller raises it to the probe's end:
        start)."""
        rec = read_record(self.out)
        if rec is None:
            return provisional
        if rec["budget_s"] != self.budget_s:  # another budget: the last recorded step time, no new probe
            was, total = rec["budget_s"], steps_for(self.budget_s, latest_step_s(rec), 0)
            rec = dict(rec, budget_s=self.budget_s, step_s=latest_step_s(rec), probe_steps=latest_span(rec),
                       total_steps=total, decided_steps=total, revisions=[])  # the span that step time is of
            print0(f"train: note: {self.out} decided {was:g} s before; {describe(rec)} from its recorded step time")
        else:
            print0(f"train: {describe(rec)} (decided before, {self.out}/run.json)")
        if self.is_main:  # (check_run_dir wrote the provisional total into run.json's config)
            write_record(self.out, rec)
        self.record = rec
        return rec["total_steps"]

    def total_at(self, step: int, total: int) -> int:
        """The total in effect after `step` (a restored checkpoint's): the record's (total_at), else `total`."""
        return total if self.record is None else max(step, total_at(self.record, step))

    def start(self, step: int, total: int) -> int:
        """Before the loop, at `step`: the total to train with (the record's in effect at `step`; a pending
        decision's provisional one, raised so that the probe ends before it)."""
        self.first_step = step
        if self.record is not None:
            self.before_s = step * latest_step_s(self.record)
            return self.total_at(step, total)
        self.start_step = step + WARMUP_STEPS + 1
        return max(total, self.start_step + self.probe - 1)

    def after_step(self, step: int, trained: Callable[[], float], slowest: Callable[[float], float]) -> int | None:
        """After optimizer step `step`: the probe's clock, the decision, a recorded revision replayed or a revision
        due made. Returns the total from the next step on when it changes (None otherwise). trained(): this
        process's training time so far on the device-synced clock (less its first compiled call, validations and
        --follow waits); slowest(x): the max of x over the ranks (every rank calls it at the same steps)."""
        if self.record is None:
            if self.start_step is None:
                return None
            if step == self.start_step - 1:
                self.t0 = trained()
            elif step == self.start_step + self.probe - 1:
                t = trained()
                step_s = slowest(max(t - self.t0, 1e-9) / self.probe)
                total = steps_for(self.budget_s, step_s, step)
                self.record = {"budget_s": self.budget_s, "step_s": step_s, "probe_steps": [self.start_step, step],
                               "total_steps": total, "decided_steps": total, "revisions": [],
                               "decided_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                self.before_s = self.first_step * step_s
                self.mark = (step, t)
                print0(f"train: {describe(self.record)}")
                if self.is_main:
                    write_record(self.out, self.record)
                return total
            return None
        if self.mark is None and step == self.first_step + WARMUP_STEPS:  # a resumed process: after its warm-up
            self.mark = (step, trained())
        revisions = self.record.setdefault("revisions", [])
        recorded = next((r for r in revisions if r["step"] == step), None)
        if recorded is not None:  # replayed: the learning rate the run had
            return recorded["total_steps"]
        if len(revisions) == len(REVISE_AT) or (revisions and step < revisions[-1]["step"]) or self.mark is None:
            return None
        due = step >= math.ceil(REVISE_AT[len(revisions)] * self.record["total_steps"])
        if not due or step - self.mark[0] < self.probe:
            return None
        t, (since, t_since) = trained(), self.mark
        step_s = slowest(max(t - t_since, 1e-9) / (step - since))
        spent = slowest(self.before_s + t)
        total = step + steps_in(self.budget_s - spent, step_s)
        revisions.append({"step": step, "spent_s": round(spent, 3), "step_s": step_s, "total_steps": total,
                          "steps": [since + 1, step]})
        self.record["total_steps"] = total
        self.mark = (step, t)
        print0(f"train: --time-budget {self.budget_s:g} s: revised at step {step:,}: {spent:.1f} s spent, "
               f"{1000 * step_s:.1f} ms a step over steps {since + 1:,}-{step:,} -> {total:,} steps")
        if self.is_main:
            write_record(self.out, self.record)
        return total
