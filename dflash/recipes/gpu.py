"""The GPU recipe of `dflash demo`: SmolLM2-135M-Instruct + user turns it writes itself and the user turns of
chitchat and three other packaged datasets (configs/demo-gpu.yaml's `sources`), on one CUDA GPU.

Sizes and hyper-parameters live in the preset configs/demo-gpu.yaml (one section per stage, read with
dflash.core.config like every preset; flags of `dflash demo` override a few). Stages, each resumed when rerun
into the same workdir:

    prepare target (bundled GGUF -> bf16 folder)
    -> self prompts (only when `self` is one of the sources: user turns sampled from the target,
       dflash/recipes/self_prompts.py)
    -> data: chitchat conversations split by conversation (a hash of its id: heldout_percent held out);
       history "target": each training conversation becomes ONE multi-turn `messages` sample (turns alternate
       user / assistant, the first turn is the user's), cut to max_turns messages, ending on an assistant turn,
       every answer regenerated after the target's own earlier ones; history "dataset": one sample per answered
       user turn, the history as chitchat has it, only its answer regenerated (`regenerate --turns last`, the
       kept answers marked weight 0: context, not trained on). The eval prompts are held-out histories up to a
       user turn, at varied turn positions; the held-out conversations, cut the same way, make the validation set.
       With several `sources` (dflash/recipes/sources.py: chat and instruction datasets shipped in packages), each
       is split so and their samples mixed by fixed shares (mix_sources); the in-source eval prompts come from every
       source's held-out conversations, and a `heldout_source` kept whole out of training (MT-Bench) gives the
       out-of-source prompts, beside them in the same eval (rows labelled `set` and `category`). The source `self`
       (dflash/recipes/self_prompts.py) is user turns the target writes itself, sampled in a stage of its own before
       this one
    -> regenerate the answers with the target (large batch)
    -> extract the hidden states (and the validation set's, for train's --val-cache) -> train (compiled CUDA-graph
       step, held-out loss and decoding tau at every checkpoint)
    -> eval in bf16 (target alone, DFlash, n-gram lookup) and float32 (target alone, DFlash: the lossless check)

With `compare: dflash2` (`dflash demo --compare dflash2`; dflash/recipes/compare.py) both caches hold the target's
last hidden state too (extract --last-hidden), and after DFlash's training and evals a DFlash2 drafter trains from
the same caches for the same training time into run-dflash2/ (DFlash trains compare_max_steps, or the train section's
max_steps; DFlash2 trains with `--time-budget` = DFlash's training time and the preset's schedule otherwise, and so
gets the steps that time buys: dflash/recipes/compare.py), and is evaluated the same way: stages "train dflash2",
"eval bfloat16 dflash2", "eval float32 dflash2". The summary puts the two side by side under "compare" (each
drafter's own figures under "train"/"eval"/"bars" and "dflash2").

Workdir layout: target/, data/{train,heldout,valid}.jsonl + data/split.json (and data/self-prompts.json{,l}),
regenerated/, regenerated-valid/, cache/, cache-valid/, run/ (with eval-bfloat16.json, eval-float32.json; a
comparison's run-dflash2/ likewise),
summary.json (the JSON summary, with the bars checked), time.json (the wall time of every run on the workdir: the
time from nothing across resumes), caches/ (the tokenise, datasets and matplotlib caches: nothing is written outside
the workdir). Each stage prints its line with its expected share of the time as it starts; a rerun of a finished demo
prints the stored result and changes nothing (dflash/recipes/stages.py).

Files: gpu_config.py (the preset's `recipe` section, the bars), mix.py (the data stage: split and mix),
gpu_stages.py (the stages), summary.py (the summary's figures and table), compare.py (a comparison's figures and
table); this module runs them in order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any

from dflash.core.config import ConfigError, check, read_preset
from dflash.core.io import atomic_json
from dflash.recipes.compare import (DFLASH2_EVAL_FACTOR, LAST_HIDDEN_EXTRACT_FACTOR, compare_run, compare_summary,
                                    dflash2_train_seconds, equal_time_budget)
from dflash.recipes.coder import CODER_DIR, coder_stage_seconds
from dflash.recipes.gpu_config import (COMPARE_ARCHS, GPU_STAGE_SECONDS, MEASURED_SELF_PROMPTS, PRESET,  # noqa: F401
                                       data_scale, load_recipe)
from dflash.recipes.gpu_stages import FollowingTrainer, WorkTime, follower_args, prepare, train_and_eval
from dflash.recipes.self_prompts import NAME as SELF
from dflash.recipes.stages import StagePlan, caches_under, now_stamp, read_dict, show_stored, stored_result
from dflash.recipes.summary import drafter_figures, format_gpu_summary


def compare_overrides(recipe, train_overrides: dict | None, compare: str) -> dict:
    """The training overrides of a run: a comparison trains DFlash for compare_max_steps unless the steps were given
    (DFlash2: its provisional total, before its time budget decides its steps)."""
    train_overrides = dict(train_overrides or {})
    if compare and recipe.compare_max_steps and "max_steps" not in train_overrides:
        train_overrides["max_steps"] = recipe.compare_max_steps
    return train_overrides


def gpu_stage_plan(preset: str = PRESET, train_overrides: dict | None = None, compare: str = "") -> StagePlan:
    """The GPU recipe's stages for the preset, with GPU_STAGE_SECONDS (a coder preset's: the estimate of
    dflash/recipes/coder.py; training's scaled by a max_steps override);
    with `compare`, the second drafter's training and evals after DFlash's and the extraction with the last hidden
    state, estimated by dflash/recipes/compare.py's figures: its training takes DFlash's training time (its time
    budget), plus its first compiled call and its validations."""
    recipe = load_recipe(preset)
    ref = dict(coder_stage_seconds(recipe.coder_model) if recipe.coder_model else GPU_STAGE_SECONDS)
    if not recipe.coder_model:  # more or fewer samples than the measured preset: the data's stages scale with them
        scale = data_scale(recipe)
        trainer = ref["train"] + ref["extract"]  # the trainer ran beside the extraction, then on its own
        ref["self prompts"] *= recipe.self_prompts / MEASURED_SELF_PROMPTS if SELF in recipe.sources else 1.0
        for k in ("data", "regenerate", "extract"):
            ref[k] *= scale
        ref["train"] = max(trainer - ref["extract"], 0.25 * trainer) if recipe.follow else ref["train"]
    if compare:
        for k in ("extract", "validation data"):
            ref[k] *= LAST_HIDDEN_EXTRACT_FACTOR
    secs = {k: ref[k] for k in ("prepare target", "self prompts", "data", "regenerate")
            if k != "self prompts" or SELF in recipe.sources}
    if recipe.validation and recipe.follow:  # the trainer that follows the extraction needs the validation cache
        secs["validation data"] = ref["validation data"]
    secs["extract"] = ref["extract"]
    if recipe.validation and not recipe.follow:
        secs["validation data"] = ref["validation data"]
    train = read_preset(preset, "train")
    train_overrides = compare_overrides(recipe, train_overrides, compare)
    steps, preset_steps = train_overrides.get("max_steps"), train.get("max_steps")
    scale = steps / preset_steps if steps and preset_steps else 1.0
    secs["train"] = ref["train"] * scale
    evals = {f"eval {dtype}": ref.get(f"eval {dtype}", ref["eval bfloat16"] if i == 0 else ref["eval float32"])
             for i, dtype in enumerate(recipe.eval_dtypes)}
    secs.update(evals)
    if compare:  # trained alone after DFlash's (which follows the extraction), for DFlash's training time
        secs[f"train {compare}"] = dflash2_train_seconds(steps or preset_steps or 0, train.get("save_every"),
                                                         recipe.validation)
        secs.update({f"{k} {compare}": v * DFLASH2_EVAL_FACTOR for k, v in evals.items()})
    return StagePlan(secs)


def plan_source(recipe, compare: str) -> str:
    """Where gpu_stage_plan's seconds come from, for the demo's first line."""
    if compare:
        return (f"estimated: the {compare} stages from DFlash's, training for DFlash's training time, eval "
                f"x{DFLASH2_EVAL_FACTOR:g}")
    if recipe.coder_model:
        return (f"the {recipe.coder_model}'s stages as measured, training scaled by the preset's steps: "
                "dflash/recipes/coder.py")
    scale = data_scale(recipe)
    if scale == 1.0:
        return "as measured for the shipped preset"
    return f"estimated: the shipped preset's stages as measured, the data's scaled by its {scale:.2f}x the samples"


def check_caches(workdir: str, last_hidden: bool) -> None:
    """A workdir whose caches were extracted for the other mode (a comparison's hold the target's last hidden state, the
    recipe's do not) is one error line before any stage, rather than the extraction's mismatch."""
    for name in ("cache", "cache-valid"):
        path = os.path.join(workdir, name)
        root = read_dict(os.path.join(path, "zarr.json"))
        if root is None:
            continue
        has = bool((root.get("attributes") or {}).get("last_hidden", False))
        if has != last_hidden:
            raise ConfigError(f"--workdir {workdir}: its {name}/ was extracted {'with' if has else 'without'} the "
                              f"target's last hidden state, for a demo {'with' if has else 'without'} --compare: give "
                              "another --workdir (a comparison's default is work/demo-gpu-dflash2, the recipe's "
                              f"work/demo-gpu) or delete {path}")


def gpu_request(preset: str, device: str, target: str | None, train_overrides: dict | None,
                eval_prompts: int | None, compare: str = "") -> dict[str, Any]:
    """What makes a GPU demo's result (the preset by name and content, and the arguments that change it): a rerun
    with the same finds it stored. A comparison's names its architecture (`compare`)."""
    from dflash.core.config import resolve_preset

    path = resolve_preset(preset)
    data = open(path, "rb").read() if isinstance(path, str) else path.read_bytes()
    return {"preset": preset, "preset_sha256": hashlib.sha256(data).hexdigest(), "device": device, "target": target,
            "train_overrides": dict(train_overrides or {}), "eval_prompts": eval_prompts,
            **({"compare": compare} if compare else {})}


def show_reports(reports: dict[str, dict], named: bool) -> None:
    """Print the eval reports ({path: report}), each headed by its path when `named` (a comparison's two drafters)."""
    from dflash.train.evaluate.eval import format_report

    for path, ev in reports.items():
        if named:
            print(f"{path}:")
        print(format_report(ev))
        print()


def run_gpu_demo(workdir: str, preset: str = PRESET, device: str = "auto", progress: bool = True,
                 target: str | None = None, train_overrides: dict | None = None,
                 eval_prompts: int | None = None, compare: str | None = None,
                 coder_dir: str = CODER_DIR) -> dict[str, Any]:
    """The whole GPU recipe; prints the eval tables and writes WORKDIR/summary.json. A rerun that finds the summary
    of a finished run with the same request (gpu_request) and its eval reports prints them and writes nothing.
    compare: a second drafter architecture trained and evaluated beside DFlash's (dflash/recipes/compare.py; None:
    the preset's `compare`); coder_dir: where a coder preset's target GGUF is (dflash/recipes/coder_assets.py)."""
    workdir = os.path.abspath(workdir)  # every path the stages print is absolute
    recipe = load_recipe(preset)
    arch = recipe.compare if compare is None else compare
    check(arch in COMPARE_ARCHS, "compare", f"must be one of {', '.join(a for a in COMPARE_ARCHS if a)}, got {arch!r}")
    run, summary_path = os.path.join(workdir, "run"), os.path.join(workdir, "summary.json")
    runs = {"dflash": run, **({arch: compare_run(workdir, arch)} if arch else {})}
    request = gpu_request(preset, device, target, train_overrides, eval_prompts, arch)
    train_overrides = compare_overrides(recipe, train_overrides, arch)
    reports = [os.path.join(r, f"eval-{dtype}.json") for r in runs.values() for dtype in recipe.eval_dtypes]
    stored = stored_result(summary_path, request, "request", reports)
    if stored is not None:
        summary, found = stored
        show_stored("demo", summary_path, summary, workdir,
                    again="delete that file and " + " and ".join(f"{r}/eval-*.json" for r in runs.values())
                    + " to measure again")
        print()
        show_reports(dict(zip(reports, found)), bool(arch))
        print(format_gpu_summary(summary))
        return summary
    check_caches(workdir, bool(arch))
    plan = gpu_stage_plan(preset, train_overrides, arch)
    what = f"the GPU recipe ({preset})" + (f", a {arch} drafter compared with the DFlash one," if arch else "")
    measured_on = "H100" if recipe.coder_model else "H200"  # where the plan's stages were measured
    print(f"demo: {what} in {len(plan.seconds)} stages, about {sum(plan.seconds.values()) / 60:.0f} min on one "
          f"{measured_on} ({plan_source(recipe, arch)}); the first training steps compile the step (~40 s)", flush=True)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    clock = WorkTime(workdir, timings)
    try:
        with caches_under(workdir) as tokenize_cache:
            followers: list[FollowingTrainer] = []

            def start_follower(target_dir: str, cache: str, val_cache: str | None) -> None:
                followers.append(FollowingTrainer(follower_args(target_dir, cache, val_cache, run, preset, device,
                                                                train_overrides)))

            try:
                prep = prepare(workdir, preset, device, progress, target, timings, stages=plan, coder_dir=coder_dir,
                               tokenize_cache=tokenize_cache, before_extract=start_follower if recipe.follow else None,
                               last_hidden=bool(arch))
                prep.follower = followers[0] if followers else None
                out = train_and_eval(prep, run, preset, device, progress, train_overrides, eval_prompts,
                                     timings=timings, stages=plan)
                if arch:  # from the same caches, for DFlash's training time, the same eval; after DFlash's
                    budget = {"arch": arch, "time_budget_s": equal_time_budget(run)}
                    out2 = train_and_eval(dataclasses.replace(prep, follower=None), runs[arch], preset, device,
                                          progress, dict(train_overrides, **budget), eval_prompts, timings=timings,
                                          stages=plan, label=arch)
            finally:
                for f in followers:
                    f.stop()
    finally:
        clock.close()
    evals = out["eval"]
    # a resumed run's own figures cover only what it did: the earlier runs' come from the summary they left
    # (regeneration, extraction) and from RUN/metrics.jsonl (every logged window of the training, resumes cut it
    # back to the checkpoint they start from)
    old = read_dict(os.path.join(workdir, "summary.json")) or {}
    regen = {k: prep.regen.get(k) for k in ("tokens_per_s_this_rank", "generated_tokens_this_rank",
                                            "generation_s_this_rank", "engine_this_rank", "counts")} if prep.regen else None
    if regen and not regen["generated_tokens_this_rank"] and old.get("regenerate"):
        regen = old["regenerate"]
    ex_tps = (prep.extract or {}).get("tokens_per_s_this_rank") or old.get("extract_tokens_per_s")
    summary = {
        "recipe": "gpu-coder" if recipe.coder_model else "gpu", "preset": preset, "request": request, "finished_at": now_stamp(),
        "target": prep.target, "data": prep.counts,
        "regenerate": regen,
        "extract_tokens_per_s": ex_tps,
        **drafter_figures(run, out["train"], evals),
        "lossless_float32": (evals["float32"]["dflash"]["outputs_identical"] == evals["float32"]["prompts"]
                             if "float32" in evals else None),
        "timings_s": timings,
        # the recipe's follow: the trainer's own wall time, from its start beside the extraction to its end
        "follow": ({"trainer_wall_s": prep.follower.wall_s, "extract_s": timings.get("extract"),
                    "train_after_extract_s": timings.get("train")} if prep.follower is not None else None),
        "wall_s": time.perf_counter() - t0,
        "all_runs": clock.runs,  # every run of the demo on this workdir, the killed ones too (WORKDIR/time.json)
        "wall_s_all_runs": sum(r["wall_s"] for r in clock.runs),
    }
    if arch:  # the compared drafter's own figures (as the DFlash drafter's above), then both side by side
        summary[arch] = drafter_figures(runs[arch], out2["train"], out2["eval"])
        summary["compare"] = compare_summary(arch, runs, {"dflash": evals, arch: out2["eval"]},
                                             read_preset(preset, "train").get("max_steps"))

    atomic_json(summary_path, summary)
    print()
    outs = [out, out2] if arch else [out]
    show_reports({os.path.join(r, f"eval-{dt}.json"): ev for r, o in zip(runs.values(), outs)
                  for dt, ev in o["eval"].items()}, bool(arch))
    print(format_gpu_summary(summary))
    return summary
