"""Shared by every test module.

  * One torch intra-op thread per test module (one_torch_thread).
  * The caches a run writes (the datasets library's, extract's tokenise cache, matplotlib's, Hugging Face's; anything
    else that follows XDG_CACHE_HOME) go to a temporary folder of the test session, removed at its end, never under
    ~/.cache: TEST_CACHES, set in the environment before anything imports datasets or matplotlib, so that the CLI
    processes the tests start inherit it. A test that checks where a command puts its caches removes these variables
    from its subprocess's environment.
  * Tests marked `cxx` run torch.compile on the CPU, whose backend (inductor) builds C++ kernels: without a C++
    compiler they skip, naming the compiler they looked for (missing_cxx).
"""

import atexit
import os
import shutil
import tempfile

TEST_CACHES = tempfile.mkdtemp(prefix="dflash-test-caches-")
atexit.register(shutil.rmtree, TEST_CACHES, ignore_errors=True)
CACHE_ENV = {
    "XDG_CACHE_HOME": os.path.join(TEST_CACHES, "xdg"),
    "HF_HOME": os.path.join(TEST_CACHES, "huggingface"),
    "HF_DATASETS_CACHE": os.path.join(TEST_CACHES, "datasets"),
    "MPLCONFIGDIR": os.path.join(TEST_CACHES, "matplotlib"),
    "DFLASH_TOKENIZE_CACHE": os.path.join(TEST_CACHES, "tokenized"),
}
os.environ.update(CACHE_ENV)

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread (more only add overhead, and spin on a busy 2-core
    machine); the CLI subprocesses the tests start get OMP_NUM_THREADS=1 to match."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def missing_cxx() -> str | None:
    """None when inductor's CPU backend finds its C++ compiler ($CXX, else g++: torch._inductor.config.cpp.cxx),
    else why the tests that compile on the CPU skip."""
    name = os.environ.get("CXX") or "g++"
    if shutil.which(name):
        return None
    try:  # torch's own search (it may also install one through conda, when asked to)
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
        return None
    except Exception:  # torch._inductor.exc.InvalidCxxCompiler
        return (f"needs a C++ compiler: torch.compile's CPU backend (inductor) builds C++ kernels with {name} "
                "($CXX), which is not installed (e.g. apt-get install g++)")


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("cxx")]
    why = missing_cxx() if marked else None
    if why:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=why))
