"""Tests of dflash_cache, the hidden-state cache: real zarr stores on disk, real subprocesses, no mocks.

This file is also the writer script that the multi-process tests run:

    python tests/test_cache.py PATH [--shards 0,3] [--barrier FILE] [--seed N]

writes the shards of a small test cache (all by default, committed ones skipped), printing
"committed S" after each. Test-only hooks, set through the environment (never in library code):
DFLASH_TEST_HANG_SHARD=S stops for good right after the first hidden chunk of shard S is on disk
(printing "hang"), so a test can SIGKILL the writer mid-shard; DFLASH_TEST_FSIZE=N limits the size
of any file the process writes to N bytes (a write past it fails like a full disk).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import dflash_cache
from dflash_cache import (
    CacheCorruptError,
    CacheError,
    CacheIncompleteError,
    CacheMismatchError,
    CacheNotFoundError,
    CacheSpec,
    CacheVersionError,
    CacheWriter,
    NotACacheError,
)
from dflash_cache.format import group_json, root_record_json

PY = sys.executable
HERE = Path(__file__).resolve()

T, H, LAYERS, CHUNK = 16, 8, [1, 3], 4  # rows of 16 tokens, hidden [16, 2*8], 4 chunks per row
W = H * len(LAYERS)
# bf16 bit patterns a lossy path would change: -0.0, +inf, -inf, nan, -nan with payload,
# smallest subnormal, largest finite, all ones (a nan)
SPECIAL_BF16 = np.array([0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0001, 0x7F7F, 0xFFFF], dtype=np.uint16)
ARRAYS = ("input_ids", "loss_mask", "doc_ids", "hidden")


# The writer script (see the docstring) imports this file: torch is imported only by the tests that use
# it, so that the subprocesses start in well under a second.


# -- test data -------------------------------------------------------------------------------------
def make_spec(num_rows=7, rows_per_shard=3, **kw) -> CacheSpec:
    kw.setdefault("hidden_chunk_tokens", CHUNK)
    kw.setdefault("info", {"target": {"name_or_path": "test/tiny", "num_layers": 4}})
    return CacheSpec(seq_len=T, hidden_size=H, layer_ids=LAYERS, num_rows=num_rows, rows_per_shard=rows_per_shard, **kw)


def script_spec() -> CacheSpec:
    """The cache the writer script writes: 5 shards of 2 rows."""
    return make_spec(num_rows=10, rows_per_shard=2)


def shard_data(spec: CacheSpec, shard: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic packed rows: documents of random length, then padding (doc 0, mask 0, zero hidden)."""
    _, rows = spec.shard_rows(shard)
    T, W = spec.seq_len, spec.row_width
    rng = np.random.default_rng([seed, shard])
    doc_ids = np.zeros((rows, T), np.int32)
    for r in range(rows):
        real = int(rng.integers(T // 2, T + 1))
        t, d = 0, 0
        while t < real:
            n = min(real - t, int(rng.integers(1, T // 2 + 1)))
            d += 1
            doc_ids[r, t:t + n] = d
            t += n
    real = doc_ids > 0
    hidden = rng.integers(0, 1 << 16, (rows, T, W), dtype=np.uint16)
    hidden[0, 0, :len(SPECIAL_BF16)] = SPECIAL_BF16  # token 0 is always real
    hidden[~real] = 0
    return {
        "input_ids": np.where(real, rng.integers(1, 50_000, (rows, T)), 0).astype(np.int32),
        "loss_mask": (real & (rng.random((rows, T)) < 0.6)).astype(np.uint8),
        "doc_ids": doc_ids,
        "hidden": hidden,
    }


def all_rows(spec: CacheSpec, seed: int = 0) -> dict[str, np.ndarray]:
    parts = [shard_data(spec, s, seed) for s in range(spec.num_shards)]
    return {k: np.concatenate([p[k] for p in parts]) for k in ARRAYS}


def write_cache(path, spec: CacheSpec, seed: int = 0, shards=None, **writer_kw) -> CacheWriter:
    w = CacheWriter(path, spec, **writer_kw)
    for s in range(spec.num_shards) if shards is None else shards:
        if s not in w.committed:
            w.submit_shard(s, **shard_data(spec, s, seed))
    w.close()
    return w


def bits(x) -> np.ndarray:
    """The raw bits of a tensor/array, for bit-exact comparison (NaN == NaN, -0.0 != 0.0)."""
    import torch

    if isinstance(x, torch.Tensor):
        x = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        x = x.numpy()
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x


def row_equal(got: dict, want: dict, i: int) -> None:
    for k in ARRAYS:
        np.testing.assert_array_equal(bits(got[k]), want[k][i], err_msg=f"row {i}: {k}")


def shard_files(path, shard: int) -> dict[str, bytes]:
    """Every file of a shard except its group zarr.json (which carries the commit time and writer)."""
    base = Path(path) / "shards" / f"{shard:06d}"
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*"))
            if p.is_file() and p.relative_to(base) != Path("zarr.json")}


def commit_record(path, shard: int) -> dict:
    doc = json.loads((Path(path) / "shards" / f"{shard:06d}" / "zarr.json").read_text())
    return doc["attributes"]["dflash_commit"]


def as_an_older_dflash_wrote_it(path, change_root=None) -> None:
    """Make the cache at `path` look as a dflash from before root records wrote it (no record of the root in
    shards/zarr.json, commit records without their shard index and root digest); change_root(attributes), if
    given, then edits the root (say, drops a field that older dflash did not write)."""
    path = Path(path)
    (path / "shards" / "zarr.json").write_bytes(group_json({}))
    for group in sorted((path / "shards").glob("[0-9]" * 6 + "/zarr.json")):
        doc = json.loads(group.read_text())
        rec = doc["attributes"].get("dflash_commit")
        if rec is not None:
            rec.pop("shard", None), rec.pop("root", None)
            group.write_text(json.dumps(doc))
    if change_root is not None:
        doc = json.loads((path / "zarr.json").read_text())
        change_root(doc["attributes"])
        (path / "zarr.json").write_text(json.dumps(doc))


def assert_same_cache(a, b) -> None:
    """Byte-identical shards (every array of every shard), equal commit records but for who/when."""
    import zarr

    ca, cb = dflash_cache.open(a), dflash_cache.open(b)
    assert ca.metadata == cb.metadata
    assert sorted(ca.commits) == sorted(cb.commits)
    for s in sorted(ca.commits):
        ra, rb = ({k: v for k, v in commit_record(p, s).items() if k not in ("writer", "time")} for p in (a, b))
        assert ra == rb, f"shard {s}: commit records differ"
        assert shard_files(a, s) == shard_files(b, s), f"shard {s}: files differ"
        for name in ARRAYS:
            za, zb = (zarr.open_array(str(p), path=f"shards/{s:06d}/{name}", mode="r")[...] for p in (a, b))
            np.testing.assert_array_equal(za, zb, err_msg=f"shard {s}: {name}")


def run_cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "dflash", *map(str, args)], capture_output=True, text=True, timeout=timeout)


def start_writer(path, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([PY, str(HERE), str(path), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def dflash_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dflash-")]


# -- round trip --------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", dflash_cache.CODECS)
def test_round_trip_is_bit_exact(tmp_path, codec):
    import torch
    import zarr

    spec = make_spec(num_rows=7, rows_per_shard=3, codec=codec)  # shards of 3, 3 and 1 rows
    w = CacheWriter(tmp_path / "c", spec, threads=3)
    for s in range(spec.num_shards):
        data = shard_data(spec, s)
        if s == 1:  # the extractor hands over torch tensors; hidden as bf16
            data = {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if k == "hidden" else torch.from_numpy(v)
                    for k, v in data.items()}
        w.submit_shard(s, **data)
    w.close()
    assert w.committed == {0, 1, 2}
    want = all_rows(spec)

    cache = dflash_cache.open(tmp_path / "c")
    assert len(cache) == 7 and cache.complete
    assert cache.metadata["layer_ids"] == LAYERS and cache.metadata["info"]["target"]["name_or_path"] == "test/tiny"
    for i in range(7):
        row = cache[i]
        assert row["hidden"].dtype == torch.bfloat16 and row["hidden"].shape == (T, W)
        row_equal(row, want, i)
    row_equal(cache[-1], want, 6)

    got = cache.read_rows([6, 0, 4], check=True)
    for j, i in enumerate([6, 0, 4]):
        row_equal({k: got[k][j] for k in ARRAYS}, want, i)

    seen = set()
    for b in cache.batches(2, threads=2):
        for j, i in enumerate(b["row_index"].tolist()):
            if b["row_valid"][j]:
                row_equal({k: b[k][j] for k in ARRAYS}, want, i)
                seen.add(i)
    assert seen == set(range(7))

    # any zarr client reads it: a real zarr v3 hierarchy of plain arrays
    root = zarr.open_group(str(tmp_path / "c"), mode="r")
    assert root.metadata.zarr_format == 3 and root.attrs["format"] == "dflash-cache"
    for s in range(spec.num_shards):
        first, rows = spec.shard_rows(s)
        for name in ARRAYS:
            arr = zarr.open_array(str(tmp_path / "c"), path=f"shards/{s:06d}/{name}", mode="r")
            assert arr.metadata.zarr_format == 3
            np.testing.assert_array_equal(arr[...], want[name][first:first + rows], err_msg=f"zarr: shard {s} {name}")


def test_out_of_range_row_raises_index_error(tmp_path):
    cache_path = tmp_path / "c"
    write_cache(cache_path, make_spec())
    cache = dflash_cache.open(cache_path)
    with pytest.raises(IndexError):
        cache[7]
    with pytest.raises(IndexError):
        cache[-8]


def test_wrong_shapes_and_dtypes_are_refused(tmp_path):
    import torch

    spec = make_spec()
    w = CacheWriter(tmp_path / "c", spec)
    data = shard_data(spec, 0)
    with pytest.raises(CacheError, match="'hidden' has shape"):
        w.write_shard(0, **{**data, "hidden": data["hidden"][:, :8]})
    with pytest.raises(CacheError, match="bf16"):
        w.write_shard(0, **{**data, "hidden": data["hidden"].astype(np.float32)})
    with pytest.raises(CacheError, match="bfloat16"):
        w.write_shard(0, **{**data, "hidden": torch.zeros(3, T, W)})
    with pytest.raises(CacheError, match="out of range"):
        w.write_shard(3, **data)
    w.close()
    assert w.committed == set()


# -- many writers, crashes ------------------------------------------------------------------------------
def test_concurrent_writer_processes(tmp_path):
    spec, path, barrier = script_spec(), tmp_path / "c", tmp_path / "go"
    procs = [start_writer(path, "--shards", ",".join(str(s) for s in range(k, spec.num_shards, 3)), "--barrier", barrier)
             for k in range(3)]
    for p in procs:  # every writer is imported and waiting; then all create the cache at once
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    barrier.touch()
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    rep = dflash_cache.verify(path)
    assert rep.ok and rep.shards_ok == list(range(spec.num_shards))
    assert len({commit_record(path, s)["writer"] for s in range(spec.num_shards)}) == 3
    write_cache(tmp_path / "ref", spec)
    assert_same_cache(path, tmp_path / "ref")


def test_killed_writer_leaves_no_committed_partial_shard_and_resumes(tmp_path):
    spec, path = script_spec(), tmp_path / "c"
    p = start_writer(path, env={"DFLASH_TEST_HANG_SHARD": "2"})
    lines = []
    for line in p.stdout:  # blocks until the writer is inside shard 2, with a chunk of it on disk
        lines.append(line.strip())
        if line.startswith("hang"):
            break
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert lines[:2] == ["committed 0", "committed 1"] and lines[2].startswith("hang"), (lines, p.stderr.read())
    assert list((path / "shards" / "000002" / "hidden" / "c").rglob("*")), "the killed writer had written a chunk"

    with pytest.raises(CacheIncompleteError, match="3 of 5 shards"):
        dflash_cache.open(path)
    partial = dflash_cache.open(path, allow_incomplete=True)
    assert sorted(partial.commits) == [0, 1] and len(partial) == 4 and not partial.complete
    rep = dflash_cache.info(path)  # info works on an incomplete cache
    assert (rep["complete"], rep["shards_committed"], rep["shards_planned"], rep["rows"]) == (False, 2, 5, 4)
    before = {s: (commit_record(path, s), (path / "shards" / f"{s:06d}" / "zarr.json").stat().st_mtime_ns) for s in (0, 1)}
    time.sleep(0.01)

    p = start_writer(path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.split() == ["committed", "2", "committed", "3", "committed", "4"]  # only the rest was redone
    for s in (0, 1):
        assert (commit_record(path, s), (path / "shards" / f"{s:06d}" / "zarr.json").stat().st_mtime_ns) == before[s]
    assert commit_record(path, 2)["writer"] != before[0][0]["writer"]

    write_cache(tmp_path / "ref", spec)  # an uninterrupted run
    assert_same_cache(path, tmp_path / "ref")
    assert dflash_cache.verify(path).ok


def test_rerun_after_crash_during_creation(tmp_path):
    """A writer killed while creating the root leaves only a temp file; a rerun must not call it foreign."""
    path = tmp_path / "c"
    path.mkdir()
    (path / "zarr.json.0123abcd.partial").write_text('{"zarr_fo')
    write_cache(path, make_spec())
    assert dflash_cache.verify(path).ok

    (path / "shards" / "zarr.json").unlink()  # killed between the root and the shards group
    write_cache(path, make_spec())
    assert (path / "shards" / "zarr.json").exists()


@pytest.mark.parametrize("limit,failing", [(16 << 10, "shards/000000/hidden/c/0/"), (256, "zarr.json")])
def test_failed_write_is_a_cache_error_naming_the_file(tmp_path, limit, failing):
    """A write that fails in the OS (here: past RLIMIT_FSIZE, like a full disk) surfaces as a CacheError
    naming the file: a hidden chunk (in a worker thread), or the cache's root metadata."""
    path = tmp_path / "c"
    p = start_writer(path, "--big", env={"DFLASH_TEST_FSIZE": str(limit)})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, (out, err)
    assert out.startswith(f"CacheError: cannot write {path}/{failing}") and "File too large" in out, out
    assert "threads after close: []" in out, out  # the writer's pools shut down
    assert not list(path.rglob("*.partial"))
    if (path / "zarr.json").exists():
        assert dflash_cache.open(path, allow_incomplete=True).commits == {}


def test_writer_pools_shut_down_after_error(tmp_path):
    spec = make_spec()
    bad = {**shard_data(spec, 0), "hidden": np.zeros((3, T, W), np.float32)}
    with pytest.raises(CacheError, match="bf16"):
        with CacheWriter(tmp_path / "c", spec, threads=2) as w:
            w.submit_shard(1, **shard_data(spec, 1))
            w.submit_shard(0, **bad)
            w.wait()
    assert dflash_threads() == []
    assert w.committed == {1}


def test_submit_shard_bounds_the_queue(tmp_path):
    spec = make_spec(num_rows=12, rows_per_shard=2)
    w = CacheWriter(tmp_path / "c", spec, threads=1, max_inflight_shards=1, max_queued_shards=2)
    futs = []
    for s in range(spec.num_shards):
        futs.append(w.submit_shard(s, **shard_data(spec, s)))
        assert sum(not f.done() for f in futs) <= 2
    w.close()
    assert w.committed == set(range(6))


# -- corruption ------------------------------------------------------------------------------------------
def corrupt(path) -> None:
    """Shard 0: flipped bytes in a chunk; shard 1: a truncated chunk; shard 2: a deleted chunk; shard 3 intact."""
    def chunk(s, row, c):
        return path / "shards" / f"{s:06d}" / "hidden" / "c" / str(row) / str(c) / "0"

    f = chunk(0, 1, 2)
    raw = bytearray(f.read_bytes())
    for i in range(len(raw) - 8, len(raw)):
        raw[i] ^= 0x5A
    f.write_bytes(bytes(raw))
    f = chunk(1, 0, 1)
    f.write_bytes(f.read_bytes()[:-3])
    chunk(2, 1, 3).unlink()


@pytest.mark.parametrize("codec", ["lz4", "none"])
def test_verify_names_every_bad_shard(tmp_path, codec):
    path = tmp_path / "c"
    write_cache(path, make_spec(num_rows=8, rows_per_shard=2, codec=codec))
    assert dflash_cache.verify(path).ok
    corrupt(path)

    rep = dflash_cache.verify(path)
    assert not rep.ok and sorted(rep.bad) == [0, 1, 2] and rep.shards_ok == [3]
    flipped, truncated, deleted = (" ".join(rep.bad[s]) for s in (0, 1, 2))
    assert "checksum mismatch" in flipped or (codec != "none" and "cannot decode" in flipped), flipped
    assert "truncated" in truncated, truncated
    assert "hidden/c/1/3/0 is missing" in deleted, deleted

    cache = dflash_cache.open(path)
    for shard, row in ((0, 1), (1, 0), (2, 1)):
        with pytest.raises(CacheCorruptError, match=f"shard {shard}\\b"):
            cache[2 * shard + row]
    for shard, row in ((1, 0), (2, 1)):  # truncated or missing data is caught even without checksums
        with pytest.raises(CacheCorruptError, match=f"shard {shard}\\b"):
            cache.read_rows([2 * shard + row], check=False)
    with pytest.raises(CacheCorruptError, match="shard 1\\b"):
        list(cache.batches(8))
    row_equal(cache[6], all_rows(make_spec(num_rows=8, rows_per_shard=2)), 6)  # intact shard reads fine

    if codec != "lz4":
        return  # the CLI over one codec is enough
    res = run_cli("cache", "verify", path)
    assert res.returncode == 1, res.stdout + res.stderr
    bad_lines = [l for l in res.stdout.splitlines() if l.startswith("BAD shard")]
    assert {l.split()[2].rstrip(":") for l in bad_lines} == {"000000", "000001", "000002"}, res.stdout
    assert "1 of 4 shards OK" in res.stdout


def test_short_or_broken_commit_record_is_corruption(tmp_path):
    path = tmp_path / "c"
    write_cache(path, make_spec(num_rows=8, rows_per_shard=2))
    zj = path / "shards" / "000001" / "zarr.json"
    doc = json.loads(zj.read_text())
    doc["attributes"]["dflash_commit"]["crc32"]["hidden"] = doc["attributes"]["dflash_commit"]["crc32"]["hidden"][:3]
    zj.write_text(json.dumps(doc))
    zj = path / "shards" / "000002" / "zarr.json"
    doc = json.loads(zj.read_text())
    del doc["attributes"]["dflash_commit"]["crc32"]["loss_mask"]
    zj.write_text(json.dumps(doc))

    cache = dflash_cache.open(path)
    assert len(cache) == 8
    row_equal(cache[0], all_rows(make_spec(num_rows=8, rows_per_shard=2)), 0)
    with pytest.raises(CacheCorruptError, match="shard 1\\b.*commit record"):
        cache[3]
    with pytest.raises(CacheCorruptError, match="shard 2\\b.*commit record"):
        cache[4]
    rep = dflash_cache.verify(path)
    assert sorted(rep.bad) == [1, 2] and rep.shards_ok == [0, 3]
    assert rep.bad[1] == ["commit record: crc32['hidden'] has 3 entries, expected 8"]
    assert rep.bad[2] == ["commit record: crc32['loss_mask'] has 0 entries, expected 1"]


# -- metadata ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("seq_len", 3000), ("hidden_size", 2048), ("layer_ids", [1, 9, 17, 25]),
                                         ("rows_per_shard", 16), ("codec", "zstd")])
def test_reopening_with_other_settings_names_the_field(tmp_path, field, value):
    # Qwen3-8B-shaped metadata (no rows are written): each change also changes a derived field
    # (the chosen hidden chunking, or the number of shards), and the error must name the one that was set.
    base = dict(seq_len=4096, hidden_size=4096, layer_ids=[1, 9, 17, 25, 33], num_rows=100, rows_per_shard=8)
    CacheWriter(tmp_path / "c", CacheSpec(**base)).close()
    with pytest.raises(CacheMismatchError, match=f"field '{field}'") as e:
        CacheWriter(tmp_path / "c", CacheSpec(**{**base, field: value}))
    assert e.value.field == field and e.value.wanted == value
    CacheWriter(tmp_path / "c", CacheSpec(**base)).close()  # the same settings reopen fine


def test_info_mismatch_names_the_dotted_field_but_run_details_may_differ(tmp_path):
    info = {"target": {"name_or_path": "a"}, "run": {"host": "x"}}
    CacheWriter(tmp_path / "c", make_spec(info=info)).close()
    CacheWriter(tmp_path / "c", make_spec(info={**info, "run": {"host": "y"}})).close()
    with pytest.raises(CacheMismatchError, match="field 'info.target.name_or_path'"):
        CacheWriter(tmp_path / "c", make_spec(info={**info, "target": {"name_or_path": "b"}}))


def test_open_with_expectations(tmp_path):
    write_cache(tmp_path / "c", make_spec())
    cache = dflash_cache.open(tmp_path / "c", expect={"seq_len": T, "layer_ids": tuple(LAYERS), "target.name_or_path": "test/tiny"})
    assert len(cache) == 7
    for key, wrong in (("seq_len", 32), ("layer_ids", [1, 2]), ("hidden_size", 4), ("target.name_or_path", "other")):
        with pytest.raises(CacheMismatchError, match=f"field '{key}'") as e:
            dflash_cache.open(tmp_path / "c", expect={key: wrong})
        assert e.value.field == key
    with pytest.raises(CacheMismatchError, match="field 'no_such_field' is None"):
        dflash_cache.open(tmp_path / "c", expect={"no_such_field": 1})


def test_overwrite_replaces_the_cache(tmp_path):
    path = tmp_path / "c"
    write_cache(path, make_spec(num_rows=7, rows_per_shard=3))
    spec = make_spec(num_rows=4, rows_per_shard=4, codec="zstd")
    with pytest.raises(CacheMismatchError):
        CacheWriter(path, spec)
    w = write_cache(path, spec, seed=1, overwrite=True)
    assert w.committed == {0}
    assert sorted(os.listdir(path / "shards")) == ["000000", "zarr.json"]
    cache = dflash_cache.open(path)
    assert len(cache) == 4 and cache.metadata["codec"] == "zstd"
    row_equal(cache[3], all_rows(spec, seed=1), 3)


# -- bad input ---------------------------------------------------------------------------------------------
def bad_inputs(tmp_path) -> dict[str, Path]:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("not a cache")
    newer = tmp_path / "newer"
    write_cache(newer, make_spec())
    doc = json.loads((newer / "zarr.json").read_text())
    doc["attributes"]["format_version"] = 99  # as a newer dflash would write it: the root and its record
    (newer / "zarr.json").write_text(json.dumps(doc))
    (newer / "shards" / "zarr.json").write_bytes(root_record_json(doc["attributes"]))
    file = tmp_path / "file.bin"
    file.write_bytes(b"x")
    return {"missing": tmp_path / "nope", "plain": plain, "newer": newer, "file": file}


def test_bad_paths_raise_clear_errors(tmp_path):
    p = bad_inputs(tmp_path)
    with pytest.raises(CacheNotFoundError, match="does not exist"):
        dflash_cache.open(p["missing"])
    with pytest.raises(NotACacheError, match="not a dflash cache"):
        dflash_cache.open(p["plain"])
    with pytest.raises(NotACacheError, match="not a directory"):
        dflash_cache.open(p["file"])
    with pytest.raises(CacheVersionError, match="version 99"):
        dflash_cache.open(p["newer"])
    with pytest.raises(CacheVersionError, match="version 99"):
        CacheWriter(p["newer"], make_spec())
    with pytest.raises(NotACacheError, match="refusing to write"):
        CacheWriter(p["plain"], make_spec())
    assert os.listdir(p["plain"]) == ["notes.txt"]
    with pytest.raises(NotACacheError, match="not a directory"):
        CacheWriter(p["file"], make_spec())
    with pytest.raises(CacheNotFoundError):
        dflash_cache.verify(p["missing"])
    with pytest.raises(NotACacheError):
        dflash_cache.info(p["plain"])


def test_cli_bad_paths_print_one_error_line_and_exit_2(tmp_path):
    p = bad_inputs(tmp_path)
    cases = [("info", p["missing"], "does not exist"), ("verify", p["plain"], "not a dflash cache"),
             ("verify", p["newer"], "version 99")]
    procs = [subprocess.Popen([PY, "-m", "dflash", "cache", cmd, str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cmd, path, _ in cases]
    for (cmd, path, words), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, (cmd, path, out, err)
        assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, (cmd, err)
        assert "Traceback" not in out + err


# -- iteration ----------------------------------------------------------------------------------------------
N_ITER = 11  # rows; shards of 4, 4, 3


@pytest.fixture(scope="module")
def iter_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("iter") / "c"
    spec = make_spec(num_rows=N_ITER, rows_per_shard=4)
    write_cache(path, spec)
    return dflash_cache.open(path), all_rows(spec)


def epoch_rows(cache, batch_rows, world, epoch, seed=5):
    """Per rank: the list of batches (as numpy) of one epoch."""
    return [[{k: bits(v) for k, v in b.items()}
             for b in cache.batches(batch_rows, rank=r, world=world, epoch=epoch, seed=seed, threads=2, prefetch=2)]
            for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_epoch_covers_every_row_once_across_ranks(iter_cache, world):
    cache, want = iter_cache
    B = 3
    steps = cache.steps_per_epoch(B, world)
    assert steps == -(-N_ITER // (B * world))
    orders = []
    for epoch in (0, 1):
        valid_rows, fillers, order = [], 0, []
        for rank_batches in epoch_rows(cache, B, world, epoch):
            assert len(rank_batches) == steps  # every rank takes the same number of steps
            for b in rank_batches:
                assert b["hidden"].shape == (B, T, W) and b["input_ids"].shape == (B, T) and b["row_valid"].shape == (B,)
                for j, i in enumerate(b["row_index"]):
                    order.append(int(i))
                    for k in ("input_ids", "doc_ids", "hidden"):
                        np.testing.assert_array_equal(b[k][j], want[k][i])
                    if b["row_valid"][j]:
                        valid_rows.append(int(i))
                        np.testing.assert_array_equal(b["loss_mask"][j], want["loss_mask"][i])
                    else:
                        fillers += 1
                        assert not b["loss_mask"][j].any(), "a filler row must not be trained on"
        assert sorted(valid_rows) == list(range(N_ITER))
        assert fillers == steps * B * world - N_ITER
        orders.append(order)
    assert orders[0] != orders[1]


def test_order_is_a_function_of_seed_and_epoch(iter_cache):
    cache, _ = iter_cache
    a = cache.epoch_order(2, 1, 2, epoch=3, seed=7)
    b = cache.epoch_order(2, 1, 2, epoch=3, seed=7)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], cache.epoch_order(2, 1, 2, epoch=4, seed=7)[0])
    assert not np.array_equal(a[0], cache.epoch_order(2, 1, 2, epoch=3, seed=8)[0])
    with pytest.raises(CacheError, match="rank 2"):
        cache.epoch_order(2, 2, 2, epoch=0, seed=0)


def test_start_step_yields_the_tail_of_the_epoch(iter_cache):
    cache, _ = iter_cache
    full = list(cache.batches(2, epoch=1, seed=3, threads=2))
    assert len(full) == 6
    for k in (0, 1, 4, 5, 6):
        tail = list(cache.batches(2, epoch=1, seed=3, start_step=k, threads=2))
        assert len(tail) == len(full) - k
        for a, b in zip(tail, full[k:]):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(bits(a[key]), bits(b[key]))
    with pytest.raises(CacheError, match="start_step"):
        list(cache.batches(2, start_step=-1))
    with pytest.raises(CacheError, match="batch_rows"):
        list(cache.batches(0))


def _copy(batch) -> dict:
    return {k: bits(v).copy() for k, v in batch.items()}


def test_multi_epoch_iteration_equals_epoch_by_epoch(iter_cache):
    """epochs=E (or None, endless) from (epoch, start_step) yields exactly the batches of iterating the
    epochs one by one, with the same buffers and threads throughout (what the trainer relies on)."""
    import itertools

    cache, _ = iter_cache
    per_epoch = [[_copy(b) for b in cache.batches(2, epoch=e, seed=3, threads=2)] for e in range(1, 5)]
    want = [b for ep in per_epoch for b in ep][4:]  # from step 4 of epoch 1 on
    for kwargs in ({"epochs": 4}, {"epochs": None}, {"epochs": None, "reuse_buffers": True, "prefetch": 3}):
        got = []
        it = cache.batches(2, epoch=1, seed=3, start_step=4, threads=2, **kwargs)
        for b in itertools.islice(it, len(want)):
            got.append(_copy(b))
            b.release()
        more = next(it, None)
        assert (more is None) == (kwargs["epochs"] == 4)
        it.close()
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
    assert dflash_threads() == []
    with pytest.raises(CacheError, match="epochs"):
        list(cache.batches(2, epochs=0))


def test_reused_buffers_form_a_ring_and_need_release(iter_cache):
    cache, want = iter_cache
    it = cache.batches(1, reuse_buffers=True, prefetch=2, threads=2, epochs=2)
    seen, buffers = [], set()
    for b in it:
        buffers.add(b["hidden"].data_ptr())
        i = int(b["row_index"][0])
        np.testing.assert_array_equal(bits(b["hidden"])[0], want["hidden"][i])
        seen.append(i)
        b.release()
    assert sorted(seen) == sorted(list(range(N_ITER)) * 2)
    assert len(buffers) <= 4  # prefetch + 2 buffers for 22 batches
    with pytest.raises(CacheError, match="release"):
        list(cache.batches(1, reuse_buffers=True, prefetch=2))  # holding every buffer is an error, not a hang


def test_unpinned_batches_are_plain_cpu_tensors(iter_cache):
    cache, _ = iter_cache
    it = cache.batches(4, pin_memory=False, threads=2)
    b = next(it)
    assert not b["hidden"].is_pinned() and b["hidden"].device.type == "cpu"
    b.release()  # a no-op without pinned buffers
    it.close()
    assert dflash_threads() == []  # stopping early shuts the reader threads down


def test_pinned_batches_reuse_a_ring_of_buffers(iter_cache):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    cache, want = iter_cache
    seen = []
    for b in cache.batches(1, pin_memory=True, prefetch=2, threads=2):
        assert b["hidden"].is_pinned()
        dev = b["hidden"].cuda(non_blocking=True)
        torch.cuda.synchronize()
        b.release()
        i = int(b["row_index"][0])
        np.testing.assert_array_equal(bits(dev.cpu())[0], want["hidden"][i])
        seen.append(i)
    assert sorted(seen) == list(range(N_ITER))
    with pytest.raises(CacheError, match="release"):
        list(cache.batches(1, pin_memory=True, prefetch=2))  # holding every buffer is an error, not a hang


# -- info ------------------------------------------------------------------------------------------------
def test_cli_info_json_reports_what_was_written(tmp_path):
    path = tmp_path / "c"
    spec = make_spec(num_rows=7, rows_per_shard=3)
    write_cache(path, spec)
    want = all_rows(spec)
    real = int((want["doc_ids"] > 0).sum())
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    res = run_cli("cache", "info", path, "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["rows"] == 7 and rep["complete"] and rep["shards_committed"] == 3
    assert rep["real_tokens"] == real and 0 < real < 7 * T
    assert rep["supervised_tokens"] == int(want["loss_mask"].sum())
    assert rep["padding_fraction"] == pytest.approx(1 - real / (7 * T))
    assert rep["bytes_on_disk"] == on_disk
    assert rep["bytes_per_real_token"] == pytest.approx(on_disk / real)
    assert rep["raw_hidden_bytes_per_token"] == 2 * W
    assert rep["metadata"]["layer_ids"] == LAYERS

    res = run_cli("cache", "info", path)
    assert res.returncode == 0 and "7 x 16 tokens" in res.stdout and "test/tiny" in res.stdout, res.stdout


# -- the writer script the subprocess tests run --------------------------------------------------------------
def hang_after_first_chunk(writer: CacheWriter, shard: int) -> None:
    put = writer.store.put

    def put_then_hang(key, data):
        put(key, data)
        if key.startswith(f"shards/{shard:06d}/hidden/c/"):
            print("hang", key, flush=True)
            time.sleep(600)

    writer.store.put = put_then_hang


def limit_file_size(nbytes: int) -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def script_main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--shards", default=None)
    ap.add_argument("--barrier", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--big", action="store_true", help="64 KiB hidden chunks, no compression")
    args = ap.parse_args(argv)
    spec = script_spec()
    if args.big:
        spec = CacheSpec(seq_len=64, hidden_size=1024, layer_ids=[1, 2], num_rows=2, rows_per_shard=2,
                         codec="none", hidden_chunk_tokens=16)
    if args.barrier:
        print("ready", flush=True)
        while not os.path.exists(args.barrier):
            time.sleep(0.005)
    shards = range(spec.num_shards) if args.shards is None else [int(s) for s in args.shards.split(",")]
    if "DFLASH_TEST_FSIZE" in os.environ:
        limit_file_size(int(os.environ["DFLASH_TEST_FSIZE"]))
    w = None
    try:
        w = CacheWriter(args.path, spec, threads=1)
        if "DFLASH_TEST_HANG_SHARD" in os.environ:
            hang_after_first_chunk(w, int(os.environ["DFLASH_TEST_HANG_SHARD"]))
        for s in shards:
            if s not in w.committed:
                w.write_shard(s, **shard_data(spec, s, args.seed))
                print("committed", s, flush=True)
        w.close()
    except CacheError as e:
        if w is not None:
            try:
                w.close()
            except CacheError:
                pass
        print(f"{type(e).__name__}: {e}")
        print("threads after close:", dflash_threads(), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(script_main(sys.argv[1:]))


def test_overwrite_never_replaces_a_directory_that_is_not_a_cache(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    spec = CacheSpec(seq_len=16, hidden_size=4, layer_ids=[0], num_rows=2, rows_per_shard=2)
    with pytest.raises(NotACacheError, match="refusing"):
        CacheWriter(str(d), spec, overwrite=True)
    assert (d / "precious.txt").read_text() == "keep me" and sorted(p.name for p in d.iterdir()) == ["precious.txt"]


def test_fsspec_url_round_trip():
    """Any fsspec URL works through zarr's store (here fsspec's in-memory filesystem)."""
    import uuid

    import torch

    url = f"memory://dflash-{uuid.uuid4().hex}/cache"
    spec = CacheSpec(seq_len=32, hidden_size=4, layer_ids=[0, 1], num_rows=5, rows_per_shard=2)
    g = torch.Generator().manual_seed(0)
    rows = {}
    with CacheWriter(url, spec) as w:
        for s in range(spec.num_shards):
            _, n = spec.shard_rows(s)
            h = torch.randn(n, 32, 8, generator=g).to(torch.bfloat16)
            rows[s] = h
            w.write_shard(s, torch.zeros(n, 32, dtype=torch.int32), torch.ones(n, 32, dtype=torch.uint8),
                          torch.ones(n, 32, dtype=torch.int32), h)
    c = dflash_cache.open(url)
    assert len(c) == 5 and c.complete
    assert torch.equal(c[4]["hidden"].view(torch.int16), rows[2][0].view(torch.int16))
    assert dflash_cache.verify(url).ok
    assert dflash_cache.info(url)["bytes_on_disk"] > 0
