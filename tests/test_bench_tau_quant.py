"""bench/tau_quant.py --recipe-workdir: tau from an fp8 cache over seeds against caches on a basis, from a GPU
recipe's own workdir (its target, regenerated answers, eval prompts and validation answers) with its preset's
settings: the command BENCHMARKS.md "Cache size" names for the GPU recipe, run here on a tiny recipe on CPU.

  * --prepare makes the recipe's data and caches first (no training); without it a workdir lacking them is one
    error naming --prepare.
  * The base kind trains from the recipe's own W/cache and W/cache-valid when W/cache is a complete cache in its
    hidden dtype and not on a basis; a cache of another dtype, on a basis or not complete is not reused.
  * A basisR cache is on a basis fitted as the recipe fits its own: on the regenerated samples spread over the
    answers (gpu_stages.shared_basis), WORKDIR/cache-basisR-fit, the main and validation caches on its basis.
  * Each kind's cache is made just before its first run; the runs go base seed 0, the first other kind, the base's
    other seeds, the other kinds; the table keeps kind then seed; a rerun redoes nothing.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from bench import tau_quant
from tests.test_demo_gpu_recipe import TINY_RECIPE
from tests.tiny import make_tiny_target


def tiny_recipe(tmp_path):
    """A tiny fp8 copy of the GPU recipe's preset, and a recipe workdir holding only its (tiny random) target."""
    preset = tmp_path / "tiny.yaml"
    preset.write_text(TINY_RECIPE.replace("extract:\n", "extract:\n  hidden_dtype: fp8\n"))
    work = tmp_path / "recipe"
    make_tiny_target(work / "target")
    return preset, work


def run_lines(out: str) -> list[str]:
    """The runs of the `tau-quant: {...}` lines, in the order they ended."""
    return [json.loads(m)["run"] for m in re.findall(r"^tau-quant: (\{.*\})$", out, re.M)]


def test_tau_quant_prepares_a_recipe_reuses_its_cache_and_fits_bases_as_it_does(tmp_path, capsys, monkeypatch):
    import dflash_cache
    from dflash.recipes import gpu_stages

    monkeypatch.setattr(gpu_stages, "BASIS_SAMPLES", 10)  # fewer than the tiny recipe's samples: a spread of them

    preset, work = tiny_recipe(tmp_path)
    tq, out = tmp_path / "tq", tmp_path / "out.json"
    args = ["--recipe-workdir", str(work), "--prepare", "--preset", str(preset), "--workdir", str(tq),
            "--hidden-dtypes", "fp8", "--seeds", "0,1", "--basis-ranks", "12,8", "--steps", "4", "--device", "cpu",
            "--json", str(out)]
    tau_quant.main(args)
    s = json.loads(out.read_text())
    runs = s["runs"]
    assert sorted(runs) == ["basis12-seed0", "basis8-seed0", "fp8-seed0", "fp8-seed1"] and s["base"] == "fp8"
    for r in runs.values():
        assert r["steps"] == 4 and r["identical"] == r["prompts"] == 3  # float32: every output the target's
        assert 1.0 <= r["val_tau_decode"] <= 4.0  # its own validation cache, on its basis
        assert list(r["tau_sets"]) == ["in-source"] and r["tau_sets"]["in-source"] == r["tau"]
        assert r["identical_sets"] == {"in-source": 3} and r["near_tie"] == r["suspect"] == 0
    for k in ("basis12-seed0", "basis8-seed0"):
        assert runs[k]["bytes_per_real_token"] < runs["fp8-seed0"]["bytes_per_real_token"] / 4
    assert s["base_spread"] == [min(runs[k]["tau"] for k in ("fp8-seed0", "fp8-seed1")),
                                max(runs[k]["tau"] for k in ("fp8-seed0", "fp8-seed1"))]
    printed = capsys.readouterr().out
    assert "tau-quant: preparing" in printed and not (work / "run").exists()  # the recipe's stages, no training
    assert all((work / n).is_dir() for n in ("cache", "cache-valid", "regenerated", "regenerated-valid"))

    # the base kind is the recipe's own fp8 caches: none extracted again
    assert f"tau-quant: cache fp8: reusing the recipe's {work / 'cache'} and {work / 'cache-valid'}" in printed
    assert not (tq / "cache-fp8").exists() and not (tq / "cache-valid-fp8").exists()
    assert runs["fp8-seed0"]["bytes_per_real_token"] == dflash_cache.inspect.info(str(work / "cache"))[
        "bytes_per_real_token"]

    # each basis fitted as the recipe fits its own: on BASIS_SAMPLES samples spread evenly over the answers
    regen = [x for f in sorted((work / "regenerated" / "data").glob("part-*.jsonl"))
             for x in f.read_text().splitlines()]
    step = len(regen) // 10
    assert step > 1 and (tq / "basis-fit.jsonl").read_text().splitlines() == regen[::step][:10]
    assert f"fitted on 10 of the {len(regen)} regenerated samples (one in {step}) -> {tq / 'cache-basis12-fit'}" \
        in printed
    for R in (12, 8):
        recs = {n: dflash_cache.open(str(tq / n)).metadata["basis"]
                for n in (f"cache-basis{R}-fit", f"cache-basis{R}", f"cache-valid-basis{R}")}
        assert {r["rank"] for r in recs.values()} == {R} and len({r["digest"] for r in recs.values()}) == 1

    # runs in order, each cache made just before its kind's first run; the table by kind then seed
    assert run_lines(printed) == ["fp8-seed0", "basis12-seed0", "fp8-seed1", "basis8-seed0"]
    at = {k: printed.index(f'"run": "{k}"') for k in runs}
    assert at["fp8-seed0"] < printed.index("tau-quant: cache basis12 ready") < at["basis12-seed0"]
    assert at["fp8-seed1"] < printed.index("tau-quant: cache basis8 ready") < at["basis8-seed0"]
    table = printed[printed.index("| run"):]
    assert [table.index(f"| {k} ") for k in ("fp8-seed0", "fp8-seed1", "basis12-seed0", "basis8-seed0")] == sorted(
        table.index(f"| {k} ") for k in runs)
    assert "| held-out tau |" in table and "| tau in-source |" in table

    # a rerun resumes: no run again, no cache made or checked again, nothing prepared again
    tau_quant.main(args)
    again = capsys.readouterr().out
    assert again.lstrip().startswith("fp8 over seeds [0, 1]: tau mean")  # nothing before the summary
    assert json.loads(out.read_text())["runs"] == runs


def test_tau_quant_reuses_only_a_complete_recipe_cache_of_its_dtype_off_a_basis(tmp_path, capsys):
    from dflash.extract.run import ExtractConfig, run_extract

    preset, work = tiny_recipe(tmp_path)
    with pytest.raises(SystemExit, match="run `dflash demo` there first, or pass --prepare"):
        tau_quant.main(["--recipe-workdir", str(work), "--preset", str(preset), "--workdir", str(tmp_path / "x")])
    tq = tmp_path / "tq"
    tau_quant.main(["--recipe-workdir", str(work), "--prepare", "--preset", str(preset), "--workdir", str(tq),
                    "--hidden-dtypes", "bf16", "--seeds", "0", "--steps", "2", "--device", "cpu"])
    assert "reusing" not in capsys.readouterr().out  # W/cache is fp8: a bf16 base extracts its own
    assert (tq / "cache-bf16").is_dir() and (tq / "cache-valid-bf16").is_dir()

    assert tau_quant.reusable(str(work / "cache"), "fp8") and tau_quant.reusable(str(work / "cache-valid"), "fp8")
    assert not tau_quant.reusable(str(work / "cache"), "bf16") and not tau_quant.reusable(str(tq / "none"), "fp8")
    on_basis = tmp_path / "on-basis"
    run_extract(ExtractConfig(target=str(work / "target"), data=str(work / "regenerated-valid"), out=str(on_basis),
                              seq_len=256, hidden_dtype="fp8", basis_rank=8, num_context_layers=3, device="cpu",
                              progress=False))
    assert not tau_quant.reusable(str(on_basis), "fp8")  # complete, fp8, but on a basis
    partial = tmp_path / "partial"
    shutil.copytree(work / "cache-valid", partial)
    (partial / "shards" / "000000" / "zarr.json").unlink()  # a shard not committed (yet)
    assert not tau_quant.reusable(str(partial), "fp8") and tau_quant.complete_cache(str(partial)) is None


def test_tau_quant_eval_in_a_fresh_process_reports_what_the_eval_in_this_one_does(tmp_path):
    """On a GPU each run's eval is a process of its own (eval_in_fresh_process: spawned, so none of this process's
    compiled layers or CUDA graphs): its report comes back whole, the same figures an eval here gives."""
    from dflash.core.config import build
    from dflash.recipes.gpu_config import load_recipe
    from dflash.recipes.gpu_stages import prepare
    from dflash.train.evaluate.eval import EvalConfig, run_eval
    from dflash.train.fit.trainer import TrainConfig, run_train

    preset, work = tiny_recipe(tmp_path)
    prepare(str(work), str(preset), "cpu", progress=False)
    run_train(build(TrainConfig, str(preset), "train", {"cache": str(work / "cache"), "target": str(work / "target"),
                                                        "out": str(tmp_path / "run"), "device": "cpu",
                                                        "progress": False, "max_steps": 2}))
    cfg = EvalConfig(target=str(work / "target"), drafter=str(tmp_path / "run" / "final"),
                     data=str(work / "data" / "heldout.jsonl"), device="cpu", progress=False,
                     max_new_tokens=load_recipe(str(preset)).eval_max_new_tokens)
    here, fresh = run_eval(cfg), tau_quant.eval_in_fresh_process(cfg)
    assert fresh["prompts"] == here["prompts"] >= 3
    for name in ("dflash", "ngram"):
        assert fresh[name]["tau"] == here[name]["tau"] and fresh[name]["tokens"] == here[name]["tokens"]
        assert fresh[name]["outputs_identical"] == here[name]["outputs_identical"] == here["prompts"]
    assert fresh["dflash"]["differences"]["differing"] == 0 and list(fresh["sets"]) == list(here["sets"])
