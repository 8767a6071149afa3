"""What a stock machine adds for a newcomer (a fresh clone: `make venv`, `make test`, the first commands):

  * the test session keeps its caches (datasets, tokenise, matplotlib, Hugging Face) in a temporary folder, never
    under ~/.cache (tests/conftest.py), and the CLI processes it starts inherit that;
  * without a C++ compiler the tests that compile on the CPU skip, naming the compiler, instead of failing (and
    stopping `pytest -x`);
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tests.conftest as conftest

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
    where = {"datasets": str(datasets.config.HF_DATASETS_CACHE), "matplotlib cache": matplotlib.get_cachedir(),
             "matplotlib config": matplotlib.get_configdir(), **{k: os.environ[k] for k in conftest.CACHE_ENV}}
    for what, path in where.items():
        path = os.path.realpath(path)
        assert path.startswith(root + os.sep), (what, path)
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
