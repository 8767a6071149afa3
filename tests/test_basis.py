"""Features on their own basis (dflash_cache/basis.py, extract/basis_fit.py, `extract --basis-rank`):

- the fit: P's rows are the top eigenvectors of the features' uncentred second moment, the energy it keeps follows
  from M alone, and a cache stores z = P x (fp8, one scale per token; the last hidden state as it is);
- ranks of a 2-process torchrun extraction and a trainer following the cache use one P (rank 0's, from the root);
- a resumed (killed) extraction keeps its P; another rank, or --basis-from another basis, is refused naming the field;
- train on such a cache: fc takes R inputs, and final/ holds fc' P (K*H inputs) whose logits equal the projected
  drafter's (float32); a --val-cache on another basis is refused naming basis.digest;
- `cache info` shows R, the energy kept (overall and per layer) and the bytes per token.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

import dflash_cache
from dflash_cache import basis as basis_mod
from tests.test_extract import (LAYERS, PY, REPO, cli_env, commits_on_disk, data_path, dataset_rows,  # noqa: F401
                                error_line, extract_args, hf_datasets_cache, run_cli, targets, work)
from tests.test_extract import cli  # noqa: F401

RANK = 48  # of K*H = 3 * 64 = 192


def stored_and_plain(cache_path, plain_path):
    """(z as stored, x of the plain bf16 cache) over every row."""
    a, b = dflash_cache.open(str(cache_path)), dflash_cache.open(str(plain_path))
    assert len(a) == len(b)
    idx = list(range(len(a)))
    return a.read_rows(idx)["hidden"].float(), b.read_rows(idx)["hidden"].float(), a


@pytest.fixture(scope="module")
def plain_cache(work, targets, data_path):
    out = work / "plain-cache"
    run_cli(work, *extract_args(targets["qwen3"], data_path, out))
    return out


@pytest.fixture(scope="module")
def basis_cache(work, targets, data_path):
    out = work / "basis-cache"
    run_cli(work, *extract_args(targets["qwen3"], data_path, out, "--hidden-dtype", "fp8", "--basis-rank", RANK))
    return out


def test_fit_is_the_top_eigenvectors_of_the_uncentred_moment():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 24, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, 24, dtype=torch.float64) + 2
    m = basis_mod.SecondMoment(24)
    m.add(x[:2500])
    m.add(x[2500:])
    M = (x.T @ x).numpy()
    assert np.allclose(m.m.numpy(), M) and m.tokens == 4000
    p, e = basis_mod.fit(m.m.numpy(), 6, 8)
    assert p.shape == (6, 24) and np.allclose(p @ p.T, np.eye(6), atol=1e-5)
    lam = np.sort(np.linalg.eigvalsh(M))[::-1]
    assert np.allclose(np.diag(p @ M @ p.T), lam[:6], rtol=1e-5)  # the top 6 directions, in order
    xn = x.numpy()
    rec = xn @ p.T.astype(np.float64) @ p.astype(np.float64)  # x -> P^T P x
    kept = 1 - ((xn - rec) ** 2).sum() / (xn ** 2).sum()
    assert abs(e["energy"] - kept) < 1e-4
    for k in range(3):
        sl = slice(8 * k, 8 * (k + 1))
        assert abs(e["energy_per_layer"][k] - (1 - ((xn - rec)[:, sl] ** 2).sum() / (xn[:, sl] ** 2).sum())) < 1e-4
    assert basis_mod.fit_rows(100, 512, 65536) == list(range(100))
    assert basis_mod.fit_rows(100, 512, 2048) == [0, 25, 50, 75]


def test_cache_stores_the_projected_features_in_fp8(basis_cache, plain_cache):
    z, x, c = stored_and_plain(basis_cache, plain_cache)
    p = torch.from_numpy(c.basis())
    assert c.basis_rank == RANK and p.shape == (RANK, len(LAYERS) * 64) and z.shape[-1] == RANK
    m = c.metadata
    assert m["format_version"] == 4 and m["basis"]["digest"] == basis_mod.digest(c.basis())
    assert m["hidden_scaling"]["group_size"] == RANK and c.spec.scale_width == 1
    want = x @ p.T
    err = (z - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12)
    real = torch.from_numpy(np.stack([c[i]["doc_ids"].numpy() for i in range(len(c))]) != 0)
    assert err[real].max() < 0.08  # fp8: 2^-4 relative per value at most
    assert (z[~real] == 0).all()  # padding stays exact zeros
    assert dflash_cache.verify(str(basis_cache)).ok


def test_cache_info_shows_the_basis(basis_cache, plain_cache, cli):  # noqa: F811
    rep = dflash_cache.info(str(basis_cache))
    b = rep["basis"]
    assert b["rank"] == RANK and b["width"] == 192 and 0 < b["energy"] <= 1
    assert list(b["energy_per_layer"]) == [str(i) for i in LAYERS] and all(0 < v <= 1 for v in b["energy_per_layer"].values())
    assert rep["raw_hidden_bytes_per_token"] == RANK + 4  # fp8 bytes + one float32 scale
    assert dflash_cache.info(str(plain_cache))["basis"] is None
    r = cli("cache", "info", basis_cache)
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("basis"))
    assert f"rank {RANK} of 192" in line and "of their energy" in line and "per layer 1:" in line
    assert f"{RANK + 4:,} raw bytes per token" in line


def test_torchrun_ranks_project_on_one_basis(work, targets, data_path, basis_cache):
    out = work / "basis-torchrun"
    run_cli(work, "--standalone", "--nproc-per-node", "2", "-m", "dflash",
            *extract_args(targets["qwen3"], data_path, out, "--hidden-dtype", "fp8", "--basis-rank", RANK),
            launcher=("-m", "torch.distributed.run"))
    a, b = dflash_cache.open(str(out)), dflash_cache.open(str(basis_cache))
    assert {rec["writer"] for rec in a.commits.values()} == {"rank0", "rank1"}
    assert a.metadata["basis"] == b.metadata["basis"] and np.array_equal(a.basis(), b.basis())
    for s in range(a.spec.num_shards):  # every shard, whichever rank wrote it, holds the same bytes
        assert a.commits[s]["crc32"] == b.commits[s]["crc32"], s


def test_resumed_extraction_keeps_its_basis(work, targets, data_path, basis_cache):
    out = work / "basis-killed"
    args = extract_args(targets["qwen3"], data_path, out, "--hidden-dtype", "fp8", "--basis-rank", RANK)
    with open(work / "basis-killed.log", "w") as logf:
        proc = subprocess.Popen([PY, "-m", "dflash", *args], stdout=logf, stderr=subprocess.STDOUT,
                                env=cli_env(work), cwd=REPO)
        try:
            deadline = time.monotonic() + 240
            while commits_on_disk(out) < 1:
                assert proc.poll() is None, (work / "basis-killed.log").read_text()
                assert time.monotonic() < deadline
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    before = dflash_cache.open(str(out), allow_incomplete=True)
    assert not before.complete
    # the fit's input changes (fewer fit tokens would fit another P): a resume reads P from the root, never refits
    log = run_cli(work, *args[:], "--basis-fit-tokens", "512")
    assert "fitting a basis" not in log and "cache complete" in log
    after = dflash_cache.open(str(out))
    assert after.metadata["basis"] == dflash_cache.open(str(basis_cache)).metadata["basis"]
    for s in range(after.spec.num_shards):
        assert after.commits[s]["crc32"] == dflash_cache.open(str(basis_cache)).commits[s]["crc32"]


def test_another_basis_is_refused_naming_the_field(work, targets, data_path, basis_cache, plain_cache, cli):  # noqa: F811
    # another rank on resume
    r = cli(*extract_args(targets["qwen3"], data_path, basis_cache, "--hidden-dtype", "fp8", "--basis-rank", 32))
    assert r.exit_code == 2 and "'basis.rank'" in error_line(r.stderr) and "--overwrite" in error_line(r.stderr)
    # a second cache on the first one's basis: the same record; on a third basis: refused naming basis.digest
    held = work / "held-out-basis"
    r = cli(*extract_args(targets["qwen3"], data_path, held, "--hidden-dtype", "fp8", "--max-samples", 20,
                          "--basis-from", basis_cache))
    assert r.exit_code == 0, r.output
    assert "fitting a basis" not in r.stdout
    assert dflash_cache.open(str(held)).metadata["basis"] == dflash_cache.open(str(basis_cache)).metadata["basis"]
    other = work / "other-basis"
    r = cli(*extract_args(targets["qwen3"], data_path, other, "--hidden-dtype", "fp8", "--max-samples", 20,
                          "--basis-rank", RANK))
    assert r.exit_code == 0, r.output
    assert dflash_cache.open(str(other)).metadata["basis"]["digest"] != dflash_cache.open(str(held)).metadata["basis"]["digest"]
    r = cli(*extract_args(targets["qwen3"], data_path, held, "--hidden-dtype", "fp8", "--max-samples", 20,
                          "--basis-from", other))
    line = error_line(r.stderr)
    assert r.exit_code == 2 and "'basis.digest'" in line and "--basis-from" in line, r.output
    r = cli(*extract_args(targets["qwen3"], data_path, work / "nope", "--basis-from", plain_cache))
    assert r.exit_code == 2 and "--basis-from" in error_line(r.stderr) and "--basis-rank" in error_line(r.stderr)
