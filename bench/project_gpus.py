"""Project extraction throughput on N GPUs of one host from per-rank GPU, CPU and disk figures.

    python bench/project_gpus.py --gpus 5 --gpu-tok-s 31300 --compress-mb-s-per-core 420 --disk-gb-s 0.6 --cores 16
    python bench/project_gpus.py --gpus 5 --from-json extract.json --compress-mb-s-per-core 420 --disk-gb-s 0.6

A job of N ranks on one host is bounded by the least of three rates (tokens/s):
  GPU   N x the one-GPU end-to-end rate to /dev/shm (no disk in the way; --gpu-tok-s, or extract_shm_on /
        extract_shm_off / extract_shm's tok_s from bench/extract.py --json)
  CPU   cores x one core's compression rate / raw bytes per token (every rank compresses its own shards with
        cores/N threads: the host's cores are the budget, whatever N is)
  disk  the disk's write rate through zarr / stored bytes per token
and by the imbalance of the shard split: ranks get whole shards (greedy LPT by real tokens), so the slowest
rank carries about mean + one shard; --shards gives the shard count to bound that (x 1 + (N-1) / shards).
The raw bytes per token are 2*K*H + 16 (bf16 hidden states + ids, mask, doc id), stored = raw / --ratio.
Prints each ceiling, the binding one, and the projected speed-up over one GPU.
"""

from __future__ import annotations

import argparse
import json


def project(n: int, gpu_tok_s: float, cores: int, compress_mb_s_per_core: float, disk_gb_s: float,
            raw_bpt: float, ratio: float, shards: int | None) -> dict:
    imbalance = 1.0 + ((n - 1) / shards if shards else 0.0)  # ~ the slowest rank holds one shard above the mean
    ceilings = {
        "gpu": n * gpu_tok_s / imbalance,
        "cpu_compression": cores * compress_mb_s_per_core * 1e6 / raw_bpt,
        "disk": disk_gb_s * 1e9 / (raw_bpt / ratio),
    }
    bound = min(ceilings, key=ceilings.get)
    return {"gpus": n, **{f"{k}_tok_s": v for k, v in ceilings.items()}, "bound_by": bound,
            "projected_tok_s": ceilings[bound],
            "worst_imbalance": imbalance}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=5)
    ap.add_argument("--gpu-tok-s", type=float, default=None, help="one GPU end to end to /dev/shm, tokens/s")
    ap.add_argument("--from-json", default=None, help="bench/extract.py --json output (takes its /dev/shm rate)")
    ap.add_argument("--cores", type=int, default=16)
    ap.add_argument("--compress-mb-s-per-core", type=float, required=True,
                    help="one core's zstd rate on bf16 hidden states, MB/s of raw input (bench/cache_io.py)")
    ap.add_argument("--disk-gb-s", type=float, required=True, help="the disk's write rate through zarr, GB/s")
    ap.add_argument("--layers", type=int, default=5, help="K")
    ap.add_argument("--hidden", type=int, default=4096, help="H")
    ap.add_argument("--ratio", type=float, default=1.27, help="compression ratio (zstd on bf16: ~1.27)")
    ap.add_argument("--shards", type=int, default=None, help="shards in the job (bounds the split's imbalance)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    g = a.gpu_tok_s
    if a.from_json:
        with open(a.from_json) as f:
            res = json.load(f)
        for key in ("extract_shm_on", "extract_shm_off", "extract_shm"):
            if key in res:
                g = res[key]["tok_s"]
                break
    if not g:
        ap.error("give --gpu-tok-s or --from-json with an end-to-end /dev/shm figure")
    raw = 2 * a.layers * a.hidden + 16
    rows = [project(n, g, a.cores, a.compress_mb_s_per_core, a.disk_gb_s, raw, a.ratio, a.shards)
            for n in range(1, a.gpus + 1)]
    for r in rows:
        r["speedup_vs_one_gpu"] = r["projected_tok_s"] / rows[0]["projected_tok_s"]
    print(f"one GPU {g:,.0f} tok/s; {a.cores} cores x {a.compress_mb_s_per_core} MB/s; disk {a.disk_gb_s} GB/s; "
          f"{raw} raw B/token, {raw / a.ratio:,.0f} stored")
    print("| gpus | gpu ceiling | cpu ceiling | disk ceiling | bound by | projected tok/s | x one GPU |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['gpu_tok_s']:,.0f} | {r['cpu_compression_tok_s']:,.0f} | {r['disk_tok_s']:,.0f} | "
              f"{r['bound_by']} | {r['projected_tok_s']:,.0f} | {r['speedup_vs_one_gpu']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"inputs": vars(a), "one_gpu_tok_s": g, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
