"""The GPU recipe's comparison (`dflash demo --compare dflash2`): a second drafter architecture trained from the
same cache as the DFlash drafter for the same training time, evaluated by the same eval, side by side.

Equal training time: the DFlash drafter trains its steps (the preset's compare_max_steps, else its train max_steps);
the second drafter then trains with `dflash train --time-budget` = DFlash's training time (equal_time_budget) and the
preset's schedule otherwise, so it gets the steps that time buys (train/fit/time_budget.py decides them from its step
time). What the comparison adds to WORKDIR/summary.json, under "compare" (compare_summary), and to the printed
summary (a table, format_compare):

  * arch, steps (DFlash's; and whether they are fewer than the preset's train max_steps: compare_max_steps),
    same_steps, and time_budget: the second drafter's decision (its budget, step time and steps) from its trainer's
    summary;
  * train: per drafter, its training time from its trainer's RUN/summary.json (train_time): the loop's wall time,
    less the first compiled call (the compile), the validations and, for the trainer that followed the
    extraction, its waits for shards; that per step; train_s_all, the training time of all its steps (train_s, or
    for a resumed run, whose earlier processes' time its summary lacks, its step time x its steps); and the median
    logged window's step time (the steady step: windows exclude validation, and the median is not moved by the
    first window's compile nor by the windows that shared the GPU with the extraction). train_time_ratio (the second
    drafter's train_s_all over DFlash's), equal_training_time (within EQUAL_TIME_TOLERANCE) and step_time_ratio (of
    the median windows: "DFlash2's step is x% slower");
  * eval: per eval dtype and drafter, the figures of its eval report: tau in source and out of source (MT-Bench),
    tau over n-gram lookup's on each, the speed-up over the target alone on each, identical outputs, and eval's
    own note of which models ran as CUDA graphs (a drafter whose static step failed its check drafts eagerly);
  * lossless_float32 per drafter, and `wins`: which drafter has the higher tau in source, on MT-Bench and the
    higher speed-up (bf16), whichever it is.

The stage plan's estimates for the comparison (dflash/recipes/gpu.py) use the figures below, stated here and
nowhere else.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

from dflash.recipes.stages import read_dict

# The stage plan's figures (the time shares printed as each stage starts), on one H200 at the recipe's shape:
# a DFlash2 training step against a DFlash one, measured 2026-12-04: 2.80x (147.3 against 52.6 ms, the median
# windows of the comparison's metrics.jsonl; 2.96x at steps 400-450 the day before). Its loss reads the target's
# logits beside the drafter's (a second vocabulary-wide matmul and softmax per slot) and its layers add two block
# convolutions; the recipe's small drafter spends more of its step on the vocabulary than the Qwen3-8B shape's (1.3x
# there: 662.6 against ~510 ms, BENCHMARKS.md). With equal training time it sets how many steps DFlash2 gets (hence
# its validations), not how long it trains.
DFLASH2_TRAIN_FACTOR = 2.80
# DFlash2's first compiled call (41 s in the comparison of 2026-12-04; DFlash's 42 s), and DFlash's step (~53 ms)
# and one validation of the recipe's held-out cache (~16-18 s with 4 layers) (BENCHMARKS.md, "GPU recipe")
DFLASH2_FIRST_CALL_S = 41.0
DFLASH_STEP_S = 0.053
VALIDATION_S = 16.0
# its evals against DFlash's, which run first in the process and pay the target's compile: 52 against 59 s (bf16),
# 28 against 31 s (float32), 2026-12-04; its validations are counted at this factor too
DFLASH2_EVAL_FACTOR = 0.9
# an extraction with --last-hidden against one without: the fp8 cache of 5 context layers writes a sixth layer's
# bytes (+20%) and the target runs its last layers too
LAST_HIDDEN_EXTRACT_FACTOR = 1.2
# the training times are "equal" within this fraction of DFlash's
EQUAL_TIME_TOLERANCE = 0.10


def compare_run(workdir: str, arch: str) -> str:
    """The run directory of the compared drafter: WORKDIR/run-ARCH (the DFlash drafter's is WORKDIR/run)."""
    return os.path.join(workdir, f"run-{arch}")


def train_time(run: str) -> dict[str, Any]:
    """The training time of the run in RUN, from its trainer's summary.json (the last process that trained it) and
    RUN/metrics.jsonl (module docstring). steps_timed: the steps that process made (all of them unless resumed)."""
    from dflash.train.fit.run_dir import read_metrics

    s = read_dict(os.path.join(run, "summary.json")) or {}
    elapsed = s.get("elapsed_s")
    steps_timed = s.get("steps_this_run")
    compile_s = float((s.get("first_compiled_call") or {}).get("seconds") or 0.0)
    waited = float((s.get("follow") or {}).get("waited_s") or 0.0)
    validation_s = float(sum(h.get("val_s", 0.0) for h in s.get("history") or []))
    train_s = elapsed - compile_s - waited - validation_s if elapsed is not None else None
    windows = [h["step_ms"] for h in (read_metrics(run) or [])[1:] if "step_ms" in h]
    step_ms = 1000 * train_s / steps_timed if train_s is not None and steps_timed else None
    steps = s.get("steps")
    resumed = steps_timed != steps
    return {"steps": steps, "steps_timed": steps_timed, "resumed": resumed,
            "wall_s": elapsed, "compile_s": compile_s, "validation_s": validation_s, "follow_waited_s": waited,
            "train_s": train_s, "step_ms": step_ms,
            "train_s_all": (step_ms * steps / 1000 if step_ms is not None and steps else None) if resumed else train_s,
            "step_ms_median_window": statistics.median(windows) if windows else None,
            "time_budget": s.get("time_budget")}


def equal_time_budget(run: str) -> float:
    """The --time-budget of the compared drafter: the training time of the DFlash run in RUN (train_time's
    train_s_all), to the millisecond (a rerun gives its trainer the same budget, and so the recorded decision)."""
    t = train_time(run)["train_s_all"]
    if t is None or not t > 0:
        from dflash.core.config import ConfigError

        raise ConfigError(f"{run}/summary.json holds no training time of the DFlash drafter, which the compared "
                          "drafter's --time-budget is: rerun the demo, or delete that run to train it again")
    return round(t, 3)


def dflash2_train_seconds(dflash_steps: int, save_every: int | None, validation: bool) -> float:
    """The stage plan's estimate of the compared drafter's training: DFlash's training time for dflash_steps (its
    time budget), its first compiled call, and its validations (one per save_every of the steps that time buys at
    DFLASH2_TRAIN_FACTOR x DFlash's step, and one at the end)."""
    budget = dflash_steps * DFLASH_STEP_S
    steps = budget / (DFLASH_STEP_S * DFLASH2_TRAIN_FACTOR)
    validations = math.ceil(steps / save_every) if validation and save_every else 0
    return DFLASH2_FIRST_CALL_S + budget + validations * VALIDATION_S * DFLASH2_EVAL_FACTOR


def graphs_note(ev: dict[str, Any]) -> str:
    """Eval's own line saying which models ran as CUDA graphs ("speed-ups with target and drafter in CUDA graphs")."""
    from dflash.train.evaluate.eval import format_report

    return next(ln for ln in format_report(ev).splitlines() if ln.startswith("speed-ups with"))


def eval_side(ev: dict[str, Any]) -> dict[str, Any]:
    """One drafter's figures of one eval report: in source (all prompts when the report has no sets) and out of
    source (MT-Bench), each tau, tau over n-gram lookup's and speed-up; identical outputs; the CUDA-graph note."""
    sets = ev.get("sets") or {}
    everything = {"dflash": ev["dflash"], "tau_over_ngram": ev.get("tau_gain_over_ngram")}
    out = {}
    for key, g in (("in_source", sets.get("in-source") or everything), ("out_of_source", sets.get("out-of-source"))):
        if g is None:
            continue
        out[f"tau_{key}"] = g["dflash"]["tau"]
        out[f"tau_over_ngram_{key}"] = g.get("tau_over_ngram")  # None without n-gram lookup (a later dtype's eval)
        out[f"speedup_{key}"] = g["dflash"]["speedup"]
    return out | {"identical": f"{ev['dflash']['outputs_identical']}/{ev['prompts']}",
                  "target_graph": ev.get("target_graph"), "draft_graph": ev.get("draft_graph"),
                  "graphs": graphs_note(ev)}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_summary(arch: str, runs: dict[str, str], evals: dict[str, dict[str, dict]],
                    preset_steps: int | None) -> dict[str, Any]:
    """The summary's "compare" (module docstring). runs: {drafter: run directory}, evals: {drafter: {dtype: report}},
    both "dflash" first, then arch; preset_steps: the preset's train max_steps (the plain recipe's)."""
    names = list(runs)
    train = {n: train_time(runs[n]) for n in names}
    base, other = train["dflash"], train[arch]
    time_ratio = ratio(other["train_s_all"], base["train_s_all"])
    steps = base["steps"]
    side = {dt: {n: eval_side(evals[n][dt]) for n in names} for dt in evals["dflash"]}
    first = next(iter(side.values()))
    wins = {}
    for key in ("tau_in_source", "tau_out_of_source", "speedup_in_source", "speedup_out_of_source"):
        a, b = first["dflash"].get(key), first[arch].get(key)
        if a is not None and b is not None:
            wins[key] = "tie" if a == b else (arch if b > a else "dflash")
    return {
        "arch": arch, "runs": runs, "steps": steps, "preset_steps": preset_steps,
        "fewer_steps_than_preset": bool(preset_steps and steps and steps < preset_steps),
        "same_steps": other["steps"] == steps,
        "time_budget": other["time_budget"],  # the compared drafter's --time-budget decision (None: same steps)
        "train": train,
        "train_time_ratio": time_ratio,
        "equal_training_time": time_ratio is not None and abs(time_ratio - 1) <= EQUAL_TIME_TOLERANCE,
        "equal_time_tolerance": EQUAL_TIME_TOLERANCE,
        "step_time_ratio": ratio(other["step_ms_median_window"], base["step_ms_median_window"]),
        "eval": side,
        "lossless_float32": ({n: side["float32"][n]["identical"].split("/")[0] == side["float32"][n]["identical"]
                              .split("/")[1] for n in names} if "float32" in side else None),
        "wins": wins,
    }


def format_compare(c: dict[str, Any]) -> str:
    """The side-by-side table of the summary's "compare", then the verdict lines."""
    arch = c["arch"]
    names = ["dflash", arch]
    dt = next(iter(c["eval"]))
    ev = c["eval"][dt]

    def num(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    def pair(key, fmt="{:.2f}"):
        return [num(ev[n].get(key), fmt) for n in names]

    tr = c["train"]
    trained = [tr[n].get("train_s_all", tr[n]["train_s"]) for n in names]  # (train_s: a summary from before it)
    rows = [("", *names),
            ("training steps", *[str(tr[n]["steps"]) for n in names]),
            ("training time (less compile, validation, waits)", *[num(t, "{:.1f} s") for t in trained]),
            ("time budget (--time-budget)", *[num((tr[n].get("time_budget") or {}).get("budget_s"), "{:.1f} s")
                                              for n in names]),
            ("step (median logged window)", *[num(tr[n]["step_ms_median_window"], "{:.1f} ms") for n in names]),
            (f"tau in source ({dt})", *pair("tau_in_source")),
            (f"tau on MT-Bench ({dt})", *pair("tau_out_of_source")),
            ("tau / n-gram's, in source", *pair("tau_over_ngram_in_source", "{:.2f}x")),
            ("tau / n-gram's, MT-Bench", *pair("tau_over_ngram_out_of_source", "{:.2f}x")),
            ("speed-up vs target alone, in source", *pair("speedup_in_source", "{:.2f}x")),
            ("speed-up vs target alone, MT-Bench", *pair("speedup_out_of_source", "{:.2f}x")),
            (f"identical outputs ({dt})", *[ev[n]["identical"] for n in names])]
    if "float32" in c["eval"] and dt != "float32":
        rows.append(("identical outputs (float32)", *[c["eval"]["float32"][n]["identical"] for n in names]))
    rows.append(("CUDA graphs", *[" + ".join(m for m, on in (("target", ev[n]["target_graph"]),
                                                              ("drafter", ev[n]["draft_graph"] == "graph")) if on)
                                   or "none" for n in names]))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(x.ljust(w[i]) if i == 0 else x.rjust(w[i]) for i, x in enumerate(r)) for r in rows]
    fewer = f" (fewer than the recipe's {c['preset_steps']}: compare_max_steps)" if c["fewer_steps_than_preset"] else ""
    budget = c.get("time_budget")
    if budget:  # equal training time: the compared drafter's steps are those its budget bought
        steps = (f"dflash {c['steps']} steps{fewer}; {arch} {tr[arch]['steps']} steps, what its time budget bought "
                 f"({budget['budget_s']:.1f} s, dflash's training time, at {1000 * budget['step_s']:.1f} ms a step"
                 + "".join(f"; revised at step {v['step']} at {1000 * v['step_s']:.1f} ms"
                           for v in budget.get("revisions") or []) + ")")
    else:
        steps = f"both drafters {c['steps']} steps{fewer}"
    r, sr = c["train_time_ratio"], c["step_time_ratio"]
    if r is None:
        timing = "training times not measured (a resumed run's trainer summary lacks them)"
    else:
        timing = (f"{arch}'s training time {r:.2f}x dflash's: "
                  + ("equal" if c["equal_training_time"] else "not equal")
                  + f" (within {100 * c['equal_time_tolerance']:.0f}%)")
    if sr is not None:
        timing += (f"; its step {100 * (sr - 1):.0f}% slower" if sr > 1 else f"; its step {100 * (1 - sr):.0f}% faster"
                   if sr < 1 else "; the same step time")
    lines.append(f"{steps}; {timing}")
    for n in names:
        lines.append(f"{n}: {ev[n]['graphs']}")
    wins = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in c["wins"].items())
    if wins:
        lines.append(f"higher ({dt}): {wins}")
    return "\n".join(lines)
