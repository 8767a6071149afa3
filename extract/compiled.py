"""A compiled target forward for extraction, checked against the eager forward before the job runs.

    runner, report = compiled_or_eager(target, first_batch, rows, seq_len)   # target: extract.target.PackedTarget
    runner.run(ids, pos, doc, out)                                          # same contract as PackedTarget.run

Contract:
  * `CompiledTarget` runs `torch.compile(target.model, dynamic=False)` (the truncated HF model with the same
    capture hooks and document mask as the eager path; on the GPU the flex document mask). Rows have a fixed
    shape, so it compiles once per (rows, seq_len) (on the GPU every batch has batch_rows rows). The hooks write
    into one fixed buffer per shape, copied into `out` after the forward (the graph's inputs keep one identity).
  * With the flex mask, attention stays outside the compiled graph (`split_flex_attention`): the model's
    attention implementation becomes SPLIT_ATTN, HF's flex attention behind `torch.compiler.disable`, so each
    layer's attention runs HF's own separately compiled flex kernel (as the eager forward does) and the rest of
    the layer is compiled around it (one graph break per layer). Why: inside one whole-model graph inductor
    fuses the q/k RMSNorm and rotary embedding into the flex kernel, and that kernel took 151 ms of a 485 ms
    forward where the eager forward's flex kernel took 61 ms (H200, Qwen3-8B shape, 4 rows of 4096;
    BENCHMARKS.md, "The compiled forward's attention"). Inductor's `prologue_fusion = False` does not stop it
    (measured). Outside compilation the wrapper is the plain flex call, so the eager path is unchanged.
  * `check_compiled` runs the first batch three ways: eager, compiled, and (for a bf16 target) eager with the
    weights temporarily in float32, the reference. Per captured layer k, over real tokens:
        err_eager_k    = ||eager_k - ref_k|| / ||ref_k||      (what bf16 rounding alone costs)
        err_compiled_k = ||compiled_k - ref_k|| / ||ref_k||
    and the compiled forward passes when err_compiled_k <= max(FLOOR, FACTOR * err_eager_k) for every layer.
    Why: a compiled graph computes the same bf16 operations with other fusion and rounding points, so its
    distance to the float32 result is of the order of eager bf16's own (FACTOR = 2 allows for that); a wrong
    graph (a dropped mask, a wrong layer, a mis-fused op) lands at O(1) relative error. For a float32 target,
    the reference is eager itself and compiled float32 must agree within FLOOR = 1e-3 (measured ~1e-6).
  * `compiled_or_eager` compiles and checks; on a failed check or a compile error it says so (the report's
    `why`) and returns the eager target: the run continues eagerly. The report goes into the run summary.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dflash.extract.target import PackedTarget

FACTOR = 2.0
FLOOR = 1e-3
SPLIT_ATTN = "dflash_flex_outside_graph"  # the attention implementation name of split_flex_attention


def split_flex_attention(model) -> bool:
    """Makes `model` (an HF model on flex attention) run its attention outside any compiled graph (module
    docstring); True if it did, False if the model does not use flex attention."""
    if model.config._attn_implementation not in ("flex_attention", SPLIT_ATTN):
        return False
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward

    AttentionInterface.register(SPLIT_ATTN, torch.compiler.disable(flex_attention_forward))
    model.config._attn_implementation = SPLIT_ATTN
    return True


class CompiledTarget:
    """PackedTarget.run through a torch.compile'd model (module docstring)."""

    def __init__(self, target: PackedTarget, mode: str | None = None, split_attention: bool = True):
        self.target = target
        self.split_attention = split_attention and split_flex_attention(target.model)
        target.capture.hooks_outside_graph(self.split_attention)
        self.model = torch.compile(target.model, dynamic=False, mode=mode)
        self.bufs: dict[tuple, torch.Tensor] = {}

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor, out: torch.Tensor,
            doc_host: torch.Tensor | None = None):
        key = (tuple(out.shape), out.dtype)
        if key not in self.bufs:
            self.bufs[key] = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        buf = self.bufs[key]
        self.target.forward(self.model, input_ids, position_ids, doc_ids, buf, doc_host)
        out.copy_(buf)
        out.masked_fill_((doc_ids == 0)[..., None], 0)
        return out


def _rel_errors(x: torch.Tensor, ref: torch.Tensor, real: torch.Tensor, K: int) -> list[float]:
    """Per captured layer, ||x - ref|| / ||ref|| over real tokens (float64 sums)."""
    H = ref.shape[-1] // K
    out = []
    for k in range(K):
        a = x[..., k * H:(k + 1) * H][real].double()
        b = ref[..., k * H:(k + 1) * H][real].double()
        out.append(float((a - b).norm() / b.norm().clamp(min=1e-30)))
    return out


def check_compiled(target: PackedTarget, runner, ids, pos, doc) -> dict[str, Any]:
    """The compiled runner against eager (and a float32 reference for a low-precision target) on one batch."""
    K = len(target.layer_ids)
    shape = (*ids.shape, K * target.hidden_size)
    real = doc != 0
    eager = target.run(ids, pos, doc, torch.zeros(shape, dtype=torch.float32, device=ids.device))
    t0 = time.perf_counter()
    compiled = runner.run(ids, pos, doc, torch.zeros(shape, dtype=torch.float32, device=ids.device))
    first_call_s = time.perf_counter() - t0  # the compile, mostly
    dtype = next(target.model.parameters()).dtype
    if dtype == torch.float32:
        ref, err_eager = eager, [0.0] * K
    else:
        target.model.float()
        try:
            ref = target.run(ids, pos, doc, torch.zeros(shape, dtype=torch.float32, device=ids.device))
        finally:
            target.model.to(dtype)
        err_eager = _rel_errors(eager, ref, real, K)
    err_compiled = _rel_errors(compiled, ref, real, K)
    tol = [max(FLOOR, FACTOR * e) for e in err_eager]
    passed = all(c <= t for c, t in zip(err_compiled, tol)) and bool(torch.isfinite(compiled).all())
    return {"passed": passed, "layer_ids": list(target.layer_ids), "err_compiled_vs_ref": err_compiled,
            "err_eager_vs_ref": err_eager, "tolerance": tol, "reference": "eager float32" if dtype != torch.float32
            else "eager (float32 target)", "err_compiled_vs_eager": _rel_errors(compiled, eager, real, K),
            "first_call_s": first_call_s}


def compiled_or_eager(target: PackedTarget, first_batch: tuple, mode: str | None = None, make=None):
    """(runner, report): the checked compiled target, or the eager one with the reason (module docstring)."""
    t0 = time.perf_counter()
    try:
        runner = (make or CompiledTarget)(target, mode)
        report = check_compiled(target, runner, *first_batch)
    except Exception as e:  # noqa: BLE001  (inductor/dynamo failures are many kinds; eager still works)
        return target, {"compiled": False, "passed": False, "why": f"compile failed: {type(e).__name__}: {e}"[:500],
                        "seconds": time.perf_counter() - t0}
    report["seconds"] = time.perf_counter() - t0
    if not report["passed"]:
        worst = max(range(len(report["layer_ids"])),
                    key=lambda k: report["err_compiled_vs_ref"][k] / report["tolerance"][k])
        report["why"] = (f"compiled forward disagrees with eager at layer {report['layer_ids'][worst]}: relative error "
                         f"{report['err_compiled_vs_ref'][worst]:.3g} vs tolerance {report['tolerance'][worst]:.3g}")
        report["compiled"] = False
        return target, report
    report["compiled"] = True
    return runner, report
