"""How the training step is compiled, and how a new process skips most of that work.

Scopes (TrainConfig.compile_scope, `dflash train --compile-scope`):
  regions (the default): model.forward_slots (the blocks, their masks, fc, the decoder layers, the final norm) is one
      graph, fullgraph, CUDA graphs on a GPU (mode reduce-overhead). The loss runs its chunk loop in Python, every
      chunk through one compiled linear_ce_chunk (no CUDA graph: a few launches per chunk), compiled once for the
      chunk's shape and reused by every chunk and step (train/loss.even_chunk makes the chunks one shape).
  step: the whole forward_train as one graph, the way it was. Inside one graph the chunk loop is unrolled, and each
      chunk gets its own copies of the loss's fused kernels (the chunk's slice offsets are constants in their code).
      Kept to measure against (bench/train.py --compile-scopes regions,step).
  A DFlash2 drafter's loss (train/drafter/dflash2.py) runs the same way with its KL chunk compiled; the selector's few ops
  around it run eagerly.
  The repeated decoder layers need no region of their own: their kernels are identical source, which inductor builds
  once per graph. On a fresh machine the first compiled call at the Qwen3-8B shape takes 39 s on an H200 (47 kernels
  built on 16 cores, the last 25 s after the first); it took 204-242 s while the flex BlockMask came from
  create_block_mask traced into the graph, one of whose kernels took 174 s to build (train/blocks.block_mask,
  BENCHMARKS.md "First compiled step"; bench/train.py --isolate fresh names the slowest kernels).

Artifacts (torch's "mega-cache"): once the first compiled step has run (and passed its check), rank 0 saves
torch.compiler.save_cache_artifacts() (inductor's graphs, AOT autograd's, the built Triton kernels) as
DIR/<key>.bin, then DIR/<key>.json: its size and sha256, the torch / Triton / CUDA versions, the device, and the step
it is for (the key hashes the drafter config, batch shape, dtype, attention, scope and mode). DIR is RUN/compile by
default (--compile-cache DIR shares it between runs; 'off': none). Before compiling, every rank loads the file
whose record matches this process (same key, versions, device) and whose bytes have that size and checksum; inductor
then finds its kernels built (a restart, a resume on a fresh machine that has the run directory). Any mismatch is
a note and the file is not loaded: an artifact is never trusted unchecked. A record that cannot be one (not UTF-8,
not JSON, not an object, its env not an object, a directory) is set aside with the payload (DIR/damaged-<key>.*, never
deleted) and noted, and the run saves a good pair. The note says whether torch took the checked payload: a payload it
cannot read is "ignored" (the step compiles from scratch), never "loaded". The files hold pickled compiler state:
load only directories you wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
from typing import Any, Callable

import torch

from dflash.core.io import atomic_json, atomic_write, short_hash

from dflash.train.drafter.blocks import Blocks
from dflash.train.drafter.dflash2 import DFlash2Drafter, kl_chunk
from dflash.train.drafter.loss import chunked_block_loss, linear_ce_chunk

SCOPES = ("regions", "step")
DAMAGED = "damaged-"  # prefix of a damaged record (and its payload) set aside in DIR, never deleted
_BLOCK_FIELDS = tuple(f.name for f in dataclasses.fields(Blocks))


def compile_step(model, scope: str, cuda: bool) -> Callable:
    """The compiled step: a function with forward_train's signature returning (loss, metrics). Compiles lazily (at
    its first call), as torch.compile does."""
    mode = "reduce-overhead" if cuda else None
    if scope == "step":
        return torch.compile(model.forward_train, mode=mode, dynamic=False, fullgraph=True)
    if scope != "regions":
        raise ValueError(f"compile scope must be one of {SCOPES}, got {scope!r}")

    def slots(hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, hidden_scales):
        h, blocks = model.forward_slots(hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors,
                                        hidden_scales)
        return h, tuple(getattr(blocks, name) for name in _BLOCK_FIELDS)  # plain tensors out of the graph

    trunk = torch.compile(slots, mode=mode, dynamic=False, fullgraph=True)
    if isinstance(model, DFlash2Drafter):  # its loss: the KL chunk compiled once, the selector's few ops eager
        kl = torch.compile(kl_chunk, dynamic=False, fullgraph=True)

        def step2(hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors: int, gamma: float = 7.0,
                  hidden_scales=None):
            h, parts = trunk(hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, hidden_scales)
            return model.slot_loss(h, Blocks(*parts), model.target_hidden(hidden, hidden_scales), gamma,
                                   model.selector_loss_alpha, kl)

        return step2
    chunk = torch.compile(linear_ce_chunk, dynamic=False, fullgraph=True)

    def step(hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors: int, gamma: float = 7.0,
             hidden_scales=None):
        h, parts = trunk(hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, hidden_scales)
        return chunked_block_loss(h, model.lm_head_weight, Blocks(*parts), gamma, chunk)

    return step


def environment() -> dict[str, Any]:
    """What compiled code depends on besides the step: versions and the device."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - no Triton (a CPU build): none recorded
        triton_version = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda, "device": device,
            "python": platform.python_version()}


class CompileArtifacts:
    """The saved compile artifacts of one step in `directory` (the module docstring): load() before compiling,
    save() after the first compiled step. Both return a one-line note of what they did."""

    def __init__(self, directory: str | None, step: dict[str, Any]):
        self.dir = directory
        self.env = environment()
        self.step = step
        self.key = short_hash(json.dumps(step, sort_keys=True, default=str))
        self.loaded = False

    @property
    def paths(self) -> tuple[str, str]:
        return os.path.join(self.dir, f"{self.key}.bin"), os.path.join(self.dir, f"{self.key}.json")

    def load(self) -> str:
        if not self.dir:
            return "compile artifacts off"
        data_path, rec_path = self.paths
        if not os.path.lexists(rec_path):
            return f"no compile artifacts for this step in {self.dir}"
        try:
            with open(rec_path, "rb") as f:
                rec = json.loads(f.read().decode("utf-8"))
            if not isinstance(rec, dict):
                raise ValueError(f"a JSON {type(rec).__name__}, not a compile record")
            if not isinstance(rec.get("env", {}), dict):
                raise ValueError(f"its env is a JSON {type(rec['env']).__name__}, not an object")
        except (OSError, ValueError) as e:  # a damaged record: set aside, so that this run saves a good one
            return f"compile artifacts {data_path} ignored: {rec_path} is damaged ({e}); {self._set_aside()}"
        try:
            with open(data_path, "rb") as f:
                data = f.read()
        except OSError as e:
            return f"compile artifacts {data_path} ignored: unreadable ({e})"
        why = self._mismatch(rec, data)
        if why:
            return f"compile artifacts {data_path} ignored: {why}"
        try:
            loaded = _quietly(torch.compiler.load_cache_artifacts, data)
        except Exception as e:  # noqa: BLE001 - a cache that cannot be loaded only costs the compile time
            loaded, failure = None, f"{type(e).__name__}: {e}"
        else:
            failure = "not a payload it can read"
        if loaded is None:  # torch returns None for a payload it cannot unpickle (its size and checksum matched)
            return (f"compile artifacts {data_path} ignored: checked, but torch could not load them ({failure}); "
                    "the step compiles from scratch")
        self.loaded = True
        count = sum(len(v) for v in getattr(loaded, "artifacts", {}).values())
        return (f"loaded compile artifacts {data_path} ({len(data) / 2**20:.1f} MiB, checked; torch took "
                f"{count} entries)")

    def _set_aside(self) -> str:
        """Move this key's record and payload aside (DAMAGED prefix, kept for inspection); what was done, in words."""
        moved = []
        for path in self.paths:
            if os.path.lexists(path):
                aside = os.path.join(self.dir, DAMAGED + os.path.basename(path))
                try:
                    if os.path.isdir(aside) and not os.path.islink(aside):
                        shutil.rmtree(aside)
                    os.replace(path, aside)
                    moved.append(os.path.basename(aside))
                except OSError as e:
                    return f"could not set it aside ({e})"
        return f"kept aside as {', '.join(moved)}"

    def _mismatch(self, rec: dict, data: bytes) -> str | None:
        if rec.get("key") != self.key or rec.get("step") != json.loads(json.dumps(self.step, default=str)):
            return "written for another step"
        for k, v in self.env.items():
            if rec.get("env", {}).get(k) != v:
                return f"written with {k} {rec.get('env', {}).get(k)!r}, this process has {v!r}"
        if rec.get("bytes") != len(data):
            return f"{len(data)} bytes, its record says {rec.get('bytes')} (truncated or replaced)"
        if rec.get("sha256") != hashlib.sha256(data).hexdigest():
            return "checksum mismatch (damaged or replaced)"
        return None

    def save(self) -> str:
        if not self.dir:
            return ""
        try:
            got = torch.compiler.save_cache_artifacts()
        except Exception as e:  # noqa: BLE001 - saving is an optimisation: never stop a run for it
            return f"compile artifacts not saved: {type(e).__name__}: {e}"
        if not got:
            return "compile artifacts not saved: torch has none to give"
        data = got[0]
        data_path, rec_path = self.paths
        try:
            os.makedirs(self.dir, exist_ok=True)
            atomic_write(data_path, data)
            atomic_json(rec_path, {"key": self.key, "step": self.step, "env": self.env, "bytes": len(data),
                                   "sha256": hashlib.sha256(data).hexdigest()})  # the record last: it vouches
        except OSError as e:
            return f"compile artifacts not saved ({e})"
        return f"saved compile artifacts {data_path} ({len(data) / 2**20:.1f} MiB)"


def _quietly(fn, *args):
    """fn(*args) with torch's compile-cache logger silenced: it logs a traceback for a payload it cannot unpickle,
    which load() reports in its one note."""
    logger = logging.getLogger("torch.compiler._cache")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return fn(*args)
    finally:
        logger.setLevel(level)


def cache_counters() -> dict[str, int]:
    """How many compiled graphs inductor took from its cache (hit) or built (miss) so far in this process."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {"fx_graph_cache_hit": int(c.get("fxgraph_cache_hit", 0)), "fx_graph_cache_miss": int(c.get("fxgraph_cache_miss", 0))}
