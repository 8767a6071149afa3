"""How long the content fingerprint of a target's weights takes (dflash/core/weights.py), as `dflash extract`
computes it for every run and `dflash train` for the embedding and LM head.

Feeds BENCHMARKS.md, "Extraction" (the weights fingerprint row).

Builds a synthetic Qwen3-8B-shaped target as sharded safetensors (HF tensor names and shapes, bf16, ~16.4 GB in
5 shards at the default sizes; the bytes are random: hashing speed does not depend on them), then times:

    cold   every file dropped from the page cache first (posix_fadvise DONTNEED after fsync): a first read
    warm   the same again, the files now in the page cache
    train  only the embedding and LM head (what `dflash train` hashes), warm

for each --threads value, and prints a table; --json writes the results.

GPU machine (16 cores, NVMe), the real size (~16 GB written once, kept with --keep for reruns):
    python bench/hash_weights.py --out /root/hash_target --keep --threads 1,4,8,16 --json hash_weights.json
CPU smoke test (~60 MB):
    python bench/hash_weights.py --out /tmp/hash_target --hidden 256 --intermediate 768 --vocab 32000 --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflash.core.weights import fingerprint  # noqa: E402


def qwen3_tensors(layers: int, hidden: int, inter: int, vocab: int, heads: int, kv_heads: int, head_dim: int):
    """(name, shape) of every tensor of a Qwen3 causal LM checkpoint, in HF's order."""
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                (p + "self_attn.q_norm.weight", (head_dim,)), (p + "self_attn.k_norm.weight", (head_dim,)),
                (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter)),
                (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def write_target(out: str, tensors, shards: int) -> int:
    """Sharded bf16 safetensors (written directly: header, then bytes from a reused random block) + index."""
    os.makedirs(out, exist_ok=True)
    sizes = [(n, s, 2 * int(__import__("math").prod(s))) for n, s in tensors]
    total = sum(b for _, _, b in sizes)
    per, groups, cur, acc = total / shards, [], [], 0
    for t in sizes:
        cur.append(t)
        acc += t[2]
        if acc >= per * (len(groups) + 1) and len(groups) < shards - 1:
            groups.append(cur)
            cur = []
    groups.append(cur)
    block = os.urandom(64 << 20)
    weight_map = {}
    for k, group in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for n, s, b in group:
            header[n] = {"dtype": "BF16", "shape": list(s), "data_offsets": [off, off + b]}
            off += b
            weight_map[n] = name
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        with open(os.path.join(out, name), "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            left, i = off, 0
            while left > 0:
                n = min(left, len(block) - 4096)
                start = (i * 4099) % 4096  # a different slice each time: tensors do not repeat one another
                f.write(memoryview(block)[start:start + n])
                left -= n
                i += 1
            f.flush()
            os.fsync(f.fileno())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def drop_cache(d: str) -> None:
    for name in os.listdir(d):
        if name.endswith(".safetensors"):
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="Where the synthetic target is written (reused with --keep).")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=12288)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=0, help="[default: hidden / heads]")
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--threads", default="1,4,16", help="Thread counts to time, comma-separated.")
    ap.add_argument("--repeats", type=int, default=2, help="Timed runs per case (the best is reported).")
    ap.add_argument("--keep", action="store_true", help="Reuse a target already at --out of the same shape.")
    ap.add_argument("--json", help="Write the results here.")
    a = ap.parse_args()
    head_dim = a.head_dim or a.hidden // a.heads
    tensors = qwen3_tensors(a.layers, a.hidden, a.intermediate, a.vocab, a.heads, a.kv_heads, head_dim)
    want = sum(2 * int(__import__("math").prod(s)) for _, s in tensors)
    index = os.path.join(a.out, "model.safetensors.index.json")
    have = json.load(open(index))["metadata"]["total_size"] if a.keep and os.path.exists(index) else None
    t0 = time.perf_counter()
    if have != want:
        write_target(a.out, tensors, a.shards)
        print(f"wrote {want / 1e9:.2f} GB in {a.shards} shards to {a.out} in {time.perf_counter() - t0:.1f} s")
    else:
        print(f"reusing {want / 1e9:.2f} GB at {a.out}")
    rows = []
    for threads in [int(x) for x in a.threads.split(",") if x]:
        for case in ("cold", "warm", "train"):
            best, fp = float("inf"), None
            for _ in range(a.repeats):
                if case == "cold":
                    drop_cache(a.out)
                elif case == "warm" and fp is None:
                    fingerprint(a.out, threads=threads)  # warm the page cache
                t = time.perf_counter()
                fp = fingerprint(a.out, threads=threads,
                                 names={"model.embed_tokens.weight", "lm_head.weight"} if case == "train" else None)
                best = min(best, time.perf_counter() - t)
            rows.append({"threads": threads, "case": case, "bytes": fp.bytes_hashed, "seconds": best,
                         "GB_per_s": fp.bytes_hashed / best / 1e9, "tensors": len(fp.tensors), "digest": fp.digest})
    print(f"\ncontent fingerprint of a {want / 1e9:.2f} GB target ({len(tensors)} tensors, {a.shards} shards), "
          f"{os.cpu_count()} CPU cores; best of {a.repeats}")
    print(f"{'threads':>7}  {'case':<6} {'GB':>7} {'seconds':>8} {'GB/s':>7}")
    for r in rows:
        print(f"{r['threads']:>7}  {r['case']:<6} {r['bytes'] / 1e9:>7.2f} {r['seconds']:>8.2f} {r['GB_per_s']:>7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": vars(a), "bytes": want, "cpu_count": os.cpu_count(), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
