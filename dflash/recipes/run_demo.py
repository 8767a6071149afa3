"""`dflash demo`: the recipe a DemoConfig resolves to, run. Above the recipes (dflash/recipes/cpu.py, gpu.py,
coder.py), which read their settings from dflash/recipes/demo.py."""

from __future__ import annotations

import glob
import os
from dataclasses import replace
from typing import Any

from dflash.core.config import ConfigError
from dflash.recipes.coder import CODER_DIR, PRESETS, WORKDIRS
from dflash.recipes.cpu import cpu_paths, run_cpu_demo
from dflash.recipes.demo import DemoConfig
from dflash.recipes.gpu import run_gpu_demo
from dflash.recipes.gpu_config import PRESET


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The recipe cfg.recipe resolves to: the GPU one (dflash/recipes/gpu.py; the coder recipe is the GPU one on
    Qwen2.5-Coder-Instruct) or the CPU one (dflash/recipes/cpu.py); its last lines say where its outputs are (the
    drafter, the eval reports, the plot, the summary)."""
    if cfg.recipe == "gpu-coder":
        model = cfg.coder_model or "0.5b"
        cfg = replace(cfg, config=cfg.config or PRESETS[model], workdir=cfg.workdir or WORKDIRS[model])
    if cfg.resolved_recipe() in ("gpu", "gpu-coder"):
        if cfg.train_prompts is not None:
            raise ConfigError("--train-prompts: the GPU recipe trains on every training conversation of chitchat "
                              "(its sizes are in configs/demo-gpu.yaml); use --recipe cpu for a prompt count")
        if cfg.responses != "regenerate":
            raise ConfigError("--responses: the GPU recipe trains on regenerated responses only")
        overrides = {k: v for k, v in (("max_steps", cfg.train_steps), ("drafter_layers", cfg.drafter_layers))
                     if v is not None}
        workdir = cfg.workdir or ("work/demo-gpu-" + cfg.compare if cfg.compare else "work/demo-gpu")
        summary = run_gpu_demo(workdir, cfg.config or PRESET, cfg.device, cfg.progress, train_overrides=overrides,
                               eval_prompts=cfg.eval_prompts, compare=cfg.compare,
                               **({"coder_dir": cfg.coder_dir or CODER_DIR} if cfg.recipe == "gpu-coder" else {}))
        _print_outputs(format_outputs(demo_outputs(workdir, "gpu")))
        return summary
    if cfg.compare is not None:
        raise ConfigError("--compare: a comparison of the GPU recipe; the CPU recipe trains one drafter "
                          "(use --recipe gpu)")
    if cfg.config is not None:
        raise ConfigError("--config: a preset of the GPU recipe; the CPU recipe takes none (use --recipe gpu)")
    cpu = cfg.cpu()
    summary = run_cpu_demo(cpu)
    _print_outputs(format_outputs(demo_outputs(cpu.workdir, "cpu", cpu.responses)))
    return summary


def _print_outputs(lines: str) -> None:
    """The demo's last lines (format_outputs): where its outputs are, as --workdir names
    them."""
    if lines:
        print()
        print(lines, flush=True)


def demo_outputs(workdir: str, recipe: str, responses: str = "regenerate") -> list[tuple[str, str]]:
    """(what, path) for each output a finished demo left under workdir, as workdir names it, in the order a user
    reads them: the drafter (what `dflash eval`, `check` and `export` take), the eval reports, the plot and the
    summary. The CPU recipe's paths are dflash/recipes/cpu.py cpu_paths'; the GPU recipe's are run/ and a
    comparison's run-ARCH/ (its final/, eval-DTYPE.json, acceptance-DTYPE.png) and summary.json. Only those that
    exist are listed: the lines never name a file that is not there."""
    if recipe == "cpu":
        p = cpu_paths(workdir, responses)
        items = [("drafter", os.path.join(p["run"], "final")), ("eval report", p["eval"]), ("plot", p["plot"]),
                 ("summary", p["summary"])]
    else:
        items = []
        runs = sorted(glob.glob(os.path.join(glob.escape(workdir), "run-*")))
        for run in [os.path.join(workdir, "run"), *runs]:
            tag = "" if os.path.basename(run) == "run" else f" ({os.path.basename(run)[4:]})"
            items += [(f"drafter{tag}", os.path.join(run, "final"))]
            items += [(f"eval report{tag}", f) for f in sorted(glob.glob(os.path.join(glob.escape(run), "eval-*.json")))]
            items += [(f"plot{tag}", f) for f in sorted(glob.glob(os.path.join(glob.escape(run), "acceptance-*.png")))]
        items.append(("summary", os.path.join(workdir, "summary.json")))
    return [(what, path) for what, path in items if os.path.exists(path)]


def format_outputs(items: list[tuple[str, str]]) -> str:
    """The demo's last lines: one `demo: WHAT  PATH` line per output (demo_outputs)."""
    if not items:
        return ""
    w = max(len(what) for what, _ in items)
    return "\n".join(f"demo: {what:<{w}}  {path}" for what, path in items)
