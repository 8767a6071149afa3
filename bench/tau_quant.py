"""tau from fp8 / fp4 caches against bf16, and from caches on their own basis against fp8: does the drafter notice
the cache's precision, or the directions a basis drops?

Feeds BENCHMARKS.md, "Cache size" (tau from an fp8 cache against bf16's spread over seeds; tau from caches on a
basis of rank R, `extract --basis-rank R`, against fp8's spread).

The demo's recipe (SmolLM2-135M-Instruct + chitchat, regenerated replies by default), extracted once per
hidden dtype (bf16, fp8, fp4) from the same data; drafters trained with the same recipe: from the bf16 cache
with several seeds (their spread is the noise), from each quantised cache with the first of those seeds (the
same batches and anchors as that bf16 run); with --basis-ranks, one cache per rank R in the last of --hidden-dtypes
(fp8 by default: z = P x stored in fp8) trained with that first seed too. The spread is the first dtype's: bf16 by
default, fp8 with --hidden-dtypes fp8. Every final drafter is measured by real speculative decoding on
the same held-out prompts (train.eval: tau, n-gram tau, outputs identical to the target's greedy output).

    python bench/tau_quant.py --workdir work/tau-quant                           # the demo's sizes
    python bench/tau_quant.py --workdir work/tau-quant --data work/demo/regenerated   # reuse regenerated data
    python bench/tau_quant.py --workdir work/tau-basis --hidden-dtypes fp8 --basis-ranks 288,576,1152  # bases vs fp8
    python bench/tau_quant.py --workdir /tmp/tq --responses original --train-prompts 16 --eval-prompts 2 \\
        --steps 3 --eval-max-new-tokens 8 --seq-len 256 --seeds 0,1 --device cpu       # CPU smoke test, ~3 min

With --recipe-workdir W (a GPU recipe's workdir, e.g. work/demo-gpu after `dflash demo`, or made here by --prepare:
the recipe's stages up to its caches, no training), the recipe's own target, regenerated answers and eval prompts
(W/data/heldout.jsonl: in-source and MT-Bench), and --preset's extract, train and eval settings (--steps overrides
its max_steps): each cache gets a validation cache of W/regenerated-valid on its basis, and each run reports the
held-out decoding tau beside in-source and MT-Bench tau. The base kind (the first of --hidden-dtypes) trains from the
recipe's own W/cache and W/cache-valid when they are complete caches in that dtype, not on a basis (the GPU recipe's
fp8 cache is ~42 GB: a second copy would not fit a 64 GB disk). A basisR cache is on a basis fitted as the recipe
fits its own (gpu_stages.shared_basis: rank R on BASIS_SAMPLES training samples spread over the regenerated answers,
WORKDIR/cache-basisR-fit), the main and validation caches extracted on it. The whole GPU comparison, from nothing,
in one command, meant for one H100 or H200 and its 64 GB disk: ~26 min on one H100 (3,000 steps a run, 2026-12-06):

    python bench/tau_quant.py --recipe-workdir work/demo-gpu --prepare --preset demo-gpu --workdir work/tau-gpu \\
        --hidden-dtypes fp8 --basis-ranks 288,576 --steps 3000 --device cuda

Each kind's cache is extracted just before its first run, and the runs go in this order: the base kind's first seed,
the first other kind, the base kind's other seeds, the other kinds; so a run cut short already has the first
comparison, then the spread.

Every stage resumes when rerun (extract and train do; evaluated runs are kept in WORKDIR/tau-quant.json, rewritten
after each run, and not run again). Prints one line per run as it ends (`tau-quant: {...}`) and a table: tau per
run, the bf16 seeds' mean and spread (min..max), and for each quantised cache its tau minus the bf16 run of the same
seed and whether it lies within the bf16 spread. On a GPU each run's eval is a process of its own
(eval_in_fresh_process); each run records its outputs identical to the target's per set, and its near ties and
suspect differences.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def eval_in_fresh_process(cfg):
    """run_eval(cfg) in a process of its own (spawned: nothing of this one's CUDA or compile state), its report
    returned. On a GPU each run's eval does so: in one process the target's compiled layers and CUDA graphs carry
    over from the regeneration, the extractions, the trainings and the evals before, and one run measured 92/96 bf16
    outputs identical to the target's in the first eval of its process, 48/96 in each later one (likely: which
    compiled variant a step uses moves its near-tie argmax flips between the target alone and its verification).
    A user's `dflash eval` is such a fresh process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from dflash.train.evaluate.eval import run_eval

    # not multiprocessing.Pool: its workers are daemons, which may not start processes of their own (inductor's
    # compile workers); an executor's may
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_eval, cfg).result()


def complete_cache(path: str):
    """The cache at path, open, when it is complete (every shard committed: not one still being written; the reader
    refuses any other); else None."""
    import dflash_cache

    try:
        return dflash_cache.open(path)
    except dflash_cache.CacheError:
        return None


def reusable(path: str, hidden_dtype: str) -> bool:
    """Whether path holds a complete cache in hidden_dtype (bf16, fp8, fp4) with the context features as they are
    (not on a basis): what a run of that kind would otherwise extract again."""
    from dflash_cache.quant import resolve

    cache = complete_cache(path)
    return cache is not None and not cache.spec.basis and cache.spec.hidden_dtype == resolve(hidden_dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="work/tau-quant")
    ap.add_argument("--responses", choices=["regenerate", "original"], default="regenerate")
    ap.add_argument("--data", help="an existing training dataset (e.g. a regenerated directory): skips regenerating")
    ap.add_argument("--hidden-dtypes", default="bf16,fp8,fp4")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the first hidden dtype (the spread); the other caches "
                    "train with the first")
    ap.add_argument("--basis-ranks", default="", help="also caches on their own basis of these ranks (comma list), in "
                    "the last of --hidden-dtypes")
    ap.add_argument("--train-prompts", type=int, default=240)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--regen-max-new-tokens", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--num-anchors", type=int, default=64)
    ap.add_argument("--batch-rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--eval-max-new-tokens", type=int, default=48)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", help="also write the results here (default: WORKDIR/tau-quant.json only)")
    ap.add_argument("--recipe-workdir", help="a GPU recipe's workdir: its target, answers and eval prompts (docstring)")
    ap.add_argument("--preset", default="demo-gpu", help="with --recipe-workdir: the extract, train and eval settings")
    ap.add_argument("--prepare", action="store_true", help="with --recipe-workdir: make the recipe's data and caches "
                    "there first when they are not all there (the recipe's stages up to its extraction; no training)")
    a = ap.parse_args(argv)
    if a.prepare and not a.recipe_workdir:
        ap.error("--prepare makes a GPU recipe's data: it needs --recipe-workdir")

    from dflash_cache.inspect import info as cache_info
    from dflash.core.io import atomic_json
    from dflash.recipes.assets import smollm2_gguf
    from dflash.recipes.cpu import _regenerate, prepare_data
    from dflash.recipes.demo import DemoConfig
    from dflash.extract.run import ExtractConfig, run_extract
    from dflash.core.target import convert_gguf
    from dflash.train.evaluate.eval import EvalConfig, run_eval
    from dflash.train.fit.trainer import TrainConfig, run_train

    os.makedirs(a.workdir, exist_ok=True)
    recipe = a.recipe_workdir
    if recipe:  # the GPU recipe's own target, answers and eval prompts; its preset's settings
        from dflash.core.config import build, read_preset
        from dflash.recipes.gpu_config import load_recipe

        target, data = os.path.join(recipe, "target"), a.data or os.path.join(recipe, "regenerated")
        held = os.path.join(recipe, "data", "heldout.jsonl")
        valid = os.path.join(recipe, "regenerated-valid")
        needs = (target, data, held)
        if a.prepare and not (all(map(os.path.exists, needs)) and complete_cache(os.path.join(recipe, "cache"))
                              and (not load_recipe(a.preset).validation
                                   or complete_cache(os.path.join(recipe, "cache-valid")))):  # else all there
            from dflash.recipes.gpu_stages import prepare

            print(f"tau-quant: preparing {recipe}: the recipe's target, data, regenerated answers and caches "
                  "(resumed; no training)", flush=True)
            prepare(recipe, a.preset, a.device, progress=False)
        for need in needs:
            if not os.path.exists(need):
                sys.exit(f"tau-quant: --recipe-workdir {recipe}: no {need} (run `dflash demo` there first, or pass "
                         "--prepare)")
        valid = valid if os.path.isdir(valid) else None
        eval_new = int((read_preset(a.preset, "recipe") or {}).get("eval_max_new_tokens", a.eval_max_new_tokens))

        def extract_cfg(**kw):
            return build(ExtractConfig, a.preset, "extract", dict(kw, target=target, device=a.device, progress=False))

        def train_cfg(**kw):
            return build(TrainConfig, a.preset, "train", dict(kw, target=target, device=a.device, progress=False,
                                                              max_steps=a.steps))

        def eval_cfg(**kw):
            return build(EvalConfig, a.preset, "eval", dict(kw, target=target, data=held, max_new_tokens=eval_new,
                                                            device=a.device, progress=False))
    else:
        demo = DemoConfig(workdir=a.workdir, responses=a.responses, train_prompts=a.train_prompts,
                          eval_prompts=a.eval_prompts, regen_max_new_tokens=a.regen_max_new_tokens, device=a.device,
                          progress=False)
        target = convert_gguf(smollm2_gguf(), os.path.join(a.workdir, "target"))
        train_jsonl, held = prepare_data(demo)
        data = a.data or (_regenerate(demo, target, train_jsonl) if a.responses == "regenerate" else train_jsonl)
        valid = None

        def extract_cfg(**kw):
            return ExtractConfig(target=target, seq_len=a.seq_len, device=a.device, progress=False, **kw)

        def train_cfg(**kw):
            return TrainConfig(target=target, drafter_layers=a.drafter_layers, block_size=a.block_size,
                               num_anchors=a.num_anchors, batch_rows=a.batch_rows, max_steps=a.steps, lr=a.lr,
                               warmup_ratio=0.05, log_every=20, save_every=max(20, a.steps), device=a.device,
                               progress=False, **kw)

        def eval_cfg(**kw):
            return EvalConfig(target=target, data=held, max_new_tokens=a.eval_max_new_tokens, device=a.device,
                              progress=False, **kw)
    dtypes = a.hidden_dtypes.split(",")
    seeds = [int(s) for s in a.seeds.split(",")]
    path = os.path.join(a.workdir, "tau-quant.json")
    done = json.load(open(path)) if os.path.exists(path) else {}
    caches, stored, val_caches = {}, {}, {}
    ranks = [int(r) for r in a.basis_ranks.split(",") if r.strip()]
    kinds = dtypes + [f"basis{r}" for r in ranks]  # a kind: a stored dtype, or basisR (the last dtype on rank R)
    base_kind = kinds[0]

    def recipe_caches(kind, hdt):
        """The recipe's own W/cache and W/cache-valid for the base kind, when W/cache is a complete cache of the
        same answers in this hidden dtype, its features as they are (no basis): (cache, validation cache or None).
        W/cache-valid is used when it is such a cache too. None: extract this kind's own caches."""
        if not recipe or kind != base_kind:
            return None
        if os.path.abspath(data) != os.path.abspath(os.path.join(recipe, "regenerated")):
            return None  # --data: other answers than the recipe's cache holds
        main_cache, val_cache = os.path.join(recipe, "cache"), os.path.join(recipe, "cache-valid")
        if not reusable(main_cache, hdt):
            return None
        return main_cache, val_cache if valid and reusable(val_cache, hdt) else None

    def ready(kind):
        """Extract the kind's cache and its validation cache (resumed), or take the recipe's: just before its first
        run. In recipe mode a basisR cache is on a basis fitted as the recipe fits its own (gpu_stages.shared_basis:
        BASIS_SAMPLES training samples spread over the regenerated answers, WORKDIR/cache-basisR-fit)."""
        if kind in caches:
            return
        hdt, rank = (dtypes[-1], int(kind[5:])) if kind.startswith("basis") else (kind, 0)
        t = time.perf_counter()
        reused = recipe_caches(kind, hdt)
        if reused:
            caches[kind], val = reused
            print(f"tau-quant: cache {kind}: reusing the recipe's {caches[kind]}"
                  + (f" and {val}" if val else ""), flush=True)
            if val:
                val_caches[kind] = val
        else:
            caches[kind] = os.path.join(a.workdir, f"cache-{kind}")
            fit = None
            if rank and recipe:
                from dflash.recipes.gpu_stages import shared_basis

                fit = shared_basis(a.workdir, a.preset, target, data, a.device, False, {"hidden_dtype": hdt},
                                   rank=rank, out=caches[kind] + "-fit",
                                   data=os.path.join(a.workdir, "basis-fit.jsonl"))
            run_extract(extract_cfg(data=data, out=caches[kind], hidden_dtype=hdt, basis_rank=rank, basis_from=fit))
        if valid and kind not in val_caches:  # the held-out answers on this cache's basis: train's --val-cache
            val_caches[kind] = os.path.join(a.workdir, f"cache-valid-{kind}")
            run_extract(extract_cfg(data=valid, out=val_caches[kind], hidden_dtype=hdt, basis_rank=rank,
                                    basis_from=caches[kind] if rank else None))
        stored[kind] = cache_info(caches[kind])["bytes_per_real_token"]
        print(f"tau-quant: cache {kind} ready ({time.perf_counter() - t:.0f} s)", flush=True)

    # the base kind's first seed, then the first other kind (the spread's anchor and the first comparison come
    # first: a run cut short has both), then the base kind's other seeds, then the other kinds
    others = [(k, seeds[0]) for k in kinds[1:]]
    runs = [(base_kind, seeds[0]), *others[:1], *[(base_kind, s) for s in seeds[1:]], *others[1:]]
    for hdt, seed in runs:
        key = f"{hdt}-seed{seed}"
        if key in done:
            continue
        ready(hdt)
        out = os.path.join(a.workdir, f"run-{key}")
        t = time.perf_counter()
        tr = run_train(train_cfg(cache=caches[hdt], out=out, seed=seed,
                                 **({"val_cache": val_caches[hdt]} if hdt in val_caches else {})))
        train_s = time.perf_counter() - t
        cfg = eval_cfg(drafter=os.path.join(out, "final"))
        ev = eval_in_fresh_process(cfg) if a.device != "cpu" else run_eval(cfg)
        diff = ev["dflash"].get("differences") or {}
        hist = tr.get("history") or [{}]
        sets = {name: v["dflash"]["tau"] for name, v in (ev.get("sets") or {}).items()}
        done[key] = {"hidden_dtype": hdt, "seed": seed, "bytes_per_real_token": stored.get(hdt), "tau": ev["dflash"]["tau"], "tau_ngram": ev["ngram"]["tau"],
                     "identical": ev["dflash"]["outputs_identical"], "prompts": ev["prompts"],
                     "near_tie": diff.get("near_tie"), "suspect": diff.get("suspect"),
                     "identical_sets": {name: v["dflash"].get("identical")
                                        for name, v in (ev.get("sets") or {}).items()},
                     "final_loss": hist[-1].get("loss"), "train_s": train_s,
                     "data_wait_frac": tr.get("data_wait_frac"), "steps": tr.get("steps"),
                     "val_tau_decode": (tr.get("val") or {}).get("val_tau_decode"), "tau_sets": sets}
        atomic_json(path, done)  # a run killed while this is written keeps the runs before it
        print("tau-quant:", json.dumps({"run": key, **done[key]}), flush=True)

    bf = [done[f"{base_kind}-seed{s}"]["tau"] for s in seeds if f"{base_kind}-seed{s}" in done]
    lo, hi = (min(bf), max(bf)) if bf else (None, None)
    base = done.get(f"{base_kind}-seed{seeds[0]}")
    rows = []
    for key in sorted(done, key=lambda k: (kinds.index(done[k]["hidden_dtype"]) if done[k]["hidden_dtype"] in kinds
                                           else 99, done[k]["seed"])):
        r = done[key]
        row = {"run": key, "tau": r["tau"], "tau_ngram": r["tau_ngram"], "identical": f"{r['identical']}/{r['prompts']}",
               "final_loss": r["final_loss"], "bytes/token": r.get("bytes_per_real_token"),
               "held-out tau": r.get("val_tau_decode"), **{f"tau {k}": v for k, v in (r.get("tau_sets") or {}).items()}}
        if r["hidden_dtype"] != base_kind and base is not None:
            row[f"tau - {base_kind} same seed"] = r["tau"] - base["tau"]
            row[f"within {base_kind} spread"] = lo <= r["tau"] <= hi if len(bf) > 1 else None
        rows.append(row)
    from bench.common import table

    print(f"\n{base_kind} over seeds {seeds}: tau mean {sum(bf) / len(bf):.3f}, spread {lo:.3f}..{hi:.3f} "
          f"({hi - lo:.3f})" if bf else f"\nno {base_kind} runs")
    set_cols = sorted({k for r in rows for k in r if k.startswith("tau ") and not k.startswith("tau - ")})
    print(table(rows, ["run", "tau", f"tau - {base_kind} same seed", f"within {base_kind} spread", "tau_ngram",
                       *(["held-out tau"] if recipe else []), *set_cols, "identical", "final_loss", "bytes/token"]))
    summary = {"args": vars(a), "base": base_kind, "base_tau": bf, "base_spread": [lo, hi], "runs": done}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
