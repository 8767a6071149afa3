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
from tests.tiny import chat_rows, write_jsonl

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


@pytest.fixture(scope="module")
def held_cache(work, targets, data_path, basis_cache):
    """A second cache extracted on the first one's basis (--basis-from)."""
    held = work / "held-out-basis"
    log = run_cli(work, *extract_args(targets["qwen3"], data_path, held, "--hidden-dtype", "fp8", "--max-samples", 20,
                                      "--basis-from", basis_cache))
    assert "fitting a basis" not in log
    return held


@pytest.fixture(scope="module")
def other_cache(work, targets, data_path):
    """A cache on a basis of its own (fitted on other rows: the first 20 conversations)."""
    other = work / "other-basis"
    run_cli(work, *extract_args(targets["qwen3"], data_path, other, "--hidden-dtype", "fp8", "--max-samples", 20,
                                "--basis-rank", RANK))
    return other


def test_another_basis_is_refused_naming_the_field(work, targets, data_path, basis_cache, plain_cache, held_cache,
                                                   other_cache, cli):  # noqa: F811
    # another rank on resume
    r = cli(*extract_args(targets["qwen3"], data_path, basis_cache, "--hidden-dtype", "fp8", "--basis-rank", 32))
    assert r.exit_code == 2 and "'basis.rank'" in error_line(r.stderr) and "--overwrite" in error_line(r.stderr)
    # --basis-from gives the same record; a cache on another basis differs in its digest
    assert dflash_cache.open(str(held_cache)).metadata["basis"] == dflash_cache.open(str(basis_cache)).metadata["basis"]
    assert (dflash_cache.open(str(other_cache)).metadata["basis"]["digest"]
            != dflash_cache.open(str(held_cache)).metadata["basis"]["digest"])
    # resuming a cache with --basis-from another basis: refused naming basis.digest
    r = cli(*extract_args(targets["qwen3"], data_path, held_cache, "--hidden-dtype", "fp8", "--max-samples", 20,
                          "--basis-from", other_cache))
    line = error_line(r.stderr)
    assert r.exit_code == 2 and "'basis.digest'" in line and "--basis-from" in line, r.output
    # --basis-from a cache without a basis, or with a basis of another rank than --basis-rank: refused before the
    # target loads or the data tokenises, and nothing is written
    r = cli(*extract_args(targets["qwen3"], data_path, work / "nope", "--basis-from", plain_cache))
    assert r.exit_code == 2 and "--basis-from" in error_line(r.stderr) and "--basis-rank" in error_line(r.stderr)
    assert "tokenised" not in r.output and not (work / "nope").exists()
    r = cli(*extract_args(targets["qwen3"], data_path, work / "nope", "--basis-from", held_cache, "--basis-rank",
                          RANK + 1))
    assert r.exit_code == 2 and f"has a basis of rank {RANK}" in error_line(r.stderr) and not (work / "nope").exists()


@pytest.mark.parametrize("given, says", [
    ("missing", "--basis-from {} : no such directory"),
    ("a-file", "--basis-from {} is a file, not a directory"),
    ("not-a-cache", "--basis-from {} is not a dflash cache"),
    ("https://example.com/cache", "--basis-from {}: https:// URLs cannot be opened here"),
    ("ftp2://example.com/cache", "--basis-from {}: unknown URL protocol ftp2://"),
])
def test_basis_from_that_is_no_cache_is_one_line_naming_the_flag(work, targets, data_path, cli, given, says):  # noqa: F811
    where = given if "://" in given else str(work / f"bf-{given}")
    if given == "a-file":
        open(where, "w").close()
    if given == "not-a-cache":
        os.makedirs(where, exist_ok=True)
    r = cli(*extract_args(targets["qwen3"], data_path, work / "bf-out", "--basis-from", where))
    line = error_line(r.stderr)
    assert r.exit_code == 2 and line.startswith("error: " + says.format(where).replace(" : ", ": ")), r.output
    assert "Traceback" not in r.stderr and not (work / "bf-out").exists()


# ------------------------------------------------------------------------------------------------ train


def test_composed_drafter_drafts_the_projected_drafters_logits(tmp_path):
    from dflash.train.drafter.checkpoint import load_drafter, save_drafter
    from dflash.train.drafter.dflash2 import make_drafter
    from dflash.train.drafter.model import DrafterConfig

    cfg = DrafterConfig.named("tiny", basis_rank=40)  # K*H = 2 * 64 = 128 features, 40 stored
    g = torch.Generator().manual_seed(0)
    model = make_drafter(cfg).float()
    model.reset_parameters(seed=1)
    V, H = cfg.vocab_size, cfg.hidden_size
    emb, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) / 8
    model.set_target_head(emb, head)
    assert model.fc.weight.shape == (H, 40)
    p = torch.linalg.qr(torch.randn(128, 40, generator=g, dtype=torch.float64))[0].T.float()  # [40, 128]
    x = torch.randn(2, 24, 128, generator=g) * 3
    z = x @ p.T
    save_drafter(model, str(tmp_path / "final"), dtype=torch.float32, basis=p.numpy())
    comp = load_drafter(str(tmp_path / "final"), dtype=torch.float32)
    comp.set_target_head(emb, head)
    assert comp.cfg.basis_rank == 0 and comp.fc.weight.shape == (H, 128)
    assert "basis_rank" not in json.loads((tmp_path / "final" / "config.json").read_text())["dflash_config"]

    def draft(m, hidden):
        cache = m.new_cache(2, 32)
        m.extend_context(cache, hidden, torch.arange(24).expand(2, 24))
        block = torch.tensor([[5, cfg.mask_token_id, cfg.mask_token_id, cfg.mask_token_id]] * 2)
        return m.draft_block(cache, block, torch.arange(24, 28).expand(2, 4))

    a, b = draft(model, z), draft(comp, x)
    assert a.shape == (2, cfg.block_size - 1, V)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    assert torch.allclose(model.fuse_context(z), comp.fuse_context(x), rtol=1e-5, atol=1e-5)


SMALL = ["--drafter-layers", "1", "--block-size", "4", "--num-anchors", "16", "--batch-rows", "2", "--no-progress"]


def check_composed(run, cache_path) -> None:
    """final/ = the last checkpoint's fc' times the cache's P, in the usual layout (K*H inputs, no basis_rank)."""
    from safetensors.torch import load_file

    ck = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    ck_cfg = json.loads((ck / "config.json").read_text())
    fin_cfg = json.loads((run / "final" / "config.json").read_text())
    assert ck_cfg["dflash_config"]["basis_rank"] == RANK and "basis_rank" not in fin_cfg["dflash_config"]
    fc_ck = load_file(str(ck / "model.safetensors"))["fc.weight"]
    fc_final = load_file(str(run / "final" / "model.safetensors"))["fc.weight"]
    p = torch.from_numpy(dflash_cache.open(str(cache_path)).basis())
    assert fc_ck.shape == (64, RANK) and fc_final.shape == (64, len(LAYERS) * 64)
    want = (fc_ck.double() @ p.double()).to(torch.bfloat16)
    assert torch.equal(fc_final, want)


def test_train_on_a_basis_writes_the_composed_drafter(work, targets, basis_cache, held_cache, cli):  # noqa: F811
    run = work / "run-basis"
    r = cli("train", "--cache", basis_cache, "--target", targets["qwen3"], "--out", run, *SMALL, "--max-steps", 4,
            "--save-every", 2, "--val-cache", held_cache, "--val-rows", 2)
    assert r.exit_code == 0, (r.output, r.exception)
    check_composed(run, basis_cache)
    rec = json.loads((run / "run.json").read_text())["caches"]
    assert rec["cache"]["identity"]["basis.digest"] == rec["val_cache"]["identity"]["basis.digest"]
    # final/ exports and checks as any drafter; a checkpoint on the basis is refused naming the field
    # (no --check: layer 5 is this tiny target's last, which speculators drops whatever the basis)
    r = cli("export", run / "final", "--format", "zlab", "--out", work / "export-basis")
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    assert load_file(str(work / "export-basis" / "model.safetensors"))["fc.weight"].shape == (64, len(LAYERS) * 64)
    ck = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    r = cli("export", ck, "--format", "zlab", "--out", work / "export-ck")
    assert r.exit_code == 2 and "basis_rank" in error_line(r.stderr), r.output
    # so are `check` and `eval` of it (its fc reads z = P x, which neither an engine nor the target's forward gives)
    r = cli("check", ck)
    assert r.exit_code == 2 and "basis_rank" in error_line(r.stderr), r.output
    data = write_jsonl(work / "eval-basis.jsonl", chat_rows(2, seed=9))
    r = cli("eval", "--target", targets["qwen3"], "--drafter", ck, "--data", data, "--max-prompts", 1,
            "--max-new-tokens", 4)
    assert r.exit_code == 2 and "basis_rank" in error_line(r.stderr), r.output


def test_train_refuses_a_val_cache_on_another_basis(work, targets, basis_cache, other_cache, plain_cache, cli):  # noqa: F811
    for val, theirs in ((other_cache, "'basis.digest'"), (plain_cache, "'basis.digest' is None")):
        r = cli("train", "--cache", basis_cache, "--target", targets["qwen3"], "--out", work / "run-refused", *SMALL,
                "--max-steps", 2, "--val-cache", val)
        line = error_line(r.stderr)
        assert r.exit_code == 2 and "--val-cache" in line and theirs in line and "--basis-from" in line, r.output


def test_a_follower_trains_on_the_extractions_basis(work, targets, data_path):
    out, run = work / "basis-followed", work / "run-follower"
    args = extract_args(targets["qwen3"], data_path, out, "--hidden-dtype", "fp8", "--basis-rank", RANK)
    with open(work / "basis-followed.log", "w") as logf:
        ext = subprocess.Popen([PY, "-m", "dflash", *args], stdout=logf, stderr=subprocess.STDOUT, env=cli_env(work),
                               cwd=REPO)
        try:
            log = run_cli(work, "train", "--cache", out, "--target", targets["qwen3"], "--out", run, *SMALL,
                          "--max-steps", 4, "--save-every", 2, "--follow", "--follow-timeout", 300)
        finally:
            assert ext.wait(timeout=300) == 0, (work / "basis-followed.log").read_text()
    assert "--follow" in log
    check_composed(run, out)
    digest = dflash_cache.open(str(out)).metadata["basis"]["digest"]
    assert json.loads((run / "run.json").read_text())["caches"]["cache"]["identity"]["basis.digest"] == digest


def test_the_fit_tokens_default_is_the_cache_modules():
    """extract's --basis-fit-tokens default (a literal, for --help without torch) is dflash_cache.basis.FIT_TOKENS."""
    from dflash.extract.run import ExtractConfig
    from dflash_cache.basis import FIT_TOKENS

    assert ExtractConfig.__dataclass_fields__["basis_fit_tokens"].default == FIT_TOKENS
