"""The compiled step's check: its first-batch loss and gradients against the eager step's, and the compile count.

A guard, not a formality: at the Qwen3-8B shape torch 2.11 once compiled the step into wrong gradients (fixed
by blocks.make_blocks_opaque; BENCHMARKS.md, "Compiled step"), and a run must not learn from such a step
silently. The eager reference runs its attention through dense SDPA: no kernel shared with flex_attention,
nothing compiled. On disagreement the trainer continues eagerly (Trainer.verify_compiled).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

# The compiled step passes its check when its first-batch loss and gradients are those of the eager step up to
# bf16 rounding. Measured at the Qwen3-8B shape on an H200: eager bf16 vs float32 differ by 1e-5 (loss) and
# 0.023 (gradients, relative L2 over all parameters); the faulty compiled graph differed by 7.5e-4 and 0.79.
CHECK_LOSS_RTOL = 1e-3
CHECK_GRAD_RTOL = 0.15


def check_compiled(compiled_fn, model, params: list[torch.Tensor], args: tuple, cuda: bool, dist) -> dict[str, Any]:
    """The compiled step `compiled_fn` against model.forward_train with dense SDPA attention, both on args (one
    micro-batch): loss and gradients of `params`. Every rank ends with the same verdict ("passed")."""

    def loss_and_grads(fn):
        loss, _ = fn(*args)
        loss.backward()
        grads = [p.grad.detach().clone() for p in params]
        for p in params:
            p.grad = None
        return float(loss.detach()), grads

    t0 = time.perf_counter()
    phases0 = compile_phases()
    if cuda:
        torch.compiler.cudagraph_mark_step_begin()
    loss_c, g_c = loss_and_grads(compiled_fn)
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    phases = {k: round(v - phases0.get(k, 0.0), 2) for k, v in compile_phases().items()}
    saved = model.attn_impl
    model.attn_impl = "sdpa"
    try:
        loss_e, g_e = loss_and_grads(model.forward_train)
        res: dict[str, Any] = {"ran": True}
    except torch.OutOfMemoryError:
        for p in params:
            p.grad = None
        torch.cuda.empty_cache()
        res = {"ran": False, "why": "the eager reference did not fit in memory"}
    finally:
        model.attn_impl = saved
    ok = True
    if res["ran"]:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        agree = grad_agreement(g_c, g_e, names)
        grad_err = agree["global_rel_err"]
        loss_err = abs(loss_c - loss_e) / max(abs(loss_e), 1e-6)
        ok = math.isfinite(loss_c) and loss_err <= CHECK_LOSS_RTOL and grad_err <= CHECK_GRAD_RTOL
        res.update(loss_compiled=loss_c, loss_eager=loss_e, loss_rel_err=loss_err, grad_rel_err=grad_err,
                   min_grad_cos=agree["min_cos"], min_grad_cos_param=agree["min_cos_param"])
    if dist.distributed:  # every rank goes on the same way (and each takes part, checked or not)
        flag = torch.tensor([1.0 if ok else 0.0], device=dist.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        ok = bool(flag.item() == 1.0)
    t2 = time.perf_counter()
    res.update(passed=ok, seconds=t2 - t0, compiled_s=t1 - t0, eager_s=t2 - t1, compile_phases=phases)
    return res


# torch's own compile-time counters (torch._dynamo.utils.compile_times: seconds per phase, summed over the process)
# that say where a first compiled call's time went. Nested: the forward's inductor compile is inside AOT autograd
# (compile_phases reports AOT autograd's own part), and the kernel builds are inside the two inductor phases.
_PHASES = {"dynamo": "bytecode_tracing", "aot autograd": "create_aot_dispatcher_function",
           "inductor forward": "compile_fx.<locals>.fw_compiler_base", "inductor backward": "compile_fx.<locals>.bw_compiler",
           "kernel builds waited for": "async_compile.wait"}


def compile_phases() -> dict[str, float]:
    """Seconds spent so far in this process in each of _PHASES ({} where torch does not say: a private API)."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        got = dict(zip(names, (float(v) for v in values)))
    except Exception:  # noqa: BLE001 - a diagnostic only: its absence must not stop training
        return {}
    out = {k: got.get(v, 0.0) for k, v in _PHASES.items()}
    out["aot autograd"] = max(0.0, out["aot autograd"] - out["inductor forward"])  # its own part
    return out


def _timing(c: dict[str, Any]) -> str:
    """'first compiled call 231 s (dynamo 10, ...), eager reference 3 s' for the check's line."""
    ph = ", ".join(f"{k} {v:.0f}" for k, v in c.get("compile_phases", {}).items() if v >= 0.5)
    return (f"first compiled call {c['compiled_s']:.0f} s" + (f" ({ph})" if ph else "")
            + f", eager reference {c['eager_s']:.0f} s")


def check_and_report(compiled_fn, model, params, args: tuple, cuda: bool, dist) -> tuple[dict[str, Any], bool]:
    """check_compiled, said in one line; on disagreement a warning, and the compiled graphs released (the caller
    then trains with the eager step). Returns (the check's record, whether the compiled step may be used)."""
    from dflash.core.dist import print0

    c = check_compiled(compiled_fn, model, params, args, cuda, dist)
    if c["ran"]:
        print0(f"train: compiled step vs eager on the first batch: loss {c['loss_compiled']:.5f} vs "
               f"{c['loss_eager']:.5f}, gradient error {c['grad_rel_err']:.3g} (lowest cosine "
               f"{c['min_grad_cos']:.4f}, {c['min_grad_cos_param']}): {'agree' if c['passed'] else 'DISAGREE'}; "
               f"{_timing(c)}")
    else:
        print0(f"train: note: compiled-step check skipped: {c['why']}")
    if not c["passed"]:
        print0("train: WARNING: the compiled step disagrees with the eager one at this shape; continuing with the "
               "eager step (slower, correct). --no-compile-check skips the check; --compile off skips compilation.")
        release_compiled(cuda)
    return c, bool(c["passed"])


def grad_agreement(grads: list[torch.Tensor], ref: list[torch.Tensor], names: list[str]) -> dict[str, Any]:
    """How far gradients are from reference ones: relative L2 error over all tensors together, and per tensor
    its relative error and cosine (the lowest cosine and whose it is, too)."""
    rows, num, den = [], 0.0, 0.0
    for n, g, r in zip(names, grads, ref):
        g, r = g.float().reshape(-1), r.float().reshape(-1)
        d, rn = float((g - r).norm()), float(r.norm())
        cos = float((g @ r) / (g.norm() * r.norm()).clamp(min=1e-30))
        rows.append({"param": n, "rel_err": d / max(rn, 1e-30), "cos": cos})
        num, den = num + d * d, den + rn * rn
    low = min(rows, key=lambda x: x["cos"])
    return {"global_rel_err": math.sqrt(num / max(den, 1e-30)), "min_cos": low["cos"], "min_cos_param": low["param"],
            "per_param": rows}


def compile_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def release_compiled(cuda: bool) -> None:
    """Drop the compiled graphs and their CUDA-graph memory pool (the eager step needs that memory)."""
    import torch._dynamo

    torch._dynamo.reset()
    if cuda:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
        torch.cuda.empty_cache()
