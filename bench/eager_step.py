"""The eager CPU training step: dense SDPA mask vs the split attention (train/drafter/attention.py).

Feeds BENCHMARKS.md, "Training step" (the CPU row).

    python bench/eager_step.py                                  # `dflash train` defaults: 4 x 2048, 512 anchors, B 16
    python bench/eager_step.py --rows 1 --modes sdpa,split --json out.json

The drafter is the one `dflash train` builds for the tiny test target (tests/tiny.py: hidden 64, 4 heads,
2 kv heads, vocab 416) with the trainer's defaults (5 layers, block 16, 512 anchors per row, float32, AdamW):
~0.19M trainable parameters. Rows are synthetic packed rows (bench/train.synthetic_rows: 2-5 documents per
row, ~3% padding, the first quarter of each document unsupervised). One step = forward_train, backward,
AdamW step. Each mode runs in its own process (so each peak RSS is its own); the step time is the median of
--steps steps after one warm-up step; cpu_s is the step's process CPU time (with OMP_NUM_THREADS=1, what the step
costs on a machine shared with other work; wall time includes waiting for a core). The loss of the first step is printed per mode: the modes compute the
same function, so it must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import hardware, table  # noqa: E402


def one_mode(a) -> dict:
    import numpy as np
    import torch

    from bench.train import synthetic_rows
    from dflash.train.drafter.model import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=416, target_layer_ids=[1, 3], num_target_layers=6, num_layers=a.layers,
                        block_size=a.block, mask_token_id=415)
    model = DFlashDrafter(cfg, attn_impl=a.mode)
    model.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(0)
    model.set_target_head(torch.randn(416, 64, generator=g) * 0.02, torch.randn(416, 64, generator=g) * 0.02)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4)
    ids, lm, doc, hid = synthetic_rows(a.rows, a.seq_len, 128, 400, np.random.default_rng(0), g)
    x = [torch.from_numpy(ids), torch.from_numpy(lm), torch.from_numpy(doc)]
    hidden = hid.float()
    times, cpu, losses = [], [], []
    for step in range(a.steps + 1):
        scores = torch.rand(a.rows, a.seq_len, generator=torch.Generator().manual_seed(step))
        t0, c0 = time.perf_counter(), time.process_time()
        loss, _ = model.forward_train(hidden, *x, scores, a.anchors)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        losses.append(float(loss.detach()))
        if step > 0:
            times.append(dt)
            cpu.append(dc)
    return {"mode": a.mode, "rows": a.rows, "seq_len": a.seq_len, "anchors": a.anchors, "block": a.block,
            "params": sum(p.numel() for p in params), "step_s": statistics.median(times), "min_step_s": min(times),
            "cpu_s": statistics.median(cpu),
            "first_loss": losses[0], "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="sdpa,split", help="comma list of attention paths: sdpa (dense mask), split")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # one mode, in a child process
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(one_mode(a)))
        return
    res = []
    for mode in a.modes.split(","):
        argv = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--rows", str(a.rows), "--seq-len",
                str(a.seq_len), "--anchors", str(a.anchors), "--block", str(a.block), "--layers", str(a.layers),
                "--steps", str(a.steps)]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        res.append(json.loads(out.strip().splitlines()[-1]))
    for r in res:
        r["speedup_vs_first"] = res[0]["step_s"] / r["step_s"]
        r["cpu_speedup_vs_first"] = res[0]["cpu_s"] / r["cpu_s"]
    print(f"eager CPU step, {hardware()}, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(table(res, ["mode", "rows", "seq_len", "anchors", "block", "params", "step_s", "min_step_s", "cpu_s", "speedup_vs_first",
                      "cpu_speedup_vs_first",
                      "peak_rss_gb", "first_loss"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hardware": hardware(), "results": res}, f, indent=2)


if __name__ == "__main__":
    main()
