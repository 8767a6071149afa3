"""The host time of a prefill's ids in the slot engine (extract/generation/slot_engine.py `padded`): the prompts right-padded
into one [k, width] tensor while the GPU waits, against building it row by row (one small tensor a prompt, as the
engine did before). Feeds BENCHMARKS.md, "Regeneration".

    python bench/prefill_ids.py --prompts 1024 --lengths 20-300
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.extract.generation.slot_engine import padded  # noqa: E402


def row_by_row(prompts: list[list[int]], width: int, pad: int) -> torch.Tensor:
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--lengths", default="20-300", help="LO-HI: prompt lengths uniform in [LO, HI] (seeded)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.lengths.split("-"))
    rng = random.Random(0)
    prompts = [[rng.randrange(50_000) for _ in range(rng.randint(lo, hi))] for _ in range(args.prompts)]
    width = max(map(len, prompts))
    assert torch.equal(row_by_row(prompts, width, 0), padded(prompts, width, 0)[0])
    for name, fn in (("row by row", row_by_row), ("padded", lambda p, w, pad: padded(p, w, pad)[0])):
        t = time.perf_counter()
        for _ in range(args.iters):
            fn(prompts, width, 0)
        print(f"{name:10} {(time.perf_counter() - t) / args.iters * 1e3:7.2f} ms for {args.prompts} prompts of "
              f"{args.lengths} tokens", flush=True)


if __name__ == "__main__":
    main()
