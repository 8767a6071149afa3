"""Regeneration of multi-turn conversations with and without --continue-turns: prefill work, fed ids, time.

    python bench/regen_turns.py --target work/demo/target --conversations 16 --max-turns 8 --max-new-tokens 24
    python bench/regen_turns.py --target /root/work/demo-gpu/target --conversations 1024 --max-turns 32 \\
        --max-new-tokens 96 --batch-size 1024                                           # the GPU recipe's shape

Chitchat conversations (the demo's training split, dflash/demo_gpu.py: the first --max-turns turns of each, in
the file's order) are regenerated twice by `dflash regenerate`'s own code (extract/regenerate.py), once with each
setting, into WORKDIR/on and WORKDIR/off. Prints per setting: seconds of generation, prompt ids prefilled, ids fed
to continuing rows, turns continued, decode steps, and whether both wrote the same text (the lossless check: in
float32 they must; in bf16 a prefill and a step-by-step feed of the same ids can differ in the last bits).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="an HF folder of the target (e.g. the demo's converted SmolLM2)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=8, help="messages kept per conversation (user + assistant)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=0, help="0: the engine's default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workdir", default=None, help="default: a temporary directory, removed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from dflash.core.io import atomic_jsonl
    from dflash.demo_gpu import GpuRecipe, split_data
    from dflash.demo_assets import chitchat_json
    from dflash.extract.regenerate import RegenerateConfig, committed_parts, part_name, run_regenerate

    work = a.workdir or tempfile.mkdtemp(prefix="regen-turns-")
    os.makedirs(work, exist_ok=True)
    with open(chitchat_json()) as f:
        raw = json.load(f)
    samples, _, _ = split_data(raw, GpuRecipe(max_turns=a.max_turns, eval_prompts=1))
    samples = samples[: a.conversations]
    data = os.path.join(work, "chats.jsonl")
    atomic_jsonl(data, [{"messages": s} for s in samples], ensure_ascii=False)
    out = {}
    for on in (True, False):
        d = os.path.join(work, "on" if on else "off")
        shutil.rmtree(d, ignore_errors=True)
        s = run_regenerate(RegenerateConfig(target=a.target, data=data, out=d, max_new_tokens=a.max_new_tokens,
                                            batch_size=a.batch_size, part_size=max(1, len(samples)),
                                            continue_turns=on, device=a.device, dtype=a.dtype, progress=False))
        e = s["engine_this_rank"]
        rows = []
        for p in sorted(committed_parts(d)):
            with open(os.path.join(d, "data", part_name(p))) as f:
                rows += [json.loads(line) for line in f]
        out["on" if on else "off"] = {
            "generation_s": s["generation_s_this_rank"], "generated_tokens": s["generated_tokens_this_rank"],
            "turns": s["counts"]["turns"], "context_tokens": s["counts"]["prompt_tokens"],
            "prefilled_tokens": e["prompt_tokens"], "fed_tokens": e["continuation_tokens"],
            "continued_turns": e["continued_turns"], "refused": e["continuations_refused"],
            "decode_steps": e["decode_steps"], "prefills": e["prefills"], "seconds": e["seconds"],
            "rows": {r["source_row"]: r["messages"] for r in rows}}
    same = out["on"]["rows"] == out["off"]["rows"]
    for v in out.values():
        del v["rows"]
    res = {"conversations": len(samples), "max_turns": a.max_turns, "max_new_tokens": a.max_new_tokens,
           "same_text": same, **out}
    print(f"{len(samples)} conversations, {out['on']['turns']} assistant turns, {a.max_new_tokens} new tokens at most")
    print("| setting | generation s | prefilled ids | fed ids | turns continued | decode steps | prefill s | decode s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for k, v in out.items():
        print(f"| --{'' if k == 'on' else 'no-'}continue-turns | {v['generation_s']:.1f} | {v['prefilled_tokens']:,} | "
              f"{v['fed_tokens']:,} | {v['continued_turns']:,} of {v['turns'] - len(samples):,} | {v['decode_steps']:,} | "
              f"{v['seconds'].get('prefill', 0):.1f} | {v['seconds'].get('decode', 0):.1f} |")
    print(f"same text with and without: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
