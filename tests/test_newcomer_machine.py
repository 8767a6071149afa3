"""What a stock machine adds for a newcomer (a fresh clone: `make venv`, `make test`, the first commands):

  * the test session keeps its caches (datasets, tokenise, matplotlib, Hugging Face) in a temporary folder, never
    under ~/.cache (tests/conftest.py), and the CLI processes it starts inherit that;
  * without a C++ compiler the tests that compile on the CPU skip, naming the compiler, instead of failing (and
    stopping `pytest -x`);
  * eval, regenerate and prompts decode on one intra-op thread on a CPU unless --threads (or OMP_NUM_THREADS) says
    otherwise, and leave a GPU machine's threads alone; the count is restored after the work;
  * `make venv` takes torch from PyTorch's CPU wheel index (TORCH_INDEX), and from the default index where that one
    cannot be reached (the Makefile's own recipe, run by make with a pip that records its command lines);
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest
import torch

import tests.conftest as conftest
from click.testing import CliRunner
from dflash.cli import main as cli_main
from tests.tiny import make_tiny_target

REPO = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def test_the_tests_keep_their_caches_out_of_home():
    """Before: `make test` wrote datasets', the tokenise and matplotlib caches under ~/.cache."""
    import datasets.config
    import matplotlib

    home = os.path.realpath(os.path.expanduser("~"))
    root = os.path.realpath(conftest.TEST_CACHES)
    tmp = os.path.realpath(tempfile.gettempdir())  # a demo run by an earlier test points matplotlib at its workdir
    where = {"datasets": str(datasets.config.HF_DATASETS_CACHE), "matplotlib cache": matplotlib.get_cachedir(),
             "matplotlib config": matplotlib.get_configdir(), **{k: os.environ[k] for k in conftest.CACHE_ENV}}
    for what, path in where.items():
        path = os.path.realpath(path)
        assert path.startswith((root + os.sep, tmp + os.sep)), (what, path)
        assert not path.startswith(os.path.join(home, ".cache") + os.sep), (what, path)
    # a command the tests start puts its caches there too: extract's default tokenise cache
    code = ("from dflash.extract.run import ExtractConfig, _tokenize_cache_dir\n"
            "print(_tokenize_cache_dir(ExtractConfig(target='t', data='d', out='o')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert os.path.realpath(p.stdout.split()[-1]).startswith(root + os.sep), p.stdout


def test_compile_tests_skip_naming_the_missing_compiler():
    """Before: without g++ they failed with InvalidCxxCompiler and `pytest -x` stopped the suite."""
    missing = "/nonexistent/g++"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/test_compiled_extract.py::test_compiled_equals_eager_float32"],
                       cwd=REPO, env=_env(CXX=missing), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 skipped" in p.stdout and "needs a C++ compiler" in p.stdout and missing in p.stdout, p.stdout[-3000:]
    assert conftest.missing_cxx() is None  # here one is installed: the marked tests run


FAKE_PIP = """#!/bin/sh
echo "$@" >> "$PIP_LOG"
case " $* " in *" --index-url "*) [ -n "$INDEX_DOWN" ] && exit 1 ;; esac
[ -n "$ALL_DOWN" ] && exit 1
exit 0
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_venv_takes_torch_from_the_cpu_index_else_the_default_one(tmp_path):
    """Before: `pip install torch==2.13.0` from the default index, on a stock machine the CUDA build (GBs of nvidia
    packages)."""
    pip = tmp_path / "pip"
    pip.write_text(FAKE_PIP)
    pip.chmod(0o755)

    def make(*args, **env):
        log = tmp_path / f"log-{len(list(tmp_path.glob('log-*')))}"
        p = subprocess.run(["make", "-s", "venv-torch", f"PIP={pip}", *args], cwd=REPO, capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, PIP_LOG=str(log), **env))
        return p, log.read_text().splitlines() if log.exists() else []

    cpu = "install -q --retries 1 --timeout 30 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"
    p, calls = make()
    assert p.returncode == 0 and calls == [cpu], (p.stdout, p.stderr, calls)
    p, calls = make(INDEX_DOWN="1")  # the CPU index unreachable: the default one
    assert p.returncode == 0 and calls == [cpu, "install -q torch==2.13.0"], (p.stdout, p.stderr, calls)
    assert "from the default index instead" in p.stdout
    p, calls = make("TORCH_INDEX=")  # skipped on request
    assert p.returncode == 0 and calls == ["install -q torch==2.13.0"], calls
    p, calls = make("TORCH_INDEX=https://example.org/whl/cu130", "TORCH=torch==2.14.1")
    assert calls == ["install -q --retries 1 --timeout 30 --index-url https://example.org/whl/cu130 torch==2.14.1"]
    p, calls = make(INDEX_DOWN="1", ALL_DOWN="1")  # neither: make venv fails
    assert p.returncode != 0 and len(calls) == 2
    # and `make venv` installs torch through this target, before dflash (whose torch>=2.11 it then satisfies)
    dry = subprocess.run(["make", "-n", "-B", "venv", "VENV=" + str(tmp_path / "venv"), f"PIP={pip}"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, PIP_LOG=str(tmp_path / "dry")))
    lines = dry.stdout.splitlines()
    torch_at = next(i for i, x in enumerate(lines) if "--index-url https://download.pytorch.org/whl/cpu" in x)
    assert torch_at < next(i for i, x in enumerate(lines) if "-e '.[test]'" in x), dry.stdout


def test_decoding_threads_are_one_on_a_cpu_unless_asked(monkeypatch):
    """Before: eval and regenerate ran on torch's default threads (all cores): 4-7x slower on a shared 2-core machine."""
    from dflash.core.threads import chosen_threads, decode_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert chosen_threads(0, "cpu") == 1 and chosen_threads(3, "cpu") == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert chosen_threads(0, "cpu") is None and chosen_threads(3, "cpu") == 3  # the environment's choice stands
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert chosen_threads(0, "auto") is None  # on CUDA: left as they are
    monkeypatch.undo()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with decode_threads(0, "cpu") as n:
            assert n == torch.get_num_threads() == (2 if os.environ.get("OMP_NUM_THREADS") else 1)
        assert torch.get_num_threads() == 2  # restored: the demo trains in the same process
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["eval", "regenerate", "prompts"])
def test_each_decoding_command_runs_its_work_on_the_threads_chosen(command, tmp_path, monkeypatch):
    """The commands' own entry points, with the work replaced by a probe of torch's threads: --threads 3 gives 3,
    the default gives 1 on a CPU, and the count is restored after."""
    import dflash.extract.generation.prompts as prompts_mod
    import dflash.extract.generation.regenerate as regen_mod
    import dflash.train.evaluate.eval as eval_mod

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    probe = {"eval": (eval_mod, "_run_eval", "run_eval", eval_mod.EvalConfig, dict(drafter="d", data="d")),
             "regenerate": (regen_mod, "_run_regenerate", "run_regenerate", regen_mod.RegenerateConfig,
                            dict(data="d", out=str(tmp_path / "out"))),
             "prompts": (prompts_mod, "_run", "run_prompts", prompts_mod.PromptsConfig,
                         dict(out=str(tmp_path / "out")))}
    module, work, run, cls, fields = probe[command]
    monkeypatch.setattr(module, work, lambda *a, **k: torch.get_num_threads())
    target = make_tiny_target(tmp_path / "target", num_layers=2)  # the commands read its layer kinds first
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert getattr(module, run)(cls(target=target, device="cpu", **fields)) == 1
        assert getattr(module, run)(cls(target=target, device="cpu", threads=3, **fields)) == 3
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    r = CliRunner().invoke(cli_main, [command, "--help"])
    assert "--threads" in r.output and "1 on a CPU" in " ".join(r.output.split())
    args = {"eval": ["--drafter", "d", "--data", "d"], "regenerate": ["--data", "d", "--out", str(tmp_path / "o")],
            "prompts": ["--out", str(tmp_path / "o")]}[command]
    r = CliRunner().invoke(cli_main, [command, "--target", "t", "--threads", "-1", *args])
    assert r.exit_code == 2 and "--threads must be in [0, " in r.output, r.output


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_prints_the_reason_of_each_skip():
    """Before: `make test` ended "15 skipped" and named neither the tests nor why (no CUDA, a compiler, a package)."""
    dry = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, timeout=60)
    line = next(x for x in dry.stdout.splitlines() if " -m pytest " in x)
    assert " -rs " in f"{line} ", line
