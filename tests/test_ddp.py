"""Data parallel training is the training of one big batch: real torchrun, 2 CPU processes over gloo.

What a user pays for when DDP breaks is a drafter trained on half its data (a gradient all-reduce that
went missing: each rank drifts on its own rows), or a dashboard that shows one rank's loss (a metrics
all-reduce that went missing). The torchrun smoke test in tests/test_train.py passes either way; these
tests do not:

    two ranks hold identical weights after N steps (every parameter, bit for bit: they apply the same
        averaged gradient to the same weights);
    two ranks with batch b follow one process with batch 2b, step by step: the same logged loss and
        gradient norm, and the same weights after N steps, within float32 rounding (derivation below).
        The reader gives rank r the r-th slice of the global batch (Cache.epoch_order) and a row's anchors
        depend on its slot in the step's global batch (Trainer.anchor_scores), so both see the same rows and
        the same anchors;
    a two-rank run killed after a checkpoint and rerun under torchrun ends bit for bit where the
        uninterrupted two-rank run ends.

Tolerance. Both runs compute in float32 on CPU; only the grouping of sums differs (each rank sums over its
b rows and the all-reduce averages the two partial means; one process sums over 2b rows). Every micro-batch
carries the same weight (tests/workload.py), so the two agree exactly in real arithmetic. A reassociated
float32 sum of n terms moves by ~sqrt(n) * 2^-24 relative (at most n * 2^-24): for the loss n = 24 labelled
slots, for a gradient entry a few hundred products, so ~1e-6 relative at most. AdamW's update
lr * m / (sqrt(v) + eps) passes a relative gradient error on at the same relative size, times lr = 3e-3 per
step, so after 4 steps the weights (entries up to ~1) differ by ~4 * 3e-3 * 1e-6 ~ 1e-8, plus the float32
rounding of the weights themselves (~1e-7). Measured: losses and gradient norms within 9e-8 relative,
weights within 2.4e-7. Allowed: 1e-5 relative on the logged loss, gradient norm and expected tau, 1e-4
absolute on the weights: AdamW divides each entry's update by its own gradient scale, so an entry whose gradient
is itself at rounding level passes that rounding on at full size (measured 2026-12-03: 4.4e-5 on fc.weight's
columns for near-silent hidden channels, every other tensor within a few 1e-6); both far below what either
missing all-reduce causes (measured: without the gradient all-reduce the ranks' weights differ after one step; without the
metrics all-reduce the logged step-1 loss is rank 0's, 5e-3 relative away).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash.cli import main as cli_main
from tests.workload import PAIRED, make_workload

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
STEPS = 4
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-4

# `dflash train` whose every rank also writes the weights it ends with to RUN/rank<r>.safetensors
DUMPING = """
import os, sys
from safetensors.torch import save_file
import dflash.train.fit.trainer as t
_train = t.Trainer.train
def train(self):
    out = _train(self)
    save_file({k: v.detach().contiguous() for k, v in self.model.state_dict().items()},
              os.path.join(self.cfg.out, f"rank{self.dist.rank}.safetensors"))
    return out
t.Trainer.train = train
from dflash.cli import main
sys.argv = ["dflash", *sys.argv[1:]]
main()
"""


def _env() -> dict:
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WANDB_MODE", "WANDB_PROJECT"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = make_workload(tmp_path_factory.mktemp("ddp"))
    assert w["rows"] >= STEPS * 4, w  # every step's global batch of 4 rows is real (no filler rows)
    return w


def args(w, out: Path, batch_rows: int) -> list[str]:
    return ["train", "--cache", str(w["cache"]), "--target", w["target"], "--out", str(out), *PAIRED,
            "--batch-rows", str(batch_rows), "--max-steps", str(STEPS), "--save-every", "2"]


def torchrun(w, out: Path, batch_rows: int) -> None:
    script = out.parent / "dumping_train.py"
    script.write_text(DUMPING)
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
                        *args(w, out, batch_rows)], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"


def records(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def assert_weights_close(a: dict, b: dict, atol: float, what: str) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, f"{what}: weights differ by up to {worst:.3g} (allowed {atol:g})"


@pytest.fixture(scope="module")
def ddp(work, tmp_path_factory):
    """The two-rank run (torchrun, batch 2 per rank), shared by the tests below."""
    run = tmp_path_factory.mktemp("ddp_run") / "ddp"
    torchrun(work, run, batch_rows=2)
    assert json.loads((run / "run.json").read_text())["config"]["world"] == 2
    return run


def test_two_ranks_hold_one_set_of_weights_and_follow_one_process_with_the_global_batch(work, ddp, tmp_path):
    one = tmp_path / "one"
    r = CliRunner().invoke(cli_main, args(work, one, batch_rows=4), catch_exceptions=False)
    assert r.exit_code == 0, r.output

    # 1. the ranks hold the same weights, bit for bit
    w0, w1 = load_file(str(ddp / "rank0.safetensors")), load_file(str(ddp / "rank1.safetensors"))
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "ranks diverged: the gradients were not averaged"
    at_step_2 = load_file(str(ddp / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert any(not torch.equal(w0[k], at_step_2[k]) for k in w0)  # the weights moved: it trained

    # 2. two ranks x batch 2 follow one process x batch 4, step by step
    rd, ro = records(ddp), records(one)
    assert [x["step"] for x in rd] == [x["step"] for x in ro] == list(range(1, STEPS + 1))
    for a, b in zip(rd, ro):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=LOSS_RTOL), (a["step"], a["grad_norm"], b["grad_norm"])
        assert a["tau_expected"] == pytest.approx(b["tau_expected"], rel=LOSS_RTOL)
    final_one = load_file(str(one / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors"))
    assert_weights_close(w0, final_one, WEIGHT_ATOL, "2 ranks x batch 2 vs 1 process x batch 4")


def test_a_two_rank_run_resumed_under_torchrun_ends_where_the_uninterrupted_one_ends(work, ddp, tmp_path):
    # killed after the step-2 checkpoint (as a crash would leave it), rerun under torchrun: bit-exact
    cut = tmp_path / "cut"
    shutil.copytree(ddp, cut)
    for p in ("final", "summary.json", "rank0.safetensors", "rank1.safetensors", f"checkpoints/step_{STEPS:08d}"):
        shutil.rmtree(cut / p) if (cut / p).is_dir() else (cut / p).unlink()
    (cut / "checkpoints" / "latest").write_text("step_00000002")
    torchrun(work, cut, batch_rows=2)
    assert [x["step"] for x in records(cut)] == list(range(1, STEPS + 1))
    assert [x["loss"] for x in records(cut)] == [x["loss"] for x in records(ddp)]
    assert json.loads((cut / "summary.json").read_text())["steps_this_run"] == STEPS - 2
    w0 = load_file(str(ddp / "rank0.safetensors"))
    c0, c1 = load_file(str(cut / "rank0.safetensors")), load_file(str(cut / "rank1.safetensors"))
    assert all(torch.equal(c0[k], w0[k]) and torch.equal(c1[k], w0[k]) for k in w0)


def test_rank_r_reads_the_r_th_slice_of_the_global_batch(work):
    """The reader's side of the comparison above (and of tests/test_accum.py): with world ranks x batch b, rank
    r's rows of step s are rows [r*b, (r+1)*b) of one process's step s with batch world*b; with
    accumulation, micro-batch a of a step is slice a. Checked over two epochs (other permutations)."""
    import dflash_cache

    cache = dflash_cache.open(str(work["cache"]))
    for epoch in (0, 1):
        whole, whole_valid = cache.epoch_order(4, 0, 1, epoch, seed=1)
        assert whole_valid.all()
        for r in (0, 1):
            part, _ = cache.epoch_order(2, r, 2, epoch, seed=1)
            assert (part == whole[:, 2 * r:2 * r + 2]).all(), (epoch, r)
        micro, _ = cache.epoch_order(2, 0, 1, epoch, seed=1)
        assert (micro.reshape(-1, 2, 2) == whole.reshape(-1, 2, 2)).all()
