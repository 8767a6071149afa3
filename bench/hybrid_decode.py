"""Decoding a hybrid target through the static decoder (dflash/core/static_hybrid.py: per-slot conv windows and
recurrent states beside the attention layers' KV cache, steps replayed as CUDA graphs), against its bytes bound.

Feeds BENCHMARKS.md, "Hybrid targets when decoding". On one GPU, random bf16 weights of the Qwen3.6-27B shape
(bench/hybrid_extract.py QWEN36_27B: hidden 5120, linear attention 16 key / 48 value heads of 128, full attention
24 / 4 heads of 256, vocab 248,320), its first --layers layers (3 linear to 1 full):

  step b1       one token of one sequence after --context tokens (the target alone in `dflash eval`)
  step bN       one token for each of --rows sequences of --context tokens (regenerate's batched step)
  verify 16     eval's verify of a 16-token block at batch 1: recorded (the state after each token kept) + accept of
                half the block (the rollback after a partial acceptance), against the same verify unrecorded
  regenerate    the slot engine (extract/generation/slot_engine.py) on --rows prompts of 64..--context tokens, each
                generating --new-tokens (no EOS), end to end: generated tokens/s, prefill and decode seconds

bound = bytes a step must move / --hbm-gbs (H100 SXM ~3,350 GB/s): the weights (the input embedding's one row
aside), each linear layer's recurrent state read and written (float32) and its conv window, the full-attention
layers' keys and values read, the logits written; a recorded verify also writes the state after each token and
accept reads one back. `x bound` = measured / bound.

    python bench/hybrid_decode.py --layers 8 --out hybrid_decode.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import hardware, table  # noqa: E402
from bench.decode import timed  # noqa: E402
from bench.hybrid_extract import QWEN36_27B  # noqa: E402
from dflash.core.static import static_decoder  # noqa: E402
from dflash.core.target import decode_sdpa  # noqa: E402


def build(layers: int):
    import transformers as tf

    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    cfg = tf.Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=kinds, **QWEN36_27B)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        return tf.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()


def weight_bytes(m) -> int:
    """Every weight a step reads: all parameters but the input embedding (one row a token)."""
    n = sum(p.numel() * p.element_size() for p in m.parameters())
    emb = m.get_input_embeddings().weight
    return n - emb.numel() * emb.element_size()


class Bytes:
    """What a step of the model must move, per part (module docstring)."""

    def __init__(self, m):
        c = m.config
        self.weights = weight_bytes(m)
        n_lin = sum(k == "linear_attention" for k in c.layer_types)
        self.n_attn = len(c.layer_types) - n_lin
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        self.state = n_lin * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        self.conv = n_lin * conv_dim * (c.linear_conv_kernel_dim - 1) * 2
        self.kv_token = self.n_attn * 2 * c.num_key_value_heads * c.head_dim * 2
        self.vocab = c.vocab_size

    def step(self, rows: int, context: int, q: int = 1, recorded: bool = False) -> int:
        b = self.weights + rows * (2 * self.state + 2 * self.conv + context * self.kv_token + q * self.vocab * 2)
        if recorded:  # the state after each token written, then the kept one read back and written
            b += rows * (q * (self.state + self.conv) + 2 * self.state)
        return b


def prefilled(m, rows: int, context: int, max_q: int):
    dec = static_decoder(m, slots=rows, max_len=context + 32, max_q=max_q)
    V = m.config.vocab_size
    for lo in range(0, rows, 64):  # the prompts into their slots, in chunks
        hi = min(rows, lo + 64)
        with decode_sdpa():
            dec.prefill(torch.randint(0, V, (hi - lo, context), device="cuda"), torch.arange(lo, hi, device="cuda"))
    return dec


def steps(m, rows: int, context: int, iters: int) -> float:
    dec = prefilled(m, rows, context, max_q=1)
    ids = torch.randint(0, m.config.vocab_size, (rows, 1), device="cuda")
    start = torch.full((rows,), context, dtype=torch.long, device="cuda")

    def fn():
        with decode_sdpa():
            dec.step(ids, start, context + 1)
    return timed(fn, iters)


def verifies(m, context: int, iters: int) -> tuple[float, float]:
    dec = prefilled(m, 1, context, max_q=16)
    block = torch.randint(0, m.config.vocab_size, (1, 16), device="cuda")
    start = torch.full((1,), context, dtype=torch.long, device="cuda")
    keep = torch.full((1,), 8, dtype=torch.long, device="cuda")

    def recorded():
        with decode_sdpa():
            dec.step(block, start, context + 16, record=True)
            dec.accept(keep)

    def plain():
        with decode_sdpa():
            dec.step(block, start, context + 16, record=False)
    return timed(recorded, iters), timed(plain, iters)


def regenerate(m, rows: int, context: int, new_tokens: int) -> dict:
    from dflash.extract.generation.engine import Request
    from dflash.extract.generation.slot_engine import SlotEngine

    rng = random.Random(0)
    V = m.config.vocab_size
    eng = SlotEngine(m, eos_ids=set(), slots=rows, max_len=context + new_tokens, prefill_tokens=16384)
    for i in range(rows):
        eng.add(Request([rng.randrange(V) for _ in range(rng.randint(64, context))], new_tokens, key=i))
    torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.busy:
        eng.step()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    return {"generated": eng.generated, "seconds": secs, "tok_s": eng.generated / secs, "steps": eng.steps,
            "prefill_s": eng.seconds["prefill"], "decode_s": eng.seconds["decode"], "captures": eng.dec.captures}


def free():
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="the first N of the 27B shape's 64 layers (3 linear : 1 full)")
    ap.add_argument("--context", type=int, default=512, help="tokens before each step (regenerate: the longest prompt)")
    ap.add_argument("--rows", type=int, default=1024, help="rows of the batched step and of regenerate")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens each regenerated row generates")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--hbm-gbs", type=float, default=3350.0, help="HBM bandwidth of the GPU, GB/s (H100 SXM)")
    ap.add_argument("--skip", default="", help="comma-separated: b1, bN, verify, regenerate")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    m = build(a.layers)
    size = Bytes(m)
    res = {"hardware": hardware(), "layers": a.layers, "context": a.context, "rows": a.rows, "hbm_gbs": a.hbm_gbs,
           "weight_bytes": size.weights, "state_bytes_per_row": size.state + size.conv, "results": []}

    def add(what: str, secs: float, nbytes: int, tokens: int):
        bound = nbytes / (a.hbm_gbs * 1e9)
        res["results"].append({"what": what, "ms": secs * 1e3, "bound ms": bound * 1e3, "x bound": secs / bound,
                               "tok/s": tokens / secs, "GB moved": nbytes / 1e9})
        print(f"{what}: {secs * 1e3:.2f} ms ({secs / bound:.2f}x its bound of {bound * 1e3:.2f} ms)", flush=True)

    with torch.inference_mode():
        if "b1" not in skip:
            add("step b1", steps(m, 1, a.context, a.iters), size.step(1, a.context), 1)
            free()
        if "verify" not in skip:
            rec, plain = verifies(m, a.context, a.iters)
            add("verify 16, recorded + accept", rec, size.step(1, a.context, 16, recorded=True), 16)
            add("verify 16, plain", plain, size.step(1, a.context, 16), 16)
            res["verify_record_overhead"] = rec / plain - 1
            free()
        if "bN" not in skip:
            add(f"step b{a.rows}", steps(m, a.rows, a.context, a.iters), size.step(a.rows, a.context), a.rows)
            free()
        if "regenerate" not in skip:
            res["regenerate"] = regenerate(m, a.rows, a.context, a.new_tokens)
            free()
    print(table(res["results"], ["what", "ms", "bound ms", "x bound", "tok/s", "GB moved"]))
    if "regenerate" in res:
        r = res["regenerate"]
        print(f"\nregenerate, {a.rows} rows x {a.new_tokens} new tokens (prompts 64-{a.context}): "
              f"{r['tok_s']:,.0f} tok/s ({r['generated']:,} tokens in {r['seconds']:.1f} s: prefill "
              f"{r['prefill_s']:.1f} s, decode {r['decode_s']:.1f} s, {r['steps']} steps, {r['captures']} captures)")
    if "verify_record_overhead" in res:
        print(f"verify recording + accept: {res['verify_record_overhead'] * 100:+.1f}% over the plain verify")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
