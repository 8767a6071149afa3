"""Where a graph-captured decode step's time goes: the static decoder's step (dflash/core/static_decode.py) under
torch.profiler, kernels by device time. `python bench/decode_profile.py --shape recipe --batch 1 --q 1`;
`--batch 1024 --fused --varlen triton --mixed 32-512`: regenerate's batched step (fused layers, each row's own
columns read by that kernel: triton or flash)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode import graph_step, mixed_lengths, model_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="recipe")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--q", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--fused", action="store_true", help="the layers as compiled functions (a GPU's default)")
    ap.add_argument("--varlen", choices=["triton", "flash"], help="a batched step reads each row's own columns with "
                    "this kernel (else it attends over the span)")
    ap.add_argument("--mixed", help="LO-HI: row lengths uniform in [LO, HI] (seeded) instead of --context each")
    ap.add_argument("--rows", type=int, default=25, help="kernels listed")
    args = ap.parse_args()
    m = model_of(args.shape, torch.device("cuda"), torch.bfloat16)
    lengths = mixed_lengths(args.mixed, args.batch) if args.mixed else None
    fn = graph_step(m, args.batch, args.context, args.q, args.fused, lengths, varlen=args.varlen or False)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    from dflash.core import static_decode

    dec = fn.__closure__[[c.cell_contents.__class__ for c in fn.__closure__].index(static_decode.StaticDecoder)].cell_contents
    dec.graphs_on = False  # the same kernels, launched one by one, so the profiler names each
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
