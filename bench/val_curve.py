"""The held-out curve of one or more `dflash train --val-cache` runs: tau against the context tokens trained on.

Feeds BENCHMARKS.md, "GPU recipe" (the held-out curve, docs/val-curve-gpu.png).

    python bench/val_curve.py --run RUN_DIR [--run LABEL=RUN_DIR ...] --out curve.png [--hline LABEL=TAU ...]
    python bench/val_curve.py --run WORKDIR/run          # the GPU recipe's run: the table only

Reads each run's metrics.jsonl (the validation lines: val_tau_decode, val_tau_expected) and run.json (rows per
step = batch_rows x grad_accum x ranks; the row length from its cache, or --seq-len), prints the table and,
with matplotlib installed (not a dependency), plots the decoding tau (solid) and the expected tau (dashed) of
every run; --hline draws a measured eval tau (e.g. n-gram lookup's) as a horizontal line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def load(run: str, seq_len: int = 0) -> dict:
    with open(os.path.join(run, "run.json")) as f:
        cfg = json.load(f)["config"]
    rows_per_step = cfg["batch_rows"] * cfg.get("grad_accum", 1) * cfg.get("world", 1)
    if not seq_len:
        if not os.path.exists(cfg["cache"]):
            raise SystemExit(f"{run}: its cache {cfg['cache']} is not here to read the row length from: pass --seq-len")
        import dflash_cache

        seq_len = dflash_cache.open(cfg["cache"], allow_incomplete=True).seq_len
    from dflash.train.fit.run_dir import read_metrics

    # a resumed run repeats no step: run_dir drops the records after the checkpoint it resumes from
    points = {r["step"]: (r.get("val_tau_decode"), r["val_tau_expected"]) for r in read_metrics(run)
              if "val_tau_expected" in r}
    return {"tokens_per_step": rows_per_step * seq_len,
            "points": [(s, s * rows_per_step * seq_len, d, e) for s, (d, e) in sorted(points.items())]}


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="RUN_DIR or LABEL=RUN_DIR (repeatable)")
    ap.add_argument("--out", help="the PNG to write (needs matplotlib)")
    ap.add_argument("--hline", action="append", default=[], help="LABEL=TAU: a horizontal line (repeatable)")
    ap.add_argument("--title", default="held-out tau against training tokens")
    ap.add_argument("--seq-len", type=int, default=0, help="the cache's row length, when the cache is not here")
    a = ap.parse_args(argv)
    runs = []
    for spec in a.run:
        label, _, path = spec.rpartition("=") if "=" in spec else (os.path.basename(spec.rstrip("/")), "", spec)
        runs.append((label, load(path, a.seq_len)))
    for label, r in runs:
        print(f"{label}: {r['tokens_per_step']:,} context tokens per step")
        print("  step  tokens (M)  decoding tau  expected tau")
        for s, t, d, e in r["points"]:
            print(f"  {s:>5}  {t / 1e6:>10.1f}  {'-' if d is None else f'{d:.2f}':>12}  {e:>12.2f}")
    if not a.out:
        return runs
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--out needs matplotlib (not a dflash dependency): pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4), dpi=110)
    for i, (label, r) in enumerate(runs):
        color = f"C{i}"
        xs = [t / 1e6 for _, t, _, _ in r["points"]]
        dec = [(x, d) for x, (_, _, d, _) in zip(xs, r["points"]) if d is not None]
        if dec:
            ax.plot(*zip(*dec), "o-", color=color, label=f"{label}: decoding tau")
        ax.plot(xs, [e for _, _, _, e in r["points"]], "s--", color=color, alpha=0.5, label=f"{label}: expected tau")
    for j, spec in enumerate(a.hline):
        label, _, v = spec.rpartition("=")
        ax.axhline(float(v), color=f"C{len(runs) + j}", linestyle=":", label=f"{label}: {float(v):.2f}")
    ax.set_xlabel("context tokens trained on (millions)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title(a.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: the curves fill them
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")
    return runs


if __name__ == "__main__":
    main()
