"""How the order in which `regenerate` hands prompts to the slot engine changes the columns a decode step attends
over (extract/generation/slot_engine.py: a step attends over its longest live row's columns, rounded up to 256). The engine is
the real SlotEngine, on a CPU with a one-layer random model (the scheduling does not depend on the model); prompts
are given in parts as `regenerate` does (extract/generation/regenerate.py: longest first within a window of parts).

    python bench/slot_schedule.py --prompts 16384 --slots 1024 --windows 1,8,16,32

Prompt lengths are log-normal (median ~300 tokens, clipped to 16-3,000), answers 8-96 tokens, seeded. Prints per
window (parts of --part-size prompts): decode steps and attended / real cache columns. Feeds BENCHMARKS.md,
"Regeneration".
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import tiny_llama  # noqa: E402
from dflash.extract.generation.generate import Request  # noqa: E402
from dflash.extract.generation.regenerate import PartOrder  # noqa: E402
from dflash.extract.generation.slot_engine import SlotEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16384)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--part-size", type=int, default=256)
    ap.add_argument("--windows", default="1,8,16,32", help="parts per window, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_llama(max_position_embeddings=8192)
    rng = random.Random(0)
    lens = [max(16, min(3000, int(rng.lognormvariate(5.7, 0.9)))) for _ in range(args.prompts)]
    news = [rng.randint(8, 96) for _ in range(args.prompts)]
    parts = [list(range(i, min(args.prompts, i + args.part_size))) for i in range(0, args.prompts, args.part_size)]
    for window in (int(w) for w in args.windows.split(",")):
        eng = SlotEngine(model, eos_ids=set(), slots=args.slots, max_len=4096, graphs=False, start_len=512,
                         prefill_tokens=1 << 16)
        order = PartOrder(args.slots, args.part_size, window_parts=window)
        queue, t = list(range(len(parts))), time.time()
        while True:
            while queue and order.wants(queue[0], len(eng.pending)):
                p = queue.pop(0)
                order.open(p)
                for r in parts[p]:
                    eng.add(Request([1] * lens[r], news[r], key=r, priority=order.priority(p, lens[r], r)))
            if not eng.busy:
                break
            eng.step()
        print(f"window of {window} parts: {eng.steps} decode steps, attended / real columns "
              f"{eng.decode_columns / eng.decode_real_columns:.2f} ({eng.decode_columns / 1e6:.0f}M / "
              f"{eng.decode_real_columns / 1e6:.0f}M), {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
