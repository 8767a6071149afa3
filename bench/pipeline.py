"""Extraction then training, one after the other, against `dflash pipeline` (both at once) on the same GPU(s).

    python bench/pipeline.py --workdir /root/bp --json out.json                  # one GPU shared by both
    python bench/pipeline.py --extract-gpus 0,1,2,3,4 --train-gpus 5,6,7 ...      # the seeds' layout

A random SmolLM2-shaped target (+ the tiny chat tokenizer) and synthetic chats (bench/common.py), with the GPU
recipe's settings (configs/demo-gpu.yaml: rows of 2048 tokens, fp8 hidden states, a 4-layer block-16 drafter, batch
8 x 512 anchors) and --steps training steps. Each way starts from nothing: its own cache, run directory and
tokenise cache, and new empty inductor/Triton caches (a fresh machine's compile). Reported per way: the wall clock from
the start to the trained drafter, the extraction's rate (its summary), the training's (its summary: steps, the
first compiled call, the last window's context tokens/s, the time it waited for shards), and the final losses of
the two runs side by side (bf16 on a GPU: close, not bit-equal; the CPU test shows bit-equality).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import SMOLLM2, hardware, random_target_dir, synthetic_chats, write_jsonl  # noqa: E402


def fresh_env(root: str) -> dict[str, str]:
    """The environment of one way: empty compile caches of its own."""
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
                TRITON_CACHE_DIR=os.path.join(root, "triton"), PYTHONUNBUFFERED="1")


def run(cmd: list[str], env: dict, log: str, timeout: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=max(1.0, timeout)).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    return rc, time.perf_counter() - t0


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def train_figures(run_dir: str) -> dict:
    s = read(os.path.join(run_dir, "summary.json"))
    hist = s.get("history") or [{}]
    return {"steps": s.get("steps"), "train_elapsed_s": s.get("elapsed_s"),
            "first_compiled_call_s": (s.get("first_compiled_call") or {}).get("seconds"),
            "ctx_tok_s_last_window": hist[-1].get("ctx_tokens_per_s"), "loss_last": hist[-1].get("loss"),
            "waited_for_shards_s": (s.get("follow") or {}).get("waited_s")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--chats", type=int, default=6000)
    ap.add_argument("--mean-tokens", type=int, default=900)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--config", default="demo-gpu")
    ap.add_argument("--extract-gpus", default="0", help="'' = one plain process on its default device (a CPU smoke run)")
    ap.add_argument("--train-gpus", default="0")
    ap.add_argument("--ways", default="sequential,pipeline")
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop each way at what is left of this (0: no limit)")
    ap.add_argument("--json")
    a = ap.parse_args()
    t_start = time.perf_counter()
    wd = a.workdir or tempfile.mkdtemp(prefix="dflash-bench-pipeline-")
    os.makedirs(wd, exist_ok=True)
    import torch

    target = random_target_dir(os.path.join(wd, "target"), SMOLLM2, device="cuda" if torch.cuda.is_available() else "cpu")
    data = os.path.join(wd, "chats.jsonl")
    if not os.path.exists(data):
        write_jsonl(data, synthetic_chats(a.chats, mean_tokens=a.mean_tokens))
    dflash = [sys.executable, "-m", "dflash"]
    results = {"hardware": hardware(), "chats": a.chats, "steps": a.steps, "config": a.config, "ways": {}}
    for way in a.ways.split(","):
        root = os.path.join(wd, way)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        cache, out, tok = os.path.join(root, "cache"), os.path.join(root, "run"), os.path.join(root, "tokenized")
        ext_json = os.path.join(root, "extract.json")
        env = fresh_env(root)
        left = lambda: (a.budget_s - (time.perf_counter() - t_start)) if a.budget_s else 3600.0  # noqa: E731
        extract = ["--config", a.config, "--target", target, "--data", data, "--tokenize-cache", tok, "--no-progress"]
        train = ["--config", a.config, "--target", target, "--max-steps", str(a.steps), "--no-progress"]
        t0 = time.perf_counter()
        if way == "sequential":
            gpus = lambda ids: ["--gpus", ids] if ids else []  # noqa: E731 (none: one plain process)
            rc, _ = run(dflash + ["extract", *extract, "--out", cache, "--json", ext_json, *gpus(a.extract_gpus)],
                        env, os.path.join(root, "extract.log"), left())
            if rc == 0:
                rc, _ = run(dflash + ["train", *train, "--cache", cache, "--out", out, *gpus(a.train_gpus)],
                            env, os.path.join(root, "train.log"), left())
        else:
            ids = [*(["--extract-gpus", a.extract_gpus] if a.extract_gpus else []),
                   *(["--train-gpus", a.train_gpus] if a.train_gpus else [])]
            rc, _ = run(dflash + ["pipeline", "--config", a.config, "--target", target, "--data", data, "--cache", cache,
                                  "--out", out, *ids,
                                  "--extract-args", f"--tokenize-cache {tok}", "--train-args", f"--max-steps {a.steps}",
                                  "--json", os.path.join(root, "pipeline.json")],
                        env, os.path.join(root, "pipeline.log"), left())
            e = read(os.path.join(root, "pipeline.json")).get("extract") or {}
            write_json(ext_json, e)
        wall = time.perf_counter() - t0
        e = read(ext_json)
        results["ways"][way] = {"rc": rc, "wall_s": wall, "extract_tok_s": e.get("tokens_per_s_all_ranks"),
                                "extract_tokens": e.get("tokens_all_ranks"), "extract_s": e.get("slowest_rank_s"),
                                **train_figures(out)}
        print(json.dumps({way: results["ways"][way]}), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=2)
    w = results["ways"]
    if "sequential" in w and "pipeline" in w and w["pipeline"]["wall_s"]:
        results["speedup"] = w["sequential"]["wall_s"] / w["pipeline"]["wall_s"]
        print(f"sequential {w['sequential']['wall_s']:.0f} s, pipeline {w['pipeline']['wall_s']:.0f} s "
              f"({results['speedup']:.2f}x); final loss {w['sequential'].get('loss_last')} vs "
              f"{w['pipeline'].get('loss_last')}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
