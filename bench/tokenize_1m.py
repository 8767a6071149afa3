"""Tokenise and pack a million conversations: a serial pass per rank vs tokenise-once (extract/tokenize_cache.py).

Feeds BENCHMARKS.md, "Extraction" (the tokenise-and-pack row).

    python bench/tokenize_1m.py --n 1000000 --workers 16 --json tok.json      # the GPU machine (16 cores)
    python bench/tokenize_1m.py --n 10000 --workers 2                          # a smoke run

Writes N synthetic conversations (one user and one assistant turn, log-normal lengths with mean
--mean-tokens, as bench/common.synthetic_chats) to a jsonl under --dir, then, each mode in its own process:
  serial    load_chat_dataset + tokenize_dataset (one process, what every rank did before) + pack
  parallel  load_chat_dataset + tokenize_cached with --workers processes into an empty cache + pack (rank 0)
  reuse     the same call once the entry exists (what the other ranks and a rerun do) + pack
Reports seconds per phase, peak RSS of the process and of its largest worker, its anonymous and file-backed
(mapped cache files) resident memory at the end, and checks that every mode
gives the same data fingerprint and the same number of packed rows. The tokenizer is the tiny byte-level
BPE of tests/tiny.py (~2.75 tokens per word; a real 150k-vocabulary tokenizer is slower per token), or
--tokenizer DIR (a local HF tokenizer with a chat template).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import WORDS, hardware, table  # noqa: E402


def write_chats(path: str, n: int, mean_tokens: int, seed: int = 0) -> None:
    """Streamed (constant memory): the length mix of bench.common.synthetic_chats."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            total = int(min(4000, max(32, rng.lognormvariate(0, 0.8) * mean_tokens * 0.72)))
            prompt = max(8, int(total * rng.uniform(0.1, 0.4)))
            words = lambda k: " ".join(rng.choices(WORDS, k=max(1, int(k / 2.75))))
            f.write(json.dumps({"messages": [{"role": "user", "content": words(prompt)},
                                             {"role": "assistant", "content": words(total - prompt)}]}) + "\n")


def rss_split_gb() -> tuple[float, float]:
    """(anonymous, file-backed) resident GB of this process now: the flat arrays of the cache are mapped files,
    resident as page cache the kernel can drop, not heap."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0]) / 1e6
    return vals.get("RssAnon", 0.0), vals.get("RssFile", 0.0)


def one_mode(a) -> dict:
    from dflash.extract.data import ChatTokenizer, data_fingerprint, tokenize_dataset
    from dflash.core.chat import load_chat_dataset
    from dflash.extract.pack import pack
    from dflash.extract.tokenize_cache import tokenize_cached

    if a.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.tokenizer)
    else:
        from tests.tiny import make_tiny_tokenizer

        tok = make_tiny_tokenizer()
    chat_tok = ChatTokenizer(tok)
    t0 = time.perf_counter()
    ds = load_chat_dataset(a.data)
    t1 = time.perf_counter()
    if a.mode == "serial":
        data = tokenize_dataset(ds, chat_tok, a.seq_len, a.data, progress=False)
        fp = data_fingerprint(data)
    else:
        data = tokenize_cached(ds, chat_tok, a.seq_len, a.data, a.cache, workers=a.workers, progress=False)
        fp = data.fingerprint
    t2 = time.perf_counter()
    plan = pack(data.lengths, a.seq_len)
    t3 = time.perf_counter()
    anon, filed = rss_split_gb()
    return {"rss_anon_gb_at_end": anon, "rss_file_gb_at_end": filed,"mode": a.mode, "conversations": len(ds), "docs": len(data.docs), "tokens": int(data.tokens),
            "rows": len(plan), "load_s": t1 - t0, "tokenize_s": t2 - t1, "pack_s": t3 - t2, "total_s": t3 - t0,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
            "worker_peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6, "fingerprint": fp,
            "workers": a.workers if a.mode != "serial" else 1}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="conversations")
    ap.add_argument("--mean-tokens", type=int, default=900)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--modes", default="serial,parallel,reuse")
    ap.add_argument("--dir", default=None, help="where the jsonl and the cache go (default: a temp dir, removed)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--json", default=None)
    for hidden in ("--mode", "--data", "--cache"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(one_mode(a)))
        return
    work = a.dir or tempfile.mkdtemp(prefix="dflash-tok1m-")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, f"chats-{a.n}-{a.mean_tokens}.jsonl")
    try:
        t0 = time.perf_counter()
        if not os.path.exists(data):
            write_chats(data, a.n, a.mean_tokens)
        print(f"data: {a.n:,} conversations, {os.path.getsize(data) / 1e9:.2f} GB jsonl ({time.perf_counter() - t0:.0f} s)")
        cache = os.path.join(work, "tok-cache")
        shutil.rmtree(cache, ignore_errors=True)
        res = []
        for mode in a.modes.split(","):
            argv = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--data", data, "--cache", cache,
                    "--seq-len", str(a.seq_len), "--workers", str(a.workers)] + (["--tokenizer", a.tokenizer] if a.tokenizer else [])
            out = subprocess.run(argv, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
            res.append(json.loads(out.strip().splitlines()[-1]))
            print(f"  {mode}: {res[-1]['total_s']:.1f} s", flush=True)
        fps = {r["fingerprint"] for r in res}
        rows = {r["rows"] for r in res}
        print(f"tokenise + pack, {hardware()}; same data fingerprint in every mode: {len(fps) == 1}; "
              f"same packed rows: {len(rows) == 1}")
        print(table(res, ["mode", "workers", "conversations", "docs", "tokens", "rows", "load_s", "tokenize_s", "pack_s",
                          "total_s", "peak_rss_gb", "rss_anon_gb_at_end", "rss_file_gb_at_end",
                          "worker_peak_rss_gb"]))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"hardware": hardware(), "n": a.n, "mean_tokens": a.mean_tokens, "seq_len": a.seq_len,
                           "same_fingerprint": len(fps) == 1, "results": res}, f, indent=2)
        if len(fps) != 1 or len(rows) != 1:
            sys.exit("the modes disagree")
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
