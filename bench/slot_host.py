"""The slot engine's host time per decode step: the bookkeeping between two replays of the step's CUDA graph
(positions, which rows end, their tokens, freed slots), during which the GPU waits (extract/generation/slot_engine.py). The
model's step is replaced by a stand-in returning logits of the right shape at once, and greedy sampling picks a
token from them, so what is timed is the engine's own Python and numpy work (plus that pick: on a GPU it is device
work).

    python bench/slot_host.py --slots 1024 --prompts 4096

Prompts of 20-120 tokens, up to 96 new tokens each, one end id that the stand-in's logits never pick (every row runs
to its budget). Prints the decode steps and the host milliseconds a step, prefills excluded. Feeds BENCHMARKS.md,
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
from dflash.extract.generation.slot_engine import SlotEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_llama()
    V = model.config.vocab_size
    eng = SlotEngine(model, eos_ids={V - 1}, slots=args.slots, max_len=256, prefill_tokens=1 << 16, bucket=64,
                     graphs=False)
    logits = torch.zeros(args.slots, 1, V)
    eng.dec.step = lambda ids, start, end, all_logits=True: (logits[:ids.shape[0]], None)
    rng = random.Random(0)
    for i in range(args.prompts):
        eng.add(Request([rng.randrange(1, V - 1) for _ in range(rng.randint(20, 120))], args.max_new_tokens, key=i))
    t = time.perf_counter()
    while eng.busy:
        eng.step()
    host = time.perf_counter() - t - eng.seconds["prefill"]
    print(f"{args.slots} slots, {args.prompts} prompts: {eng.steps} decode steps, "
          f"{1e3 * host / eng.steps:.2f} ms of host work a step ({eng.generated:,} tokens)")


if __name__ == "__main__":
    main()
