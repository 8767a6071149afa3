"""A package that installs anywhere: a wheel built from this checkout, installed into a fresh virtualenv, runs a
tiny `dflash extract` + `dflash train --config tiny` from a directory outside the checkout.

What it pins down (DESIGN.md section 2): the presets ship inside the package (`--config tiny` and
`qwen3-8b` resolve with no configs/ folder in sight), the stages install as dflash.extract and dflash.train
(the wheel holds no top-level `extract` or `train` package, and none is importable), and the console script
works. The heavy dependencies (torch, transformers, zarr, ...) are not reinstalled: the fresh virtualenv sees
this interpreter's site-packages through a .pth file (no network, and seconds instead of minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.tiny import chat_rows, make_tiny_target, write_jsonl

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "dflash", "dflash_cache", "extract", "train", "configs")


def _run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _can_build_wheels_offline() -> bool:
    """This interpreter's setuptools meets pyproject's build requirement (>= 77: the SPDX license string; it has
    bdist_wheel built in)."""
    try:
        import setuptools
    except ImportError:
        return False
    version = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
    return version >= (77, 0)


def _dependency_paths() -> list[str]:
    """Where this interpreter finds its installed packages (site-packages and what .pth files add), the checkout's
    sources and the standard library left out: the fresh venv sees torch & co. there, never this checkout's
    dflash. A virtualenv inside the checkout (`make test`'s .venv) is kept: its site-packages hold the deps."""
    stdlib = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
    out = []
    for p in sys.path:
        real = os.path.realpath(p or os.getcwd())
        in_checkout = real == str(REPO) or (real.startswith(str(REPO) + os.sep) and "site-packages" not in real)
        if (os.path.isdir(real) and real not in stdlib and not in_checkout  # a .venv inside the checkout stays
                and not any(real.startswith(s + os.sep + "lib-dynload") for s in stdlib)):
            out.append(real)
    return list(dict.fromkeys(out))


@pytest.mark.slow
def test_a_wheel_installed_in_a_fresh_venv_extracts_and_trains_outside_the_checkout(tmp_path):
    # 1. the wheel, built from a copy of the sources (an in-tree build would leave build/ in the checkout)
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    # this interpreter's setuptools builds the wheel when it meets pyproject's requirement (the `make venv`
    # environment); else pip's isolated build fetches a current setuptools from PyPI
    offline = _can_build_wheels_offline()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "wheels", src,
          *(["--no-build-isolation", "--no-index"] if offline else [])])
    wheel = next((tmp_path / "wheels").glob("dflash-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"dflash", "dflash_cache"}, tops  # no top-level extract/ train/ configs/
    assert {"dflash/configs/tiny.yaml", "dflash/configs/qwen3-8b.yaml", "dflash/extract/run.py",
            "dflash/train/fit/trainer.py", "dflash/train/evaluate/eval.py", "dflash/train/serve/export.py",
            "dflash/extract/generation/regenerate.py", "dflash/core/target.py"} <= set(names)

    # 2. a fresh virtualenv (no pip of its own: this interpreter's pip installs into it), heavy deps via .pth
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    vpy = venv / "bin" / "python"
    vsite = Path(_run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = _dependency_paths()
    (vsite / "_dflash_test_deps.pth").write_text("\n".join(deps) + "\n")
    _run([sys.executable, "-m", "pip", "--python", vpy, "install", "--no-deps", "--no-index", "-q", wheel])

    # 3. outside the checkout, nothing of it on the path
    work = tmp_path / "work"
    work.mkdir()
    target = make_tiny_target(str(work / "target"))
    data = write_jsonl(str(work / "chats.jsonl"), chat_rows(16))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    probe = _run([vpy, "-c", "import importlib.util, json, dflash, dflash.train.fit.trainer as t\n"
                  "from dflash.core.config import read_preset\n"
                  "print(json.dumps([dflash.__file__, t.__file__, importlib.util.find_spec('train') is None,\n"
                  "                  importlib.util.find_spec('extract') is None, read_preset('qwen3-8b', 'train')]))"],
                 cwd=work, env=env)
    init, trainer, no_train, no_extract, qwen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert init.startswith(str(venv)) and trainer.startswith(str(venv)), (init, trainer)
    assert no_train and no_extract  # the stages are dflash.train / dflash.extract only
    assert qwen.get("drafter_layers") == 5, qwen  # a shipped preset, read from the installed package

    dflash = venv / "bin" / "dflash"
    _run([dflash, "extract", "--config", "tiny", "--target", target, "--data", data, "--out", "cache",
          "--no-progress"], cwd=work, env=env)
    _run([dflash, "train", "--config", "tiny", "--cache", "cache", "--target", target, "--out", "run",
          "--max-steps", "2", "--save-every", "2", "--no-progress"], cwd=work, env=env)
    info = json.loads(_run([dflash, "cache", "info", "cache", "--json"], cwd=work, env=env).stdout)
    assert info["complete"] and info["rows"] > 0 and info["seq_len"] == 256  # the tiny preset's seq_len
    assert (work / "run" / "final" / "config.json").exists()


def test_pyproject_lists_every_package_of_the_checkout():
    """pyproject names its packages explicitly (the stage folders map into dflash): a new subpackage that is not
    listed would be missing from every wheel while all checkout tests still pass."""
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = tool.get("package-dir", {})

    def folder_of(pkg: str) -> Path:
        """The folder setuptools builds a package from: its own package-dir entry, else its nearest mapped parent's
        folder plus the rest of its name (dflash.train.fit: train/fit)."""
        parts = pkg.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in mapped:
                return REPO / mapped[".".join(parts[:n])] / Path(*parts[n:]) if parts[n:] else REPO / mapped[pkg]
        return REPO / Path(*parts)

    folders = {pkg: folder_of(pkg) for pkg in tool["packages"]}
    assert all((f / "__init__.py").is_file() for f in folders.values()), folders
    want = set()
    for root_pkg, folder in (("dflash", REPO / "dflash"), ("dflash.extract", REPO / "extract"),
                             ("dflash.train", REPO / "train"), ("dflash.configs", REPO / "configs"),
                             ("dflash_cache", REPO / "dflash_cache")):
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            want.add(".".join((root_pkg, *rel)))
    assert want == set(tool["packages"]), (sorted(want - set(tool["packages"])), sorted(set(tool["packages"]) - want))
