"""Cache bytes per real token with the features on their own basis (`extract --basis-rank R`), against fp8 and bf16.

Feeds BENCHMARKS.md, "Cache size" (features on their own basis).

    python bench/basis_size.py                          # SmolLM2-135M-Instruct on chitchat, CPU, a few minutes
    python bench/basis_size.py --conversations 400 --json basis.json

Runs the real `dflash extract` (in-process, one after the other) over the same data into: a bf16 cache, an fp8 cache,
and fp8 caches on bases of rank H/2, H and 2H (by default). For each: bytes on disk per real token (`cache info`:
everything under the cache directory, the token ids, masks and commit records included) and the raw hidden bytes per
token; and beside it the per-token relative error of the features a drafter's fc sees, against the bf16 cache
(x: bf16 K*H features): ||x^ - x|| / ||x|| with x^ = the dequantised fp8 features, or P^T z for a basis (P's
projection loss and fp8's rounding together; fc' on z equals fc' P on P^T z). Median and 99th percentile over real
tokens, separately over the rows the basis was fitted on and the others (held out). Then the same bytes computed for
the 8B shape (K = 5, H = 4096), raw (before compression). tau is not measured here: it needs the GPU recipe.
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


def extract(out: str, target: str, data: str, args, *extra: str) -> float:
    from click.testing import CliRunner

    from dflash.cli import main

    t0 = time.perf_counter()
    r = CliRunner().invoke(main, ["extract", "--target", target, "--data", data, "--out", out, "--seq-len",
                                  str(args.seq_len), "--no-progress", "--overwrite", "--tokenize-cache",
                                  os.path.join(args.workdir, "tokenized"), *extra], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return time.perf_counter() - t0


def rel_errors(path: str, ref, fit_rows: set[int]) -> dict:
    import dflash_cache

    c = dflash_cache.open(path)
    p = c.basis()
    held, fitted = [], []
    for i in range(len(c)):
        row, x = c[i], ref[i]["hidden"].float()
        real = row["doc_ids"] != 0
        h = row["hidden"].float()
        xh = h @ torch.from_numpy(p) if p is not None else h
        x, xh = x[real], xh[real]
        e = ((xh - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)).numpy()
        (fitted if i in fit_rows else held).append(e)
    out = {}
    for name, parts in (("fit_rows", fitted), ("held_out_rows", held)):
        if parts:
            e = np.concatenate(parts)
            out[name] = {"median": float(np.median(e)), "p99": float(np.quantile(e, 0.99)), "tokens": int(e.size)}
    return out


def analytic_8b(K: int = 5, H: int = 4096) -> list[dict]:
    rows = [{"format": "bf16", "raw_bytes_per_token": 2 * K * H},
            {"format": "fp8", "raw_bytes_per_token": K * H + 4 * K}]
    for R in (H // 2, H, 2 * H):
        rows.append({"format": f"fp8, basis R={R}", "raw_bytes_per_token": R + 4,
                     "basis_bytes": R * K * H * 4, "fraction_of_fp8": round((R + 4) / (K * H + 4 * K), 4)})
    return rows


def add_target_data_args(ap: argparse.ArgumentParser, conversations: int, workdir: str) -> None:
    """The options target_data_ranks reads (and --seq-len, --json), with a bench's own defaults."""
    ap.add_argument("--target", help="HF model dir or .gguf (default: the demo's SmolLM2-135M-Instruct)")
    ap.add_argument("--data", help="chat jsonl (default: the demo's chitchat conversations)")
    ap.add_argument("--conversations", type=int, default=conversations)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--ranks", help="basis ranks (default: H/2, H, 2H)")
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), workdir))
    ap.add_argument("--json")


def target_data_ranks(args) -> tuple[str, str, int, list[int]]:
    """(target, data, H, ranks) of a basis bench: --target or the demo's SmolLM2-135M-Instruct (converted into
    --workdir), --data or the first --conversations of the demo's chitchat conversations (written there), the target's
    hidden size and --ranks or H/2, H, 2H."""
    from dflash.core.target import convert_gguf, load_config, text_config

    target = args.target
    if target is None:
        from dflash.recipes.assets import smollm2_gguf

        target = convert_gguf(smollm2_gguf(), os.path.join(args.workdir, "smollm2-target"))
    data = args.data
    if data is None:
        from dflash.recipes.cpu import chitchat_conversations, write_jsonl

        data = os.path.join(args.workdir, "chitchat.jsonl")
        convs = chitchat_conversations()[: args.conversations]
        write_jsonl(data, [{"messages": [{"role": "user", "content": c["prompt"]},
                                         {"role": "assistant", "content": c["reply"]}]} for c in convs])
    H = text_config(load_config(target)).hidden_size
    return target, data, H, [int(r) for r in args.ranks.split(",")] if args.ranks else [H // 2, H, 2 * H]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_data_args(ap, 240, "dflash-bench-basis")
    ap.add_argument("--fit-tokens", type=int, default=16384, help="extract --basis-fit-tokens")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.makedirs(args.workdir, exist_ok=True)

    import dflash_cache
    from dflash_cache.basis import fit_rows

    target, data, H, ranks = target_data_ranks(args)
    common = ["--max-samples", str(args.conversations)]
    runs = [("bf16", ["--hidden-dtype", "bf16"]), ("fp8", ["--hidden-dtype", "fp8"])]
    runs += [(f"fp8, basis R={R}", ["--hidden-dtype", "fp8", "--basis-rank", str(R), "--basis-fit-tokens",
                                    str(args.fit_tokens)]) for R in ranks]
    results = []
    ref = None
    for name, extra in runs:
        out = os.path.join(args.workdir, "cache-" + name.replace(", basis R=", "-r"))
        seconds = extract(out, target, data, args, *common, *extra)
        info = dflash_cache.info(out)
        rec = {"format": name, "bytes_per_real_token": round(info["bytes_per_real_token"], 1),
               "raw_hidden_bytes_per_token": info["raw_hidden_bytes_per_token"], "extract_s": round(seconds, 1),
               "real_tokens": info["real_tokens"], "rows": info["rows"]}
        if info["basis"]:
            rec["energy_kept_fit"] = info["basis"]["energy"]
            rec["energy_per_layer_fit"] = info["basis"]["energy_per_layer"]
        if ref is None:
            ref = dflash_cache.open(out)
        else:
            fr = set(fit_rows(info["rows"], args.seq_len, args.fit_tokens)) if info["basis"] else set()
            rec["rel_error"] = rel_errors(out, ref, fr)
        results.append(rec)
        print(json.dumps(rec), flush=True)
    bf16 = results[0]["bytes_per_real_token"]
    fp8 = results[1]["bytes_per_real_token"]
    for r in results:
        r["fraction_of_bf16"], r["fraction_of_fp8"] = round(r["bytes_per_real_token"] / bf16, 4), round(
            r["bytes_per_real_token"] / fp8, 4)
    report = {"target": target, "hidden_size": H, "layer_ids": ref.layer_ids, "seq_len": args.seq_len,
              "conversations": args.conversations, "fit_tokens": args.fit_tokens, "results": results,
              "analytic_8b_shape": analytic_8b(), "machine": platform.platform(), "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if os.environ.get("DFLASH_BENCH_KEEP") != "1":
        for name, _ in runs:
            shutil.rmtree(os.path.join(args.workdir, "cache-" + name.replace(", basis R=", "-r")), ignore_errors=True)


if __name__ == "__main__":
    main()
