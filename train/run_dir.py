"""The run directory and its checkpoints: what --out may be, run.json, metrics.jsonl on resume, step_N/ and latest.

A run directory holds run.json (its marker and settings), metrics.jsonl, summary.json, checkpoints/step_N
(model.safetensors, optimizer.pt, trainer.json; written under a temporary name, then renamed) with `latest`
naming the newest, and final/. Nothing else in it is ever removed; a failed write names its file and the
last good checkpoint, which stays intact.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from dflash.core.dist import atomic_json
from dflash.core.io import atomic_write
from dflash.core.paths import check_output_dir, inside, is_url
from dflash.train.checkpoint import save_drafter
from dflash.train.config import IDENTITY, TrainConfig, TrainError
from dflash.train.model import DFlashDrafter
from dflash_cache.lock import LOCK_NAME


# What a run directory holds: RUN/run.json ({"dflash": "train", ...}) marks it as dflash's; --overwrite removes
# exactly these entries of such a directory (and never a directory without the marker).
RUN_MARKER = "run.json"
RUN_ENTRIES = ("run.json", "metrics.jsonl", "summary.json", "checkpoints", "final", "final.tmp", "wandb")


def _run_marker(out: str) -> dict | None:
    """RUN/run.json when it is a dflash train record, else None."""
    try:
        with open(os.path.join(out, RUN_MARKER)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("dflash") == "train" else None


def _describe_dir(out: str, entries: list[str]) -> str:
    if "zarr.json" in entries:
        return "a zarr store (a dflash cache?)"
    head = ", ".join(sorted(entries)[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    return f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'} not written by dflash train: {head}"


def check_out_path(cfg: TrainConfig) -> None:
    """Before anything is written: --out may be a new or empty directory or a dflash train run directory, never
    a file, a user's folder, a cache, nor anything holding or inside the cache this run reads."""
    check_output_dir(cfg.out, "out")
    if not is_url(cfg.cache) and (inside(cfg.cache, cfg.out) or inside(cfg.out, cfg.cache)):
        how = "is" if os.path.realpath(cfg.cache) == os.path.realpath(cfg.out) else (
            "contains" if inside(cfg.cache, cfg.out) else "lies inside")
        raise TrainError(f"--out {cfg.out} {how} the cache this run reads (--cache {cfg.cache}); "
                         "a run directory must be apart from its cache: choose another --out")
    if not os.path.isdir(cfg.out):
        return
    entries = [n for n in os.listdir(cfg.out) if not n.startswith(LOCK_NAME)]
    if entries and _run_marker(cfg.out) is None:
        raise TrainError(f"--out {cfg.out} is not a dflash run directory (it holds {_describe_dir(cfg.out, entries)}); "
                         "choose another --out (--overwrite only replaces a dflash train run directory, one with run.json)")


def _remove_run(out: str) -> None:
    """Remove what dflash train wrote in RUN (RUN_ENTRIES), nothing else (not the lock, not a user's file)."""
    for name in RUN_ENTRIES:
        p = os.path.join(out, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)


def check_run_dir(cfg: TrainConfig, resolved: dict[str, Any]) -> None:
    """RUN/run.json must describe the same run (else error, or start over with --overwrite)."""
    check_out_path(cfg)
    path = os.path.join(cfg.out, RUN_MARKER)
    old_doc = _run_marker(cfg.out)
    if old_doc is not None:
        old = old_doc.get("config", {})
        for k in IDENTITY:
            if json.dumps(old.get(k)) != json.dumps(resolved.get(k)):
                if cfg.overwrite:
                    _remove_run(cfg.out)
                    break
                raise TrainError(f"{cfg.out} holds a different run: setting '{k}' was {old.get(k)!r}, now "
                                 f"{resolved.get(k)!r}; use another --out, or --overwrite to start over")
    elif cfg.overwrite and os.path.isdir(cfg.out):
        _remove_run(cfg.out)
    os.makedirs(os.path.join(cfg.out, "checkpoints"), exist_ok=True)
    atomic_json(path, {"config": resolved, "dflash": "train"})


def latest_checkpoint(out: str) -> str | None:
    p = os.path.join(out, "checkpoints", "latest")
    if not os.path.exists(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    full = os.path.join(out, "checkpoints", name)
    return full if os.path.exists(os.path.join(full, "trainer.json")) else None


def finished_run(out: str, step: int, total_steps: int) -> dict[str, Any] | None:
    """The summary of a run that already finished its total_steps (restored at step == total_steps, with
    summary.json of that step and final/), with steps_this_run 0; else None. A rerun then changes nothing."""
    path = os.path.join(out, "summary.json")
    if step < total_steps or not (os.path.exists(path) and os.path.isdir(os.path.join(out, "final"))):
        return None
    with open(path) as f:
        summary = json.load(f)
    return dict(summary, steps_this_run=0) if summary.get("steps") == step else None


def read_metrics(out: str) -> list[dict]:
    """The records of RUN/metrics.jsonl in order ([] before the first one is logged)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def drop_metrics_after(out: str, step: int) -> None:
    """Remove the records of steps > step from RUN/metrics.jsonl (they are about to be redone)."""
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= step]
        atomic_write(metrics, "".join(keep))


class DiskWriteError(TrainError):
    """A checkpoint file that could not be written (disk full, quota, file too large, I/O error)."""


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: itself, its cause/context (torch.save wraps it in a RuntimeError), or the
    `os error N` that safetensors puts in its message."""
    import re

    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, OSError):
            return e
        m = re.search(r"os error (\d+)", str(e))
        if m:
            n = int(m.group(1))
            return OSError(n, os.strerror(n))
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


class writing:
    """`with writing(file, last_good, cleanup):` turns an I/O failure while writing `file` into one DiskWriteError
    naming it and the last good checkpoint (which is left intact); `cleanup` (a partial directory) is removed."""

    def __init__(self, file: str, last_good: str | None, cleanup: str | None = None):
        self.file, self.last_good, self.cleanup = file, last_good, cleanup

    def __enter__(self):
        return self

    def __exit__(self, typ, e, tb):
        if e is None:
            return False
        err = _os_error(e)
        if err is None:
            return False  # not an I/O failure: the traceback is shown
        if self.cleanup:
            shutil.rmtree(self.cleanup, ignore_errors=True)
        import errno

        what = {errno.ENOSPC: "disk full", errno.EFBIG: "file too large for the filesystem or limit",
                errno.EDQUOT: "disk quota exceeded"}.get(err.errno, err.strerror or str(err))
        raise DiskWriteError(f"cannot write {self.file}: {what} (errno {err.errno}); the last good checkpoint "
                             f"{self.last_good or '(none yet)'} is intact: free space and rerun the same command to resume")


def save_checkpoint(out: str, step: int, model: DFlashDrafter, opt: torch.optim.Optimizer, state: dict, keep: int) -> str:
    """RUN/checkpoints/step_N (written under a temporary name, then renamed), then `latest` points to it.
    A failed write (disk full, ...) is a DiskWriteError naming the file; the previous checkpoint stays intact."""
    ck = os.path.join(out, "checkpoints")
    name = f"step_{step:08d}"
    tmp = os.path.join(ck, name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    last_good = latest_checkpoint(out)
    with writing(os.path.join(tmp, "model.safetensors"), last_good, cleanup=tmp):
        save_drafter(model, tmp, dtype=next(model.parameters()).dtype)
    with writing(os.path.join(tmp, "optimizer.pt"), last_good, cleanup=tmp):
        with open(os.path.join(tmp, "optimizer.pt"), "wb") as f:  # a file object: the OSError stays visible
            torch.save(opt.state_dict(), f)
    with writing(os.path.join(tmp, "trainer.json"), last_good, cleanup=tmp):
        atomic_json(os.path.join(tmp, "trainer.json"), state)
    final = os.path.join(ck, name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    with writing(os.path.join(ck, "latest"), last_good):
        atomic_write(os.path.join(ck, "latest"), name)
    olds = sorted(d for d in os.listdir(ck) if d.startswith("step_") and not d.endswith(".tmp"))
    for d in olds[:-keep]:
        shutil.rmtree(os.path.join(ck, d), ignore_errors=True)
    return final


def load_checkpoint(ck: str, model: DFlashDrafter, opt: torch.optim.Optimizer, device: torch.device) -> dict:
    """Load step_N's weights and optimizer state into model and opt; its trainer.json (the step) is returned."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(ck, "model.safetensors"), device=str(device))
    model.load_state_dict(sd, strict=False)
    opt.load_state_dict(torch.load(os.path.join(ck, "optimizer.pt"), map_location=device, weights_only=True))
    with open(os.path.join(ck, "trainer.json")) as f:
        return json.load(f)


def save_final(out: str, model: DFlashDrafter) -> str:
    """RUN/final: the servable drafter in bf16 (written as final.tmp, then renamed)."""
    final = os.path.join(out, "final")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(os.path.join(tmp, "model.safetensors"), latest_checkpoint(out), cleanup=tmp):
        save_drafter(model, tmp, dtype=torch.bfloat16)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final
