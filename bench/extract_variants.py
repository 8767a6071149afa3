"""The extraction target's pure forward + capture under torch.compile variants (issue 17: where the compiled
forward's time goes, and what lifts it).

    python bench/extract_variants.py                                  # eager4,default4,whole4 on one GPU
    python bench/extract_variants.py --variants eager4,default4 --profile --matmul --json v.json

A variant is KIND + batch rows: eager (PackedTarget.run), default (extract/compiled.py's CompiledTarget as
`dflash extract` runs it: attention outside the graph), whole (one graph for the whole model, flex attention
inside it: inductor folds the q/k norms and rotary embedding into the flex kernel), freeze (the default with
inductor's `freezing`: weights become constants, so inductor may fold them and fuse the linear layers that share
an input, q/k/v and gate/up, into one matmul each). Each compiled variant is checked on the first batch against
eager and a float32 reference (extract/compiled.py's check) and then timed over every batch of the rows
(bench/extract.py's forward_speed: inputs already on the device, one warm-up batch, synchronised timers). The
Qwen3-8B-shaped target is random (speed does not depend on the weights) and built once in --dir.

--profile runs torch.profiler over two more batches of each variant and splits the GPU time into matmuls,
attention (flex), the other fused kernels, copies and the rest; with the target's linear FLOPs this gives the
matmuls' own rate. --matmul times each linear layer's shape alone (torch.mm, bf16, M = rows x seq_len): the
chip's rate on exactly these matmuls, so what the forward leaves on the table is measured, not assumed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import (QWEN3_8B, hardware, kernel_summary, random_target_dir, synthetic_chats, table,  # noqa: E402
                          write_jsonl)
from bench.extract import compiled_speed, device_batch, forward_speed, packed_rows  # noqa: E402


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="eager4,default4,whole4",
                    help="comma list of KIND+ROWS: eager|default|whole|freeze")
    ap.add_argument("--chats", type=int, default=300, help="synthetic chats (~900 tokens mean, log-normal)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--dir", default="/dev/shm/dflash-bench-variants", help="where the random target is built")
    ap.add_argument("--profile", action="store_true", help="split each variant's GPU time by kernel category")
    ap.add_argument("--matmul", action="store_true", help="time the target's linear shapes alone (torch.mm)")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch._inductor.config as inductor_config

    from dflash.core.io import atomic_json

    from dflash.core.layers import default_layer_ids
    from dflash.extract.target import PackedTarget

    os.makedirs(a.dir, exist_ok=True)
    target = random_target_dir(os.path.join(a.dir, "target"), QWEN3_8B, device="cuda")
    data = write_jsonl(os.path.join(a.dir, "chats.jsonl"), synthetic_chats(a.chats, max_tokens=a.seq_len - 96))
    rows, _, plan = packed_rows(target, data, a.seq_len)
    pt = PackedTarget(target, default_layer_ids(QWEN3_8B["num_hidden_layers"]), device="cuda", dtype=torch.bfloat16,
                      attn="flex")
    res: dict = {"hardware": hardware(), "torch": torch.__version__, "rows": len(plan), "variants": {}}
    flops_tok = linear_flops_per_row_token(pt.model)
    res["linear_GFLOP_per_token"] = flops_tok / 1e9

    def save():
        if a.json:
            atomic_json(a.json, res)

    variants = []  # (name, kind, batch rows)
    for v in a.variants.split(","):
        kind = v.rstrip("0123456789")
        if kind not in ("eager", "default", "whole", "freeze"):
            raise SystemExit(f"--variants: {v!r}: the kind must be eager, default, whole or freeze")
        variants.append((v, kind, int(v[len(kind):] or 4)))
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


if __name__ == "__main__":
    main()
