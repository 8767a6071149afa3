"""Does the compiled CUDA-graph training step compute what the eager one does, at a real shape?

    python bench/compile_check.py                          # Qwen3-8B-shaped drafter on the GPU
    python bench/compile_check.py --shape demo --steps 20  # the demo-size drafter
    python bench/compile_check.py --shape tiny --device cpu --attn sdpa   # a smoke run on CPU

Two parts, on the same random drafter and synthetic batches (bench/train.py's rows, on the device):

1. One step, three ways: eager in float32 (the reference; on the GPU its attention is the flex kernel
   too, so bench/flex_check.py checks the pieces against SDPA), eager in bf16 and compiled in bf16
   (`torch.compile(mode="reduce-overhead")`, as `dflash train` runs it; on CPU without CUDA graphs).
   Reports the loss and, per parameter tensor, the gradient's relative error and cosine against the
   float32 reference: the compiled step is right when its errors are of the size of eager bf16's.
   If they are not, `mode="default"` (the same graph without CUDA graphs) is tried as well.
   --variant compiles something other than the whole forward_train, to locate a fault:
     mask_outside  blocks and block masks built eagerly (model.prepare), the rest in one graph (forward_blocks)
     attn_outside  as mask_outside, with attention called outside the graph (a graph break per layer)
   --inductor sets torch._inductor.config flags (e.g. allow_buffer_reuse=False) for the compiled step.
2. Loss trajectories of the trainer's update (clip 1.0, fused AdamW, tensor learning rate, cosine
   schedule) for each --warmups value: eager, compiled, and eager started from weights moved by one
   bf16 ulp in random places. When the compiled curve departs from the eager one no more than that
   one-ulp copy does, the departure is the schedule amplifying rounding, not a wrong step.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import QWEN3_8B, SMOLLM2, hardware, qwen3_config  # noqa: E402
from bench.train import SHAPES, synthetic_rows  # noqa: E402

TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
ALL_SHAPES = {**SHAPES, "tiny": (TINY, 256, 2, 32, 16, 2)}


def build(shape, device: str, attn: str, seed: int = 0):
    from dflash.train.model import DFlashDrafter, DrafterConfig
    from dflash.core.layers import default_layer_ids

    tshape, T, rows, anchors, block, layers = shape
    hf = qwen3_config(tshape)
    L = tshape["num_hidden_layers"]
    dcfg = DrafterConfig.from_target(hf, num_layers=layers, layer_ids=default_layer_ids(L), block_size=block,
                                     mask_token_id=tshape["vocab_size"] - 1)
    model = DFlashDrafter(dcfg, attn_impl=attn)
    model.reset_parameters(seed=seed)
    model.to(device, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    V, H = tshape["vocab_size"], tshape["hidden_size"]
    emb = (torch.randn(V, H, generator=g, device=device) * 0.02).to(torch.bfloat16)
    head = (torch.randn(V, H, generator=g, device=device) * 0.02).to(torch.bfloat16)
    model.set_target_head(emb, head)
    return model, dcfg


def batches(shape, dcfg, n: int, device: str, seed: int = 0):
    tshape, T, rows, anchors, block, layers = shape
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids, lm, doc, hid = synthetic_rows(rows, T, tshape["hidden_size"] * dcfg.num_context_layers,
                                           tshape["vocab_size"], rng, g)
        sg = torch.Generator().manual_seed(1000 + i)
        out.append((hid.to(device), torch.from_numpy(ids).to(device), torch.from_numpy(lm).to(device),
                    torch.from_numpy(doc).to(device), torch.rand(rows, T, generator=sg).to(device)))
    return out


def fwd_bwd(fn, model, batch, anchors: int, gamma: float, cuda_graphs: bool):
    """loss (float) and the gradients (cloned out of any graph pool), parameters' grads cleared."""
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    loss, met = fn(*batch, anchors, gamma)
    loss.backward()
    grads = [p.grad.detach().float().clone() for p in model.parameters() if p.requires_grad]
    for p in model.parameters():
        p.grad = None
    return float(loss.detach()), grads


def compare(grads, ref, names):
    from dflash.train.compile_check import grad_agreement

    out = grad_agreement(grads, ref, names)
    out["worst"] = max(out["per_param"], key=lambda x: x["rel_err"])
    out["grad_norm"] = math.sqrt(sum(float(g.norm()) ** 2 for g in grads))
    return out


def trajectory(fn, model, init, data, steps: int, warmup_ratio: float, lr: float, anchors: int, gamma: float,
               cuda_graphs: bool, nudge: bool = False):
    """The trainer's update, step by step, from `init` weights: per-step loss and pre-clip grad norm."""
    from dflash.train.trainer import lr_at

    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, w in zip(params, init):
            p.copy_(w)
            if nudge:  # one bf16 ulp up or down in ~1% of the elements
                gen = torch.Generator(device=p.device).manual_seed(7)
                m = torch.rand(p.shape, generator=gen, device=p.device) < 0.01
                s = (torch.randint(0, 2, p.shape, generator=gen, device=p.device) * 2 - 1).to(torch.int16)
                bits = p.view(torch.int16)
                bits.add_(torch.where(m, s, torch.zeros_like(s)))
    lr_t = torch.tensor(lr, dtype=torch.float32, device=params[0].device)
    opt = torch.optim.AdamW(params, lr=lr_t, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=params[0].is_cuda)
    sched = SimpleNamespace(lr=lr, warmup_ratio=warmup_ratio, min_lr_ratio=0.0)
    losses, norms = [], []
    for step in range(steps):
        lr_t.fill_(lr_at(step, steps, sched))
        loss, grads = fwd_bwd(fn, model, data[step % len(data)], anchors, gamma, cuda_graphs)
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)))
        opt.step()
        for p in params:
            p.grad = None
        losses.append(loss)
    return losses, norms


def compiled_step(model, variant: str, mode):
    """The step function compile_check compares with eager (see --variant)."""
    import dflash.train.model as M

    if variant == "full":
        return torch.compile(model.forward_train, mode=mode, dynamic=False, fullgraph=True)
    if variant == "attn_outside":
        M.attend = torch.compiler.disable(M.attend)  # a no-op when eager
    main_fn = torch.compile(model.forward_blocks, mode=mode, dynamic=False, fullgraph=variant == "mask_outside")

    def step(hidden, input_ids, loss_mask, doc_ids, scores, num_anchors, gamma):
        blocks, masks = model.prepare(input_ids, loss_mask, doc_ids, scores, num_anchors)
        return main_fn(hidden, blocks, masks, gamma)

    return step


def parse_flags(text: str) -> dict:
    """'a=False,b=3,c=x' -> {'a': False, 'b': 3, 'c': 'x'} (Python literals where they parse, else strings)."""
    import ast

    out = {}
    for kv in filter(None, text.split(",")):
        k, v = (x.strip() for x in kv.split("=", 1))
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(ALL_SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attn", default=None, help="flex (default on GPU) or sdpa")
    ap.add_argument("--steps", type=int, default=40, help="trajectory steps (0: the one-step comparison only)")
    ap.add_argument("--variant", default="full", choices=("full", "mask_outside", "attn_outside"))
    ap.add_argument("--ref-attn", default=None, help="attention of the eager references (default: --attn)")
    ap.add_argument("--inductor", default="", help="torch._inductor.config flags for the compiled step, k=v,...")
    ap.add_argument("--no-retry", action="store_true", help="no mode='default' retry when the step is wrong")
    ap.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    ap.add_argument("--warmups", default="0.04,0.25", help="warm-up ratios of the trajectories (0.04: the default)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--skip-fp32", action="store_true", help="no float32 reference (saves its memory)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = a.device
    cuda = dev.startswith("cuda")
    attn = a.attn or ("flex" if cuda else "sdpa")
    shape = ALL_SHAPES[a.shape]
    _, T, rows, anchors, block, layers = shape
    gamma = 7.0
    ref_attn = a.ref_attn or attn
    flags = parse_flags(a.inductor)
    if flags:
        import torch._inductor.config as ic

        for k, v in flags.items():
            setattr(ic, k, v)
    res = {"hardware": hardware(), "torch": torch.__version__, "shape": a.shape, "attn": attn, "device": dev,
           "variant": a.variant, "ref_attn": ref_attn, "inductor": flags}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)

    def log(*x):
        print(*x, flush=True)

    model, dcfg = build(shape, dev, attn)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    data = batches(shape, dcfg, a.batches, dev)
    init = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    def eager(*args):
        saved = model.attn_impl
        model.attn_impl = ref_attn
        try:
            return model.forward_train(*args)
        finally:
            model.attn_impl = saved

    compiled = compiled_step(model, a.variant, "reduce-overhead" if cuda else None)

    # 1. one step, three ways
    one = {}
    t0 = time.perf_counter()
    l_bf, g_bf = fwd_bwd(eager, model, data[0], anchors, gamma, False)
    one["eager_bf16"] = {"loss": l_bf, "s": time.perf_counter() - t0}
    if cuda:
        torch.cuda.empty_cache()  # its activations' memory back, for the compiled step (or another process)
    log("eager bf16", one["eager_bf16"])
    t0 = time.perf_counter()
    l_c1, g_c1 = fwd_bwd(compiled, model, data[0], anchors, gamma, cuda)  # compiles (and records, on CUDA)
    l_c, g_c = l_c1, g_c1
    for _ in range(2):  # replays of the recorded graphs
        l_c, g_c = fwd_bwd(compiled, model, data[0], anchors, gamma, cuda)
    one["compiled_bf16"] = {"loss": l_c, "loss_first_call": l_c1, "s_incl_compile": time.perf_counter() - t0}
    log("compiled bf16", one["compiled_bf16"])
    if not a.skip_fp32:
        m32 = copy.deepcopy(model).float()
        m32.attn_impl = ref_attn
        l_32, g_32 = fwd_bwd(m32.forward_train, m32, data[0], anchors, gamma, False)
        del m32
        one["eager_fp32"] = {"loss": l_32}
        ref, ref_name = g_32, "eager_fp32"
    else:
        ref, ref_name = g_bf, "eager_bf16"
    one["reference"] = ref_name
    one["eager_bf16_vs_ref"] = compare(g_bf, ref, names)
    one["compiled_vs_ref"] = compare(g_c, ref, names)
    one["compiled_first_call_vs_ref"] = compare(g_c1, ref, names)
    one["compiled_vs_eager_bf16"] = compare(g_c, g_bf, names)
    for k in ("eager_bf16_vs_ref", "compiled_vs_ref", "compiled_first_call_vs_ref", "compiled_vs_eager_bf16"):
        log(k, json.dumps({x: v for x, v in one[k].items() if x != "per_param"}))
    one["verdict"] = {"loss_rel_err": abs(l_c - l_bf) / abs(l_bf),
                      "grad_rel_err_vs_eager_bf16": one["compiled_vs_eager_bf16"]["global_rel_err"],
                      "eager_bf16_vs_ref": one["eager_bf16_vs_ref"]["global_rel_err"]}
    log("verdict", json.dumps(one["verdict"]))
    save()
    bad = (ref_name == "eager_fp32" and one["compiled_vs_ref"]["global_rel_err"]
           > 3 * one["eager_bf16_vs_ref"]["global_rel_err"] + 1e-3)
    if bad and cuda and not a.no_retry:  # the same graph without CUDA graphs: is it the graphs or the generated code?
        plain = torch.compile(model.forward_train, mode="default", dynamic=False, fullgraph=True)
        l_d, g_d = fwd_bwd(plain, model, data[0], anchors, gamma, False)
        one["compiled_default_mode"] = {"loss": l_d, **compare(g_d, ref, names)}
        log("compiled mode=default", json.dumps({x: v for x, v in one["compiled_default_mode"].items() if x != "per_param"}))
        torch._dynamo.reset()
        compiled = compiled_step(model, a.variant, "reduce-overhead")
    res["one_step"] = one
    save()

    # 2. trajectories
    res["trajectories"] = {}
    for w in [float(x) for x in a.warmups.split(",")] if a.steps > 0 else []:
        tr = {}
        for name, fn, graphs, nudge in (("eager", eager, False, False), ("compiled", compiled, cuda, False),
                                        ("eager_1ulp", eager, False, True)):
            t0 = time.perf_counter()
            losses, norms = trajectory(fn, model, init, data, a.steps, w, a.lr, anchors, gamma, graphs, nudge)
            tr[name] = {"loss": losses, "grad_norm": norms, "s": time.perf_counter() - t0}
            log(f"warmup {w} {name}: loss", " ".join(f"{x:.3f}" for x in losses))
        e = np.array(tr["eager"]["loss"])
        for k in ("compiled", "eager_1ulp"):
            tr[f"max_abs_dev_{k}"] = float(np.abs(np.array(tr[k]["loss"]) - e).max())
            tr[f"last_dev_{k}"] = float(abs(tr[k]["loss"][-1] - e[-1]))
        log(f"warmup {w}: max |loss - eager| compiled {tr['max_abs_dev_compiled']:.4f}, "
            f"one-ulp eager {tr['max_abs_dev_eager_1ulp']:.4f}")
        res["trajectories"][str(w)] = tr
        save()
    save()


if __name__ == "__main__":
    main()
