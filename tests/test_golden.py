"""A golden loss curve (torchtitan keeps these): `configs/tiny.yaml`, a fixed seed, the first 50 losses.

A refactor of the model, the loss, the sampler or the trainer that changes what a run computes moves this
curve; one that does not leaves it where tests/golden/tiny_losses.json holds it. The run: the tiny Qwen3
target of tests/tiny.py (seed 0), 40 synthetic conversations (chat_rows(40, seed=3)), `dflash extract
--config tiny` then `dflash train --config tiny --log-every 1` (float32, eager, CPU), every setting from
the preset. Regenerate the file only when a change is meant to move the curve, and say so in the commit:

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m tests.test_golden

Tolerance: 1e-4 relative per step. The same machine reproduces the curve bit for bit; other CPUs and torch
builds sum in other orders (float32, ~1e-7 relative per op) and Adam carries that through 50 steps at
lr 1e-3 (measured here: 1 and 2 intra-op threads give identical curves). A behavioural
change moves a loss by more (measured: block positions shifted by one, 1e-4 relative at step 3; no
warm-up, 4e-3 at step 2).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_losses.json"
RTOL = 1e-4


def tiny_losses(root: Path) -> list[float]:
    from click.testing import CliRunner

    from dflash.cli import main as cli_main
    from tests.tiny import chat_rows, make_tiny_target, write_jsonl

    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "chat.jsonl", chat_rows(40, seed=3))
    run = CliRunner().invoke
    r = run(cli_main, ["extract", "--config", "tiny", "--target", target, "--data", data, "--out", str(root / "cache"),
                       "--no-progress"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = run(cli_main, ["train", "--config", "tiny", "--target", target, "--cache", str(root / "cache"),
                       "--out", str(root / "run"), "--log-every", "1", "--no-progress"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    recs = [json.loads(ln) for ln in (root / "run" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [x["step"] for x in recs] == list(range(1, len(recs) + 1))
    return [x["loss"] for x in recs]


def test_tiny_preset_follows_its_golden_loss_curve(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    got = tiny_losses(tmp_path)
    want = golden["losses"]
    assert len(got) == len(want) == 50
    for step, (g, w) in enumerate(zip(got, want), 1):
        assert g == pytest.approx(w, rel=RTOL), f"step {step}: loss {g!r}, golden {w!r}"


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        losses = tiny_losses(Path(d))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"what": "dflash train --config tiny (see tests/test_golden.py), loss per step",
                                  "torch": torch.__version__, "losses": losses}, indent=1) + "\n")
    print(f"wrote {len(losses)} losses to {GOLDEN}", file=sys.stderr)
