"""The training metrics of a logging window: device accumulators (no host sync until read) and wandb.

The step adds each micro-batch's metrics (train/drafter/loss.py's block_metrics) and each step's gradient norm into
tensors on the device; the logging window all-reduces them over the ranks (AVG), reads them once (the single
host sync of a window) and resets them. `losses` keeps every micro-step's loss of the window, so that a
non-finite one can be named by its step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dflash.train.fit.config import TrainConfig, TrainError


@dataclass
class TrainMetrics:
    """Sums over a logging window, on the device. `losses` (and `n`, how many it holds) are kept apart: they
    are this rank's per-micro-step losses, for the finiteness check, never all-reduced."""

    loss: torch.Tensor  # [] sum of micro-batch losses
    tau: torch.Tensor  # [] sum of micro-batch expected acceptance lengths
    slot_hits: torch.Tensor  # [B-1] correct predictions per slot
    slot_count: torch.Tensor  # [B-1] supervised labels per slot
    grad_norm: torch.Tensor  # [] sum of the steps' (pre-clip) gradient norms
    losses: torch.Tensor  # [log_every * grad_accum] per-micro-step losses (a ring)
    n: int = 0

    SUMS = ("loss", "tau", "slot_hits", "slot_count", "grad_norm")

    @classmethod
    def zeros(cls, slots: int, micro_steps: int, device) -> "TrainMetrics":
        z = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        return cls(z(()), z(()), z(slots), z(slots), z(()), z(micro_steps))

    def add(self, met: dict[str, torch.Tensor]) -> None:
        """One micro-batch's metrics (device tensors; nothing read)."""
        self.loss += met["loss"].detach()
        self.tau += met["tau"]
        self.slot_hits += met["slot_acc"] * met["slot_count"]
        self.slot_count += met["slot_count"]
        self.losses[self.n % self.losses.numel()] = met["loss"].detach()
        self.n += 1

    def add_grad_norm(self, grad_norm: torch.Tensor) -> None:
        self.grad_norm += grad_norm.float()

    def all_reduce(self) -> None:
        """Average the sums over the ranks (one all-reduce): the logged metrics are over all ranks' data."""
        sums = [getattr(self, name) for name in self.SUMS]
        flat = torch.cat([v.reshape(-1) for v in sums])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.AVG)
        off = 0
        for v in sums:
            v.copy_(flat[off:off + v.numel()].view_as(v))
            off += v.numel()

    def read(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(the sums on the host, this window's per-micro-step losses on the host): the window's host sync."""
        sums = {name: getattr(self, name).detach().cpu() for name in self.SUMS}
        return sums, self.losses[: min(self.n, self.losses.numel())].cpu()

    def reset(self) -> None:
        for name in self.SUMS:
            getattr(self, name).zero_()
        self.n = 0


class _NoLog:
    def log(self, *a, **k):
        pass

    def finish(self):
        pass


def init_wandb(cfg: TrainConfig, resolved: dict, is_main: bool):
    """wandb on rank 0 only (optional; offline works without an account); a logger that does nothing elsewhere."""
    if not cfg.wandb_project or not is_main:
        return _NoLog()
    if cfg.wandb_mode:
        os.environ["WANDB_MODE"] = cfg.wandb_mode
    try:
        import wandb
    except ImportError as e:
        raise TrainError("--wandb-project needs the wandb package (pip install wandb)") from e
    return wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=resolved, dir=cfg.out)
