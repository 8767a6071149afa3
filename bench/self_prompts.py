"""Can the target write its own training prompts? A probe of self-prompted instructions for the out-of-source gap.

Feeds BENCHMARKS.md, "GPU recipe" ("what limits it"). The recipe's drafter does not generalise to MT-Bench because the
prompts it learns from are chit-chat plus ~1,200 distinct instructions; no larger instruction set ships in a package.
An instruction-tuned target, given its chat template up to the start of a user turn and sampled, writes a user turn
of the kind it was tuned on (the "pre-query template" method of Magpie, Xu et al. 2024). This script samples N such
turns from the demo's target and reports how many are distinct, how many ended on their own (the end-of-turn token
within --max-new-tokens), their mean length, and prints them.

    python bench/self_prompts.py                       # 48 prompts, SmolLM2-135M-Instruct (the demo's GGUF), CPU
    python bench/self_prompts.py --n 1024 --device cuda --json p.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=48, help="prompts to sample")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.99)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target", default=None,
                    help="an HF target directory (default: the demo's SmolLM2 GGUF, converted)")
    ap.add_argument("--json")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = a.target
    if target is None:
        from dflash.core.target import convert_gguf
        from dflash.demo_assets import smollm2_gguf

        target = convert_gguf(smollm2_gguf(), os.path.join(tempfile.gettempdir(), "dflash-bench-smollm2"))
    tok = AutoTokenizer.from_pretrained(target)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(a.device).eval()
    marker = "\x00PROMPT\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    prefix = text[:text.index(marker)]  # the template up to where a user's words begin
    eot = tok.eos_token_id
    torch.manual_seed(a.seed)
    prompts, ended, lengths = [], 0, []
    start = tok(prefix, return_tensors="pt", add_special_tokens=False).input_ids.to(a.device)
    t0 = time.perf_counter()
    while len(prompts) < a.n:
        ids = start.repeat(min(a.batch, a.n - len(prompts)), 1)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=a.temperature,
                                 top_p=a.top_p, max_new_tokens=a.max_new_tokens, eos_token_id=eot, pad_token_id=eot)
        for row in out[:, ids.shape[1]:].tolist():
            n = row.index(eot) if eot in row else len(row)
            ended += eot in row
            lengths.append(n)
            prompts.append(tok.decode(row[:n], skip_special_tokens=True).strip())
    seconds = time.perf_counter() - t0
    res = {"target": target, "n": len(prompts), "distinct": len(set(prompts)), "ended": ended,
           "mean_tokens": sum(lengths) / len(lengths), "seconds": round(seconds, 1), "prefix": prefix,
           "settings": vars(a), "prompts": prompts}
    for p in prompts:
        print("-", p[:200].replace("\n", " "))
    print(f"\n{res['n']} prompts in {seconds:.0f} s on {a.device}: {res['distinct']} distinct, {ended} ended on their "
          f"own within {a.max_new_tokens} tokens, {res['mean_tokens']:.1f} tokens on average")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
