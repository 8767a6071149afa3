"""Extraction speed: the target's pure forward, end-to-end `dflash extract`, the compiled forward and its variants.

Feeds BENCHMARKS.md, "Extraction" (the end-to-end and compiled rows, the stored dtypes, the peers' torch.save) and
its note "The compiled forward's attention" (--variants, --profile, --matmul).

    python bench/extract.py                          # Qwen3-8B-shaped random target, T = 4096, on one GPU
    python bench/extract.py --chats 800 --skip peer,forward,compiled,disk --compile-modes on   # one job per process
    python bench/extract.py --skip forward,peer --hidden-dtypes bf16,fp8,fp4 --disk-dir /root/bench   # per stored dtype
    python bench/extract.py --chats 300 --variants eager4,default4 --profile --matmul --json v.json   # by kernel

In one run, on the same packed rows:
  1. the truncated target's pure forward tokens/s (flex document mask; also plain causal, no mask,
     and the SDPA 4D mask), no capture, nothing copied to the host;
  2. `dflash extract` end to end to committed shards in /dev/shm (isolates the pipeline's overhead),
     and to the machine's disk (disk-bound: GB/s written is reported);
     With --hidden-dtypes bf16,fp8,fp4 step 2 runs once per stored dtype (fp8/fp4 quantised on the GPU).
  3. the peers' way: the same forwards, then one torch.save file per sample of the K concatenated
     layers (synchronous copies), tokens/s and bytes per token.
  4. the compiled target forward (extract/compiled.py): its pure forward + capture, its first-batch check
     against eager (per-layer errors vs a float32 reference), and end to end with --compile off and on
     (--compile-modes) to /dev/shm and to disk; each run's compile seconds are reported apart, and its tail
     (the last shard's encoding and write after the last forward) with the rate without it.
`dflash extract` runs one job per process; several --compile-modes in one process measure a compiled run after an
eager one, which is not what the command does (dynamo's caches are shared).

--variants KIND+ROWS,... times only the pure forward + capture under compile variants, instead of the above:
eager (PackedTarget.run), default (extract/compiled.py's CompiledTarget as `dflash extract` runs it: attention
outside the graph), whole (one graph for the whole model, flex attention inside it: inductor then folds the q/k
norms and rotary embedding into the flex kernel), freeze (the default with inductor's `freezing`). Each compiled
variant is checked on the first batch against eager and a float32 reference, then timed over every batch.
--profile splits each variant's GPU time into matmuls, attention (flex), the other fused kernels and copies
(torch.profiler, two batches); --matmul times each linear shape alone (torch.mm, bf16, M = rows x seq_len): the
chip's rate on exactly these matmuls.

--json is rewritten after every measurement, so a run cut by a time limit keeps what it measured.
Speed does not depend on the weights, so the target is random (built on the GPU, saved once).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import (QWEN3_8B, SMOLLM2, hardware, kernel_summary, random_target_dir, synthetic_chats,  # noqa: E402
                          table, write_jsonl)


def dir_bytes(p: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)


def packed_rows(target: str, data: str, seq_len: int):
    from dflash.extract.data import ChatTokenizer, tokenize_dataset
    from dflash.core.chat import load_chat_dataset
    from dflash.extract.pack import materialize, pack
    from dflash.core.target import load_tokenizer

    tok = load_tokenizer(target)
    docs = tokenize_dataset(load_chat_dataset(data), ChatTokenizer(tok), seq_len, data, progress=False)
    plan = pack(docs.lengths, seq_len)
    return materialize(plan, docs.docs, seq_len, tok.pad_token_id or 0, 0, len(plan)), docs, plan


def device_batch(rows, i: int, n: int, dev) -> dict:
    """Rows i..i+n of the packed rows (input_ids, position_ids, doc_ids) as long tensors on dev."""
    return {k: torch.from_numpy(rows[k][i:i + n]).to(dev, torch.long) for k in ("input_ids", "position_ids", "doc_ids")}


def forward_speed(pt, rows, batch_rows: int, mode: str, capture: bool, runner=None) -> float:
    """Real tokens/s of the target over all rows; mode: flex | sdpa (document masks) | causal (no mask)."""
    from dflash.extract.target import packed_block_mask, packed_causal_mask

    dev = pt.device
    n = rows["input_ids"].shape[0]
    T = rows["input_ids"].shape[1]
    W = len(pt.layer_ids) * pt.hidden_size
    out = torch.empty(batch_rows, T, W, dtype=torch.bfloat16, device=dev)
    batches = [device_batch(rows, i, batch_rows, dev) for i in range(0, n - batch_rows + 1, batch_rows)]
    real = sum(int((b["doc_ids"] > 0).sum()) for b in batches)

    def one(b):
        with torch.inference_mode():
            if mode == "causal":
                pt.capture.out = out if capture else None
                pt.model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)
                pt.capture.out = None
            elif mode == pt.attn:
                if capture:
                    (runner or pt).run(b["input_ids"], b["position_ids"], b["doc_ids"], out)
                else:
                    mask = packed_block_mask(b["doc_ids"]) if mode == "flex" else packed_causal_mask(b["doc_ids"])[:, None]
                    pt.model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=mask, use_cache=False)
            else:
                raise ValueError(mode)

    one(batches[0])  # warm-up (flex compiles its kernel on first use)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for b in batches:
        one(b)
    torch.cuda.synchronize()
    return real / (time.perf_counter() - t)


FORWARD_MODES = {"causal", "flex", "flex-capture", "sdpa"}  # --forward-modes


def compiled_speed(pt, rows, batch_rows: int, return_runner: bool = False, split_attention: bool = True):
    """(real tokens/s, first-batch check) of extract/compiled.py's CompiledTarget: compiled, checked against eager on
    the first batch_rows rows, then timed by forward_speed (flex mask + capture). Inductor's global config (e.g.
    freezing) applies as set by the caller."""
    from dflash.extract.compiled import CompiledTarget, check_compiled

    runner = CompiledTarget(pt, split_attention=split_attention)
    first = device_batch(rows, 0, batch_rows, "cuda")
    check = check_compiled(pt, runner, first["input_ids"], first["position_ids"], first["doc_ids"])
    tps = forward_speed(pt, rows, batch_rows, "flex", True, runner=runner)
    return (tps, check, runner) if return_runner else (tps, check)


def peer_torch_save(pt, rows, plan, docs, batch_rows: int, out_dir: str, max_rows: int) -> dict:
    """One torch.save per sample (the K layers concatenated), synchronous, as the peers do."""
    dev = pt.device
    os.makedirs(out_dir, exist_ok=True)
    T = rows["input_ids"].shape[1]
    W = len(pt.layer_ids) * pt.hidden_size
    out = torch.empty(batch_rows, T, W, dtype=torch.bfloat16, device=dev)
    n = min(max_rows, rows["input_ids"].shape[0])
    tokens = 0
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(0, n - batch_rows + 1, batch_rows):
        b = {k: torch.from_numpy(rows[k][i:i + batch_rows]).to(dev, torch.long) for k in ("input_ids", "position_ids", "doc_ids")}
        pt.run(b["input_ids"], b["position_ids"], b["doc_ids"], out)
        for r in range(batch_rows):
            start = 0
            for d in plan[i + r]:
                ids, mask = docs.docs[d]
                L = len(ids)
                torch.save({"hidden": out[r, start:start + L].cpu(), "input_ids": torch.from_numpy(ids),
                            "loss_mask": torch.from_numpy(mask)}, os.path.join(out_dir, f"sample_{d}.pt"))
                start += L
                tokens += L
    dt = time.perf_counter() - t
    return {"tok_s": tokens / dt, "bytes_per_token": dir_bytes(out_dir) / tokens, "tokens": tokens}


def linear_flops_per_row_token(model) -> int:
    """2 x the weights of every linear layer: the matmul FLOPs per token (padding included: it is computed)."""
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def profile_forward(one, batches, flops_per_token: int, tokens_per_batch: int) -> dict:
    """GPU time by kernel category over len(batches) forwards (torch.profiler), and the matmuls' own TFLOP/s."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches:
            one(b)
        torch.cuda.synchronize()
    return kernel_summary(prof, len(batches), flops_per_token * tokens_per_batch * len(batches))


def matmul_rate(model, M: int) -> dict:
    """torch.mm (bf16) alone on each distinct linear shape of the model at M rows: the chip's rate on them."""
    shapes: dict[tuple, int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    flops = secs = 0.0
    per = []
    for (n, k), count in shapes.items():
        a = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ w.t()
        torch.cuda.synchronize()
        reps = 20
        t = time.perf_counter()
        for _ in range(reps):
            a @ w.t()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / reps
        per.append({"shape": f"{M}x{k} @ {k}x{n}", "layers": count, "TFLOP_s": 2 * M * n * k / dt / 1e12})
        flops += 2 * M * n * k * count
        secs += dt * count
        del a, w
    return {"M": M, "per_shape": per, "TFLOP_s": flops / secs / 1e12, "ms_all_linear": secs * 1e3}


VARIANT_KINDS = ("eager", "default", "whole", "freeze")  # --variants


def parse_variants(spec: str) -> list[tuple[str, str, int]]:
    """'eager4,default8' -> [(name, kind, batch rows)]."""
    out = []
    for v in filter(None, spec.split(",")):
        kind = v.rstrip("0123456789")
        if kind not in VARIANT_KINDS:
            raise SystemExit(f"--variants: {v!r}: the kind must be one of {', '.join(VARIANT_KINDS)}")
        out.append((v, kind, int(v[len(kind):] or 4)))
    return out


def run_variants(a, pt, rows, res: dict, save) -> None:
    """--variants: the pure forward + capture of each compile variant, its check, its profile, the matmuls alone."""
    import torch._inductor.config as inductor_config

    res["variants"] = {}
    flops_tok = linear_flops_per_row_token(pt.model)
    res["linear_GFLOP_per_token"] = flops_tok / 1e9
    variants = parse_variants(a.variants)
    if a.matmul:
        for batch in sorted({b for _, _, b in variants}):
            res[f"matmul_rate_{batch}"] = mr = matmul_rate(pt.model, batch * a.seq_len)
            print({"matmul_rate": mr}, flush=True)
            save()
    out = []
    for v, kind, batch in variants:
        t0 = time.perf_counter()
        r: dict = {"variant": v}
        runner = None
        if kind == "eager":
            r["tok_s"] = forward_speed(pt, rows, batch, "flex", True)
        else:
            torch._dynamo.reset()
            inductor_config.freezing = kind == "freeze"
            if kind == "whole":  # undo a split made by an earlier variant
                pt.model.config._attn_implementation = "flex_attention"
            tok_s, chk, runner = compiled_speed(pt, rows, batch, return_runner=True, split_attention=kind != "whole")
            r.update(tok_s=tok_s, check_passed=chk["passed"], first_call_s=chk["first_call_s"],
                     worst_of_tolerance=max(c / t for c, t in zip(chk["err_compiled_vs_ref"], chk["tolerance"])))
        if a.profile:
            T = rows["input_ids"].shape[1]
            out_buf = torch.empty(batch, T, len(pt.layer_ids) * pt.hidden_size, dtype=torch.bfloat16, device="cuda")
            bs = [device_batch(rows, i, batch, "cuda") for i in (0, batch)]

            def one(b, runner=runner, out_buf=out_buf):
                with torch.inference_mode():
                    (runner or pt).run(b["input_ids"], b["position_ids"], b["doc_ids"], out_buf)

            try:  # a profiler failure must not lose the variants still to run
                r["profile"] = profile_forward(one, bs, flops_tok, batch * T)
            except Exception as e:  # noqa: BLE001
                r["profile"] = {"error": f"{type(e).__name__}: {e}"}
            print({"profile": r["profile"]}, flush=True)
            del runner, out_buf, bs
        r.update(wall_s=time.perf_counter() - t0, peak_GB=torch.cuda.max_memory_allocated() / 1e9)
        torch.cuda.empty_cache()
        eager = next((x["tok_s"] for x in out if x["variant"] == f"eager{batch}"), None)
        if eager:
            r["vs_eager"] = r["tok_s"] / eager
        out.append(r)
        res["variants"][v] = r
        print({k: v for k, v in r.items() if k != "profile"}, flush=True)
        save()
    print(table(out, ["variant", "tok_s", "vs_eager", "check_passed", "worst_of_tolerance", "first_call_s", "wall_s",
                      "peak_GB"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["qwen3-8b", "smollm2"], default="qwen3-8b")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--chats", type=int, default=600, help="synthetic chats (~900 tokens mean, log-normal)")
    ap.add_argument("--batch-rows", type=int, default=4)
    ap.add_argument("--codec", default="zstd")
    ap.add_argument("--shm-dir", default="/dev/shm/dflash-bench-extract")
    ap.add_argument("--disk-dir", default=None, help="a directory on the machine's disk (skipped if not given)")
    ap.add_argument("--peer-rows", type=int, default=32, help="rows for the torch.save comparison")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: forward,compiled,shm,disk,peer")
    ap.add_argument("--compile-modes", default="off,on", help="end-to-end runs with these --compile values")
    ap.add_argument("--forward-modes", default="causal,flex,flex-capture,sdpa",
                    help="pure eager forwards to time (flex-capture is the one extract runs; the others explain it)")
    ap.add_argument("--hidden-dtypes", default="bf16", help="comma list of stored hidden dtypes for step 2: bf16,fp8,fp4")
    ap.add_argument("--variants", default="",
                    help="only time these compile variants of the pure forward + capture, KIND+ROWS with KIND one of "
                         "eager|default|whole|freeze (e.g. eager4,default4,whole4)")
    ap.add_argument("--profile", action="store_true", help="--variants: split each one's GPU time by kernel category")
    ap.add_argument("--matmul", action="store_true", help="--variants: time the target's linear shapes alone (torch.mm)")
    ap.add_argument("--json")
    a = ap.parse_args()
    parse_variants(a.variants)  # a bad --variants fails before the target is built
    skip = set(filter(None, a.skip.split(",")))
    fmodes = set() if "forward" in skip else set(filter(None, a.forward_modes.split(",")))
    if fmodes - FORWARD_MODES:
        raise SystemExit(f"--forward-modes: unknown {sorted(fmodes - FORWARD_MODES)}; choose from {sorted(FORWARD_MODES)}")

    def save(res: dict) -> None:  # after every measurement: a run cut by a time limit keeps what it measured
        if a.json:
            atomic_json(a.json, res)
    from dflash.core.io import atomic_json
    from dflash.extract.run import ExtractConfig, run_extract
    from dflash.extract.target import PackedTarget
    from dflash.core.layers import default_layer_ids

    shape = QWEN3_8B if a.shape == "qwen3-8b" else SMOLLM2
    os.makedirs(a.shm_dir, exist_ok=True)
    t = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke test of step 2 (--skip forward,peer)
    target = random_target_dir(os.path.join(a.shm_dir, f"target-{a.shape}"), shape, device=dev)
    build_s = time.perf_counter() - t
    data = write_jsonl(os.path.join(a.shm_dir, "chats.jsonl"), synthetic_chats(a.chats, max_tokens=a.seq_len - 96))
    layer_ids = default_layer_ids(shape["num_hidden_layers"])
    res: dict = {"hardware": hardware(), "torch": torch.__version__, "shape": a.shape, "seq_len": a.seq_len,
                 "layer_ids": layer_ids, "target_build_s": build_s}
    rows, docs, plan = packed_rows(target, data, a.seq_len)
    real = int((rows["doc_ids"] > 0).sum())
    res.update(rows=len(plan), real_tokens=real, padding=1 - real / rows["doc_ids"].size)
    print(f"{len(plan)} rows x {a.seq_len}, {real:,} real tokens, padding {100 * res['padding']:.2f}%", flush=True)
    if a.variants:
        pt = PackedTarget(target, layer_ids, device="cuda", dtype=torch.bfloat16, attn="flex")
        run_variants(a, pt, rows, res, lambda: save(res))
        return

    table_rows = []
    if fmodes - {"sdpa"} or "peer" not in skip or "compiled" not in skip:
        pt = PackedTarget(target, layer_ids, device="cuda", dtype=torch.bfloat16, attn="flex")
        for mode, cap in (("causal", False), ("flex", False), ("flex", True)):
            if mode + ("-capture" if cap else "") in fmodes:
                tps = forward_speed(pt, rows, a.batch_rows, mode, cap)
                name = {"causal": "pure forward, plain causal (no document mask)",
                        "flex": "pure forward, flex document mask"}[mode] + (" + capture into GPU buffer" if cap else "")
                table_rows.append({"what": name, "tok_s": tps})
                res[f"forward_{mode}{'_capture' if cap else ''}_tok_s"] = tps
                print(table_rows[-1], flush=True)
                save(res)
        if "compiled" not in skip:
            tps, res["compile_check"] = compiled_speed(pt, rows, a.batch_rows)
            print({"compile_check": res["compile_check"]}, flush=True)
            res["forward_flex_capture_compiled_tok_s"] = tps
            table_rows.append({"what": "pure forward, flex document mask + capture, compiled", "tok_s": tps})
            if "forward_flex_capture_tok_s" in res:  # the forwards' own ratio bounds the end-to-end one
                table_rows[-1]["vs_eager_forward"] = tps / res["forward_flex_capture_tok_s"]
                res["compiled_vs_eager_forward"] = table_rows[-1]["vs_eager_forward"]
            print(table_rows[-1], flush=True)
            save(res)
        if "peer" not in skip:
            peer = peer_torch_save(pt, rows, plan, docs, a.batch_rows, os.path.join(a.shm_dir, "peer"), a.peer_rows)
            res["peer"] = peer
            table_rows.append({"what": "peers: torch.save per sample (/dev/shm)", "tok_s": peer["tok_s"],
                               "bytes_per_token": peer["bytes_per_token"]})
            print(table_rows[-1], flush=True)
            shutil.rmtree(os.path.join(a.shm_dir, "peer"), ignore_errors=True)
        del pt
        torch.cuda.empty_cache()
    if "sdpa" in fmodes:  # the target loaded again only when its SDPA forward is timed
        pt = PackedTarget(target, layer_ids, device="cuda", dtype=torch.bfloat16, attn="sdpa")
        tps = forward_speed(pt, rows, a.batch_rows, "sdpa", False)
        res["forward_sdpa_tok_s"] = tps
        table_rows.append({"what": "pure forward, SDPA 4D document mask", "tok_s": tps})
        print(table_rows[-1], flush=True)
        save(res)
        del pt
        torch.cuda.empty_cache()

    if "shm" not in skip or ("disk" not in skip and a.disk_dir):
        # warm-up: the first extraction in a process compiles the flex kernels (seconds); keep that out
        warm = os.path.join(a.shm_dir, "warmup-cache")
        run_extract(ExtractConfig(target=target, data=data, out=warm, seq_len=a.seq_len, layers=layer_ids,
                                  batch_rows=a.batch_rows, codec=a.codec, max_samples=40, progress=False,
                                  overwrite=True, compile="off", tokenize_cache="off"))
        shutil.rmtree(warm, ignore_errors=True)
    for (where, base), hdt in [(w, d) for d in a.hidden_dtypes.split(",")
                               for w in (("shm", a.shm_dir), ("disk", a.disk_dir))]:
        if where in skip or not base:
            continue
        for comp in a.compile_modes.split(","):
            out = os.path.join(base, "cache")
            shutil.rmtree(out, ignore_errors=True)
            cfg = ExtractConfig(target=target, data=data, out=out, seq_len=a.seq_len, layers=layer_ids,
                                batch_rows=a.batch_rows, codec=a.codec, writer_threads=12, progress=False,
                                hidden_dtype=hdt, compile=comp, tokenize_cache="off")
            s = run_extract(cfg)
            size = dir_bytes(out)
            r = {"what": f"dflash extract end to end -> {'/dev/shm' if where == 'shm' else 'disk'} ({a.codec}, {hdt}), "
                         f"--compile {comp}" + ("" if comp == "off" or s["compile"]["compiled"] else " (fell back: eager)"),
                 "tok_s": s["tokens_per_s_this_rank"], "bytes_per_token": size / real,
                 "write_GB_s": s["bytes_written_this_rank"] / s["elapsed_s"] / 1e9, "elapsed_s": s["elapsed_s"],
                 "compile_s": s["compile"].get("seconds", 0.0), "tail_s": s["tail_s"],
                 # without the fixed tail (the last shard's encoding and write after the last forward), which
                 # weighs more in a short job than in a real one
                 "tok_s_before_tail": s["tokens_this_rank"] / max(1e-9, s["elapsed_s"] - s["tail_s"])}
            if "forward_flex_tok_s" in res:
                r["vs_pure_forward"] = r["tok_s"] / res["forward_flex_tok_s"]
            key = f"extract_{where}" + ("" if hdt == "bf16" else f"_{hdt}")
            off = res.get(f"{key}_off")
            if off:
                r["vs_compile_off"] = r["tok_s"] / off["tok_s"]
            res[f"{key}_{comp}"] = {**r, "compile_report": s["compile"]}
            res.setdefault("e2e_runs", []).append(r)  # every run in order (a repeated mode keeps all)
            table_rows.append(r)
            print(r, flush=True)
            save(res)
            shutil.rmtree(out, ignore_errors=True)

    print(f"\nhardware: {res['hardware']}, torch {res['torch']}; {a.shape}-shaped random target, T={a.seq_len}, "
          f"K={len(layer_ids)} layers {layer_ids}, {res['rows']} rows, {real:,} real tokens")
    print(table(table_rows, ["what", "tok_s", "vs_eager_forward", "vs_pure_forward", "vs_compile_off", "bytes_per_token",
                             "write_GB_s", "elapsed_s", "compile_s", "tail_s", "tok_s_before_tail"]))
    save(res)


if __name__ == "__main__":
    main()
