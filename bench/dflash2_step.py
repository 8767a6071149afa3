"""Issue 43's training-step bars: the DFlash2 step against speculators' own, and the windowed DFlash step's cost per
token at long rows. BENCHMARKS.md, "DFlash2 and windowed drafters".

    python bench/dflash2_step.py --mode dflash2                    # Qwen3-8B shape: 5 layers, B 16, 4 x 3072, 512 anchors
    python bench/dflash2_step.py --mode window --seq-lens 3072,16384 --window 2048
    python bench/dflash2_step.py --shape tiny --device cpu --steps 2 --mode dflash2   # a CPU smoke run

--mode dflash2: one process, the same call, the same random weights, shapes and optimizer (AdamW, fused on CUDA):
  * dflash: `dflash train`'s compiled step (train/fit/compile_step.py, regions scope, CUDA graphs), DFlash2Drafter;
  * speculators 0.9.0: DFlash2DraftModel.forward (its own torch.compile on CUDA, flex attention, its fused KL loss),
    on the R rows concatenated into one packed row of R*T tokens and R*N anchors (it trains on one row), backward.
  The bar: dflash's step >= 1.3x faster, 0 recompiles. The losses of the first step are printed: the same objective
  on the same rows, close but not equal (each draws its own anchors).
--mode window: the DFlash drafter with every layer sliding (--window) at each of --seq-lens (rows of that many
  tokens, anchors scaled with the row), step time per context token. The bar: at 16,384 within 1.2x of 3,072.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import hardware  # noqa: E402
from bench.train import synthetic_rows  # noqa: E402


def drafter_config(shape: str, **over):
    from dflash.train.drafter.model import DrafterConfig

    return DrafterConfig.named(shape, **over)


def timed(step, n: int, cuda: bool) -> list[float]:
    out = []
    for _ in range(n):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def batch(cfg, rows: int, seq_len: int, extra_layers: int, dev, seed: int = 0):
    rng, g = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    width = (cfg.num_context_layers + extra_layers) * cfg.hidden_size
    ids, lm, doc, hid = synthetic_rows(rows, seq_len, width, cfg.vocab_size - 1, rng, g)
    if extra_layers:  # the target's final state is stored normalised (its final norm, weight 1 here)
        last = hid[..., -cfg.hidden_size:].float()
        hid[..., -cfg.hidden_size:] = (last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + 1e-6)).to(hid.dtype)
    t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    return t(ids.astype(np.int64)), t(lm), t(doc.astype(np.int64)), hid.to(dev)


def dflash_step(model, dev, cuda: bool, rows, seq_len, anchors, gamma, extra_layers: int):
    from dflash.train.fit.compile_step import compile_step

    ids, lm, doc, hid = batch(model.cfg, rows, seq_len, extra_layers, dev)
    fwd = compile_step(model, "regions", cuda) if cuda else model.forward_train
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=torch.tensor(1e-4, device=dev), fused=cuda)
    gen = torch.Generator(device=dev)
    losses = []

    def step():
        gen.manual_seed(len(losses))
        scores = torch.rand(rows, seq_len, generator=gen, device=dev)
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()
        loss, _ = fwd(hid, ids, lm, doc, scores, anchors, gamma)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())

    return step, losses


def speculators_step(mine, dev, cuda: bool, rows, seq_len, anchors, gamma, loss_impl: str):
    """speculators' DFlash2DraftModel with mine's weights, on the rows as one packed row (module docstring)."""
    from transformers import Qwen3Config

    from speculators.losses import resolve_loss_config
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    c = mine.cfg
    tl = Qwen3Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=c.num_heads,
                     num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
                     num_hidden_layers=c.num_layers, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                     max_position_embeddings=c.max_position_embeddings)
    tl._attn_implementation = "simple_flex_attention" if cuda else "eager"
    ref = DFlash2DraftModel(DFlash2SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=c.vocab_size, block_size=c.block_size,
        aux_hidden_state_layer_ids=c.target_layer_ids, mask_token_id=c.mask_token_id,
        conv_kernel_size=c.conv_kernel_size, conv_group_size=c.conv_group_size, selector_rank=c.selector_rank,
        selector_top_k=c.selector_top_k))
    ref.load_state_dict(mine.state_dict(), strict=False)
    with torch.no_grad():
        for name in ("embed_tokens", "lm_head", "verifier_lm_head"):
            getattr(ref, name).weight.copy_(mine.lm_head_weight if name != "embed_tokens" else mine.embed_weight)
    ref = ref.to(dev, next(mine.parameters()).dtype)
    ids, lm, doc, hid = batch(c, rows, seq_len, 1, dev)
    hid = hid.to(next(mine.parameters()).dtype)
    offs = torch.arange(rows, device=dev)[:, None] * (int(doc.max()) + 1)
    docs = torch.where(doc > 0, doc + offs, torch.zeros_like(doc)) - 1  # the reference's padding: -1
    from dflash.train.drafter.blocks import document_positions

    pos = document_positions(doc).reshape(1, -1)
    K = c.num_context_layers * c.hidden_size
    kw = dict(hidden_states=hid[..., :K].reshape(1, -1, K), input_ids=ids.reshape(1, -1),
              loss_mask=lm.reshape(1, -1), verifier_last_hidden_states=hid[..., K:].reshape(1, -1, c.hidden_size),
              document_ids=docs.reshape(1, -1), position_ids=pos, max_anchors=rows * anchors, gamma=gamma,
              loss_config=resolve_loss_config("kl_div", loss_impl), tv_loss_fn=resolve_loss_config("tv", loss_impl)["tv"][0])
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
    losses = []

    def step():
        _, loss, _ = ref(**kw)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())

    return step, losses


def run_dflash2(a, dev, cuda) -> dict:
    from dflash.train.drafter.dflash2 import DFlash2Drafter

    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = drafter_config(a.shape, arch="dflash2", block_size=a.block_size or drafter_config(a.shape).block_size)
    model = DFlash2Drafter(cfg, attn_impl="flex" if cuda else "split")
    model.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(1)
    model.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02,
                          torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02)
    model.to(dev, dtype)
    out = {}
    makers = {"dflash": lambda: dflash_step(model, dev, cuda, a.rows, a.seq_len, a.anchors, a.gamma, 1),
              "speculators": lambda: speculators_step(model, dev, cuda, a.rows, a.seq_len, a.anchors, a.gamma,
                                                    a.spec_loss or ("fused" if cuda else "eager"))}
    for name in a.impls.split(","):
        step, losses = makers[name]()
        t0 = time.perf_counter()
        step()  # the first call: compilation
        first = time.perf_counter() - t0
        times = timed(step, a.steps, cuda)
        out[name] = {"step_s": statistics.median(times), "first_call_s": first, "first_loss": float(losses[0])}
        print(name, out[name], flush=True)
        if a.profile and cuda:  # where the step's time goes: kernels by device time
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                timed(step, 3, cuda)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90),
                  flush=True)
    if "dflash" in out and "speculators" in out:
        out["speedup"] = out["speculators"]["step_s"] / out["dflash"]["step_s"]
    return out


def run_window(a, dev, cuda) -> dict:
    from dflash.train.drafter.model import DFlashDrafter

    dtype = torch.bfloat16 if cuda else torch.float32
    out = {}
    for T in (int(t) for t in a.seq_lens.split(",")):
        over = dict(layer_types=["sliding_attention"] * drafter_config(a.shape).num_layers, sliding_window=a.window)
        cfg = drafter_config(a.shape, **over)
        model = DFlashDrafter(cfg, attn_impl="flex" if cuda else "split")
        model.reset_parameters(seed=0)
        model.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02,
                              torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02)
        model.to(dev, dtype)
        anchors = max(1, a.anchors * T // a.seq_len)  # the same anchors per token at every row length
        rows = max(1, a.rows * a.seq_len // T)  # and about the same tokens per step
        step, _ = dflash_step(model, dev, cuda, rows, T, anchors, a.gamma, 0)
        step()
        times = timed(step, a.steps, cuda)
        s = statistics.median(times)
        out[T] = {"rows": rows, "anchors": anchors, "step_s": s, "us_per_token": 1e6 * s / (rows * T)}
        print(T, out[T], flush=True)
        torch._dynamo.reset()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["dflash2", "window"], default="dflash2")
    p.add_argument("--shape", default="qwen3-8b", help="a DrafterConfig.named size (tiny, qwen3-8b)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=0, help="0: the shape's")
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--impls", default="dflash,speculators")
    p.add_argument("--spec-loss", choices=["fused", "eager"],
                   help="speculators' loss kernels (default: fused on CUDA; its fused Triton KL does not trace under "
                        "its own torch.compile with torch 2.11: eager is then its working configuration)")
    p.add_argument("--profile", action="store_true", help="--mode dflash2: print each step's kernels by device time")
    p.add_argument("--seq-lens", default="3072,16384")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev if dev.index is not None else torch.device("cuda:0"))
    res = (run_dflash2 if a.mode == "dflash2" else run_window)(a, dev, cuda)
    res = {"mode": a.mode, "args": vars(a), "hardware": hardware(), "results": res}
    print(json.dumps(res, indent=1, default=str))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
