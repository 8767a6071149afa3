"""The GPU recipe's `follow`: the trainer runs as a child `dflash train --follow` beside the main extraction (the
validation data made first), and the demo's result is the run it would have trained one stage after the other.

The bit-for-bit equality of a followed run and a run over the finished cache is tests/test_follow.py's (real
separate processes, one thread each); here the recipe's plumbing: the child's command line, its output forwarded
behind `[train] `, the summary's `follow` record, the same drafter as the sequential recipe's (to float32 rounding:
the two runs use the machine's threads), and a failing child named in one error line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash.core.config import ConfigError
from dflash.recipes.gpu import run_gpu_demo
from dflash.recipes.gpu_stages import FollowingTrainer, follower_args
from tests.test_demo_gpu_recipe import TINY_RECIPE
from tests.tiny import make_tiny_target


def test_the_follow_recipe_trains_beside_the_extraction_as_the_sequential_one_does(tmp_path, capsys):
    target = make_tiny_target(tmp_path / "target")
    runs = {}
    for follow in (False, True):
        preset = tmp_path / f"tiny-{follow}.yaml"
        preset.write_text(TINY_RECIPE.replace("recipe:\n", f"recipe:\n  follow: {str(follow).lower()}\n"))
        work = tmp_path / f"w-{follow}"
        s = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False, target=str(target))
        runs[follow] = (s, work, capsys.readouterr().out)
    (seq, seq_work, _), (fol, fol_work, out) = runs[False], runs[True]
    assert seq["follow"] is None
    assert fol["follow"]["trainer_wall_s"] > 0 and fol["follow"]["extract_s"] > 0
    assert "[train] train: drafter" in out  # the child's lines, forwarded
    assert out.index("[4/7] validation data") < out.index("[5/7] extract") < out.index("[train] train: drafter")
    # the child trained the run the in-process trainer then found finished: same steps, same losses, same weights
    m_seq = [json.loads(x) for x in (seq_work / "run" / "metrics.jsonl").read_text().splitlines()]
    m_fol = [json.loads(x) for x in (fol_work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in m_seq] == [m["step"] for m in m_fol] and m_fol
    losses = [(a["loss"], b["loss"]) for a, b in zip(m_seq, m_fol) if "loss" in a]
    assert losses and all(a == pytest.approx(b, rel=1e-4) for a, b in losses)
    w_seq = load_file(str(seq_work / "run" / "final" / "model.safetensors"))
    w_fol = load_file(str(fol_work / "run" / "final" / "model.safetensors"))
    assert w_seq.keys() == w_fol.keys()
    for k in w_seq:
        torch.testing.assert_close(w_fol[k].float(), w_seq[k].float(), rtol=2e-2, atol=2e-3)
    assert fol["eval"]["float32"]["identical"] == seq["eval"]["float32"]["identical"]


def test_follower_command_line_and_a_failing_follower(tmp_path):
    args = follower_args("T", "C", "V", "R", "demo-gpu", "cuda:0", {"max_steps": 5, "drafter_layers": 2})
    assert args[:9] == ["--config", "demo-gpu", "--target", "T", "--cache", "C", "--out", "R", "--follow"]
    assert args[args.index("--val-cache") + 1] == "V" and args[args.index("--device") + 1] == "cuda:0"
    assert args[-4:] == ["--max-steps", "5", "--drafter-layers", "2"]
    assert "--device" not in follower_args("T", "C", None, "R", "p", "auto", None)
    # a trainer that cannot start (no such cache, no extraction) fails: one error, the way to resume named
    f = FollowingTrainer(["--cache", str(tmp_path / "none"), "--target", str(tmp_path / "none"),
                          "--out", str(tmp_path / "run"), "--follow"])
    with pytest.raises(ConfigError, match="rerun the same `dflash demo`"):
        f.wait()
