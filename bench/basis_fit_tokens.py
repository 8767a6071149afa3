"""How many tokens a cache's basis should be fitted on (`extract --basis-fit-tokens N`): the projection error on
held-out tokens as the fit sees more of them.

Feeds BENCHMARKS.md, "Cache size" (features on their own basis).

    python bench/basis_fit_tokens.py                       # SmolLM2-135M-Instruct on chitchat, CPU, ~6 min
    python bench/basis_fit_tokens.py --fit-tokens 2048,8192,65536 --json fit-tokens.json

Runs the real `dflash extract` once, into a bf16 cache (the features as the target gives them), then fits bases the
way the extraction does (dflash_cache.basis: the uncentred second moment of the real tokens of `fit_rows`, rows
spread evenly over the plan; `fit`) on three rows of every four of the cache, once per --fit-tokens N, and
measures each on the fourth, never fitted on: per real token, ||x - P^T P x|| / ||x|| of the K*H features
(median and 90th percentile; the basis alone, no fp8), the same per captured layer (median), and the fraction of the
held-out tokens' energy P keeps. A basis of rank R from N tokens keeps every rank below R too, so one fit per N
serves every --ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def real_features(cache, rows) -> torch.Tensor:
    """The real tokens' K*H features of these rows of a bf16 cache, float64 [tokens, K*H]."""
    out = []
    for i in rows:
        row = cache[i]
        out.append(row["hidden"][row["doc_ids"] != 0].double())
    return torch.cat(out) if out else torch.zeros(0, 0, dtype=torch.float64)


def errors(x: torch.Tensor, p: torch.Tensor, layer_width: int) -> dict:
    """The basis p's projection error on the tokens x (module docstring)."""
    xh = (x @ p.T) @ p
    tok = ((xh - x).norm(dim=1) / x.norm(dim=1).clamp_min(1e-12)).numpy()
    k = x.shape[1] // layer_width
    xl, hl = x.reshape(-1, k, layer_width), xh.reshape(-1, k, layer_width)
    per_layer = ((hl - xl).norm(dim=2) / xl.norm(dim=2).clamp_min(1e-12)).numpy()
    return {"median": round(float(np.median(tok)), 4), "p90": round(float(np.quantile(tok, 0.9)), 4),
            "per_layer_median": [round(float(v), 4) for v in np.median(per_layer, axis=0)],
            "energy_kept": round(float((xh * x).sum() / (x * x).sum()), 6)}


def main(argv=None):
    from bench.basis_size import add_target_data_args, extract, target_data_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_data_args(ap, 2400, "dflash-bench-fit-tokens")
    ap.add_argument("--fit-tokens", default="1024,2048,4096,8192,16384,32768,65536",
                    help="row tokens each basis is fitted on (extract --basis-fit-tokens), comma list")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.makedirs(args.workdir, exist_ok=True)

    import dflash_cache
    from dflash_cache.basis import SecondMoment, fit, fit_rows

    target, data, H, ranks = target_data_ranks(args)
    out = os.path.join(args.workdir, "cache-bf16")
    seconds = extract(out, target, data, args, "--max-samples", str(args.conversations), "--hidden-dtype", "bf16")
    cache = dflash_cache.open(out)
    n_rows = len(cache)
    if n_rows < 4:
        sys.exit(f"basis-fit-tokens: {n_rows} rows of {args.seq_len} tokens: too few to hold every fourth out "
                 "(raise --conversations)")
    # every fourth row held out, the others the fits' plan: the packer orders rows longest conversations first, so a
    # block of rows (the last ones: the shortest conversations, mostly template tokens) would be a biased sample
    plan = [i for i in range(n_rows) if i % 4 != 3]
    width = len(cache.layer_ids) * H
    held = real_features(cache, range(3, n_rows, 4))[:, :width]
    print(f"basis-fit-tokens: {n_rows} rows ({seconds:.0f} s to extract), fits on {len(plan)} of them, "
          f"{held.shape[0]} real tokens of the other {n_rows - len(plan)} held out", flush=True)
    results = []
    for n in [int(v) for v in args.fit_tokens.split(",")]:
        rows = [plan[j] for j in fit_rows(len(plan), args.seq_len, n)]
        moment = SecondMoment(width)
        for i in rows:
            row = cache[i]
            moment.add(row["hidden"][:, :width], row["doc_ids"] != 0)
        if moment.tokens < max(ranks):
            print(f"basis-fit-tokens: {n} row tokens: {moment.tokens} real tokens, fewer than rank {max(ranks)}: "
                  "skipped", flush=True)
            continue
        t = time.perf_counter()
        p, _ = fit(moment.m.numpy(), max(ranks), H)
        fit_s = time.perf_counter() - t
        p = torch.from_numpy(p).double()
        for R in ranks:
            rec = {"fit_tokens": n, "fit_rows": len(rows), "real_fit_tokens": moment.tokens, "rank": R,
                   "fit_s": round(fit_s, 2), **errors(held, p[:R], H)}
            results.append(rec)
            print(json.dumps(rec), flush=True)
    from bench.common import table

    print(table([{"fit tokens": r["fit_tokens"], "real": r["real_fit_tokens"], "R": r["rank"],
                  "error median": r["median"], "p90": r["p90"],
                  "per layer": " ".join(f"{v:.3f}" for v in r["per_layer_median"]),
                  "energy kept": f"{100 * r['energy_kept']:.3f}%"} for r in results],
                ["fit tokens", "real", "R", "error median", "p90", "per layer", "energy kept"]))
    report = {"target": target, "hidden_size": H, "layer_ids": cache.layer_ids, "seq_len": args.seq_len,
              "conversations": args.conversations, "rows": n_rows, "plan_rows": len(plan),
              "held_out_tokens": int(held.shape[0]), "results": results, "machine": platform.platform(),
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if os.environ.get("DFLASH_BENCH_KEEP") != "1":
        shutil.rmtree(out, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
