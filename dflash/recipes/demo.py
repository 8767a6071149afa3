"""`dflash demo`: the whole pipeline on a real chat model, offline, from data shipped in packages.

DemoConfig holds the command's settings (dflash/cli.py maps its flags onto it); run_demo runs the recipe they choose:
the CPU recipe (dflash/recipes/cpu.py: SmolLM2-135M-Instruct on chitchat, in minutes on a laptop CPU, at CPU_SIZES)
or the GPU recipe (dflash/recipes/gpu.py, sized by configs/demo-gpu.yaml). `--recipe auto` is the GPU one when torch
sees CUDA. This module imports neither recipe nor torch at import time: `dflash --help` reads CPU_SIZES from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash.core.config import ConfigError, check

CPU_SIZES = {"train_prompts": 240, "eval_prompts": 16, "train_steps": 160, "drafter_layers": 1}
# The CPU recipe's duration, the one place it is stated (the demo's first line, `dflash demo --help` and README use
# cpu_demo_time()): each stage's seconds at CPU_SIZES and the default settings, measured on an idle 2-core CPU
# (2026-12-02). All are CPU-bound: on another machine they scale with the cores, their speed and whatever else runs
# there (not all alike: on a 2-core machine loaded by other work, regenerate took 8.7x as long and train 3.8x); each
# stage's line shows its share of the whole.
CPU_STAGE_SECONDS = {"prepare target": 11.0, "regenerate": 80.0, "extract": 42.0, "train": 188.0, "eval": 131.0}


def cpu_demo_time(seconds: dict[str, float] | None = None) -> str:
    """The CPU recipe's measured duration, e.g. "7 min 32 s": the sum of `seconds` (default CPU_STAGE_SECONDS)."""
    total = round(sum((CPU_STAGE_SECONDS if seconds is None else seconds).values()))
    return f"{total // 60} min {total % 60} s" if total >= 60 else f"{total} s"


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
    # GPU recipe: a drafter architecture trained and evaluated beside DFlash's from the same cache
    # (dflash/recipes/compare.py); None: the preset's `compare`
    compare: str | None = None
    device: str = "auto"
    progress: bool = True

    def __post_init__(self):
        check(self.recipe in ("auto", "cpu", "gpu"), "recipe", f"must be auto, cpu or gpu, got {self.recipe!r}")
        check(self.responses in ("regenerate", "original"), "responses", "must be regenerate or original")
        check(self.train_prompts is None or self.train_prompts >= 8, "train_prompts", "must be >= 8")
        check(self.eval_prompts is None or self.eval_prompts >= 1, "eval_prompts", "must be >= 1")
        check(self.train_steps is None or self.train_steps >= 1, "train_steps", "must be >= 1")
        check(self.drafter_layers is None or self.drafter_layers >= 1, "drafter_layers", "must be >= 1")
        check(self.compare in (None, "dflash2"), "compare", f"must be dflash2, got {self.compare!r}")
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


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The recipe cfg.recipe resolves to: the GPU one (dflash/recipes/gpu.py) or the CPU one (dflash/recipes/cpu.py);
    its last lines say where its outputs are (the drafter, the eval reports, the plot, the summary)."""
    from dflash.recipes.cpu import run_cpu_demo  # (cpu.py imports DemoConfig from here)
    from dflash.recipes.gpu import run_gpu_demo
    from dflash.recipes.gpu_config import PRESET
    from dflash.recipes.summary import demo_outputs, format_outputs

    if cfg.resolved_recipe() == "gpu":
        if cfg.train_prompts is not None:
            raise ConfigError("--train-prompts: the GPU recipe trains on every training conversation of chitchat "
                              "(its sizes are in configs/demo-gpu.yaml); use --recipe cpu for a prompt count")
        if cfg.responses != "regenerate":
            raise ConfigError("--responses: the GPU recipe trains on regenerated responses only")
        overrides = {k: v for k, v in (("max_steps", cfg.train_steps), ("drafter_layers", cfg.drafter_layers))
                     if v is not None}
        workdir = cfg.workdir or ("work/demo-gpu-" + cfg.compare if cfg.compare else "work/demo-gpu")
        summary = run_gpu_demo(workdir, cfg.config or PRESET, cfg.device, cfg.progress, train_overrides=overrides,
                               eval_prompts=cfg.eval_prompts, compare=cfg.compare)
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
    """The demo's last lines (dflash/recipes/summary.py format_outputs): where its outputs are, as --workdir names
    them."""
    if lines:
        print()
        print(lines, flush=True)
