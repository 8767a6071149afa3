"""bench/tau_quant.py --recipe-workdir: tau from an fp8 cache over seeds against a cache on a basis, from a GPU
recipe's own workdir (its target, regenerated answers, eval prompts and validation answers) with its preset's
settings: the command BENCHMARKS.md "Cache size" names for the GPU recipe, run here on a tiny recipe on CPU."""

from __future__ import annotations

import json

from bench import tau_quant
from dflash.recipes.gpu import run_gpu_demo
from tests.test_demo_gpu_recipe import TINY_RECIPE
from tests.tiny import make_tiny_target


def test_tau_quant_on_a_recipe_workdir_gives_held_out_and_per_set_tau_for_each_cache(tmp_path, capsys):
    preset = tmp_path / "tiny.yaml"
    preset.write_text(TINY_RECIPE.replace("extract:\n", "extract:\n  hidden_dtype: fp8\n"))
    work = tmp_path / "recipe"
    run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False,
                 target=make_tiny_target(work / "target"))
    out = tmp_path / "out.json"
    tau_quant.main(["--recipe-workdir", str(work), "--preset", str(preset), "--workdir", str(tmp_path / "tq"),
                    "--hidden-dtypes", "fp8", "--seeds", "0,1", "--basis-ranks", "12", "--steps", "4",
                    "--device", "cpu", "--json", str(out)])
    s = json.loads(out.read_text())
    runs = s["runs"]
    assert sorted(runs) == ["basis12-seed0", "fp8-seed0", "fp8-seed1"] and s["base"] == "fp8"
    for r in runs.values():
        assert r["steps"] == 4 and r["identical"] == r["prompts"] == 3  # float32: every output the target's
        assert 1.0 <= r["val_tau_decode"] <= 4.0  # its own validation cache, on its basis
        assert list(r["tau_sets"]) == ["in-source"] and r["tau_sets"]["in-source"] == r["tau"]
    assert runs["basis12-seed0"]["bytes_per_real_token"] < runs["fp8-seed0"]["bytes_per_real_token"] / 4
    assert s["base_spread"] == [min(runs[k]["tau"] for k in ("fp8-seed0", "fp8-seed1")),
                                max(runs[k]["tau"] for k in ("fp8-seed0", "fp8-seed1"))]
    import dflash_cache

    tq = tmp_path / "tq"
    assert (dflash_cache.open(str(tq / "cache-valid-basis12")).metadata["basis"]["digest"]
            == dflash_cache.open(str(tq / "cache-basis12")).metadata["basis"]["digest"])
    table = capsys.readouterr().out
    assert "| held-out tau |" in table and "| tau in-source |" in table
