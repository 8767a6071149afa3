"""Shared by every test module."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread (more only add overhead, and spin on a busy 2-core
    machine); the CLI subprocesses the tests start get OMP_NUM_THREADS=1 to match."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
