"""Cache I/O benchmark: dflash_cache (each codec) against the peers' one-torch.save-file-per-sample format.

Feeds BENCHMARKS.md, "Cache size" (bytes per token per stored dtype, each codec's write and read speed).

    python bench/cache_io.py                                   # defaults: ~1 min on 2 CPU cores
    python bench/cache_io.py --hidden 4096 --layers 5 --seq-len 4096 --rows 48 --rows-per-shard 4   # Qwen3-8B-like
    python bench/cache_io.py --real-hidden hidden.pt --json out.json
    python bench/cache_io.py --hidden 4096 --layers 5 --seq-len 4096 --rows 48 --rows-per-shard 4 \
        --hidden-dtypes bf16 fp8 fp4 --codecs zstd --no-peer            # bytes per real token per hidden dtype

For each codec: the rows go through CacheWriter (end to end: encode, checksum, write, commit) and
are read back through cache.batches (one epoch, every row); for the peers' format every packed
document becomes one torch.save file {hidden [n, K*H] bf16, input_ids, loss_mask}, written and read
back with torch.load (in as many threads). Every method gets the same data.

Synthetic hidden states are bf16 of N(0, 1) * exp(N(0, 1) per channel), which compress about as
much as real hidden states do (the exponent bits carry the per-channel scale); ~3% of every row's
tail is padding written as true zeros. With --hidden-dtypes fp8/fp4 the same rows are quantised first
(dflash_cache.quant, on the CPU, outside the timing: extraction quantises on the GPU) and the writer
gets bytes + scales; the reader moves bytes + scales (batches(quantized=True)). Reads come from the page cache (or /dev/shm): they measure
decoding and copying, not a disk.

Columns: write/read MB/s = raw bytes handed to / returned by the format per second (the cache
stores padding, the peers do not); write/read tok/s = real tokens per second (comparable across
methods); ratio = raw bytes / bytes on disk; B/token = bytes on disk per real token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import dflash_cache
from dflash_cache import CacheSpec, CacheWriter, quant


@dataclass
class Data:
    """The rows every method writes: shards of packed rows, and where each document lies in them."""

    spec: CacheSpec
    shards: list[dict[str, np.ndarray]]  # input_ids, loss_mask, doc_ids, hidden (uint16 bf16 bits)
    docs: list[tuple[int, int, int, int]]  # (shard, row, start, end)
    real_tokens: int

    @property
    def raw_bytes(self) -> int:
        return sum(a.nbytes for s in self.shards for a in s.values())


@dataclass
class Result:
    method: str
    write_mb_s: float
    write_tok_s: float
    read_mb_s: float
    read_tok_s: float
    ratio: float
    bytes_per_token: float
    bytes_on_disk: int


# -- data ------------------------------------------------------------------------------------------------
def synthetic_pool(n_tokens: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """bf16 bits [n_tokens, width] of N(0, 1) * exp(N(0, 1) per channel)."""
    scale = np.exp(rng.standard_normal(width)).astype(np.float32)
    x = torch.from_numpy(rng.standard_normal((n_tokens, width), dtype=np.float32) * scale)
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def load_real_hidden(path: str) -> np.ndarray:
    """bf16 bits [tokens, width] from a .npy (bf16 bits as uint16/int16, or floats) or a .pt file
    (a tensor, or a dict holding one under 'hidden'/'hidden_states'/'aux_hidden_states', else its largest)."""
    if path.endswith(".npy"):
        a = np.load(path)
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype in (np.uint16, np.int16) \
            else torch.from_numpy(a.astype(np.float32))
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, dict):
            named = [obj[k] for k in ("hidden", "hidden_states", "aux_hidden_states") if torch.is_tensor(obj.get(k))]
            tensors = named or sorted((v for v in obj.values() if torch.is_tensor(v)), key=lambda v: -v.numel())
            if not tensors:
                sys.exit(f"error: {path} holds no tensor")
            obj = tensors[0]
        t = obj
    t = t.to(torch.bfloat16).reshape(-1, t.shape[-1]).contiguous()
    return t.view(torch.int16).numpy().view(np.uint16)


def make_data(args, rng: np.random.Generator) -> Data:
    if args.real_hidden:
        pool = load_real_hidden(args.real_hidden)
    else:
        pool = synthetic_pool(min(4 * args.seq_len, args.rows * args.seq_len), args.hidden * args.layers, rng)
    width = pool.shape[1]
    layers = args.layers if width == args.hidden * args.layers else 1  # real data: its own width
    spec = CacheSpec(seq_len=args.seq_len, hidden_size=width // layers, layer_ids=list(range(layers)),
                     num_rows=args.rows, rows_per_shard=args.rows_per_shard)
    T, shards, docs, real_total, cursor = args.seq_len, [], [], 0, 0
    for s in range(spec.num_shards):
        _, rows = spec.shard_rows(s)
        hidden = np.zeros((rows, T, width), np.uint16)
        doc_ids = np.zeros((rows, T), np.int32)
        for r in range(rows):
            real = T - int(rng.integers(0, int(0.06 * T) + 1))  # ~3% padding on average
            hidden[r, :real] = pool[np.arange(cursor, cursor + real) % len(pool)]  # tokens cycle through the pool
            cursor += real
            t, d = 0, 0
            while t < real:
                n = min(real - t, int(rng.lognormal(np.log(T / 6), 0.8)) + 1)
                d += 1
                doc_ids[r, t:t + n] = d
                docs.append((s, r, t, t + n))
                t += n
            real_total += real
        is_real = doc_ids > 0
        shards.append({
            "input_ids": np.where(is_real, rng.integers(1, 150_000, (rows, T)), 0).astype(np.int32),
            "loss_mask": (is_real & (rng.random((rows, T)) < 0.7)).astype(np.uint8),
            "doc_ids": doc_ids,
            "hidden": hidden,
        })
    return Data(spec, shards, docs, real_total)


# -- methods ------------------------------------------------------------------------------------------------
def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def warm_up(data: Data, codec: str, out: Path) -> None:
    """Write and read one row first: the writer's first shard imports zarr (~1 s), which is no I/O."""
    spec = CacheSpec(**{**asdict(data.spec), "codec": codec, "num_rows": 1})
    shutil.rmtree(out, ignore_errors=True)
    w = CacheWriter(out, spec, threads=1)
    w.write_shard(0, **{k: v[:1] for k, v in data.shards[0].items()})
    w.close()
    dflash_cache.open(out)[0]
    shutil.rmtree(out)


def quantized_shards(data: Data, hidden_dtype: str) -> list[dict[str, np.ndarray]]:
    """data's shards with hidden quantised (bytes as numpy uint8) + hidden_scales; bf16: as they are."""
    if not quant.is_quantized(hidden_dtype):
        return data.shards
    out = []
    for arrays in data.shards:
        x = torch.from_numpy(arrays["hidden"].view(np.int16)).view(torch.bfloat16)
        h, s = quant.quantize(x, hidden_dtype, len(data.spec.layer_ids))
        out.append({**arrays, "hidden": h.view(torch.uint8).numpy(), "hidden_scales": s.numpy()})
    return out


def bench_cache(data: Data, codec: str, out: Path, threads: int, batch_rows: int, hidden_dtype: str = "bfloat16") -> Result:
    spec = CacheSpec(**{**asdict(data.spec), "codec": codec, "hidden_chunk_tokens": 0, "hidden_dtype": hidden_dtype})
    shards = quantized_shards(data, hidden_dtype)
    warm_up(data, codec, out)
    t0 = time.perf_counter()
    w = CacheWriter(out, spec, threads=threads)
    for s, arrays in enumerate(shards):
        w.submit_shard(s, **arrays)
    w.close()
    t_write = time.perf_counter() - t0

    cache = dflash_cache.open(out)
    rows_read = 0
    t0 = time.perf_counter()
    for b in cache.batches(batch_rows, threads=threads, quantized=True):
        rows_read += int(b["row_valid"].sum())
    t_read = time.perf_counter() - t0
    assert rows_read == spec.num_rows, (rows_read, spec.num_rows)

    on_disk = dflash_cache.info(out)["bytes_on_disk"]
    raw = sum(a.nbytes for s in shards for a in s.values())
    name = "" if hidden_dtype == "bfloat16" else f" {hidden_dtype}"
    return Result(f"dflash_cache {codec}{name}", raw / t_write / 1e6, data.real_tokens / t_write, raw / t_read / 1e6,
                  data.real_tokens / t_read, raw / on_disk, on_disk / data.real_tokens, on_disk)


def peer_sample(data: Data, doc: tuple[int, int, int, int]) -> dict[str, torch.Tensor]:
    s, r, a, b = doc
    arrays = data.shards[s]
    hidden = torch.from_numpy(arrays["hidden"][r, a:b].copy().view(np.int16)).view(torch.bfloat16)
    return {"hidden": hidden, "input_ids": torch.from_numpy(arrays["input_ids"][r, a:b].astype(np.int64)),
            "loss_mask": torch.from_numpy(arrays["loss_mask"][r, a:b].astype(np.int64))}


def bench_peer(data: Data, out: Path, threads: int) -> Result:
    """One torch.save file per sample (document); written one by one, read back in `threads` threads."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t_write, raw = 0.0, 0
    for i, doc in enumerate(data.docs):
        sample = peer_sample(data, doc)  # built outside the clock: only saving is timed
        raw += sum(v.nbytes for v in sample.values())
        t0 = time.perf_counter()
        torch.save(sample, out / f"{i:07d}.pt")
        t_write += time.perf_counter() - t0

    files = sorted(out.iterdir())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        n_read = sum(s["hidden"].shape[0] for s in pool.map(lambda f: torch.load(f, weights_only=True), files))
    t_read = time.perf_counter() - t0
    assert n_read == data.real_tokens

    on_disk = dir_bytes(out)
    return Result("torch.save per sample (peers)", raw / t_write / 1e6, data.real_tokens / t_write,
                  raw / t_read / 1e6, data.real_tokens / t_read, raw / on_disk, on_disk / data.real_tokens, on_disk)


# -- report ---------------------------------------------------------------------------------------------------
def markdown(results: list[Result]) -> str:
    head = "| method | write MB/s | write tok/s | read MB/s | read tok/s | ratio | B/real token | on disk |"
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r.method} | {r.write_mb_s:,.0f} | {r.write_tok_s:,.0f} | {r.read_mb_s:,.0f} | "
                     f"{r.read_tok_s:,.0f} | {r.ratio:.3f} | {r.bytes_per_token:,.0f} | {r.bytes_on_disk / 2**20:,.1f} MiB |")
    return "\n".join(lines)


def default_out_dir() -> str:
    return "/dev/shm/dflash-bench" if os.path.isdir("/dev/shm") else tempfile.mkdtemp(prefix="dflash-bench-")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out-dir", default=default_out_dir(), help="where the caches and files are written")
    ap.add_argument("--rows", type=int, default=96, help="rows of --seq-len tokens")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size H")
    ap.add_argument("--layers", type=int, default=3, help="captured layers K (row width K*H)")
    ap.add_argument("--rows-per-shard", type=int, default=8)
    ap.add_argument("--batch-rows", type=int, default=4, help="rows per batch when reading")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="writer and reader threads")
    ap.add_argument("--codecs", nargs="+", default=list(dflash_cache.CODECS), choices=dflash_cache.CODECS)
    ap.add_argument("--hidden-dtypes", nargs="+", default=["bf16"], choices=list(quant.CLI_NAMES),
                    help="stored hidden dtypes to measure (each with every codec)")
    ap.add_argument("--no-peer", action="store_true", help="skip the torch.save-per-sample baseline")
    ap.add_argument("--real-hidden", help=".pt/.npy of real hidden states [..., K*H] to use instead of synthetic ones")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep what was written")
    ap.add_argument("--json", help="also write the results here as JSON")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    out = Path(args.out_dir)
    t0 = time.perf_counter()
    data = make_data(args, np.random.default_rng(args.seed))
    spec = data.spec
    padding = 1 - data.real_tokens / (spec.num_rows * spec.seq_len)
    setup = (f"{spec.num_rows} rows x {spec.seq_len} tokens x {spec.row_width} (K={len(spec.layer_ids)}, "
             f"H={spec.hidden_size}) bf16 = {data.raw_bytes / 2**30:.2f} GiB raw, {len(data.docs)} documents, "
             f"{100 * padding:.1f}% padding, {'real hidden from ' + args.real_hidden if args.real_hidden else 'synthetic'}; "
             f"{args.threads} threads; {os.cpu_count()} CPU cores; out {out}")
    print(setup, f"(data made in {time.perf_counter() - t0:.1f} s)", flush=True)

    results = []
    for dt in args.hidden_dtypes:
        for codec in args.codecs:
            results.append(bench_cache(data, codec, out / f"cache-{dt}-{codec}", args.threads, args.batch_rows,
                                       quant.resolve(dt)))
            print(f"  {results[-1].method}: done", flush=True)
            if not args.keep:
                shutil.rmtree(out / f"cache-{dt}-{codec}", ignore_errors=True)
    if not args.no_peer:
        results.append(bench_peer(data, out / "peer", args.threads))
        print(f"  {results[-1].method}: done", flush=True)
        if not args.keep:
            shutil.rmtree(out / "peer", ignore_errors=True)
    if not args.keep and out.exists() and not any(out.iterdir()):
        out.rmdir()

    bar = 2 * spec.row_width + 16
    print()
    print(markdown(results))
    print(f"\nraw bf16 hidden = {2 * spec.row_width:,} B/token; bar (DESIGN §5) <= 2*K*H + 16 = {bar:,} B/real token"
          f"; fp8 bar: <= 20,500 B/real token at the Qwen3-8B shape (K=5, H=4096)")
    if args.json:
        doc = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "setup": setup,
               "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpu_cores": os.cpu_count(),
               "args": vars(args), "padding_fraction": padding, "real_tokens": data.real_tokens,
               "results": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
