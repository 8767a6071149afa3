"""The extraction target's pure forward + capture under torch.compile variants (issue 17: what lifts the compiled
forward past 1.12x eager?).

    python bench/extract_variants.py                                  # eager4,default4,freeze4 on one GPU
    python bench/extract_variants.py --variants eager8,freeze8 --chats 300 --json v.json

A variant is KIND + batch rows: eager (PackedTarget.run), default (extract/compiled.py's CompiledTarget as
`dflash extract` runs it), freeze (the same with inductor's `freezing`: weights become constants, so inductor may
fold them and fuse the linear layers that share an input, q/k/v and gate/up, into one matmul each). Each compiled
variant is checked on the first batch against eager and a float32 reference (extract/compiled.py's check) and then
timed over every batch of the rows (bench/extract.py's forward_speed: inputs already on the device, one warm-up
batch, synchronised timers). The Qwen3-8B-shaped target is random (speed does not depend on the weights) and
built once in --dir.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import QWEN3_8B, hardware, random_target_dir, synthetic_chats, table, write_jsonl  # noqa: E402
from bench.extract import compiled_speed, forward_speed, packed_rows  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="eager4,default4,freeze4", help="comma list of KIND+ROWS: eager|default|freeze")
    ap.add_argument("--chats", type=int, default=300, help="synthetic chats (~900 tokens mean, log-normal)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--dir", default="/dev/shm/dflash-bench-variants", help="where the random target is built")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch._inductor.config as inductor_config

    from dflash.core.layers import default_layer_ids
    from dflash.extract.target import PackedTarget

    os.makedirs(a.dir, exist_ok=True)
    target = random_target_dir(os.path.join(a.dir, "target"), QWEN3_8B, device="cuda")
    data = write_jsonl(os.path.join(a.dir, "chats.jsonl"), synthetic_chats(a.chats, max_tokens=a.seq_len - 96))
    rows, _, plan = packed_rows(target, data, a.seq_len)
    pt = PackedTarget(target, default_layer_ids(QWEN3_8B["num_hidden_layers"]), device="cuda", dtype=torch.bfloat16,
                      attn="flex")
    res: dict = {"hardware": hardware(), "torch": torch.__version__, "rows": len(plan), "variants": {}}
    out = []
    for v in a.variants.split(","):
        kind, batch = v.rstrip("0123456789"), int(v[len(v.rstrip("0123456789")):] or 4)
        if kind not in ("eager", "default", "freeze"):
            raise SystemExit(f"--variants: {v!r}: the kind must be eager, default or freeze")
        t0 = time.perf_counter()
        r: dict = {"variant": v}
        if kind == "eager":
            r["tok_s"] = forward_speed(pt, rows, batch, "flex", True)
        else:
            torch._dynamo.reset()
            inductor_config.freezing = kind == "freeze"
            tok_s, chk = compiled_speed(pt, rows, batch)
            r.update(tok_s=tok_s, check_passed=chk["passed"], first_call_s=chk["first_call_s"],
                     worst_of_tolerance=max(c / t for c, t in zip(chk["err_compiled_vs_ref"], chk["tolerance"])))
        r.update(wall_s=time.perf_counter() - t0, peak_GB=torch.cuda.max_memory_allocated() / 1e9)
        torch.cuda.empty_cache()
        eager = next((x["tok_s"] for x in out if x["variant"] == f"eager{batch}"), None)
        if eager:
            r["vs_eager"] = r["tok_s"] / eager
        out.append(r)
        res["variants"][v] = r
        print(r, flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
    print(table(out, ["variant", "tok_s", "vs_eager", "check_passed", "worst_of_tolerance", "first_call_s", "wall_s",
                      "peak_GB"]))


if __name__ == "__main__":
    main()
