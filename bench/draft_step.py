"""The drafter's block forward at batch 1, as `dflash eval` drafts: wall time per dtype, and where it goes.

    python bench/draft_step.py                       # SmolLM2-135M-shaped drafter (the GPU recipe's), cuda if present
    python bench/draft_step.py --device cpu --steps 5 --context 64
    python bench/draft_step.py --graphs off,on --backends decode   # eager block forward vs one CUDA graph

A random drafter of the GPU recipe's shape (hidden 576, 9 heads / 3 KV heads, MLP 1536, vocab 49152, 2 layers,
block 8, 5 context layers) holds --context tokens of context; each step drafts one block through the eval's own
proposer (train/drafting.py DFlashProposer: block tensor, positions, draft_block, argmax on the device) after the
previous step's verified block with one accepted token (extend_context), as a speculative step does. Per dtype: the median wall time of a
step with the device synchronised, and the operators that take the most host time (torch.profiler), to tell
kernel time from launch and Python overhead. --backends default,decode measures with PyTorch's own choice of
SDPA kernel and with the ones dflash decodes with (dflash.core.target.decode_sdpa: no cuDNN).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from dflash.core.target import decode_sdpa
from dflash.train.drafting import DFlashProposer
from dflash.train.model import DFlashDrafter, DrafterConfig


def drafter(dtype: torch.dtype, device: torch.device, layers: int, block: int) -> DFlashDrafter:
    cfg = DrafterConfig(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                        vocab_size=49152, target_layer_ids=[1, 8, 14, 20, 27], num_target_layers=30,
                        num_layers=layers, block_size=block, mask_token_id=16, rope_theta=100000.0)
    torch.manual_seed(0)
    m = DFlashDrafter(cfg)
    m.reset_parameters(seed=0)
    m.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02, torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02)
    return m.to(device, dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(dtype: torch.dtype, device: torch.device, args, graph: bool = False) -> dict:
    m = drafter(dtype, device, args.layers, args.block)
    width = 5 * 576
    prop = DFlashProposer(m, args.context + args.steps + args.block + 16, graph=graph)
    with torch.inference_mode():
        prop.start(torch.randn(1, args.context, width, device=device, dtype=dtype))
        block = torch.randn(1, args.block, width, device=device, dtype=dtype)  # a verified block, 1 accepted
        pos = args.context

        def step():
            nonlocal pos
            prop.propose([], 5, pos)
            prop.observe(block, pos, 1)
            pos += 1

        for _ in range(3):
            step()
        times = []
        for _ in range(args.steps):
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - t0)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                step()
            sync(device)
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    return {"dtype": str(dtype).replace("torch.", ""), "graph": prop.graph_status, "ms_per_step": 1000 * statistics.median(times),
            "top_host_ops": [{"op": e.key, "calls_per_step": e.count / 5, "host_ms_per_step": e.self_cpu_time_total / 5000,
                              "device_ms_per_step": getattr(e, "self_device_time_total", 0) / 5000} for e in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--backends", default="default,decode",
                    help="default: PyTorch's SDPA kernel choice; decode: dflash eval's (no cuDNN)")
    ap.add_argument("--graphs", default="off", help="comma list: off (eager block forward), on (eval's --draft-graph)")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    out = []
    for graph in args.graphs.split(","):
        for backends in args.backends.split(","):
            for d in args.dtypes.split(","):
                with decode_sdpa() if backends == "decode" else contextlib.nullcontext():
                    r = measure(getattr(torch, d), device, args, graph == "on")
                out.append({"backends": backends, **r})
    for r in out:
        print(f"\n{r['dtype']}, {r['backends']} SDPA kernels, draft graph {r['graph']}: {r['ms_per_step']:.2f} ms "
              f"per draft + observe step ({device})")
        print(f"  {'op':<44} {'calls':>6} {'host ms':>8} {'dev ms':>8}")
        for o in r["top_host_ops"]:
            print(f"  {o['op'][:44]:<44} {o['calls_per_step']:>6.1f} {o['host_ms_per_step']:>8.3f} {o['device_ms_per_step']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "args": vars(args), "results": out}, f, indent=2)


if __name__ == "__main__":
    main()
