"""Shared pieces of the benchmarks: synthetic targets (random weights: speed does not depend on them),
synthetic caches and chats, and the report format. Not used by the library."""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
# Qwen2.5-Coder-0.5B-Instruct's shape (Qwen2: q/k/v biases): the coder recipe's target
CODER_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
# Qwen2.5-Coder-1.5B-Instruct's (the coder recipe's --coder-model 1.5b)
CODER_1_5B = dict(CODER_0_5B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12)
# SmolLM2-135M-Instruct's shape (Llama): the demo-size drafter is derived from it
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True)


def tiny_llama(**over):
    """A one-layer random Llama 16 wide over 64 tokens, in eval mode: for what the model's size does not change (the
    slot engine's scheduling and host work: bench/slot_schedule.py, bench/slot_host.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, **over)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def hardware() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{torch.cuda.device_count()}x {p.name} ({p.total_memory / 2**30:.0f} GiB), {os.cpu_count()} CPU cores"
    return f"CPU only, {os.cpu_count()} cores ({platform.processor() or platform.machine()})"


def qwen3_config(shape: dict, **over):
    from transformers import Qwen3Config

    kw = dict(shape)
    theta = kw.pop("rope_theta")
    try:
        return Qwen3Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta}, **over)
    except TypeError:
        return Qwen3Config(**kw, rope_theta=theta, **over)


def random_target_dir(path: str, shape: dict, device: str = "cuda", head_only: bool = False) -> str:
    """Save a random-weight Qwen3-style model of `shape` (+ the tiny chat tokenizer) into path.

    head_only=True writes only the embedding and LM head (what `dflash train` reads) with the
    full config: a 16 GB checkpoint is not needed to benchmark the drafter."""
    from safetensors.torch import save_file
    from tiny import make_tiny_tokenizer
    from transformers import Qwen3ForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    cfg = qwen3_config(shape)
    tok = make_tiny_tokenizer()
    if head_only:
        g = torch.Generator(device=device).manual_seed(0)
        V, H = shape["vocab_size"], shape["hidden_size"]
        emb = (torch.randn(V, H, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()
        tensors = {"model.embed_tokens.weight": emb}
        if not shape.get("tie_word_embeddings"):
            tensors["lm_head.weight"] = (torch.randn(V, H, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(path)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(path)
        del model
    tok.save_pretrained(path)
    return path


WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part over new sound take only little work know place year live me back give most very "
         "after thing our just name good sentence man think say great where help through much before line right "
         "too mean old any same tell boy follow came want show also around form three small set put end does").split()


def synthetic_chats(n: int, mean_tokens: int = 900, seed: int = 0, max_tokens: int = 4000) -> list[dict]:
    """Chats with a realistic (log-normal) length mix; ~2.75 tokens per word with the tiny tokenizer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        total = int(min(max_tokens, max(32, rng.lognormvariate(0, 0.8) * mean_tokens * 0.72)))
        prompt = max(8, int(total * rng.uniform(0.1, 0.4)))
        words = lambda k: " ".join(rng.choice(WORDS) for _ in range(max(1, int(k / 2.75))))
        rows.append({"messages": [{"role": "user", "content": words(prompt)},
                                  {"role": "assistant", "content": words(total - prompt)}]})
    return rows


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def timed(fn, sync: bool = True):
    if sync and torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if sync and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def _kernel_category(name: str) -> str:
    n = name.lower()
    if "flex" in n or "attention" in n or "triton_tem" in n:
        return "attention"
    if any(k in n for k in ("gemm", "xmma", "cutlass", "nvjet", "matmul", "sm90_", "sm100_")):
        return "matmul"
    if n.startswith("triton"):  # inductor's fused kernels (before "copy": their names often hold _to_copy)
        return "fused/elementwise"
    if "memcpy" in n or "memset" in n or "copy" in n:
        return "copy"
    if "elementwise" in n or "reduce" in n:
        return "fused/elementwise"
    return "other"


def kernel_summary(prof, iters: int, matmul_flops: float | None = None, top: int = 20) -> dict:
    """A finished torch.profiler run's GPU time by kernel category (matmul, attention, fused, copy) per
    iteration, the top kernels, and the matmuls' own TFLOP/s when their FLOPs over all iterations are given."""
    cats: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us <= 0:
            continue
        cats[_kernel_category(e.key)] = cats.get(_kernel_category(e.key), 0.0) + us
        kernels.append((us, e.key[:120], e.count))
    total = sum(cats.values())
    if not total:
        raise RuntimeError("the profiler saw no GPU kernels")
    kernels.sort(reverse=True)
    mm_s = cats.get("matmul", 0.0) / 1e6
    return {"gpu_ms_per_iter": total / 1e3 / iters,
            "ms_per_iter": {k: v / 1e3 / iters for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "share": {k: v / total for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "matmul_TFLOP_s": matmul_flops / mm_s / 1e12 if matmul_flops and mm_s else None,
            "top_kernels": [{"ms_per_iter": us / 1e3 / iters, "calls_per_iter": c / iters, "name": k}
                            for us, k, c in kernels[:top]]}
