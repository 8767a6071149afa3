"""Multi-GPU scaling of both stages, through the real CLI under torchrun: 1 GPU against N GPUs.

Feeds BENCHMARKS.md, "Scaling", and the `dflash train` row of "Training step" (--parts train --train-ns 1).

    python bench/scaling.py --gpus 0,1                       # extraction and training, 1 vs 2 GPUs
    python bench/scaling.py --gpus 0,1 --parts train --json out.json

Extraction: `dflash extract --gpus ...` of the same synthetic chats with a Qwen3-8B-shaped random
target (T = 4096, K = 5, zstd) into /dev/shm (so the disk does not set the pace); throughput is every
rank's tokens over the slowest rank's time (model loading excluded). Bar: N GPUs >= 0.95 x N x one GPU.

Training: `dflash train --gpus ...` with the Qwen3-8B-shaped drafter at the peers' defaults (4 rows x
3072 tokens per GPU, 512 anchors, B 16, compiled CUDA-graph step, bf16) from a synthetic cache;
throughput is the global context tokens/s of metrics.jsonl after the first log window (compilation).
Bar: 2 GPUs >= 1.85 x one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from bench.common import QWEN3_8B, hardware, random_target_dir, synthetic_chats, table, write_jsonl  # noqa: E402


def cli(args: list[str], log: str) -> float:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "-m", "dflash", *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        with open(log) as f:
            sys.exit(f"failed ({p.returncode}): dflash {' '.join(args)}\n{f.read()[-4000:]}")
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="0,1", help="the N GPUs; the one-GPU reference runs on the first")
    ap.add_argument("--parts", default="extract,train")
    ap.add_argument("--chats", type=int, default=600, help="synthetic chats for extraction (~900 tokens each)")
    ap.add_argument("--steps", type=int, default=40, help="training steps per run")
    ap.add_argument("--workdir", default="/root/dflash-scaling")
    ap.add_argument("--shm", default="/dev/shm/dflash-scaling")
    ap.add_argument("--extract-ns", default=None, help="GPU counts of the extraction runs (default: 1,N)")
    ap.add_argument("--train-ns", default=None, help="GPU counts of the training runs (default: 1,N)")
    ap.add_argument("--train-cache", default=None, help="reuse this synthetic 8B-shaped cache (T 3072), e.g. bench/train.py's")
    ap.add_argument("--train-target", default=None, help="the target of --train-cache (default: the random target)")
    ap.add_argument("--json")
    a = ap.parse_args()
    gpus = a.gpus.split(",")
    os.makedirs(a.workdir, exist_ok=True)
    os.makedirs(a.shm, exist_ok=True)
    # extraction needs the whole random target (16 GB); training reads only its embedding and LM head
    if "extract" in a.parts:
        target = random_target_dir(os.path.join(a.workdir, "target"), QWEN3_8B, device="cuda")
    else:
        target = a.train_target or random_target_dir(os.path.join(a.workdir, "target-head"), QWEN3_8B, head_only=True)
    res = {"hardware": hardware(), "gpus": len(gpus)}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)

    rows = []
    if "extract" in a.parts:
        chats = os.path.join(a.workdir, "chats.jsonl")
        write_jsonl(chats, synthetic_chats(a.chats, seed=1, max_tokens=4000))
        for n in ([int(x) for x in a.extract_ns.split(",")] if a.extract_ns else sorted({1, len(gpus)})):
            out = os.path.join(a.shm, f"cache-{n}")
            shutil.rmtree(out, ignore_errors=True)
            js = os.path.join(a.workdir, f"extract-{n}.json")
            wall = cli(["extract", "--target", target, "--data", chats, "--out", out, "--seq-len", "4096", "--codec", "zstd",
                        "--no-progress", "--gpus", ",".join(gpus[:n]), "--json", js], os.path.join(a.workdir, f"extract-{n}.log"))
            s = json.load(open(js))
            rows.append({"stage": "extract", "gpus": n, "tok_s": s["tokens_per_s_all_ranks"], "tokens": s["tokens_all_ranks"],
                         "slowest_rank_s": s["slowest_rank_s"], "load_s": s["load_s"], "wall_s": wall})
            shutil.rmtree(out, ignore_errors=True)
            res["extract"] = [r for r in rows if r["stage"] == "extract"]
            save()
        if len(res["extract"]) > 1:
            one, many = res["extract"][0]["tok_s"], res["extract"][-1]["tok_s"]
            res["extract_scaling"] = many / (res["extract"][-1]["gpus"] * one)
            save()
    if "train" in a.parts:
        from bench.train import synthetic_cache
        from dflash.core.layers import default_layer_ids

        cache = synthetic_cache(a.train_cache or os.path.join(a.shm, "train-cache"), target, 3072, 32,
                                default_layer_ids(QWEN3_8B["num_hidden_layers"]))
        for n in ([int(x) for x in a.train_ns.split(",")] if a.train_ns else sorted({1, len(gpus)})):
            out = os.path.join(a.workdir, f"run-{n}")
            shutil.rmtree(out, ignore_errors=True)
            wall = cli(["train", "--cache", cache, "--target", a.train_target or target, "--out", out, "--drafter-layers", "5",
                        "--block-size", "16", "--num-anchors", "512", "--batch-rows", "4", "--max-steps", str(a.steps),
                        "--log-every", "5", "--save-every", "1000000", "--no-progress", "--gpus", ",".join(gpus[:n])],
                       os.path.join(a.workdir, f"train-{n}.log"))
            hist = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
            steady = hist[1:] or hist
            summ = json.load(open(os.path.join(out, "summary.json")))
            rows.append({"stage": "train", "gpus": n, "tok_s": float(np.median([h["ctx_tokens_per_s"] for h in steady])),
                         "step_ms": float(np.median([h["step_ms"] for h in steady])),
                         "data_wait": float(np.mean([h["data_wait_frac"] for h in steady])),
                         "mfu": float(np.median([h["mfu"] for h in steady])),
                         "recompiles": summ.get("recompiles_after_warmup"), "wall_s": wall,
                         "compiled": summ.get("compiled"), "compile_check": summ.get("compile_check"),
                         "loss_last": hist[-1]["loss"]})
            res["train"] = [r for r in rows if r["stage"] == "train"]
            save()
        if len(res["train"]) > 1:
            one, many = res["train"][0]["tok_s"], res["train"][-1]["tok_s"]
            res["train_speedup"] = many / one
        save()
    print(f"\nhardware: {hardware()}")
    print(table(rows, ["stage", "gpus", "tok_s", "tokens", "slowest_rank_s", "load_s", "step_ms", "mfu", "data_wait",
                       "recompiles", "wall_s"]))
    print({k: v for k, v in res.items() if k.endswith(("scaling", "speedup"))})


if __name__ == "__main__":
    main()
