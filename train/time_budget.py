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
  * the record: RUN/run.json's "time_budget" (the budget, the step time, the probe's steps, the total) and its
    config.total_steps, written by rank 0 when decided and carried over by check_run_dir. A resumed run, or one that
    starts over from step 0 after the decision, takes the recorded total and never measures again; a run stopped
    before the decision measures again. A resume with another --time-budget decides again from the recorded step
    time (no new probe), as a resume with another --max-steps stretches the schedule; one without --time-budget
    trains the steps --max-steps / --epochs give;
  * the learning-rate schedule lr_at(step, total) follows the decided total from the next step on.

SECONDS is a number of seconds, or one with s, m or h (train/config.py parse_duration: `90m`, `2h`), as a flag or in
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

from .run_dir import run_marker

# steps of a process before its probe: the first compiled call (step 1), the CUDA graphs' recording and first replay
WARMUP_STEPS = 3
RECORD_KEY = "time_budget"  # in RUN/run.json


def read_record(out: str) -> dict[str, Any] | None:
    """The decision recorded in RUN/run.json, or None (none yet, no readable run.json, or a record not whole)."""
    rec = (run_marker(out) or {}).get(RECORD_KEY)

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf

    probe = rec.get("probe_steps") if isinstance(rec, dict) else None
    ok = (isinstance(rec, dict) and number(rec.get("budget_s")) and number(rec.get("step_s"))
          and isinstance(rec.get("total_steps"), int) and number(rec["total_steps"])
          and isinstance(probe, list) and len(probe) == 2 and all(isinstance(k, int) for k in probe))
    return rec if ok else None  # a damaged record is no decision: the run measures again


def write_record(out: str, rec: dict[str, Any]) -> None:
    """RUN/run.json with the decision and its config.total_steps (rank 0)."""
    path = os.path.join(out, "run.json")
    with open(path) as f:
        doc = json.load(f)
    doc[RECORD_KEY] = rec
    doc.setdefault("config", {})["total_steps"] = rec["total_steps"]
    atomic_json(path, doc)


def steps_for(budget_s: float, step_s: float, done: int) -> int:
    """The total that fills budget_s at step_s a step, never fewer than the steps already done (nor than 1)."""
    return max(done, 1, math.floor(budget_s / step_s))


def describe(rec: dict[str, Any]) -> str:
    first, last = rec["probe_steps"]
    return (f"--time-budget {rec['budget_s']:g} s: {1000 * rec['step_s']:.1f} ms a step over steps {first}-{last} "
            f"-> {rec['total_steps']:,} steps")


class TimeBudget:
    """The decision of one run (module docstring): `record` once decided (or recorded), else None while the probe
    runs. The Trainer calls resume (after check_run_dir), start (before its loop) and after_step (after each step)."""

    def __init__(self, budget_s: float, probe: int, out: str, is_main: bool):
        self.budget_s, self.probe, self.out, self.is_main = budget_s, probe, out, is_main
        self.record: dict[str, Any] | None = None
        self.start_step: int | None = None  # the probe's first step (its clock starts after the step before)
        self.t0 = self.excluded0 = 0.0

    @property
    def pending(self) -> bool:
        return self.record is None

    def resume(self, provisional: int) -> int:
        """The total this process starts with: the recorded decision's (decided again from its step time when the
        budget changed), else the provisional total (the caller raises it to the probe's end: start)."""
        rec = read_record(self.out)
        if rec is None:
            return provisional
        if rec["budget_s"] != self.budget_s:  # another budget: the recorded step time, no new probe
            was = rec["budget_s"]
            rec = dict(rec, budget_s=self.budget_s, total_steps=steps_for(self.budget_s, rec["step_s"], 0))
            print0(f"train: note: {self.out} decided {was:g} s before; {describe(rec)} from its recorded step time")
        else:
            print0(f"train: {describe(rec)} (decided before, {self.out}/run.json)")
        if self.is_main:  # (check_run_dir wrote the provisional total into run.json's config)
            write_record(self.out, rec)
        self.record = rec
        return rec["total_steps"]

    def start(self, step: int, total: int) -> int:
        """Before the loop, at `step`: the total to train with (a pending decision's provisional one, raised so that
        the probe ends before it)."""
        if self.record is not None:
            return max(total, step)
        self.start_step = step + WARMUP_STEPS + 1
        return max(total, self.start_step + self.probe - 1)

    def after_step(self, step: int, now: Callable[[], float], excluded: float,
                   slowest: Callable[[float], float]) -> int | None:
        """After optimizer step `step`: starts the probe's clock, or ends it and returns the decided total (None
        otherwise). now(): the device-synced clock; excluded: seconds so far that are not training time; slowest(x):
        the max of x over the ranks."""
        if self.record is not None or self.start_step is None:
            return None
        if step == self.start_step - 1:
            self.t0, self.excluded0 = now(), excluded
        elif step == self.start_step + self.probe - 1:
            step_s = slowest(max(now() - self.t0 - (excluded - self.excluded0), 1e-9) / self.probe)
            self.record = {"budget_s": self.budget_s, "step_s": step_s, "probe_steps": [self.start_step, step],
                           "total_steps": steps_for(self.budget_s, step_s, step),
                           "decided_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            print0(f"train: {describe(self.record)}")
            if self.is_main:
                write_record(self.out, self.record)
            return self.record["total_steps"]
        return None
