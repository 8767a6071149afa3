"""fp8 / fp4 hidden states: the quantisers' error bounds, the cache format, extraction and training from them.

Real zarr caches on disk, the real `dflash extract` (in process through click, and one SIGKILLed subprocess), a real
tiny HF target and the real Trainer; no mocks. Covered:
    the quantisers (dflash_cache.quant): every value within the bound derived from the format (fp8: 2^-4 |x| +
        2^-10 scale from e4m3's 3 mantissa bits and the amax/448 scale; fp4: max(|x|, scale) / 4 from e2m1's grid),
        and the bound is nearly reached (it is the format's, not a loose one); a 2x wrong scale breaks it; attention-sink tokens 100x the
        rest keep their own scale and leave the other tokens' bytes unchanged; all-zero padding is stored as zero
        bytes with zero scales and reads back as exact zeros; the numpy reference equals the torch dequantiser
    the cache: format version 2 and the hidden_scaling metadata; a plain zarr client rebuilds the values from the
        stored bytes, the scales and the metadata alone (its own e4m3/e2m1 decoder, a slice of a row); verify
        names a corrupted hidden_scales chunk, and the reader refuses it; cache[i] dequantises, batches() refuses a
        consumer that expects bf16 and hands bytes + scales to one that says it takes them
    extraction: `dflash extract --hidden-dtype fp8` equals quantising the bf16 extraction's states; a SIGKILL
        after the first commit + rerun gives the same bytes as an uninterrupted run; a changed --hidden-dtype on an
        existing cache is an error naming hidden_dtype
    training: the model's fuse_context on bytes + scales equals it on the dequantised values; an fp8 (and fp4) cache
        trains end to end; its first losses are those of the bf16 cache up to the quantisation error;
        compiled = eager (and the first-batch check passes) on an fp8 cache (slow: inductor compile)
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import dflash_cache
from dflash_cache import CacheError, CacheSpec, CacheWriter, quant
from dflash_cache.format import shard_key
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
K, H = 3, 64
W = K * H


def hidden_like(rows: int, T: int, seed: int = 0, sinks: bool = True) -> torch.Tensor:
    """Hidden states with per-token magnitudes over six decades, a few 100x attention-sink tokens, a 50x channel
    outlier, and all-zero padding at the end of each row (float32 [rows, T, K*H])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, T, W, generator=g) * torch.exp(torch.randn(rows, T, 1, generator=g) * 2.5)
    if sinks:
        x[:, 0] *= 100.0  # the first token of each row: an attention sink
        x[:, 3, 7] *= 50.0  # one channel of one token far above the rest
    x[:, -3:] = 0.0  # padding
    return x


def bound(x: torch.Tensor, hidden: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """The format's worst-case |dequantised - x| per element (quant.py's docstring)."""
    if fmt == quant.FP8:
        s = scales.repeat_interleave(H, dim=-1)
        return 2.0 ** -4 * x.abs() + 2.0 ** -10 * s
    s = scales.float().repeat_interleave(quant.FP4_GROUP, dim=-1)
    return torch.maximum(x.abs(), s) / 4 + 2.0 ** -11 * x.abs()


# ------------------------------------------------------------------------------------------------ the quantisers


@pytest.mark.parametrize("fmt", [quant.FP8, quant.FP4])
def test_round_trip_within_the_formats_bound_and_near_it(fmt):
    x = hidden_like(4, 64)
    h, s = quant.quantize(x, fmt, K)
    assert h.dtype == (torch.float8_e4m3fn if fmt == quant.FP8 else torch.uint8)
    assert h.shape[-1] == quant.stored_width(fmt, W) and s.shape[-1] == quant.scale_width(fmt, K, W)
    y = quant.dequantize(h, s, torch.float32)
    err, b = (y - x).abs(), bound(x, h, s, fmt)
    assert (err <= b * (1 + 1e-6) + 1e-30).all(), float((err / b.clamp(min=1e-30)).max())
    assert float((err / b.clamp(min=1e-30)).max()) > 0.9  # the bound is the format's, not a loose one
    # relative L2 well below what the worst case allows: fp8 ~2.5%, fp4 ~10%
    rel = float((y - x).norm() / x.norm())
    assert rel < (0.035 if fmt == quant.FP8 else 0.15), rel
    # the bound is tight enough to catch a wrong scale rule: stored scales off by 2x break it
    y2 = quant.dequantize(h, s * 2, torch.float32)
    assert not ((y2 - x).abs() <= b * (1 + 1e-6) + 1e-30).all()
    # the numpy reference (what a plain zarr client does) gives the same values
    hn = h.view(torch.uint8).numpy()
    assert np.array_equal(quant.dequantize_numpy(hn, s.numpy(), fmt), y.numpy())
    # bf16 output (what the training step gets) is y rounded once
    assert torch.equal(quant.dequantize(h, s), y.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", [quant.FP8, quant.FP4])
def test_sink_tokens_survive_and_leave_the_others_alone(fmt):
    plain = hidden_like(2, 32, seed=1, sinks=False)
    sunk = plain.clone()
    sunk[:, 5] *= 100.0  # sink tokens: activations 100x the rest
    h0, s0 = quant.quantize(plain, fmt, K)
    h1, s1 = quant.quantize(sunk, fmt, K)
    y1 = quant.dequantize(h1, s1, torch.float32)
    others = [t for t in range(32) if t != 5]
    assert torch.equal(h0.view(torch.uint8)[:, others], h1.view(torch.uint8)[:, others])  # unchanged bytes
    rel_sink = (y1[:, 5] - sunk[:, 5]).norm(dim=-1) / sunk[:, 5].norm(dim=-1)
    assert (rel_sink < (0.04 if fmt == quant.FP8 else 0.15)).all(), rel_sink  # kept to the format's precision
    assert (y1[:, 5].abs().amax(-1) > 0.9 * sunk[:, 5].abs().amax(-1)).all()  # not clipped


@pytest.mark.parametrize("fmt", [quant.FP8, quant.FP4])
def test_padding_is_stored_as_zero_bytes_and_reads_exact_zeros(fmt):
    x = hidden_like(2, 16)
    h, s = quant.quantize(x, fmt, K)
    assert (h.view(torch.uint8)[:, -3:] == 0).all()
    if fmt == quant.FP8:
        assert (s[:, -3:] == 0).all()
    y = quant.dequantize(h, s)
    assert (y[:, -3:].view(torch.int16) == 0).all()  # +0.0 bits, as a bf16 cache stores padding


# ------------------------------------------------------------------------------------------------ the cache


def write_cache(path, fmt: str, rows=5, T=16, rows_per_shard=2, chunk=4, seed=0, **kw):
    spec = CacheSpec(seq_len=T, hidden_size=H, layer_ids=[1, 2, 4], num_rows=rows, rows_per_shard=rows_per_shard,
                     hidden_dtype=fmt, codec=kw.pop("codec", "zstd"), hidden_chunk_tokens=chunk, info={"t": 1})
    x = hidden_like(rows, T, seed=seed).to(torch.bfloat16)
    doc = np.ones((rows, T), dtype=np.int32)
    doc[:, -3:] = 0
    with CacheWriter(str(path), spec, threads=2) as w:
        for s in range(spec.num_shards):
            a, n = spec.shard_rows(s)
            w.write_shard(s, np.arange(a * T, (a + n) * T).reshape(n, T) % 1000, doc[a:a + n] > 0, doc[a:a + n],
                          x[a:a + n])  # bf16 in: the writer quantises (extraction passes bytes + scales)
    return x


def e4m3(byte: np.ndarray) -> np.ndarray:
    """The test's own e4m3fn decoder, from the bit layout the metadata states (not dflash_cache's table)."""
    b = byte.astype(np.int64)
    sign = 1 - 2 * ((b >> 7) & 1)
    e, m = (b >> 3) & 15, b & 7
    return sign * np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e - 10))


def e2m1(code: np.ndarray) -> np.ndarray:
    mags = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    return np.where(code & 8, -1, 1) * mags[code & 7]


@pytest.mark.parametrize("fmt", [quant.FP8, quant.FP4])
def test_plain_zarr_client_rebuilds_the_values_from_the_metadata(tmp_path, fmt):
    import zarr

    x = write_cache(tmp_path / "c", fmt)
    root = zarr.open_group(str(tmp_path / "c"), mode="r")
    meta = dict(root.attrs)
    assert meta["hidden_dtype"] == fmt and meta["format_version"] == 2
    sc = meta["hidden_scaling"]
    assert sc["scales_array"] == "hidden_scales" and "formula" in sc
    g = sc["group_size"]
    # a slice of row 1 of shard 1 (global row 3), tokens 2..9: bytes and scales read by zarr itself
    hb = root[f"shards/000001/hidden"][1, 2:10]
    sb = root[f"shards/000001/{sc['scales_array']}"][1, 2:10]
    if fmt == quant.FP8:
        assert hb.dtype == np.uint8 and sb.dtype == np.float32 and g == H
        vals = e4m3(hb) * np.repeat(sb, g, axis=-1)
    else:
        assert hb.dtype == np.uint8 and sb.dtype == np.float16 and g == 32
        codes = np.stack([hb & 15, hb >> 4], axis=-1).reshape(hb.shape[0], -1)  # element 2i in the low nibble
        vals = e2m1(codes) * np.repeat(sb.astype(np.float64), g, axis=-1)
    cache = dflash_cache.open(str(tmp_path / "c"))
    lib = cache[3]["hidden"][2:10].float().numpy()  # the library's own (bf16) reading
    np.testing.assert_allclose(vals, lib, rtol=2 ** -8, atol=0)
    ref = x[3, 2:10].float()
    assert (torch.from_numpy(vals).float() - ref).abs().le(bound(ref, None, torch.from_numpy(sb), fmt) * 1.01 + 1e-30).all()


def test_versions_metadata_and_info(tmp_path):
    write_cache(tmp_path / "b", "bfloat16")
    write_cache(tmp_path / "f", quant.FP8)
    write_cache(tmp_path / "q", quant.FP4)
    b, f, q = (dflash_cache.info(str(tmp_path / n)) for n in "bfq")
    assert b["metadata"]["format_version"] == 1 and "hidden_scaling" not in b["metadata"]  # old readers still read it
    assert f["metadata"]["format_version"] == 2 and q["metadata"]["format_version"] == 2
    assert b["raw_hidden_bytes_per_token"] == 2 * W
    assert f["raw_hidden_bytes_per_token"] == W + 4 * K
    assert q["raw_hidden_bytes_per_token"] == W // 2 + 2 * W // 32
    assert f["hidden_dtype"] == quant.FP8 and dflash_cache.verify(str(tmp_path / "f")).ok
    assert dflash_cache.verify(str(tmp_path / "q")).ok
    # a different hidden dtype for an existing cache: an error naming hidden_dtype
    spec = CacheSpec(**{**dflash_cache.open(str(tmp_path / "f")).spec.__dict__, "hidden_dtype": "bfloat16"})
    with pytest.raises(dflash_cache.CacheMismatchError, match="'hidden_dtype'"):
        CacheWriter(str(tmp_path / "f"), spec)
    # what the writer refuses: scales for a bf16 cache, bytes of the wrong dtype, scales of the wrong shape
    fspec = dflash_cache.open(str(tmp_path / "f")).spec
    bspec = dflash_cache.open(str(tmp_path / "b")).spec
    x = torch.zeros(2, 16, W, dtype=torch.bfloat16)
    small = (np.zeros((2, 16), np.int32), np.zeros((2, 16), np.uint8), np.zeros((2, 16), np.int32))
    h, s = quant.quantize(x, quant.FP8, K)
    with pytest.raises(CacheError, match="hidden_scales given for a bfloat16 cache"):
        CacheWriter(str(tmp_path / "b2"), bspec).write_shard(0, *small, x, hidden_scales=s)
    w = CacheWriter(str(tmp_path / "f2"), fspec)
    with pytest.raises(CacheError, match="must be torch.float8_e4m3fn"):
        w.write_shard(0, *small, h.view(torch.int8), hidden_scales=s)
    with pytest.raises(CacheError, match="'hidden_scales' has shape"):
        w.write_shard(0, *small, h, hidden_scales=s[..., :2])
    w.close()
    # fp4 needs whole groups of 32 channels
    with pytest.raises(CacheError, match="multiple of 32"):
        CacheSpec(seq_len=8, hidden_size=48, layer_ids=[1], num_rows=1, rows_per_shard=1, hidden_dtype=quant.FP4)


def test_verify_names_a_corrupted_scales_chunk_and_the_reader_refuses_it(tmp_path):
    write_cache(tmp_path / "c", quant.FP8, codec="none")
    cache = dflash_cache.open(str(tmp_path / "c"))
    chunk = tmp_path / "c" / "shards" / "000001" / "hidden_scales" / "c" / "0" / "1" / "0"
    assert chunk.exists()
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x40  # one bit of one scale
    chunk.write_bytes(bytes(data))
    rep = dflash_cache.verify(str(tmp_path / "c"))
    assert not rep.ok and list(rep.bad) == [1], rep.bad
    assert len(rep.bad[1]) == 1 and "hidden_scales/c/0/1/0" in rep.bad[1][0], rep.bad  # (zstd: it no longer decodes)
    with pytest.raises(dflash_cache.CacheCorruptError, match="hidden_scales"):
        cache[2]  # global row 2 = shard 1, row 0, chunk 1
    with pytest.raises(dflash_cache.CacheCorruptError, match="hidden_scales"):
        for _ in cache.batches(5, check=True, quantized=True):
            pass
    # chunks that decode but hold other scales (two swapped): the checksums catch it
    other = tmp_path / "c" / "shards" / "000001" / "hidden_scales" / "c" / "1" / "1" / "0"
    chunk.write_bytes(other.read_bytes())
    rep = dflash_cache.verify(str(tmp_path / "c"))
    assert rep.bad[1] == [p for p in rep.bad[1] if "hidden_scales" in p and "checksum mismatch" in p] and rep.bad[1]
    with pytest.raises(dflash_cache.CacheCorruptError, match="checksum mismatch in .*hidden_scales"):
        cache[2]
    # and a deleted scales chunk: verify names the file
    chunk.unlink()
    rep = dflash_cache.verify(str(tmp_path / "c"))
    assert any("hidden_scales" in p and "missing" in p for p in rep.bad[1]), rep.bad


@pytest.mark.parametrize("fmt", [quant.FP8, quant.FP4])
def test_reader_dequantises_rows_and_refuses_bf16_batch_consumers(tmp_path, fmt):
    x = write_cache(tmp_path / "c", fmt)
    cache = dflash_cache.open(str(tmp_path / "c"))
    row = cache[4]
    assert row["hidden"].dtype == torch.bfloat16 and row["hidden"].shape == (16, W)
    ref = x[4].float()
    h, s = quant.quantize(x[4], fmt, K)
    assert torch.equal(row["hidden"], quant.dequantize(h, s))  # the writer's quantisation, read back exactly
    with pytest.raises(CacheError, match=f"holds {fmt}.*expects bfloat16"):
        next(iter(cache.batches(2)))
    batches = list(cache.batches(5, quantized=True))
    b = batches[0]
    assert b["hidden"].dtype == (torch.float8_e4m3fn if fmt == quant.FP8 else torch.uint8)
    assert b["hidden"].shape[-1] == quant.stored_width(fmt, W) and "hidden_scales" in b
    i = int((b["row_index"] == 4).nonzero()[0])
    assert torch.equal(quant.dequantize(b["hidden"][i], b["hidden_scales"][i]), row["hidden"])
    assert (row["hidden"] - ref).abs().max() <= bound(ref, h, s, fmt).max() * 1.01 + 2 ** -8 * ref.abs().max()
    raw = cache.read_rows([4], raw=True)
    assert torch.equal(raw["hidden"][0].view(torch.uint8), h.view(torch.uint8))


# ------------------------------------------------------------------------------------------------ extraction


SEQ = 128


def cli(*args) -> str:
    from dflash.cli import main as cli_main

    r = CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback

        raise AssertionError("".join(traceback.format_exception(r.exception))) from r.exception
    assert r.exit_code == 0, r.output[-3000:]
    return r.stdout


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny target, chat data, and bf16 / fp8 / fp4 caches extracted from them by `dflash extract` (in process)."""
    root = tmp_path_factory.mktemp("fp8")
    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "chat.jsonl", chat_rows(30, seed=5))
    caches = {}
    for name in ("bf16", "fp8", "fp4"):
        caches[name] = root / f"cache-{name}"
        cli("extract", "--target", target, "--data", data, "--out", caches[name], "--seq-len", SEQ,
            "--rows-per-shard", 3, "--batch-rows", 2, "--writer-threads", 2, "--hidden-dtype", name, "--no-progress")
    return {"root": root, "target": target, "data": data, "caches": caches}


def test_extract_fp8_is_the_quantised_bf16_extraction(env):
    b = dflash_cache.open(str(env["caches"]["bf16"]))
    for name, fmt in (("fp8", quant.FP8), ("fp4", quant.FP4)):
        c = dflash_cache.open(str(env["caches"][name]), expect={"hidden_dtype": fmt})
        assert len(c) == len(b) and c.real_tokens == b.real_tokens and dflash_cache.verify(str(env["caches"][name])).ok
        for i in (0, len(b) - 1):
            ref = b[i]["hidden"]
            # the device quantiser run on the float32 forward vs quantising its bf16 rounding: the bytes may differ
            # by one step where bf16 rounding crossed a rounding boundary; the values stay within the bound
            h, s = c.read_rows([i], raw=True)["hidden"][0], c.read_rows([i], raw=True)["hidden_scales"][0]
            got = quant.dequantize(h, s, torch.float32)
            assert torch.equal(c[i]["hidden"], got.to(torch.bfloat16))
            x = ref.float()
            slack = 2 ** -8 * x.abs() + 1e-30  # bf16 rounding of the reference
            assert ((got - x).abs() <= bound(x, h, s, fmt) * 1.01 + slack).all()
            pad = c[i]["doc_ids"] == 0
            assert (got[pad] == 0).all() and (h.view(torch.uint8)[pad] == 0).all()
    info = dflash_cache.info(str(env["caches"]["fp8"]))
    binfo = dflash_cache.info(str(env["caches"]["bf16"]))
    assert info["bytes_on_disk"] < 0.62 * binfo["bytes_on_disk"]  # half the bytes (plus the small arrays)


def commits_on_disk(path) -> int:
    n = 0
    for f in glob.glob(os.path.join(str(path), "shards", "*", "zarr.json")):
        try:
            n += "dflash_commit" in Path(f).read_text()
        except OSError:
            pass
    return n


def test_resume_of_an_fp8_extraction_is_byte_identical(env):
    import zarr

    out = env["root"] / "killed-fp8"
    args = ["extract", "--target", env["target"], "--data", env["data"], "--out", out, "--seq-len", SEQ,
            "--rows-per-shard", 3, "--batch-rows", 2, "--writer-threads", 2, "--hidden-dtype", "fp8", "--no-progress"]
    log = open(env["root"] / "killed.log", "w")
    proc = subprocess.Popen([PY, "-m", "dflash", *map(str, args)], stdout=log, stderr=subprocess.STDOUT, env=_env(),
                            cwd=REPO)
    try:
        deadline = time.monotonic() + 240
        while commits_on_disk(out) < 1:
            assert proc.poll() is None, (env["root"] / "killed.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    partial = dflash_cache.open(str(out), allow_incomplete=True)
    n = partial.spec.num_shards
    assert 1 <= len(partial.commits) < n, (len(partial.commits), n)
    cli(*args)  # the same command resumes
    ref, got = dflash_cache.open(str(env["caches"]["fp8"])), dflash_cache.open(str(out))
    ma, mb = dict(ref.metadata), dict(got.metadata)
    ia, ib = ma.pop("info"), mb.pop("info")
    ia, ib = {k: v for k, v in ia.items() if k != "run"}, {k: v for k, v in ib.items() if k != "run"}
    assert ma == mb and ia == ib  # all but the run's own record (documented volatile: info.run)
    za, zb = zarr.open_group(str(ref.path), mode="r"), zarr.open_group(str(got.path), mode="r")
    for s in range(n):
        assert ref.commits[s]["crc32"] == got.commits[s]["crc32"]  # every chunk's checksum, scales included
        for name in ("input_ids", "loss_mask", "doc_ids", "hidden", "hidden_scales"):
            a, b = za[f"{shard_key(s)}/{name}"][...], zb[f"{shard_key(s)}/{name}"][...]
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), (s, name)
    assert dflash_cache.verify(str(out)).ok


def test_a_changed_hidden_dtype_is_an_error_naming_it(env):
    from dflash.cli import main as cli_main

    r = CliRunner().invoke(cli_main, ["extract", "--target", str(env["target"]), "--data", str(env["data"]),
                                      "--out", str(env["caches"]["fp8"]), "--seq-len", SEQ, "--rows-per-shard", 3,
                                      "--hidden-dtype", "bf16", "--no-progress"])
    assert r.exit_code == 2 and "hidden_dtype" in r.stderr and "Traceback" not in r.stderr, r.output
    r = CliRunner().invoke(cli_main, ["extract", "--help"])
    assert "--hidden-dtype [bf16|fp8|fp4]" in r.stdout


# ------------------------------------------------------------------------------------------------ training


def test_fuse_context_on_bytes_equals_fuse_context_on_values():
    from dflash.train.drafter.model import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig.named("tiny", target_layer_ids=[1, 2, 3], num_target_layers=6)  # K*H = 3 * 64
    m = DFlashDrafter(cfg)
    m.reset_parameters(seed=0)
    x = hidden_like(2, 16)
    for fmt in (quant.FP8, quant.FP4):
        h, s = quant.quantize(x, fmt, 3)
        torch.testing.assert_close(m.fuse_context(h, s), m.fuse_context(quant.dequantize(h, s, torch.float32)),
                                   rtol=0, atol=0)


def train(env, cache: str, out: Path, compile="off", steps=4, **kw) -> dict:
    from dflash.train.fit.trainer import TrainConfig, Trainer

    cfg = TrainConfig(cache=str(env["caches"][cache]), target=str(env["target"]), out=str(out), drafter_layers=1,
                      block_size=4, num_anchors=16, batch_rows=2, max_steps=steps, log_every=1, save_every=10 ** 9,
                      progress=False, seed=2, compile=compile, **kw)
    return Trainer(cfg).train()


def test_training_from_fp8_and_fp4_caches(env, tmp_path):
    runs = {name: train(env, name, tmp_path / name, steps=10, lr=5e-3) for name in ("bf16", "fp8", "fp4")}
    curves = {name: [h["loss"] for h in r["history"]] for name, r in runs.items()}
    for name, r in runs.items():
        c = curves[name]
        assert len(c) == 10 and all(np.isfinite(c)) and np.mean(c[-3:]) < np.mean(c[:3]) - 0.05, (name, c)
        assert os.path.exists(os.path.join(r["final"], "model.safetensors"))
    # the same batches, anchors and initial weights: the losses differ only by the quantisation error
    assert curves["fp8"][0] == pytest.approx(curves["bf16"][0], rel=2e-3), curves
    assert curves["fp4"][0] == pytest.approx(curves["bf16"][0], rel=2e-2), curves
    assert curves["fp8"] == pytest.approx(curves["bf16"], rel=1e-2), curves
    assert curves["fp8"][0] != curves["bf16"][0]  # it did read the fp8 bytes


@pytest.mark.slow
@pytest.mark.cxx
def test_compiled_equals_eager_on_an_fp8_cache(env, tmp_path):
    eager = train(env, "fp8", tmp_path / "eager", compile="off", steps=3)
    comp = train(env, "fp8", tmp_path / "comp", compile="on", steps=3)
    c = comp["compile_check"]
    assert comp["compiled"] and c["ran"] and c["passed"] and c["grad_rel_err"] < 1e-3, c
    assert comp["recompiles_after_warmup"] == 0
    for a, b in zip(eager["history"], comp["history"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
