"""The GPU recipe's sweep and its tau curve, from ONE regenerated dataset and ONE cache (made once, shared).

    # block x drafter layers x steps: train + eval (bf16, target alone / DFlash / n-gram) each, pick by speed-up
    python bench/gpu_sweep.py --workdir /root/work/demo-gpu --blocks 4,8,16 --layers 1,2,3 --steps 1200 \
        --json /root/work/sweep.json
    # tau against training tokens for the recipe's own run (its checkpoints, every save_every steps)
    python bench/gpu_sweep.py --workdir /root/work/demo-gpu --curve --json /root/work/curve.json
    # tau from an fp8 cache at the recipe's scale, and bf16's spread over seeds (the same regenerated data)
    python bench/gpu_sweep.py --workdir /root/work/demo-gpu --blocks 8 --layers 2 --steps 3000 --eval-prompts 48 \
        --hidden-dtype fp8
    python bench/gpu_sweep.py --workdir /root/work/demo-gpu --blocks 8 --layers 2 --steps 3000 --eval-prompts 48 \
        --seeds 1,2

The workdir is the GPU recipe's (`dflash demo --recipe gpu --workdir W`): target, data, regenerated
responses and the cache are reused, or made (and resumed) if missing. Each sweep point trains into
W/sweep/b{B}-l{L}-s{S}[-{dtype}][-seed{N}]/ and is recorded in W/sweep/results.json as soon as it is evaluated: a
rerun skips finished points, so the sweep can span several device calls. --hidden-dtype fp8|fp4 extracts a second
cache (W/cache-fp8) from the same regenerated data and trains from it; --seeds trains each point once per seed.
--target DIR uses another HF model folder of the same tokenizer (e.g. bench/random_smollm2.py's random model)
instead of the bundled SmolLM2. Runs on CPU at a tiny size (--config a smaller preset, --device cpu), for smoke
tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _save(path: str, obj) -> None:
    from dflash.core.dist import atomic_json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_json(path, obj)


def point(ev: dict | None, train: dict, block: int, layers: int, steps: int, seconds: dict) -> dict:
    """A sweep point: the eval's figures (None with --eval-prompts 0) and the run's held-out decoding and expected
    tau (its --val-cache), step time and data wait."""
    hist = train.get("history") or [{}]
    steady = hist[1:] or hist
    out = {"block": block, "layers": layers, "steps": steps, "final_loss": hist[-1].get("loss"),
           "tau_expected": hist[-1].get("tau_expected"), "val_tau": (train.get("val") or {}).get("val_tau_expected"),
           "val_tau_decode": (train.get("val") or {}).get("val_tau_decode"),
           "step_ms": sorted(h.get("step_ms", 0) for h in steady)[len(steady) // 2],
           "data_wait": train.get("data_wait_frac"), "seconds": seconds}
    if ev is None:
        return out
    d, n = ev["dflash"], ev.get("ngram", {})
    return out | {"tau": d["tau"], "tau_ngram": n.get("tau"),
                  "target_tok_s": ev["target_tokens_per_s"], "dflash_tok_s": d["tokens_per_s"],
                  "ngram_tok_s": n.get("tokens_per_s"), "speedup": d["speedup"], "speedup_ngram": n.get("speedup"),
                  "draft_ms": d["ms_per_step"]["draft"], "verify_ms": d["ms_per_step"]["verify"],
                  "target_ms": ev["target"]["ms_per_step"]["total"],
                  "identical": d["outputs_identical"], "prompts": ev["prompts"], "dtype": ev["dtype"],
                  "near_tie": d["differences"]["near_tie"], "suspect": d["differences"]["suspect"],
                  "draft_graph": ev.get("draft_graph")}


def table(rows: list[dict]) -> str:
    head = ["cache", "seed", "block", "layers", "steps", "held-out dec. tau", "held-out exp. tau", "tau", "n-gram tau", "target tok/s",
            "dflash tok/s", "n-gram tok/s", "speed-up", "draft+verify ms", "identical", "step ms", "data wait", "train s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for r in sorted(rows, key=lambda r: (-(r.get("speedup") or 0), -(r.get("val_tau_decode") or r.get("val_tau") or 0))):
        lines.append("| " + " | ".join([
            r.get("hidden_dtype", "bf16"), str(r.get("seed", 0)), str(r["block"]), str(r["layers"]), str(r["steps"]),
            f(r.get("val_tau_decode"), ".2f"), f(r.get("val_tau"), ".2f"), f(r.get("tau"), ".2f"), f(r.get("tau_ngram"), ".2f"), f(r.get("target_tok_s"), ".0f"),
            f(r.get("dflash_tok_s"), ".0f"), f(r.get("ngram_tok_s"), ".0f"),
            f(r.get("speedup"), ".2f") + ("x" if r.get("speedup") else ""),
            f"{r['draft_ms']:.1f}+{r['verify_ms']:.1f}" if r.get("draft_ms") is not None else "-",
            f"{r['identical']}/{r['prompts']}" if r.get("prompts") else "-", f(r.get("step_ms"), ".1f"),
            f(100 * r["data_wait"], ".1f") + "%" if r.get("data_wait") is not None else "-",
            f"{r['seconds'].get('train', 0):.0f}"]) + " |")
    return "\n".join(lines)


def quantised_cache(a, prep):
    """prep with its cache replaced by one of --hidden-dtype, extracted (or resumed) from the same regenerated data."""
    import dataclasses

    from dflash.core.config import build
    from dflash.extract.run import ExtractConfig, run_extract

    out = os.path.join(a.workdir, f"cache-{a.hidden_dtype}")
    run_extract(build(ExtractConfig, a.config, "extract", {
        "target": prep.target, "data": os.path.join(a.workdir, "regenerated"), "out": out, "device": a.device,
        "progress": a.progress, "hidden_dtype": a.hidden_dtype}))
    return dataclasses.replace(prep, cache=out)


def point_name(block: int, layers: int, steps: int, hidden_dtype: str, seed: int) -> str:
    """A sweep point's run directory and (with "-graph" for --draft-graph) its key in results.json."""
    return (f"b{block}-l{layers}-s{steps}" + ("" if hidden_dtype == "bf16" else f"-{hidden_dtype}")
            + (f"-seed{seed}" if seed else ""))


def sweep(a, prep) -> dict:
    from dflash.demo_gpu import train_and_eval

    res_path = os.path.join(a.workdir, "sweep", "results.json")
    results = _load(res_path)
    if a.hidden_dtype != "bf16":
        prep = quantised_cache(a, prep)
    tag = "-graph" if a.draft_graph else ""
    points = [(b, n, s, sd) for b in _ints(a.blocks) for n in _ints(a.layers) for s in _ints(a.steps)
              for sd in _ints(a.seeds)]
    for block, layers, steps, seed in points:
        name = point_name(block, layers, steps, a.hidden_dtype, seed)
        key = name + tag
        if key in results:
            print(f"sweep: {key} done already", flush=True)
            continue
        # n-gram lookup depends on the block size only: measured once per block
        ngram = not any(r["block"] == block and r.get("tau_ngram") is not None for r in results.values())
        seconds: dict = {}
        t = time.perf_counter()
        out = train_and_eval(prep, os.path.join(a.workdir, "sweep", name), a.config,
                             a.device, a.progress,
                             # the preset's save_every: a point killed mid-training resumes from a checkpoint
                             train_overrides={"block_size": block, "drafter_layers": layers, "max_steps": steps,
                                              "seed": seed},
                             eval_prompts=a.eval_prompts, eval_dtypes=[a.dtype] if a.eval_prompts else [],
                             timings=seconds,
                             ngram=ngram, eval_overrides={"draft_graph": True} if a.draft_graph else None,
                             eval_tag="graph" if a.draft_graph else "")
        seconds["total"] = time.perf_counter() - t
        results[key] = dict(point(out["eval"].get(a.dtype), out["train"], block, layers, steps, seconds),
                            hidden_dtype=a.hidden_dtype, seed=seed)
        _save(res_path, results)
        r = results[key]
        f = lambda v, fmt=".2f": "-" if v is None else format(v, fmt)  # noqa: E731
        print(f"sweep: {key}: held-out decoding tau {f(r.get('val_tau_decode'))}, expected {f(r['val_tau'])}, tau {f(r.get('tau'))}, speed-up "
              f"{f(r.get('speedup'))}, step {r['step_ms']:.1f} ms, data wait {f(r['data_wait'], '.1%')}, "
              f"{seconds['total']:.0f} s", flush=True)
    wanted = {point_name(b, n, s, a.hidden_dtype, sd) + tag for b, n, s, sd in points}
    rows = [results[k] for k in sorted(wanted & set(results))]
    for r in rows:  # the block's n-gram figures where this point did not measure them
        if "tau" in r and r.get("tau_ngram") is None:
            same = [q for q in results.values() if q["block"] == r["block"] and q.get("tau_ngram") is not None]
            if same:
                r["tau_ngram"], r["ngram_tok_s"] = same[0]["tau_ngram"], same[0]["ngram_tok_s"]
    md = table(rows)
    timed = [r for r in rows if r.get("speedup")]
    best = max(timed, key=lambda r: r["speedup"]) if timed else None
    print(md)
    if best:
        print(f"best by wall-clock speed-up: block {best['block']}, {best['layers']} layers, {best['steps']} steps: "
              f"{best['speedup']:.2f}x, tau {best['tau']:.2f}")
    with open(os.path.join(a.workdir, "sweep", "sweep.md"), "w") as f:
        f.write(md + "\n")
    return {"points": rows, "best": best, "table": md}


def curve(a, prep) -> dict:
    from dflash.core.config import build
    from dflash.demo_gpu import load_recipe
    from dflash.train.eval import EvalConfig, run_eval
    from dflash.train.trainer import TrainConfig

    import dflash_cache

    run = os.path.join(a.workdir, "run")
    ck = os.path.join(run, "checkpoints")
    if not os.path.isdir(ck):
        raise SystemExit(f"--curve: {ck} is missing: run the recipe first (dflash demo --recipe gpu --workdir {a.workdir})")
    tcfg = build(TrainConfig, a.config, "train", {"cache": prep.cache, "target": prep.target, "out": run})
    T = dflash_cache.open(prep.cache).seq_len
    recipe = load_recipe(a.config)
    path = os.path.join(a.workdir, "curve.json")
    points = _load(path)
    drafters = {int(d.split("_")[1]): os.path.join(ck, d) for d in os.listdir(ck)
                if d.startswith("step_") and not d.endswith(".tmp")}
    if os.path.isdir(os.path.join(run, "final")):
        summ = _load(os.path.join(run, "summary.json"))
        if summ.get("steps"):
            drafters.setdefault(int(summ["steps"]), os.path.join(run, "final"))
    for step in sorted(drafters):
        if str(step) in points:
            continue
        ev = run_eval(build(EvalConfig, a.config, "eval", {
            "target": prep.target, "drafter": drafters[step], "data": prep.heldout,
            "max_prompts": a.eval_prompts or recipe.eval_prompts, "max_new_tokens": recipe.eval_max_new_tokens,
            "dtype": a.dtype, "ngram": False, "device": a.device, "progress": a.progress}))
        rows_seen = step * tcfg.batch_rows * tcfg.grad_accum
        points[str(step)] = {"step": step, "ctx_tokens": rows_seen * T, "anchors": rows_seen * tcfg.num_anchors,
                             "tau": ev["dflash"]["tau"], "speedup": ev["dflash"]["speedup"],
                             "identical": ev["dflash"]["outputs_identical"], "prompts": ev["prompts"]}
        _save(path, points)
        print(json.dumps(points[str(step)]), flush=True)
    rows = [points[k] for k in sorted(points, key=int)]
    ngram = _load(os.path.join(run, f"eval-{a.dtype}.json")).get("ngram", {}).get("tau")
    md = ["| step | training context tokens | anchors (blocks) | tau dflash | speed-up | identical outputs |",
          "|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['step']} | {r['ctx_tokens']:,} | {r['anchors']:,} | {r['tau']:.2f} | {r['speedup']:.2f}x | "
           f"{r['identical']}/{r['prompts']} |" for r in rows]
    if ngram:
        md.append(f"\nn-gram prompt lookup on the same prompts: tau {ngram:.2f}")
    text = "\n".join(md)
    print(text)
    with open(os.path.join(a.workdir, "curve.md"), "w") as f:
        f.write(text + "\n")
    try:
        import matplotlib
    except ImportError:  # not a dependency: the table and curve.json are the result; plot them elsewhere
        matplotlib = None
        print("curve: matplotlib is not installed, no curve.png", flush=True)
    if rows and matplotlib is not None:

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=110)
        ax.plot([r["ctx_tokens"] / 1e6 for r in rows], [r["tau"] for r in rows], "o-", label="DFlash drafter")
        if ngram:
            ax.axhline(ngram, color="gray", ls="--", label="n-gram prompt lookup")
        ax.set_xlabel("training context tokens (millions)")
        ax.set_ylabel("tau (accepted + 1 per step)")
        ax.set_title(f"GPU recipe: block {tcfg.block_size}, {tcfg.drafter_layers} layers, held-out chitchat")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.workdir, "curve.png"))
        plt.close(fig)
    return {"points": rows, "tau_ngram": ngram, "table": text, "plot": os.path.join(a.workdir, "curve.png")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="work/demo-gpu", help="The GPU recipe's workdir (reused).")
    ap.add_argument("--config", default="demo-gpu", help="The recipe's preset (path or name in configs/).")
    ap.add_argument("--target", help="An HF model folder instead of the bundled SmolLM2 (e.g. a random one).")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--layers", default="1,2,3")
    ap.add_argument("--steps", default="1200", help="Comma-separated: one training run per value.")
    ap.add_argument("--eval-prompts", type=int, default=24,
                    help="Held-out prompts per eval (the recipe's first N); 0 = no eval, the held-out decoding and expected tau only.")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--curve", action="store_true", help="The tau curve of the recipe's run instead of the sweep.")
    ap.add_argument("--draft-graph", action="store_true",
                    help="Evaluate with the drafter's block forward as one CUDA graph (points keyed '-graph'; the "
                         "trained drafters of the same block/layers/steps are reused).")
    ap.add_argument("--hidden-dtype", default="bf16", choices=["bf16", "fp8", "fp4"],
                    help="Train the points from a cache of this stored dtype (extracted once into WORKDIR/cache-DTYPE).")
    ap.add_argument("--seeds", default="0", help="Comma-separated training seeds: one run per point and seed.")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--json", help="Write the results here.")
    a = ap.parse_args()

    from dflash.demo_gpu import prepare

    prep = prepare(a.workdir, a.config, a.device, a.progress, a.target)
    out = curve(a, prep) if a.curve else sweep(a, prep)
    if a.json:
        _save(a.json, out)


if __name__ == "__main__":
    main()
