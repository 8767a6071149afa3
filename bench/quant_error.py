"""Reconstruction error of the quantised cache formats on REAL hidden states (the demo target's by default).

Feeds BENCHMARKS.md, "Cache size" (the error of fp8 and fp4, and the choice of their scales).

    python bench/quant_error.py                                # SmolLM2-135M-Instruct on chitchat, CPU, ~1-2 min
    python bench/quant_error.py --rows 16 --seq-len 1024 --save-hidden /dev/shm/smollm2-hidden.pt --json out.json
    python bench/quant_error.py --target /path/to/Qwen3-8B --data chats.jsonl --device cuda --dtype bfloat16

The target (default: the bundled SmolLM2-135M-Instruct GGUF, converted once into --workdir) runs over packed
rows of chat data exactly as `dflash extract` does (same tokenisation, packing and capture; layers by DFlash's
rule), the captured states are rounded to bf16 (what a bf16 cache stores), then quantised with each format and
dequantised. Per captured layer, over the real (non-padding) tokens: relative L2 error ||x^ - x|| / ||x||, the
worst token's relative error, and the max-abs / median-abs ratio (how outlier-heavy the layer is: attention sinks
and massive-activation channels).

Formats: the two the cache stores (fp8 = e4m3, float32 scale per token and layer; fp4 = e2m1, float16 scale per 32
channels; dflash_cache.quant) and, for the choice of scaling, two variants measured here only: fp8 with a scale per
block of 64 channels (64 divides SmolLM2's 576 and Qwen3's 4096), and fp4 with MX's power-of-two (e8m0) scale per
32 channels, rounded up so that nothing clips.
--save-hidden writes the bf16 states [tokens, K*H] for `bench/cache_io.py --real-hidden` (and --from-hidden reads
such a file instead of running the target).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import hardware, table  # noqa: E402
from dflash_cache import quant  # noqa: E402


def fp8_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """Variant: e4m3 with a float32 scale per `block` channels (not a cache format)."""
    *lead, W = x.shape
    g = x.float().reshape(*lead, W // block, block)
    s = g.abs().amax(-1, keepdim=True) / quant.FP8_MAX
    q = (g / torch.where(s > 0, s, torch.ones_like(s))).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.float() * s).reshape(*lead, W)


def fp4_e8m0_scale(x: torch.Tensor) -> torch.Tensor:
    """Variant: e2m1 with a power-of-two scale 2^ceil(log2(amax / 6)) per 32 channels (MX-style; not a cache format)."""
    *lead, W = x.shape
    g = x.float().reshape(*lead, W // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(amax / 6)).clamp(-126, 127))
    s = torch.where(amax > 0, s, torch.ones_like(s))
    y = (g / s).clamp(-6, 6)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    mags = torch.tensor(quant.E2M1_MAGNITUDES)
    q = mags[torch.bucketize(y.abs(), mids)] * torch.sign(y)
    return (q * s).reshape(*lead, W)


FORMATS = {
    "fp8 (cache: scale/token/layer)": lambda x, K: quant.dequantize(*quant.quantize(x, quant.FP8, K), torch.float32),
    "fp8 variant: scale/64 ch": lambda x, K: fp8_block(x, 64),
    "fp4 (cache: fp16 scale/32 ch)": lambda x, K: quant.dequantize(*quant.quantize(x, quant.FP4, K), torch.float32),
    "fp4 variant: e8m0 scale/32 ch": lambda x, K: fp4_e8m0_scale(x),
}


def real_hidden(args) -> tuple[torch.Tensor, list[int], str]:
    """bf16 [tokens, K*H] of the real tokens of `rows` packed rows, and the layer ids."""
    from dflash.extract.data import ChatTokenizer, tokenize_dataset
    from dflash.core.chat import load_chat_dataset
    from dflash.extract.pack import materialize, pack
    from dflash.extract.target import PackedTarget
    from dflash.core.target import convert_gguf, load_config, load_tokenizer, text_config
    from dflash.core.layers import default_layer_ids

    target = args.target
    if target is None:
        from dflash.recipes.assets import smollm2_gguf

        target = convert_gguf(smollm2_gguf(), os.path.join(args.workdir, "smollm2-target"))
    data = args.data
    if data is None:
        from dflash.recipes.cpu import chitchat_conversations, write_jsonl

        os.makedirs(args.workdir, exist_ok=True)
        data = os.path.join(args.workdir, "chitchat.jsonl")
        convs = chitchat_conversations()[: args.conversations]
        write_jsonl(data, [{"messages": [{"role": "user", "content": c["prompt"]},
                                         {"role": "assistant", "content": c["reply"]}]} for c in convs])
    L = text_config(load_config(target)).num_hidden_layers
    layer_ids = [int(i) for i in args.layers.split(",")] if args.layers else default_layer_ids(L, args.num_context_layers)
    tok = load_tokenizer(target)
    ds = tokenize_dataset(load_chat_dataset(data, max_samples=args.conversations), ChatTokenizer(tok), args.seq_len,
                          source=data, progress=False)
    plan = pack(ds.lengths, args.seq_len)[: args.rows]
    dtype = getattr(torch, args.dtype)
    pt = PackedTarget(target, layer_ids, device=args.device, dtype=dtype)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    arrays = materialize(plan, ds.docs, args.seq_len, pad, 0, len(plan))
    out = torch.empty(len(plan), args.seq_len, len(layer_ids) * pt.hidden_size, dtype=dtype, device=args.device)
    for i in range(0, len(plan), args.batch_rows):
        j = min(len(plan), i + args.batch_rows)
        ids, pos, doc = (torch.from_numpy(arrays[k][i:j]).to(args.device, torch.long)
                         for k in ("input_ids", "position_ids", "doc_ids"))
        pt.run(ids, pos, doc, out[i:j])
    real = torch.from_numpy(arrays["doc_ids"] > 0).to(args.device)
    return out[real].to(torch.bfloat16).cpu(), layer_ids, target


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF model dir or .gguf (default: the demo's SmolLM2-135M-Instruct)")
    ap.add_argument("--data", help="chat jsonl (default: the demo's chitchat conversations)")
    ap.add_argument("--conversations", type=int, default=400, help="conversations read from the data")
    ap.add_argument("--rows", type=int, default=8, help="packed rows run through the target")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-rows", type=int, default=2)
    ap.add_argument("--layers", help="layer ids (default: DFlash's rule)")
    ap.add_argument("--num-context-layers", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target forward dtype")
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "dflash-bench-quant"))
    ap.add_argument("--save-hidden", help="also save the bf16 states [tokens, K*H] here (.pt)")
    ap.add_argument("--from-hidden", help="a file written by --save-hidden: measure it, no forward")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.from_hidden:
        saved = torch.load(a.from_hidden, weights_only=True)
        x, layer_ids, target = saved["hidden"], list(saved["layer_ids"]), saved.get("target", a.from_hidden)
    else:
        x, layer_ids, target = real_hidden(a)
    K = len(layer_ids)
    H = x.shape[-1] // K
    print(f"{x.shape[0]:,} real tokens x {K} layers {layer_ids} x H {H} of {target} "
          f"(forward {a.dtype} on {a.device}, stored bf16), {time.perf_counter() - t0:.0f} s", flush=True)
    if a.save_hidden:
        torch.save({"hidden": x, "layer_ids": layer_ids, "target": target}, a.save_hidden)
    xf = x.float()
    rows = []
    for li, lid in enumerate(layer_ids):
        seg = xf[:, li * H:(li + 1) * H]
        absx = seg.abs()
        rows.append({"layer": lid, "format": "(bf16 states)", "max/median |x|": float(absx.max() / absx.median()),
                     "max token norm / median": float(seg.norm(dim=-1).max() / seg.norm(dim=-1).median())})
    results = []
    for name, fn in FORMATS.items():
        y = fn(x, K)
        for li, lid in enumerate(layer_ids):
            sl = slice(li * H, (li + 1) * H)
            d, ref = (y[:, sl] - xf[:, sl]), xf[:, sl]
            tok_rel = d.norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)
            results.append({"format": name, "layer": lid, "rel_l2": float(d.norm() / ref.norm()),
                            "worst_token_rel": float(tok_rel.max()), "median_token_rel": float(tok_rel.median())})
        d = y - xf
        results.append({"format": name, "layer": "all", "rel_l2": float(d.norm() / xf.norm()),
                        "worst_token_rel": float((d.norm(dim=-1) / xf.norm(dim=-1).clamp(min=1e-30)).max()),
                        "median_token_rel": float((d.norm(dim=-1) / xf.norm(dim=-1).clamp(min=1e-30)).median())})
    print(f"\nhardware: {hardware()}, torch {torch.__version__}")
    print("\nlayer statistics (outliers):")
    print(table(rows, ["layer", "max/median |x|", "max token norm / median"]))
    print("\nreconstruction error (relative L2 over real tokens):")
    print(table(results, ["format", "layer", "rel_l2", "median_token_rel", "worst_token_rel"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hardware": hardware(), "torch": torch.__version__, "target": target, "layer_ids": layer_ids,
                       "tokens": int(x.shape[0]), "args": vars(a), "layer_stats": rows, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
