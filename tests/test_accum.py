"""Gradient accumulation is the training of one big batch: accum 2 x batch b = accum 1 x batch 2b.

A run that forgets to divide the accumulated gradient by grad_accum trains with a gradient grad_accum
times too large: clipped at --grad-clip 1.0 it is a silently different run, and the logged gradient norm
is wrong. Resume equality (tests/test_train.py) cannot see it. Here two in-process `dflash train` runs
see the same rows (micro-batch a of a step is the a-th slice of the step's global batch, Cache.epoch_order)
and the same anchors (Trainer.anchor_scores draws per global slot of the step), in float32 with clipping
out of the way (--grad-clip 1e9), and must agree step by step: logged loss, expected tau and gradient
norm, and the weights after 4 steps.

AdamW's update is invariant to a constant gradient scale (m / sqrt(v)), so the weights alone would not
catch a missing 1/accum: the logged gradient norm (of the gradient the optimizer is given) does.

Tolerance: as in tests/test_ddp.py (every micro-batch carries the same weight, tests/workload.py, so
both are equal in real arithmetic; only the grouping of float32 sums differs, ~1e-7 relative measured):
1e-5 relative on logged values, 1e-4 absolute on weights. AdamW divides each entry's update by its own gradient
scale, so an entry whose gradient is itself at rounding level passes its rounding on at full size: measured
(2026-12-03) 4.5e-5 on fc.weight (its columns for near-silent hidden channels), at most 2.6e-6 on every other
tensor, losses within 1.6e-7 and gradient norms within 3.3e-7 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash.cli import main as cli_main
from tests.workload import PAIRED, make_workload

STEPS = 4
RTOL = 1e-5
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = make_workload(tmp_path_factory.mktemp("accum"))
    assert w["rows"] >= STEPS * 4, w  # no filler rows in the steps compared
    return w


def run(w, out: Path, batch_rows: int, accum: int) -> list[dict]:
    r = CliRunner().invoke(cli_main, ["train", "--cache", str(w["cache"]), "--target", w["target"], "--out", str(out),
                                      *PAIRED, "--batch-rows", str(batch_rows), "--grad-accum", str(accum),
                                      "--grad-clip", "1e9", "--max-steps", str(STEPS), "--save-every", str(STEPS)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def test_accumulating_two_micro_batches_is_one_batch_of_both(work, tmp_path):
    acc, one = tmp_path / "accum", tmp_path / "one"
    ra, ro = run(work, acc, batch_rows=2, accum=2), run(work, one, batch_rows=4, accum=1)
    assert [x["step"] for x in ra] == [x["step"] for x in ro] == list(range(1, STEPS + 1))
    for a, b in zip(ra, ro):
        for k in ("loss", "tau_expected", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=RTOL), (a["step"], k, a[k], b[k])
    wa = load_file(str(acc / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors"))
    wo = load_file(str(one / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors"))
    worst = max(float((wa[k] - wo[k]).abs().max()) for k in wo)
    assert worst <= WEIGHT_ATOL, worst
    assert ro[0]["loss"] != ro[-1]["loss"]  # it trained
