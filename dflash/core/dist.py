"""Process setup in the nanochat style: one process per GPU under torchrun, nothing without it."""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch

from dflash.core.config import ConfigError
from dflash.core.io import atomic_json  # noqa: F401  (re-exported: callers import it from here)


@dataclass
class Dist:
    rank: int
    local_rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def parse_device(device: str | None, local_rank: int = 0) -> torch.device:
    """--device: auto, cpu, cuda or cuda:N, checked against this machine (an error naming the flag)."""

    if device in (None, "auto"):
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: dflash runs on cpu or cuda (cuda:N), not {dev.type}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: this machine has no usable CUDA device "
                              f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use --device cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"--device {device}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return dev


def check_gpu_ids(ids: list[str]) -> None:
    """--gpus: ids that exist on this machine (torchrun would otherwise train on the CPU without a word)."""

    if not torch.cuda.is_available():
        raise ConfigError(f"--gpus {','.join(ids)}: this machine has no usable CUDA device; "
                          "run without --gpus to use the CPU")
    n = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        bad = [g for g in ids if int(g) >= n]
        if bad:
            raise ConfigError(f"--gpus: GPU {bad[0]} does not exist; this machine has {n} (0..{n - 1})")


def compute_init(device: str | None = None) -> Dist:
    """rank/world/device; initialises the process group only under torchrun with world > 1."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = parse_device(device, local_rank)
    if dev.type == "cuda" and dev.index is None:  # "cuda" means this process's GPU
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend=backend, device_id=dev if dev.type == "cuda" else None)
        # the group goes down before the interpreter does: left to C++ static destruction, gloo's threads can abort
        # a rank whose work is done ("terminate called without an active exception", exit -6)
        atexit.register(compute_cleanup)
    return Dist(rank, local_rank, world, dev)


def compute_cleanup() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def finish() -> None:
    """A rank whose command succeeded: wait for the others (they may still be writing what rank 0 reports), then take
    the group down, so that no rank tears its connections down while a peer still uses the group (a finished rank of
    a 2-process extract in CI aborted at exit with "terminate called without an active exception" while rank 0 was
    still opening the cache it had written). Only on success: a rank that failed exits at once, and torchrun stops
    the ranks that wait here."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def print0(*args, **kwargs) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def write_json0(path: str, obj) -> None:
    """A run summary, written once: by global rank 0 under torchrun (ranks' summaries differ)."""
    if int(os.environ.get("RANK", 0)) == 0:
        atomic_json(path, obj)


def launch_torchrun(module: str, argv: list[str], gpus: str) -> int:
    """Re-launch `python -m module argv` under torchrun on the given GPU ids (the --gpus convenience)."""
    import subprocess

    cmd, env = torchrun_command(module, argv, gpus, os.environ)
    check_gpu_ids(env["CUDA_VISIBLE_DEVICES"].split(","))
    return subprocess.call(cmd, env=env)


def torchrun_command(module: str, argv: list[str], gpus: str, environ) -> tuple[list[str], dict[str, str]]:
    """(command, environment) that run `python -m module argv` under torchrun, one process per id in `gpus`
    ("0,1,2"), with only those GPUs visible; ConfigError naming --gpus for a malformed list. Pure: whether
    the GPUs exist is check_gpu_ids' business."""
    import sys

    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids or not all(g.isdigit() for g in ids):
        raise ConfigError(f"--gpus expects a comma-separated list of GPU ids such as 0,1,2 (got {gpus!r})")
    env = dict(environ, CUDA_VISIBLE_DEVICES=",".join(ids))
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(ids)}",
           "-m", module, *argv]
    return cmd, env


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on GPU, float32 on CPU (CPUs without bf16 matrix units run it several times slower)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]
