"""Training-step benchmark: eager vs compiled CUDA-graph steps of the real trainer, from a real cache.

Feeds BENCHMARKS.md, "Training step", "First compiled step" and the step-per-stored-dtype rows of "Cache size".

    python bench/train.py                       # Qwen3-8B-shaped drafter and the demo-size drafter
    python bench/train.py --shapes demo --steps 40 --json out.json
    python bench/train.py --shapes qwen3-8b --modes compiled:flex --hidden-dtypes bf16,fp8,fp4   # per cache dtype
    python bench/train.py --shapes qwen3-8b --profile-steps 5 --json p.json   # GPU time by kernel category
    python bench/train.py --shapes qwen3-8b --modes compiled:flex --compile-scopes regions,step \
        --isolate fresh,warm --budget-s 500 --json c.json   # the first compiled call on a fresh machine, and warm

--isolate runs each compiled mode in new processes whose inductor and Triton caches are new empty directories:
fresh (nothing saved: what a new machine pays), then warm (the compile artifacts the fresh run saved,
train/fit/compile_step.py); first_call_s is the first compiled call (forward + backward, compilation included), step_ms
the median step after it. --compile-scopes step is the whole step as one graph (the way it was).

Qwen3-8B shape (the peers' offline defaults): 5 layers, H 4096, vocab 151,936, B 16, 4 rows x 3072
tokens, 512 anchors per row, gamma 7, bf16 weights, fused AdamW. The cache is synthetic (random
bf16 hidden states, realistic packing) and written with dflash_cache; the target directory holds
only the embedding and LM head (all `dflash train` reads). Reports tokens/s, step time, MFU
(matmul FLOPs: trainable x3, frozen LM head x2, over the chip's dense bf16 peak,
train/fit/schedule.py's table: 989 TFLOP/s on an H100/H200), recompiles after
warm-up, and the fraction of time the step waited for data. With --hidden-dtypes the same synthetic rows
are also stored as fp8 / fp4 caches (quantised by the writer); the loader then moves bytes + scales and the
step dequantises on the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np
import torch
import torch._dynamo

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import QWEN3_8B, SMOLLM2, hardware, kernel_summary, random_target_dir, table  # noqa: E402

SHAPES = {
    # name: (target shape, seq_len, rows, anchors, block, drafter layers)
    "qwen3-8b": (QWEN3_8B, 3072, 4, 512, 16, 5),
    "demo": (SMOLLM2, 512, 4, 64, 16, 2),
    "recipe": (SMOLLM2, 2048, 8, 512, 16, 4),  # the GPU recipe's step (configs/demo-gpu.yaml)
    # a smoke test of the script itself on a CPU (--modes eager:sdpa,compiled:sdpa)
    "tiny": (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False), 256, 2, 16, 4, 1),
}


def synthetic_rows(n: int, seq_len: int, width: int, vocab: int, rng, g):
    """n packed rows as the cache stores them: 3-6 documents per row, ~3% padding, the first quarter of
    each document (its prompt) unsupervised, random ids, random bf16 hidden states (std 2, 0 on padding)."""
    doc = np.zeros((n, seq_len), np.int32)
    lm = np.zeros((n, seq_len), np.uint8)
    for r in range(n):
        cuts = np.sort(rng.choice(np.arange(64, seq_len - 64), size=rng.integers(2, 6), replace=False))
        end = int(seq_len * 0.97)
        bounds = [0, *[c for c in cuts if c < end], end]
        for d in range(len(bounds) - 1):
            a, b = bounds[d], bounds[d + 1]
            doc[r, a:b] = d + 1
            lm[r, a + (b - a) // 4:b] = 1
    ids = rng.integers(0, vocab, (n, seq_len), dtype=np.int32)
    hid = (torch.randn(n, seq_len, width, generator=g) * 2).to(torch.bfloat16)
    hid[torch.from_numpy(doc == 0)] = 0
    return ids, lm, doc, hid


def synthetic_cache(path: str, target: str, seq_len: int, rows: int, layer_ids: list[int], seed: int = 0,
                    hidden_dtype: str = "bfloat16") -> str:
    import dflash_cache
    from dflash.core.target import target_info

    info = target_info(target)
    if os.path.exists(os.path.join(path, "zarr.json")):
        return path
    H = info.hidden_size
    spec = dflash_cache.CacheSpec(seq_len=seq_len, hidden_size=H, layer_ids=layer_ids, num_rows=rows,
                                  rows_per_shard=4, codec="zstd", hidden_dtype=hidden_dtype,
                                  info={"target": info.as_dict()})
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    with dflash_cache.CacheWriter(path, spec, threads=16) as w:
        for s in range(spec.num_shards):
            _, n = spec.shard_rows(s)
            w.write_shard(s, *synthetic_rows(n, seq_len, H * len(layer_ids), info.vocab_size, rng, g))
    return path


def run_one(cache, target, out, shape, compile_, attn, steps, log_every, dtype="bfloat16", profile_steps=0,
            scope="regions", compile_cache=None):
    from dflash.train.fit.trainer import Trainer, TrainConfig

    _, T, rows, anchors, block, layers = shape
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig(cache=cache, target=target, out=out, drafter_layers=layers, block_size=block, num_anchors=anchors,
                      batch_rows=rows, max_steps=steps, log_every=log_every, save_every=10**9, compile=compile_,
                      attn=attn, param_dtype=dtype, progress=False, overwrite=True, loader_threads=8,
                      compile_scope=scope, compile_cache=compile_cache)
    tr = Trainer(cfg)
    prof = None
    n = min(profile_steps, steps - 2)  # the last n steps under torch.profiler (one warm-up step before them)
    if n >= 1 and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(activities=[ProfilerActivity.CUDA], schedule=schedule(skip_first=steps - n - 1, wait=0,
                                                                              warmup=1, active=n, repeat=1))
        step, done = tr.train_step, [0]

        def profiled_step(*args, **kw):
            w = step(*args, **kw)
            done[0] += 1
            if done[0] >= steps - n - 1:  # the host runs ahead of the GPU: the window's steps end on a sync
                torch.cuda.synchronize()
            prof.step()
            return w
        tr.train_step = profiled_step
        prof.start()
    res = tr.train()
    if prof is not None:
        torch.cuda.synchronize()
        prof.stop()
    hist = res["history"][1:] or res["history"]  # the first window holds warm-up / compilation
    ms = float(np.median([h["step_ms"] for h in hist]))
    r = {
        "compile": compile_, "attn": attn, "step_ms": ms,
        "ctx_tok_s": rows * T / ms * 1000, "block_tok_s": rows * anchors * block / ms * 1000,
        "mfu": tr.flops / (ms / 1000) / tr.peak if tr.peak else None,  # the chip's peak (train/fit/schedule.py)
        "tflops": tr.flops / (ms / 1000) / 1e12,
        "recompiles": res["recompiles_after_warmup"],
        "data_wait": float(np.mean([h["data_wait_frac"] for h in hist])),
        "first_window_s": res["history"][0]["step_ms"] * min(log_every, steps) / 1000,  # incl. compilation
        "loss_first": res["history"][0]["loss"], "loss_last": res["history"][-1]["loss"],
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "compiled_kept": tr.compiled, "compile_check": tr.check,  # a failed check trains (and times) eagerly
        "scope": scope if compile_ == "on" else None, "first_compiled_call": tr.first_call,
        "first_call_s": (tr.first_call or {}).get("seconds"), "caches": (tr.first_call or {}).get("caches"),
    }
    if prof is not None:
        try:  # a profiler failure must not lose the timing
            r["profile"] = kernel_summary(prof, n, tr.flops * n)
        except Exception as e:  # noqa: BLE001
            r["profile"] = {"error": repr(e)[:300]}
    del tr
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
    return r


def run_isolated(kw: dict, phase: str, artifacts: str, timeout: float, keep: str | None = None) -> dict:
    """run_one in a new process whose inductor and Triton caches are new empty directories (a fresh machine, as far
    as compiling goes). fresh: no saved artifacts (the run saves its own in `artifacts`); warm: it loads those."""
    import subprocess
    import time

    if phase == "fresh":
        shutil.rmtree(artifacts, ignore_errors=True)
    elif not os.path.isdir(artifacts):
        return {"error": f"warm needs the artifacts of a fresh run first ({artifacts})"}
    empty = tempfile.mkdtemp(prefix=f"dflash-{phase}-caches-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(empty, "inductor"),
               TRITON_CACHE_DIR=os.path.join(empty, "triton"))
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(dict(kw, compile_cache=artifacts))],
                           env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return {"error": f"cut after {timeout:.0f} s (--budget-s)", "process_s": time.perf_counter() - t0}
    finally:
        where = f"{kw['shape_name']}-{kw['attn']}-{kw['scope']}-{phase}"
        builds = kernel_builds(env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"],
                               keep=keep and os.path.join(keep, where))
        shutil.rmtree(empty, ignore_errors=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr or p.stdout)[-600:], "process_s": time.perf_counter() - t0, "kernel_builds": builds}
    return dict(json.loads(lines[-1]), process_s=time.perf_counter() - t0, kernel_builds=builds)


def kernel_builds(inductor_dir: str, triton_dir: str, top: int = 15, keep: str | None = None) -> dict:
    """Where a fresh compile's kernel-build time went, read from the caches it filled: each Triton kernel's source
    file (written by inductor when it hands the kernel to its compile workers) and its Triton cache entries (written
    when a build of one of its configs ends). span_s: from the first to the last of these for one kernel (its
    configs' builds, and any wait for a free worker); ends_s: when its last build ended, from the first source.
    keep: a directory to copy the slowest kernels' sources to."""
    srcs: dict[str, float] = {}
    paths: dict[str, str] = {}
    for root, _, files in os.walk(inductor_dir):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            try:
                text = open(path, errors="replace").read()
            except OSError:
                continue
            if "async_compile.triton(" in text or "@triton.jit" not in text:
                continue  # a graph's module (holds every kernel), or not a kernel
            for name in re.findall(r"^def (triton_\w+)\(", text, flags=re.M):
                srcs[name] = min(srcs.get(name, float("inf")), os.path.getmtime(path))
                paths[name] = path
    ends: dict[str, list[float]] = {}
    for root, _, files in os.walk(triton_dir):
        for f in files:
            if f.endswith(".cubin") or f.endswith(".hsaco"):
                ends.setdefault(f.rsplit(".", 1)[0], []).append(os.path.getmtime(os.path.join(root, f)))
    if not srcs:
        return {"kernels": 0}
    t0 = min(srcs.values())
    rows = []
    for name, start in srcs.items():
        e = ends.get(name)
        if e:
            rows.append({"kernel": name, "configs": len(e), "submitted_s": round(start - t0, 1),
                         "ends_s": round(max(e) - t0, 1), "span_s": round(max(e) - start, 1)})
    rows.sort(key=lambda r: -r["span_s"])
    if keep:
        os.makedirs(keep, exist_ok=True)
        for r in rows[:top]:
            shutil.copy(paths[r["kernel"]], os.path.join(keep, f"{r['span_s']:06.1f}s-{r['kernel'][:80]}.py"))
    for r in rows:
        r["kernel"] = r["kernel"][:90]
    last = max((r["ends_s"] for r in rows), default=0.0)
    return {"kernels": len(srcs), "built": len(rows), "configs": sum(r["configs"] for r in rows),
            "last_build_ends_s": last, "slowest": rows[:top]}


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":  # one run_isolated measurement
        kw = json.loads(sys.argv[2])
        kw["shape"] = SHAPES[kw.pop("shape_name")]
        print(json.dumps(run_one(**kw), default=str), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-8b,demo")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="default: /dev/shm/dflash-bench-train or a temp dir")
    ap.add_argument("--modes", default="eager:flex,compiled:flex", help="comma list of compile:attn (eager|compiled : flex|sdpa)")
    ap.add_argument("--hidden-dtypes", default="bf16", help="comma list of cache hidden dtypes: bf16,fp8,fp4")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="GPU time of the last N steps of each mode by kernel category (torch.profiler; "
                         "those steps end on a device sync)")
    ap.add_argument("--compile-scopes", default="regions",
                    help="comma list for the compiled modes: regions (the default step), step (one graph, as before)")
    ap.add_argument("--isolate", default="",
                    help="comma list of fresh,warm: each compiled mode in new processes with empty inductor/Triton "
                         "caches: fresh (nothing saved) then warm (the artifacts the fresh run saved)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="with --isolate: stop each run at what is left of this many seconds (0: no limit)")
    ap.add_argument("--kernel-sources", default=None,
                    help="with --isolate: copy the sources of the kernels slowest to build into this directory")
    ap.add_argument("--cache-rows", type=int, default=0, help="rows of the synthetic cache (default: 8 batches, >= 32)")
    ap.add_argument("--json")
    a = ap.parse_args()
    import time

    t_start = time.perf_counter()
    from dflash_cache import quant
    wd = a.workdir or ("/dev/shm/dflash-bench-train" if os.path.isdir("/dev/shm") else tempfile.mkdtemp())
    os.makedirs(wd, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        tshape, T, rows, anchors, block, layers = shape
        target = random_target_dir(os.path.join(wd, f"target-{name}"), tshape, device=dev, head_only=True)
        from dflash.core.layers import default_layer_ids

        for hdt, mode in [(d, m) for d in a.hidden_dtypes.split(",") for m in a.modes.split(",")]:
            suffix = "" if hdt == "bf16" else f"-{hdt}"
            cache = synthetic_cache(os.path.join(wd, f"cache-{name}{suffix}"), target, T, a.cache_rows or max(32, rows * 8),
                                    default_layer_ids(tshape["num_hidden_layers"]), hidden_dtype=quant.resolve(hdt))
            comp, attn = mode.split(":")
            if attn == "flex" and dev == "cpu":
                continue
            scopes = a.compile_scopes.split(",") if comp == "compiled" else ["regions"]
            phases = [p for p in a.isolate.split(",") if p] if comp == "compiled" else []
            for scope, phase in [(sc, ph) for sc in scopes for ph in (phases or [None])]:
                out = os.path.join(wd, f"run-{name}-{comp}-{attn}-{scope}")
                kw = dict(cache=cache, target=target, out=out, compile_="on" if comp == "compiled" else "off",
                          attn=attn, steps=a.steps, log_every=a.log_every, profile_steps=a.profile_steps, scope=scope)
                if phase:
                    left = a.budget_s - (time.perf_counter() - t_start) if a.budget_s else 3600.0
                    r = run_isolated(dict(kw, shape_name=name), phase, os.path.join(wd, f"artifacts-{name}-{scope}"),
                                     left, keep=a.kernel_sources)
                    r.setdefault("compile", kw["compile_"])
                    r.setdefault("attn", attn)
                    r["scope"], r["phase"] = scope, phase
                else:
                    try:
                        r = run_one(shape=shape, **kw)
                    except Exception as e:  # noqa: BLE001 - a failed mode is a result too (e.g. out of memory)
                        r = {"compile": kw["compile_"], "attn": attn, "error": repr(e)[:300]}
                        gc.collect()
                        torch.cuda.empty_cache() if torch.cuda.is_available() else None
                r["shape"] = name
                r["hidden_dtype"] = hdt
                results.append(r)
                print(json.dumps(r, default=str), flush=True)
                if a.json:  # written after every mode, so a run cut short still leaves its results
                    with open(a.json, "w") as f:
                        json.dump({"hardware": hardware(), "torch": torch.__version__, "results": results}, f,
                                  indent=2, default=str)
    by = {(r["shape"], r["hidden_dtype"], r["compile"], r["attn"]): r for r in results}
    for name in a.shapes.split(","):
        for hdt in a.hidden_dtypes.split(","):
            e, c = by.get((name, hdt, "off", "flex")), by.get((name, hdt, "on", "flex"))
            if e and c and "step_ms" in e and "step_ms" in c:
                c["speedup_vs_eager"] = e["step_ms"] / c["step_ms"]
    print(f"\nhardware: {hardware()}, torch {torch.__version__}")
    print(table(results, ["shape", "hidden_dtype", "compile", "attn", "scope", "phase", "first_call_s", "caches",
                          "step_ms", "ctx_tok_s", "block_tok_s", "tflops", "mfu", "recompiles", "data_wait",
                          "speedup_vs_eager", "peak_mem_gib", "loss_first", "loss_last", "error"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hardware": hardware(), "torch": torch.__version__, "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
