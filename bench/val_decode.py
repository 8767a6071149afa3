"""The held-out decoding tau of a saved drafter, measured from its files: what `dflash train --val-cache` reports.

Feeds BENCHMARKS.md, "Decoding and quality" (the expected tau against the decoding tau).

    python bench/val_decode.py --drafter RUN/final --val-cache WORK/cache-valid --target WORK/target \
        --max-new-tokens 0,64 [--rows 0] [--device cpu] [--json out.json]

It drafts a block at every anchor position of the first --rows rows (0 = all) of the held-out cache, once, and
for each --max-new-tokens value (0 = whole answers) walks each answer as greedy speculative decoding does
(train/fit/validate.py), then prints the decoding tau beside the expected tau (the mean accepted length over every
position) and the loss. On answers the target itself wrote (regenerated, greedy), the decoding tau is what
`dflash eval` measures on the same prompts with the same --max-new-tokens. The drafter runs in float32 with the
exact split attention on CPU and GPU alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="A drafter directory (RUN/final or a checkpoint's export).")
    ap.add_argument("--val-cache", required=True, help="A cache extracted from held-out conversations.")
    ap.add_argument("--target", required=True, help="The target's HF folder (its embedding and LM head).")
    ap.add_argument("--max-new-tokens", default="0", help="Comma list: answers stop after this many tokens (0 = all).")
    ap.add_argument("--rows", type=int, default=0, help="Rows of the cache (0 = all).")
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--num-anchors", type=int, default=512, help="With --batch-rows: blocks per forward.")
    ap.add_argument("--gamma", type=float, default=7.0, help="The loss's slot decay (train --gamma): the loss only.")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", help="Write the results here.")
    a = ap.parse_args(argv)

    import torch

    import dflash_cache
    from dflash.train.drafter.checkpoint import load_drafter
    from dflash.train.drafter.target_head import load_target_head
    from dflash.train.fit.validate import Validator, decode_walk

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    model = load_drafter(a.drafter, attn_impl="split", dtype=torch.float32, device=dev)
    emb, head = load_target_head(a.target)
    model.set_target_head(emb.float().to(dev), head.float().to(dev))
    cache = dflash_cache.open(a.val_cache)
    caps = [int(x) for x in a.max_new_tokens.split(",") if x.strip()]
    t = time.perf_counter()
    v = Validator(a.val_cache, cache, {}, a.rows, a.batch_rows, a.num_anchors, a.gamma, dev, keep_accepted=True)
    base = v(model)  # one pass drafts every block; each --max-new-tokens is a walk over its accepted lengths
    seconds = time.perf_counter() - t
    results = []
    for cap in caps:
        walks = [decode_walk(*row, cap) for row in v.accepted]
        tokens, steps = sum(w[0] for w in walks), sum(w[1] for w in walks)
        r = {"max_new_tokens": cap, "val_tau_decode": tokens / steps if steps else 1.0, "steps": steps, "tokens": tokens,
             **{k: base[k] for k in ("val_tau_expected", "val_loss", "val_rows", "val_blocks")}}
        results.append(r)
        print(f"max_new_tokens {cap or 'all'}: decoding tau {r['val_tau_decode']:.3f} ({tokens} tokens in {steps} "
              f"steps), expected tau {r['val_tau_expected']:.3f}, loss {r['val_loss']:.4f} ({r['val_rows']} rows, "
              f"{r['val_blocks']} blocks)", flush=True)
    print(f"one pass over the cache: {seconds:.0f} s on {dev}")
    out = {"drafter": a.drafter, "val_cache": a.val_cache, "device": str(dev), "seconds": seconds, "results": results}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
