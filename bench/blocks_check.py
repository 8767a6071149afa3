"""Does torch.compile build the training blocks (anchors, labels, positions) as eager PyTorch does?

    python bench/blocks_check.py                     # on the GPU, rows of 512 ... 8192 tokens
    python bench/blocks_check.py --device cpu --lengths 256,512

For packed rows shaped like the cache's (bench/train.py's synthetic rows), each piece of train.blocks'
make_blocks is run eagerly and compiled (inductor generating its code), and every output compared element by
element: the whole make_blocks, document_positions (a cummax over the row), cummax alone, topk, and sort. Also
make_blocks_opaque compiled, the form the training step uses (one opaque op whose kernels inductor leaves
alone). A piece is right when nothing differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dflash.train.blocks as M  # noqa: E402
from bench.common import hardware  # noqa: E402
from bench.train import synthetic_rows  # noqa: E402


def differ(a, b) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return -1
    return int((a != b).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default="512,1024,2048,3072,4096,8192")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = a.device
    res = {"hardware": hardware(), "torch": torch.__version__, "device": dev, "lengths": {}}
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    for T in [int(x) for x in a.lengths.split(",")]:
        N = T // 6  # 512 anchors at 3072 tokens, as the Qwen3-8B training shape
        ids, lm, doc, _ = synthetic_rows(a.rows, T, 8, 151936, rng, g)
        ids = torch.from_numpy(ids).long().to(dev)
        lm, doc = torch.from_numpy(lm).to(dev), torch.from_numpy(doc).long().to(dev)
        scores = torch.rand(a.rows, T, generator=g).to(dev)
        args = (ids, lm, doc, scores, N, a.block, 151935)
        r = {}
        e = M.make_blocks(*args)
        for name, fn in (("make_blocks", M.make_blocks), ("make_blocks_opaque", M.make_blocks_opaque)):
            c = torch.compile(fn, dynamic=False, fullgraph=True)(*args)
            r[name] = {f.name: differ(getattr(c, f.name), getattr(e, f.name)) for f in fields(M.Blocks)}
        r["document_positions"] = differ(torch.compile(M.document_positions, dynamic=False)(doc),
                                         M.document_positions(doc))
        idx = torch.arange(T, device=dev).expand(a.rows, T)
        x = torch.where(torch.rand(a.rows, T, generator=g).to(dev) < 0.01, idx, torch.zeros_like(idx))

        def cm(x):
            return torch.cummax(x, dim=1).values

        r["cummax"] = differ(torch.compile(cm, dynamic=False)(x), cm(x))

        def tk(s):
            return s.topk(N, dim=1).indices

        r["topk"] = differ(torch.compile(tk, dynamic=False)(scores), tk(scores))
        top = tk(scores)

        def so(t):
            return t.sort(dim=1).values

        r["sort"] = differ(torch.compile(so, dynamic=False)(top), so(top))
        res["lengths"][T] = r
        torch._dynamo.reset()
        print(T, json.dumps(r), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
