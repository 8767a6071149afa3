"""The target's decode steps against their physical bound: eager (the HF forward with a DynamicCache, what dflash
ran before CUDA graphs) and graph-captured (dflash/core/static_decode.py, what regenerate, prompts and eval run on a
GPU), at the GPU recipe's target shape (SmolLM2-135M, Llama), the coder recipe's (Qwen2.5-Coder-0.5B, Qwen2: `coder`)
and the Qwen3-8B shape, random weights.

Feeds BENCHMARKS.md, "Decoding at serving speed".

    python bench/decode.py                                  # both shapes, cuda
    python bench/decode.py --shapes recipe --batches 256,1024 --context 512 --json decode.json

Per shape:
  * step b1: one token of one sequence after --context tokens (the target alone in `dflash eval`);
  * verify 16: a block of 16 tokens of one sequence (the verify of a drafted block);
  * decode bN: one token for each of N sequences of --context tokens each (regenerate's batched step), as tokens/s;
  * prefill KxW (--prefill): K prompts right-padded to W columns into their slots, eager (not captured), as the slot
    engine runs them; its bound is also the layers' matmul FLOPs over --peak-tflops;
each in the modes of --modes: eager, graph (the static decoder's step, its layers the HF modules), fused (its
layers through two compiled functions, the pointwise work fused: StaticDecoder(fused=True), the batched step over
the span) and triton / flash (fused, the batched step reading each row's own columns with dflash's Triton decode
kernel or flash attention's variable-length kernel: regenerate takes the faster; batched steps only); with --mixed
LO-HI the batched steps also with row lengths uniform in [LO, HI] (the bound then counts each row's own columns,
while the spanned step attends over the longest row's);
each with the bound = (weight bytes + KV bytes read) / --bandwidth (the H200's ~4.8 TB/s): a step cannot be
faster than reading its weights and its KV cache once. `x bound` = measured / bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CODER_0_5B, CODER_1_5B, QWEN3_8B, SMOLLM2, hardware, qwen3_config  # noqa: E402
from dflash.core.static_decode import StaticDecoder  # noqa: E402
from dflash.core.target import decode_sdpa  # noqa: E402
from dflash.extract.generation.slab import kv_bytes_per_token  # noqa: E402


def model_of(shape: str, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(0)
    if shape == "recipe":
        kw = dict(SMOLLM2)
        theta = kw.pop("rope_theta")
        cfg = LlamaConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta})
        cls = LlamaForCausalLM
    elif shape in ("coder", "coder-1.5b"):
        kw = dict(CODER_0_5B if shape == "coder" else CODER_1_5B)
        theta = kw.pop("rope_theta")
        cfg = Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta})
        cls = Qwen2ForCausalLM
    else:
        cfg, cls = qwen3_config(QWEN3_8B), Qwen3ForCausalLM
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        m = cls(cfg).to(dtype).eval()
    return m


def timed(fn, iters: int) -> float:
    """Median seconds of fn() with the device synchronised (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def weight_bytes(m) -> int:
    seen, n = set(), 0
    for p in m.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel() * p.element_size()
    emb = m.get_input_embeddings().weight
    return n - emb.numel() * emb.element_size() * (emb.data_ptr() != m.get_output_embeddings().weight.data_ptr())


def eager_step(m, context: int, q: int):
    from transformers import DynamicCache

    dev = next(m.parameters()).device
    cache = DynamicCache()
    ids = torch.randint(0, m.config.vocab_size, (1, context), device=dev)
    with torch.inference_mode(), decode_sdpa():
        m(input_ids=ids, cache=cache, use_cache=True)
    step = torch.randint(0, m.config.vocab_size, (1, q), device=dev)
    pos = torch.arange(context, context + q, device=dev)[None]

    def fn():
        with torch.inference_mode(), decode_sdpa():
            m(input_ids=step, position_ids=pos, cache=cache, use_cache=True)
            cache.crop(context)
    return fn


def mixed_lengths(spec: str, batch: int) -> list[int]:
    """--mixed LO-HI: batch row lengths uniform in [LO, HI], seeded (the same rows in every mode and script)."""
    lo, hi = (int(x) for x in spec.split("-"))
    return torch.randint(lo, hi + 1, (batch,), generator=torch.Generator().manual_seed(0)).tolist()


def graph_step(m, batch: int, context: int, q: int, fused: bool = False, lengths: list[int] | None = None,
               varlen: str | bool = False):
    """A step of the static decoder after `context` tokens per row (or each row's own of `lengths`); varlen: a batched
    one-token step reads each row's own columns with that kernel ("triton" or "flash"), else (False) the span's."""
    dev = next(m.parameters()).device
    lengths = lengths or [context] * batch
    longest = max(lengths)
    dec = StaticDecoder(m, slots=batch, max_len=longest + 16, max_q=max(q, 1), fused=fused, varlen=varlen)
    assert dec.varlen_kernel == (varlen or None)
    ids = torch.randint(0, m.config.vocab_size, (batch, longest), device=dev)
    lens = torch.tensor(lengths, device=dev)
    for lo in range(0, batch, 64):  # the prompts into their slots, in chunks
        with decode_sdpa():
            dec.prefill(ids[lo:lo + 64], torch.arange(lo, min(batch, lo + 64), device=dev), lens[lo:lo + 64])
    step = torch.randint(0, m.config.vocab_size, (batch, q), device=dev)
    start = lens.clone()

    def fn():
        with decode_sdpa():
            dec.step(step, start, longest + q, all_logits=q > 1)
    return fn


def prefill_step(m, k: int, w: int):
    """A prefill of k prompts right-padded to w columns (the first w long, the others 1/8-1 of it, seeded) into k
    slots, eager, as regenerate's and prompts' slot engine runs it (StaticDecoder.prefill: the layers' modules).
    Through the fused layers' compiled functions instead (their shapes symbolic) it took 30.5 against 20.5 ms at the
    recipe's 128x112 and 402 against 416 ms at the Qwen3-8B shape (H200, 2026-12-04): not used."""
    dev = next(m.parameters()).device
    dec = StaticDecoder(m, slots=k, max_len=w, fused=False, varlen=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.config.vocab_size, (k, w), generator=g).to(dev)
    lens = torch.randint(max(1, w // 8), w + 1, (k,), generator=g)
    lens[0] = w
    lens, rows = lens.to(dev), torch.arange(k, device=dev)

    def fn():
        with decode_sdpa():
            dec.prefill(ids, rows, lens)
    return fn


def run(shape: str, args, dev) -> list[dict]:
    # each shape compiles afresh: automatic dynamic shapes would otherwise make the second shape's sizes (heads,
    # widths) symbolic, slower kernels than one process decoding one target compiles
    torch._dynamo.reset()
    m = model_of(shape, dev, torch.bfloat16)
    wb, kvt = weight_bytes(m), kv_bytes_per_token(m.config, torch.bfloat16)
    bw = args.bandwidth * 1e12
    rows = []

    def add(what, mode, secs, tokens, kv_tokens, flops: float = 0.0):
        bound = max((wb + kv_tokens * kvt) / bw, flops / (args.peak_tflops * 1e12))
        rows.append({"shape": shape, "what": what, "mode": mode, "ms": 1e3 * secs, "bound_ms": 1e3 * bound,
                     "x_bound": secs / bound, "tokens_per_s": tokens / secs})
        print(json.dumps(rows[-1]), flush=True)

    c = args.context
    modes = args.modes.split(",")
    kernels = ("triton", "flash")
    # (mode, fused, the batched step's varlen kernel or False)
    graphs = [(mode, mode != "graph", mode in kernels and mode) for mode in modes
              if mode in ("graph", "fused") + kernels]
    if "eager" in modes:
        add("step b1", "eager", timed(eager_step(m, c, 1), args.iters), 1, c)
    for mode, fused, kernel in graphs:
        if not kernel:  # one row: the same step as fused (a kernel reads rows of VARLEN_MIN_ROWS or more)
            add("step b1", mode, timed(graph_step(m, 1, c, 1, fused), args.iters), 1, c)
    if "eager" in modes:
        add("verify 16", "eager", timed(eager_step(m, c, 16), args.iters), 16, c + 16)
    for mode, fused, kernel in graphs:
        if not kernel:
            add("verify 16", mode, timed(graph_step(m, 1, c, 16, fused), args.iters), 16, c + 16)
    if args.prefill:  # compute-bound: the bound is also the layers' matmuls (2 x their weights x tokens) over the peak
        k, w = (int(x) for x in args.prefill.lower().split("x"))
        flops = 2 * sum(p.numel() for p in m.model.layers.parameters()) * k * w
        add(f"prefill {k}x{w}", "eager", timed(prefill_step(m, k, w), args.iters), k * w, k * w, flops)
        torch.cuda.empty_cache()
    for b in args.batches:
        if shape == "qwen3-8b" and b > 256:
            continue  # 8B shape: 256 x 512 tokens of KV is already 19 GB
        # a batched step's bound is also its matmuls' FLOPs (2 x the weights x rows) over the peak: at 1,024 rows of
        # the coder shape that is ~1 ms, more than its bytes
        flops = 2 * wb / m.dtype.itemsize * b
        for mode, fused, kernel in graphs:
            add(f"decode b{b}", mode, timed(graph_step(m, b, c, 1, fused, varlen=kernel), args.iters), b, b * c,
                flops)
            torch.cuda.empty_cache()
        if args.mixed:  # rows of unequal lengths: the spanned step attends over the longest row's columns
            lengths = mixed_lengths(args.mixed, b)
            for mode, fused, kernel in graphs:
                fn = graph_step(m, b, c, 1, fused, lengths, varlen=kernel)
                add(f"decode b{b} mixed {args.mixed}", mode, timed(fn, args.iters), b, sum(lengths), flops)
                del fn  # its decoder's cache (8B shape, 256 rows of up to 2,048: ~76 GB) before the next one's
                torch.cuda.empty_cache()
    del m
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="recipe,qwen3-8b")
    ap.add_argument("--batches", default="64,256,1024", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--modes", default="eager,graph,fused,triton,flash",
                    help="eager (HF forward), graph (StaticDecoder, its layers the HF modules), fused (its layers "
                         "through the compiled functions, fused_layers, the batched step over the span), triton / "
                         "flash (fused, the batched step reading each row's own columns with that kernel: "
                         "regenerate's default on a GPU is the faster of the two)")
    ap.add_argument("--mixed", help="LO-HI: also the batched steps with row lengths uniform in [LO, HI] (seeded)")
    ap.add_argument("--prefill", default="128x112",
                    help="KxW: also a prefill of K prompts padded to W columns (regenerate's at the GPU recipe: "
                         "~130 prompts of ~106 columns), eager as the slot engine runs it; '' skips")
    ap.add_argument("--bandwidth", type=float, default=4.8, help="HBM bandwidth in TB/s (the H200's datasheet)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 TFLOP/s (the H200's datasheet): a prefill's compute bound")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for s in args.shapes.split(","):
        rows += run(s, args, dev)
    print(f"\n{hardware()}, torch {torch.__version__}, context {args.context}")
    for r in rows:
        print(f"{r['shape']:9} {r['what']:12} {r['mode']:6} {r['ms']:8.3f} ms  bound {r['bound_ms']:7.3f} ms  "
              f"x{r['x_bound']:5.2f}  {r['tokens_per_s']:>12,.0f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hardware(), "torch": torch.__version__, "context": args.context, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
