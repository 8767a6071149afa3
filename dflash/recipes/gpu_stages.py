"""The GPU recipe's stages (dflash/recipes/gpu.py runs them in order): prepare() makes the target, the self prompts,
the data, the regenerated answers and the caches; train_and_eval() trains the drafter (or waits for the trainer that
followed the extraction: FollowingTrainer) and evaluates it once per dtype. Each stage is skipped or resumed when its
output is there: the stages' own resume (extract, train and regenerate resume a rerun; the target is converted once;
an eval report newer than RUN/final is reused). WorkTime keeps the wall time of every run of the demo on a workdir
(WORKDIR/time.json), the killed ones too.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from dflash.core.config import ConfigError, build, read_preset
from dflash.core.io import atomic_json, atomic_write
from dflash.recipes.assets import smollm2_gguf
from dflash.recipes.gpu_config import PRESET, load_recipe
from dflash.recipes.mix import prepare_data
from dflash.recipes.self_prompts import NAME as SELF
from dflash.recipes.stages import StagePlan, read_dict


@dataclass
class Prepared:
    """What the training runs share: the target, the held-out prompts, the cache (and the validation cache)."""

    target: str
    heldout: str
    cache: str
    counts: dict
    timings: dict
    regen: dict | None = None
    extract: dict | None = None
    val_cache: str | None = None  # the held-out conversations' cache (train --val-cache), or None
    follower: "FollowingTrainer | None" = None  # the recipe's follow: the trainer started beside the extraction


class FollowingTrainer:
    """`dflash train --follow` as a child process: it trains from the cache while this process extracts it (one
    process per job, each single-threaded for CUDA; they share only the cache). Its lines are forwarded behind
    `[train] `; wait() returns once it has finished (a failure is one error line: rerunning the demo resumes both)."""

    def __init__(self, args: list[str]):
        import subprocess
        import sys
        import threading

        from dflash.pipeline import forward_lines

        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.thread = threading.Thread(target=forward_lines, args=("train", self.proc.stdout, threading.Lock()),
                                       daemon=True)  # file I/O only
        self.thread.start()
        self.wall_s: float | None = None

    def wait(self) -> float:
        """Wait for the trainer; its wall time from start to end (seconds)."""
        rc = self.proc.wait()
        self.thread.join()
        if rc != 0:
            raise ConfigError(f"the trainer following the extraction failed (exit {rc}, its lines above start with "
                              "[train]); rerun the same `dflash demo` command to resume it")
        self.wall_s = time.perf_counter() - self.t0
        return self.wall_s

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()


def follower_args(target: str, cache: str, val_cache: str | None, run: str, preset: str, device: str,
                  train_overrides: dict | None) -> list[str]:
    """The command line of the trainer that follows the extraction: what train_and_eval's run_train gets."""
    args = ["--config", str(preset), "--target", target, "--cache", cache, "--out", run, "--follow", "--no-progress"]
    if device != "auto":
        args += ["--device", device]
    if val_cache:
        args += ["--val-cache", val_cache]
    for k, v in (train_overrides or {}).items():
        args += ["--" + k.replace("_", "-"), str(v)]
    return args


def prepare(workdir: str, preset: str = PRESET, device: str = "auto", progress: bool = True,
            target: str | None = None, timings: dict | None = None, stages: StagePlan | None = None,
            tokenize_cache: str | None = None, before_extract=None, last_hidden: bool = False,
            coder_dir: str = "work/coder") -> Prepared:
    """Target, data, regenerated responses and the cache (each skipped or resumed when already there).
    target: an HF folder to use instead of the bundled SmolLM2 (e.g. a random model of its shape); timings: the
    dict each stage's seconds go into as it ends (a new one by default); stages: prints each stage's line as it
    starts; tokenize_cache: extract's --tokenize-cache (None: its default); before_extract(target, cache,
    val_cache): called just before the main extraction starts, the validation data being made first (the recipe's
    `follow`: it starts the trainer that follows the extraction); last_hidden: both caches hold the target's last
    hidden state too (extract --last-hidden: what a DFlash2 drafter trains and validates against); coder_dir: where
    a preset's coder_model GGUF is (dflash/recipes/coder_assets.py: checked against its pinned sha256 first)."""
    from dflash.extract.generation.regenerate import RegenerateConfig, run_regenerate
    from dflash.extract.run import ExtractConfig, run_extract

    recipe = load_recipe(preset)
    os.makedirs(workdir, exist_ok=True)
    timings = timings if timings is not None else {}
    start = stages.start if stages is not None else (lambda name: None)
    tok = {"tokenize_cache": tokenize_cache} if tokenize_cache else {}
    if last_hidden:
        tok["last_hidden"] = True
    start("prepare target")
    t = time.perf_counter()
    if target is None:
        target = os.path.join(workdir, "target")
        if not (os.path.exists(os.path.join(target, "config.json"))
                and os.path.exists(os.path.join(target, "tokenizer_config.json"))):  # converted once, then reused
            from dflash.core.target import convert_gguf

            if recipe.coder_model:
                from dflash.recipes.coder_assets import coder_gguf

                target = convert_gguf(coder_gguf(recipe.coder_model, coder_dir), target)
            else:
                target = convert_gguf(smollm2_gguf(), target)
    timings["prepare target"] = time.perf_counter() - t
    self_convs = self_record = None
    if SELF in recipe.sources:
        from dflash.recipes.self_prompts import self_prompts

        start("self prompts")
        t = time.perf_counter()
        self_convs, self_record = self_prompts(workdir, target, recipe, device, progress)
        timings["self prompts"] = time.perf_counter() - t
        dropped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in self_record["dropped"].items())
        print(f"demo-gpu: self prompts: {self_record['kept']} of {self_record['sampled']} user turns sampled from the "
              f"target kept ({self_record['mean_tokens_kept']} tokens on average; dropped: {dropped})", flush=True)
    start("data")
    t = time.perf_counter()
    train_jsonl, held, counts, valid_jsonl = prepare_data(workdir, recipe, self_convs, self_record)
    timings["data"] = time.perf_counter() - t
    print(f"demo-gpu: {counts['train_conversations_used']} training conversations ({counts['assistant_turns']} "
          f"assistant turns to regenerate, {counts['assistant_turns_cut_by_max_turns']} more cut by max_turns="
          f"{recipe.max_turns}; history: {recipe.history}) in {counts['train_samples']} samples, "
          f"{counts['eval_prompts']} eval prompts from {counts['heldout_conversations']} held-out conversations",
          flush=True)

    regen_out = os.path.join(workdir, "regenerated")
    start("regenerate")
    t = time.perf_counter()
    turns = {"turns": "last"} if recipe.history == "dataset" else {}
    regen = run_regenerate(build(RegenerateConfig, preset, "regenerate",
                                 {"target": target, "data": train_jsonl, "out": regen_out, "device": device,
                                  "progress": progress, **turns}))
    timings["regenerate"] = time.perf_counter() - t

    cache = os.path.join(workdir, "cache")
    basis = shared_basis(workdir, preset, target, regen_out, device, progress, tok)
    if basis is not None:  # both caches on one basis, fitted on the training answers (train refuses two bases)
        tok = dict(tok, basis_from=basis)

    def main_extract():
        start("extract")
        t = time.perf_counter()
        if before_extract is not None:
            before_extract(target, cache, val_cache)
        out = run_extract(build(ExtractConfig, preset, "extract",
                                {"target": target, "data": regen_out, "out": cache, "device": device,
                                 "progress": progress, **tok}))
        timings["extract"] = time.perf_counter() - t
        return out

    val_cache = None
    ex = None if recipe.validation and before_extract is not None else main_extract()
    if recipe.validation:  # the held-out conversations through the same two stages: the trainer's --val-cache
        start("validation data")
        t = time.perf_counter()
        regen_val = os.path.join(workdir, "regenerated-valid")
        run_regenerate(build(RegenerateConfig, preset, "regenerate",
                             {"target": target, "data": valid_jsonl, "out": regen_val, "device": device,
                              "progress": progress, **turns}))
        val_cache = os.path.join(workdir, "cache-valid")
        run_extract(build(ExtractConfig, preset, "extract", {"target": target, "data": regen_val, "out": val_cache,
                                                             "device": device, "progress": progress, **tok}))
        timings["validation data"] = time.perf_counter() - t
    if ex is None:  # follow: the trainer needs the validation cache when it starts
        ex = main_extract()
    return Prepared(target, held, cache, counts, timings, regen, ex, val_cache)


BASIS_SAMPLES = 2048  # training samples, spread evenly over the regenerated answers, that the basis is fitted from


def shared_basis(workdir: str, preset: str, target: str, regen_out: str, device: str, progress: bool,
                 tok: dict, rank: int | None = None, out: str | None = None, data: str | None = None) -> str | None:
    """With `extract: basis_rank: R` in the preset: WORKDIR/cache-basis, a cache of every k-th regenerated training
    sample (BASIS_SAMPLES of them, spread over the mix's sources, written to WORKDIR/data/basis-fit.jsonl) extracted
    with --basis-rank R, whose basis the validation cache and the main cache are then extracted on (--basis-from), so
    that they share one P whichever is extracted first (the validation cache is, when the trainer follows the main
    extraction). None without a basis. Deterministic; resumed as any extraction is. rank, out and data: a basis of
    rank R the preset does not ask for, its cache and its samples' file (bench/tau_quant.py: one fit per rank)."""
    from dflash.extract.run import ExtractConfig, run_extract

    if rank is None:
        section = read_preset(preset, "extract")
        if not section.get("basis_rank"):
            return None
        if section.get("basis_from"):
            raise ConfigError(f"preset {preset}: extract: basis_from is set by the recipe when basis_rank is (its "
                              "caches share one basis fitted on the training answers): leave it out")
        rank = section["basis_rank"]
    parts = [os.path.join(regen_out, "data", n) for n in sorted(os.listdir(os.path.join(regen_out, "data")))
             if n.endswith(".jsonl")]

    def samples():
        for part in parts:
            with open(part, encoding="utf-8") as f:
                yield from (line.rstrip("\n") + "\n" for line in f if line.strip())

    total = sum(1 for _ in samples())
    step = max(1, total // BASIS_SAMPLES)
    chosen = "".join(line for i, line in enumerate(samples()) if i % step == 0 and i // step < BASIS_SAMPLES)
    data = data or os.path.join(workdir, "data", "basis-fit.jsonl")
    old = None
    if os.path.exists(data):
        with open(data, encoding="utf-8") as f:
            old = f.read()
    if old != chosen:  # a rerun finds the same file and resumes the cache it made
        atomic_write(data, chosen)
    out = out or os.path.join(workdir, "cache-basis")
    print(f"demo-gpu: the caches' basis (rank {rank}): fitted on {chosen.count(chr(10))} of the "
          f"{total} regenerated samples (one in {step}) -> {out}", flush=True)
    mine = {k: v for k, v in tok.items() if k != "last_hidden"}  # the basis is the context features' alone
    run_extract(build(ExtractConfig, preset, "extract", {"target": target, "data": data, "out": out, "device": device,
                                                         "progress": progress, "basis_rank": rank, **mine}))
    return out


def train_and_eval(prep: Prepared, run: str, preset: str = PRESET, device: str = "auto", progress: bool = True,
                   train_overrides: dict | None = None, eval_prompts: int | None = None,
                   eval_dtypes: list[str] | None = None, timings: dict | None = None,
                   ngram: bool = True, eval_overrides: dict | None = None, eval_tag: str = "",
                   stages: StagePlan | None = None, label: str = "") -> dict[str, Any]:
    """Train a drafter into `run` (resumed when rerun) and evaluate RUN/final once per dtype (RUN/eval-DTYPE.json,
    reused when newer than RUN/final; eval_tag names variants, e.g. eval-bfloat16-graph.json); n-gram lookup runs
    in the first dtype when ngram is True; eval_overrides are EvalConfig fields (e.g. draft_graph); stages: prints
    each stage's line as it starts; label names the stages and their timings ("train LABEL", "eval DTYPE LABEL": a
    second drafter's). Returns {"train": summary, "eval": {dtype: report}}."""
    from dflash.train.evaluate.eval import EvalConfig, run_eval
    from dflash.train.fit.trainer import TrainConfig, run_train

    recipe = load_recipe(preset)
    timings = timings if timings is not None else {}
    start = stages.start if stages is not None else (lambda name: None)
    tail = f" {label}" if label else ""
    start("train" + tail)
    t = time.perf_counter()
    base = {"cache": prep.cache, "target": prep.target, "out": run, "device": device, "progress": progress}
    if prep.val_cache:
        base["val_cache"] = prep.val_cache
    if prep.follower is not None:  # it trained beside the extraction: wait for it; run_train then finds it finished
        prep.follower.wait()
    tr = run_train(build(TrainConfig, preset, "train", dict(base, **(train_overrides or {}))))
    timings["train" + tail] = time.perf_counter() - t  # with follow: only what was left after the extraction
    evals = {}
    n_eval = eval_prompt_total(recipe, prep.counts, eval_prompts)
    for i, dtype in enumerate(recipe.eval_dtypes if eval_dtypes is None else eval_dtypes):
        path = os.path.join(run, f"eval-{dtype}{'-' + eval_tag if eval_tag else ''}.json")
        if os.path.exists(path) and os.path.getmtime(path) > os.path.getmtime(os.path.join(run, "final")):
            with open(path) as f:
                evals[dtype] = json.load(f)
            continue
        start(f"eval {dtype}{tail}")
        t = time.perf_counter()
        evals[dtype] = run_eval(build(EvalConfig, preset, "eval", {
            "target": prep.target, "drafter": os.path.join(run, "final"), "data": prep.heldout,
            "max_prompts": n_eval if i == 0 or not recipe.later_dtype_prompts
            else min(recipe.later_dtype_prompts, n_eval),
            "max_new_tokens": recipe.eval_max_new_tokens,
            "dtype": dtype, "ngram": ngram and i == 0, "device": device, "json_out": path, "progress": progress,
            "plot": os.path.join(run, f"acceptance-{dtype}.png") if i == 0 else None} | (eval_overrides or {})))
        timings[f"eval {dtype}{tail}"] = time.perf_counter() - t
    return {"train": tr, "eval": evals}


def eval_prompt_total(recipe, counts: dict, eval_prompts: int | None = None) -> int:
    """The prompts the first eval runs (--eval-prompts when given): the in-source ones, the out-of-source ones and
    every eval source's (counts: mix_sources' record). heldout.jsonl alternates the sets, so a prefix samples each
    alike: a total short of their sum would cut every set, HumanEval's 164 prompts to a third."""
    return eval_prompts or recipe.eval_prompts + int(counts.get("out_of_source_prompts") or 0) \
        + sum(int(s.get("prompts") or 0) for s in (counts.get("eval_sources") or {}).values())


class WorkTime:
    """The wall time of every run of the demo on a workdir, the killed ones too: WORKDIR/time.json holds one
    record per run ({"wall_s", "stages_s": the stages it finished}), rewritten every `every` seconds by a thread
    (file I/O only) and at the end, so a run killed by a time limit counts up to its last write. Their sum is
    the time from nothing of a demo that took several runs to finish."""

    def __init__(self, workdir: str, stages: dict[str, float], every: float = 5.0):
        import threading

        self.path = os.path.join(workdir, "time.json")
        os.makedirs(workdir, exist_ok=True)
        runs = (read_dict(self.path) or {}).get("runs")
        self.runs = list(runs) if isinstance(runs, list) else []
        self.runs.append({"wall_s": 0.0, "stages_s": {}})
        self.stages, self.t0, self.every = stages, time.perf_counter(), every
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._beat, name="demo-time", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self.runs[-1] = {"wall_s": round(time.perf_counter() - self.t0, 1),
                         "stages_s": {k: round(v, 1) for k, v in dict(self.stages).items()}}
        atomic_json(self.path, {"runs": self.runs})

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self._write()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._write()
