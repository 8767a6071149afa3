"""A tiny target and a cache whose every row can host several training blocks, for the tests that compare
runs of different shapes (tests/test_ddp.py, tests/test_accum.py).

Those tests compare a run split over ranks or micro-batches with one process holding the whole batch. Each
micro-batch's loss is normalised by its own supervised weight, so the split and the whole agree only when
every micro-batch carries the same weight. With blocks of 2 (one label per block, always valid for a
valid anchor) and every row holding at least NUM_ANCHORS valid anchors, each row weighs exactly
NUM_ANCHORS * w_1: the comparison is then exact in real arithmetic, and only float32 rounding remains.

    make_workload(root) -> {"target", "cache", "rows", "min_valid_anchors"}
    hf_greedy(model, prompt, max_new, eos) -> token ids   # the independent greedy reference of the eval tests
    slowed_steps(seconds) -> Python source    # a child process's training steps slowed, for kills between steps
"""

from __future__ import annotations

import random
from pathlib import Path

from click.testing import CliRunner

import dflash_cache
from dflash.cli import main as cli_main
from tests.tiny import _text, make_tiny_target, write_jsonl

SEQ = 128
NUM_ANCHORS = 6
# one label per block: every block of a valid anchor has weight w_1, whatever the anchor. Attention through
# dense SDPA: these runs compare batch compositions, not attention kernels. The CPU default (--attn split,
# train/drafter/attention.py, equal to SDPA in tests/test_attention.py) groups its float32 sums per row and chunk,
# which after four AdamW steps moves weights by ~3e-5 between batch shapes, above the tolerance derived here.
PAIRED = ["--drafter-layers", "1", "--block-size", "2", "--num-anchors", str(NUM_ANCHORS), "--lr", "3e-3",
          "--attn", "sdpa", "--log-every", "1", "--seed", "1", "--no-progress"]


def long_answers(n: int, seed: int) -> list[dict]:
    """Short questions, answers long enough that every packed row has many supervised pairs."""
    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": _text(rng, 2, 5)},
                          {"role": "assistant", "content": _text(rng, 6, 12)}]} for _ in range(n)]


def valid_anchor_counts(cache) -> list[int]:
    """Per row: positions t with t and t+1 supervised and in the same real document (make_blocks' rule)."""
    out = []
    for i in range(len(cache)):
        r = cache[i]
        lm, d = r["loss_mask"].bool(), r["doc_ids"]
        out.append(int((lm[:-1] & lm[1:] & (d[:-1] == d[1:]) & (d[:-1] > 0)).sum()))
    return out


def make_workload(root: Path) -> dict:
    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "chat.jsonl", long_answers(48, seed=5))
    cache = root / "cache"
    r = CliRunner().invoke(cli_main, ["extract", "--target", target, "--data", data, "--out", str(cache),
                                      "--seq-len", str(SEQ), "--rows-per-shard", "8", "--no-progress"])
    assert r.exit_code == 0, r.output
    c = dflash_cache.open(str(cache))
    counts = valid_anchor_counts(c)
    return {"target": target, "cache": cache, "rows": len(c), "min_valid_anchors": min(counts)}


def hf_greedy(model, prompt: list[int], max_new: int, eos: set[int] = frozenset()) -> list[int]:
    """Greedy decoding straight over the HF model, recomputing the whole sequence at every token: no KV
    cache, no dflash wrapper, nothing shared with train/evaluate/decode.py or verify.py. Stops after an eos id or max_new tokens."""
    import torch

    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_new):
            t = int(model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t in eos:
                break
    return out


def slowed_steps(seconds: float) -> str:
    """Python source that slows every training micro-step by `seconds` (Trainer.anchor_scores wrapped, the numerics
    untouched): the start of a child process's script, so that a SIGKILL lands between two steps."""
    return f"""
import sys, time
import dflash.train.fit.trainer as t
_scores = t.Trainer.anchor_scores
def slow(self, *a):
    time.sleep({seconds})
    return _scores(self, *a)
t.Trainer.anchor_scores = slow
"""
