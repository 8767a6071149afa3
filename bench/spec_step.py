"""What a speculative step costs at batch 1, as `dflash eval` decodes: the whole step beside a step of the target
alone, and (--draft-only) the drafter's block forward by itself.

Feeds BENCHMARKS.md, "Decoding and quality" (the speculative step's cost: its attention and the drafter's CUDA graph).

    python bench/spec_step.py                          # SmolLM2-135M-shaped target and drafter, cuda if present
    python bench/spec_step.py --device cpu --prompts 2 --max-new 16 --layers 4
    python bench/spec_step.py --device cpu --dtypes float32 --attention model,decode --count-ops
    python bench/spec_step.py --draft-only --graphs off,on --backends default,decode   # the drafter's block forward

A random target of the GPU recipe's shape (Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152) and a
random drafter (2 layers, block 8, 5 context layers) decode --prompts random prompts through train/evaluate/decode.py's
speculative() loop, the target alone (NoDraft), DFlash and n-gram lookup, with the target's own attention ("model":
HF's sdpa, a 4D mask and a copy of the KV cache per query head for every multi-token forward) and with the eval's
decode attention ("auto": causal to the bottom right, no mask). Random weights accept nothing: every step emits one
token, so `step ratio` = (target ms per step) / (method ms per step) is the speed-up a drafter would give at tau 1,
and a drafter with acceptance tau gets about tau times that. The drafter's step runs as one CUDA graph on a GPU
(--draft-graph on). --count-ops only counts the host operations (top-level aten calls) of a one-token target step
and of a verify forward, per attention.

--draft-only: the drafter alone holds --context tokens of context; each step drafts one block through the eval's
own proposer (train/evaluate/drafting.py DFlashProposer) after the previous step's verified block with one accepted token,
as a speculative step does. Per dtype, --graphs (off: eager block forward; on: one CUDA graph, eval's
--draft-graph) and --backends (default: PyTorch's own SDPA kernel choice; decode: the ones dflash decodes with,
dflash.core.target.decode_sdpa, no cuDNN): the median wall time of a step with the device synchronised, and the
operators that take the most host time (torch.profiler), to tell kernel time from launch and Python overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.core.target import decode_sdpa  # noqa: E402
from dflash.train.evaluate.decode import NgramProposer, NoDraft, speculative  # noqa: E402
from dflash.train.evaluate.drafting import DFlashProposer  # noqa: E402
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash.train.evaluate.verify import Target, crop_cache  # noqa: E402

LAYER_IDS = [1, 8, 14, 20, 27]


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
    """--draft-only: the drafter's draft + observe step alone, median wall time and the top host operators."""
    m = drafter(dtype, device, args.draft_layers, args.block)
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


def target(device, dtype, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device, dtype).eval()


def run(args, device, dtype) -> list[dict]:
    model = target(device, dtype, args.layers)
    ids = [i for i in LAYER_IDS if i < args.layers] or [0]
    d = drafter(dtype, device, args.draft_layers, args.block)
    d.cfg.target_layer_ids = ids
    d.fc = torch.nn.Linear(len(ids) * 576, 576, bias=False).to(device, dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(args.prompts + 2)]
    out = []
    for attention in args.attention.split(","):
        t = Target(model, ids, attention=attention)
        props = [NoDraft(), DFlashProposer(d, args.prompt_len + args.max_new + args.block + 1,
                                           graph=args.draft_graph == "on"), NgramProposer(args.block, 3)]
        runs = {p.name: [] for p in props}
        for i, p in enumerate(prompts):
            for prop in props:
                r = speculative(t, prop, p, args.max_new, set())
                if i >= 2:  # two warm-up prompts
                    runs[prop.name].append(r)
        base = None
        for name, rs in runs.items():
            steps = sum(r.steps for r in rs)
            secs = sum(r.seconds - r.prefill_s for r in rs)
            row = {"attention": t.attention, "method": name, "steps": steps, "ms_per_step": 1e3 * secs / steps,
                   "tokens_per_s": sum(len(r.tokens) for r in rs) / sum(r.seconds for r in rs),
                   "draft_ms": 1e3 * sum(r.draft_s for r in rs) / steps,
                   "verify_ms": 1e3 * sum(r.verify_s for r in rs) / steps,
                   "tau": sum(sum(r.accept_lengths) for r in rs) / steps}
            if name == "dflash":
                row["draft_graph"] = props[1].graph_status
            base = base or row["ms_per_step"]
            row["step_ratio"] = base / row["ms_per_step"]
            out.append(row)
    return out


def count_ops(args, device, dtype) -> list[dict]:
    """Host operations (top-level aten calls, torch.profiler) of one target forward on a cached prompt: a one-token
    step and a verify of a block, with each attention. On a launch-bound GPU step each costs host time."""
    from torch.profiler import ProfilerActivity, profile

    model = target(device, dtype, args.layers)
    ids = [i for i in LAYER_IDS if i < args.layers] or [0]
    prompt = torch.arange(100, 100 + args.prompt_len, device=device)[None]
    out = []
    for attention in args.attention.split(","):
        t = Target(model, ids, attention=attention)
        t.reset()
        t.forward(prompt, 0, hidden=False)
        for q in (1, args.block):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t.forward(prompt[:, :q], args.prompt_len, hidden=True)
            ops = [e for e in prof.events() if e.name.startswith("aten::")
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
            out.append({"attention": t.attention, "tokens": q, "host_ops": len(ops)})
            crop_cache(t.cache, args.prompt_len)
    return out


def draft_only(args, device) -> None:
    """--draft-only: every --graphs x --backends x --dtypes combination of measure(), printed and saved."""
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



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--layers", type=int, default=30, help="target layers (SmolLM2-135M: 30)")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--attention", default="model,auto",
                    help="comma list: model (HF's sdpa), auto (eval's default: decode on a GPU in bf16), decode")
    ap.add_argument("--draft-graph", default="on" if torch.cuda.is_available() else "off", choices=["on", "off"])
    ap.add_argument("--count-ops", action="store_true",
                    help="Only count the host operations of a one-token step and a verify forward per attention.")
    ap.add_argument("--draft-only", action="store_true", help="Only time the drafter's block forward (no target).")
    ap.add_argument("--context", type=int, default=300, help="--draft-only: tokens of context the drafter holds")
    ap.add_argument("--steps", type=int, default=50, help="--draft-only: timed steps (the median is reported)")
    ap.add_argument("--top", type=int, default=8, help="--draft-only: host operators listed")
    ap.add_argument("--backends", default="default,decode",
                    help="--draft-only: default (PyTorch's SDPA kernel choice), decode (dflash eval's: no cuDNN)")
    ap.add_argument("--graphs", default="off", help="--draft-only: comma list of off (eager block forward), on (one "
                                                    "CUDA graph, eval's --draft-graph)")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    if args.draft_only:
        draft_only(args, device)
        return
    if args.count_ops:
        counts = [{"dtype": d, **r} for d in args.dtypes.split(",") for r in count_ops(args, device, getattr(torch, d))]
        for r in counts:
            print(f"{r['dtype']:<9} {r['attention']:<14} {r['tokens']:>2} tokens: {r['host_ops']:,} host operations")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": str(device), "args": vars(args), "counts": counts}, f, indent=2)
        return
    rows = []
    for d in args.dtypes.split(","):
        for r in run(args, device, getattr(torch, d)):
            rows.append({"dtype": d, **r})
    print(f"{'dtype':<9} {'attention':<14} {'method':<7} {'ms/step':>8} {'draft':>6} {'verify':>7} {'tok/s':>7} "
          f"{'step ratio':>10}")
    for r in rows:
        print(f"{r['dtype']:<9} {r['attention']:<14} {r['method']:<7} {r['ms_per_step']:>8.2f} {r['draft_ms']:>6.2f} "
              f"{r['verify_ms']:>7.2f} {r['tokens_per_s']:>7.1f} {r['step_ratio']:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
