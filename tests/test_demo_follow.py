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


def test_a_recipe_on_a_basis_extracts_both_caches_on_one_fitted_on_the_training_answers(tmp_path, capsys):
    """extract: basis_rank in the preset: the validation cache (extracted first, for the trainer that follows the main
    extraction) and the main cache are both on the basis of cache-basis/, fitted on samples spread over the
    regenerated training answers, so that the trainer takes the one as the other's --val-cache; the drafter it writes
    has the composed fc (K*H inputs); a rerun resumes every cache, the basis's too. Without the shared basis the two
    caches fit their own and train refuses them (basis.digest)."""
    import dflash_cache
    from dflash.recipes import gpu_stages

    target = make_tiny_target(tmp_path / "target")
    preset = tmp_path / "tiny-basis.yaml"
    preset.write_text(TINY_RECIPE.replace("recipe:\n", "recipe:\n  follow: true\n")
                      .replace("extract:\n", "extract:\n  basis_rank: 12\n  basis_fit_tokens: 512\n"))
    work = tmp_path / "w"
    s = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False, target=str(target))
    out = capsys.readouterr().out
    caches = {n: dflash_cache.open(str(work / n)) for n in ("cache-basis", "cache-valid", "cache")}
    recs = {n: c.metadata["basis"] for n, c in caches.items()}
    assert {r["rank"] for r in recs.values()} == {12} and len({r["digest"] for r in recs.values()}) == 1
    assert all(c.complete for c in caches.values())
    fit = (work / "data" / "basis-fit.jsonl").read_text().splitlines()
    regen = [x for f in sorted((work / "regenerated" / "data").glob("part-*.jsonl")) for x in f.read_text().splitlines()]
    assert fit == regen and s["data"]["train_samples"] == len(regen)  # fewer than BASIS_SAMPLES: every one
    assert f"fitted on {len(regen)} of the {len(regen)} regenerated samples (one in 1)" in out
    assert out.index("[3/7] regenerate") < out.index("the caches' basis") < out.index("[4/7] validation data")
    fc = load_file(str(work / "run" / "final" / "model.safetensors"))["fc.weight"]
    assert fc.shape[1] == 3 * 64  # composed: K * H inputs, as a drafter trained on the features themselves
    assert s["eval"]["float32"]["identical"] == "3/3" and s["train"]["steps"] == 6
    # a rerun of the stages resumes every cache: no cache file changes
    files = {f: f.stat().st_mtime_ns for n in caches for f in (work / n).rglob("*") if f.is_file()}
    (work / "run" / "eval-float32.json").unlink()
    again = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False, target=str(target))
    assert again["eval"]["float32"]["identical"] == "3/3"
    assert {f: f.stat().st_mtime_ns for n in caches for f in (work / n).rglob("*") if f.is_file()} == files
    # the basis is the recipe's to set: a preset naming basis_from is one error naming it
    bad = tmp_path / "bad.yaml"
    bad.write_text(preset.read_text().replace("extract:\n", "extract:\n  basis_from: elsewhere\n"))
    with pytest.raises(ConfigError, match="basis_from"):
        gpu_stages.shared_basis(str(work), str(bad), str(target), str(work / "regenerated"), "cpu", False, {})
