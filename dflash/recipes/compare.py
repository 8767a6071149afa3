"""The GPU recipe's comparison (`dflash demo --compare dflash2`): a second drafter architecture trained from the
same cache as the DFlash drafter, with the same schedule and steps, evaluated by the same eval, side by side.

What the comparison adds to WORKDIR/summary.json, under "compare" (compare_summary), and to the printed summary (a
table, format_compare):

  * arch, steps (both drafters'; and whether they are fewer than the preset's train max_steps: compare_max_steps);
  * train: per drafter, its training time from its trainer's RUN/summary.json (train_time): the loop's wall time,
    less the first compiled call (the compile), the validations and, for the trainer that followed the
    extraction, its waits for shards; that per step; and the median logged window's step time (the steady step:
    windows exclude validation, and the median is not moved by the first window's compile nor by the windows
    that shared the GPU with the extraction). train_time_ratio (the second drafter's training time over DFlash's,
    both over their timed steps), equal_training_time (within EQUAL_TIME_TOLERANCE) and step_time_ratio (of the
    median windows: "DFlash2's step is x% slower");
  * eval: per eval dtype and drafter, the figures of its eval report: tau in source and out of source (MT-Bench),
    tau over n-gram lookup's on each, the speed-up over the target alone on each, identical outputs, and eval's
    own note of which models ran as CUDA graphs (a drafter whose static step failed its check drafts eagerly);
  * lossless_float32 per drafter, and `wins`: which drafter has the higher tau in source, on MT-Bench and the
    higher speed-up (bf16), whichever it is.

Until the DFlash2 step is measured on the GPU, the stage plan's estimates (dflash/recipes/gpu.py) use the factors
below, stated here and nowhere else.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from dflash.recipes.stages import read_dict

# Estimates for the stage plan until measured on an H200 (the time shares printed as each stage starts):
# a DFlash2 training step against a DFlash one: its loss reads the target's logits beside the drafter's (a second
# vocabulary-wide matmul and softmax per slot) and its layers add two block convolutions (1.3x at the Qwen3-8B
# shape, 662.6 against ~510 ms, BENCHMARKS.md; the recipe's small drafter spends more of its step on the vocabulary)
DFLASH2_TRAIN_FACTOR = 1.8
# its eval against DFlash's: the selector's pass is a loop of small steps over the block (in the drafter's CUDA
# graph on a GPU)
DFLASH2_EVAL_FACTOR = 1.3
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
    from dflash.train.run_dir import read_metrics

    s = read_dict(os.path.join(run, "summary.json")) or {}
    elapsed = s.get("elapsed_s")
    steps_timed = s.get("steps_this_run")
    compile_s = float((s.get("first_compiled_call") or {}).get("seconds") or 0.0)
    waited = float((s.get("follow") or {}).get("waited_s") or 0.0)
    validation_s = float(sum(h.get("val_s", 0.0) for h in s.get("history") or []))
    train_s = elapsed - compile_s - waited - validation_s if elapsed is not None else None
    windows = [h["step_ms"] for h in (read_metrics(run) or [])[1:] if "step_ms" in h]
    return {"steps": s.get("steps"), "steps_timed": steps_timed, "resumed": steps_timed != s.get("steps"),
            "wall_s": elapsed, "compile_s": compile_s, "validation_s": validation_s, "follow_waited_s": waited,
            "train_s": train_s,
            "step_ms": 1000 * train_s / steps_timed if train_s is not None and steps_timed else None,
            "step_ms_median_window": statistics.median(windows) if windows else None}


def graphs_note(ev: dict[str, Any]) -> str:
    """Eval's own line saying which models ran as CUDA graphs ("speed-ups with target and drafter in CUDA graphs")."""
    from dflash.train.eval import format_report

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
    time_ratio = ratio(other["step_ms"], base["step_ms"])  # the same steps: the training times' ratio
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
    rows = [("", *names),
            ("training steps", *[str(tr[n]["steps"]) for n in names]),
            ("training time (less compile, validation, waits)", *[num(tr[n]["train_s"], "{:.1f} s") for n in names]),
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
    steps = f"both drafters {c['steps']} steps" + (
        f" (fewer than the recipe's {c['preset_steps']}: compare_max_steps)" if c["fewer_steps_than_preset"] else "")
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
