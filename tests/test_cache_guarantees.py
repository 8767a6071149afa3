"""Guarantees of the cache against a hostile user: metadata damage told from data damage, foreign files, what
--overwrite removes, the output lock. Each case failed before (it was a wrong verdict, a lost shard, a deleted
file, a traceback or two lock holders); README's "Guarantees" names these tests.

    1. root metadata   one field of the root zarr.json edited (or the file a JSON list, or deleted): verify names the
                       file and field, blames no shard; --repair restores it byte for byte from its record in
                       shards/zarr.json and un-commits nothing; train and extract point at --repair, and extract
                       resumes after it; a damaged record is rewritten from the root; a root that cannot be checked
                       and agrees with no shard is "in doubt": --repair un-commits nothing
    2. array metadata  each array's zarr.json against the spec (data type, codecs, fill value, chunks, attributes),
                       malformed JSON (a list, garbage, deleted) a named finding, restored by --repair; a shard group
                       that is a JSON list is a bad shard, not a traceback; files dflash did not write are a note
    3. wrong data      a chunk swapped for another row's (it decodes): `train` and its --val-cache reader exit 2
                       naming the shard; a shard directory moved to another index or copied from another cache is
                       caught by verify, the reader and train
    4. --overwrite     extract --overwrite removes the old cache and keeps a user's files and folders inside it
    5. the lock        8 real processes taking over one stale lock at once: exactly one wins, every trial; an
                       empty, cut-short or garbage lock record is stale (taken over with a note); lock creation
                       on a full disk fails naming the lock and leaves no file

CPU only; small synthetic caches (tests/test_cache.py) in process, the tiny target's extracted cache
(tests/test_trust.py's `env`) where extract and train run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import dflash_cache
from dflash_cache import CacheCorruptError, CacheIncompleteError
from dflash_cache.format import root_record_json
from dflash_cache.lock import LOCK_NAME, OutputLock
from tests.test_cache import all_rows, as_an_older_dflash_wrote_it, make_spec, row_equal, write_cache
from tests.test_trust import (  # noqa: F401  (env: the module-scoped fixture, an extracted tiny cache)
    PY,
    REPO,
    assert_same_but_volatile,
    cli,
    dead_pid,
    env,
    env_for_subprocess,
    error_line,
    extract_args,
    ok,
    train_args,
    write_lock,
)

SPEC = dict(num_rows=8, rows_per_shard=2)  # 4 shards of 2 rows


@pytest.fixture
def small(tmp_path) -> Path:
    path = tmp_path / "c"
    write_cache(path, make_spec(**SPEC))
    return path


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(change(doc) or doc))


def lines(out: str, prefix: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(prefix)]


def verify_cli(path, *more) -> tuple[int, str]:
    return cli("cache", "verify", path, *more)


def committed(path) -> list[int]:
    return sorted(dflash_cache.open(str(path), allow_incomplete=True).commits)


# ------------------------------------------------------------------------------------------------ 1. root metadata


def _set(*keys, value):
    def change(doc):
        node = doc
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return change


ROOT_EDITS = {
    "seq_len": (_set("attributes", "seq_len", value=32), "attribute 'seq_len' is 32, recorded 16"),
    "codec": (_set("attributes", "codec", value="zstd"), "attribute 'codec' is 'zstd', recorded 'lz4'"),
    "info": (_set("attributes", "info", "target", "name_or_path", value="other/model"),
             "attribute 'info.target.name_or_path' is 'other/model', recorded 'test/tiny'"),
    "zarr_format": (_set("zarr_format", value=2), "zarr_format is 2, expected 3"),
    "json_list": (lambda doc: [doc], "a JSON list, not an object"),
    "deleted": (None, "missing"),
}


@pytest.mark.parametrize("edit", list(ROOT_EDITS))
def test_edited_root_metadata_is_named_and_restored_without_uncommitting_a_shard(small, edit):
    """Before: an edited seq_len made verify blame every shard and --repair un-commit them all; an edited info field
    or zarr_format passed verify; a root that was a JSON list was a traceback, a deleted one 'not a cache'."""
    change, words = ROOT_EDITS[edit]
    root = small / "zarr.json"
    original = root.read_bytes()
    if change is None:
        root.unlink()
    else:
        edit_json(root, change)
    code, out = verify_cli(small)
    assert code == 1, out
    assert not lines(out, "BAD shard"), out
    bad = lines(out, "BAD metadata")
    assert len(bad) == 1 and bad[0].startswith("BAD metadata zarr.json: ") and words in bad[0], out
    assert "--repair restores it from the record" in bad[0] and "no shard is affected" in bad[0]
    if edit != "zarr_format":  # dflash reads the attributes: a reader (train, extract) refuses, pointing at --repair
        with pytest.raises(CacheCorruptError, match=r"zarr\.json .*changed or damaged.*verify .* --repair"):
            dflash_cache.open(str(small))
    code, out = verify_cli(small, "--repair")
    assert code == 0 and "repaired: rewrote 1 metadata file(s)" in out and "OK (after repair)" in out, out
    assert "un-committed" not in out
    assert root.read_bytes() == original  # restored exactly, zarr's own fields included
    cache = dflash_cache.open(str(small))
    assert cache.complete and len(cache) == SPEC["num_rows"]
    row_equal(cache[5], all_rows(make_spec(**SPEC)), 5)
    assert verify_cli(small) == (0, f"{small}: 4 of 4 shards OK, 0.00 GB decoded\nOK\n")


def test_extract_on_an_edited_root_points_at_repair_and_resumes_after_it(env, tmp_path):
    """Before: extract on a cache whose root had been edited said the *settings* differ (pass --overwrite), and after
    `verify --repair` (which had un-committed every shard) it still refused."""
    cache = tmp_path / "cache"
    shutil.copytree(env["cache"], cache)
    edit_json(cache / "zarr.json", _set("attributes", "info", "data_fingerprint", value="0" * 16))
    line = error_line(*cli(*extract_args(env["target"], env["data"], cache)), "zarr.json", "info.data_fingerprint",
                      "--repair")
    assert "settings" not in line and "--overwrite" not in line
    code, out = verify_cli(cache, "--repair")
    assert code == 0 and "OK (after repair)" in out, out
    out = ok(*extract_args(env["target"], env["data"], cache))
    assert "nothing to do" in out
    assert_same_but_volatile(env["cache"], cache)


def test_damaged_record_of_the_root_is_rewritten_from_the_root(small):
    """The record in shards/zarr.json edited (its digest no longer matches) or deleted: named, and --repair rewrites
    it from the root (which still matches the digest recorded with it). Before: not checked at all."""
    record = small / "shards" / "zarr.json"
    original = record.read_bytes()
    edit_json(record, _set("attributes", "dflash_root", "num_rows", value=99))
    code, out = verify_cli(small)
    bad = lines(out, "BAD metadata")
    assert code == 1 and len(bad) == 1 and not lines(out, "BAD shard"), out
    assert bad[0].startswith("BAD metadata shards/zarr.json: the record in shards/zarr.json does not match its digest")
    assert "the root matches the digest recorded with it" in bad[0]
    dflash_cache.open(str(small))  # readers go on: the root is intact
    assert verify_cli(small, "--repair")[0] == 0 and record.read_bytes() == original
    record.unlink()
    code, out = verify_cli(small)
    assert code == 1 and "BAD metadata shards/zarr.json: missing" in out, out
    assert verify_cli(small, "--repair")[0] == 0 and record.read_bytes() == original


def test_a_root_in_doubt_uncommits_nothing(small, tmp_path):
    """A root that cannot be checked (a cache of an older dflash: no record, commit records without the root's
    digest) and agrees with no shard, or one whose record was rewritten with it (every shard then says it was written
    under another root): the root is in doubt, not the shards. Before: --repair un-committed every shard."""
    legacy = tmp_path / "legacy"
    shutil.copytree(small, legacy)
    as_an_older_dflash_wrote_it(legacy)
    assert verify_cli(legacy)[0] == 0  # an older cache verifies (with a note)
    edit_json(legacy / "zarr.json", _set("attributes", "seq_len", value=32))
    code, out = verify_cli(legacy, "--repair")
    assert code == 1 and len(lines(out, "BAD shard")) == 4, out
    assert "no committed shard verifies against the root metadata" in out and "records no copy of its root" in out
    assert "un-committed" not in out and committed(legacy) == [0, 1, 2, 3]

    edit_json(small / "zarr.json", _set("attributes", "info", "data_fingerprint", value="x"))
    doc = json.loads((small / "zarr.json").read_text())
    (small / "shards" / "zarr.json").write_bytes(root_record_json(doc["attributes"]))  # the record made to agree
    code, out = verify_cli(small, "--repair")
    assert code == 1 and all("written for another cache" in ln for ln in lines(out, "BAD shard")), out
    assert "each was written under another root" in out and "un-committed" not in out
    assert committed(small) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------------ 2. array metadata


ZSTD = [{"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "zstd", "configuration": {"level": 1, "checksum": False}}]
ARRAY_EDITS = {
    "data_type": ("hidden", _set("data_type", value="int16"), "data_type is 'int16', expected 'uint16'"),
    "codecs": ("hidden", _set("codecs", value=ZSTD), "codecs is"),
    "fill_value": ("hidden", _set("fill_value", value=7), "fill_value is 7, expected 0"),
    "chunks": ("input_ids", _set("chunk_grid", "configuration", "chunk_shape", value=[1, 16]), "chunk_grid is"),
    "attributes": ("hidden", _set("attributes", "layer_ids", value=[1, 2]), "attributes is"),
    "json_list": ("loss_mask", lambda doc: [doc], "a JSON list, not an object"),
    "garbage": ("doc_ids", b"\x00{ not json", "not valid JSON"),
    "deleted": ("hidden", None, "missing"),
}


@pytest.mark.parametrize("edit", list(ARRAY_EDITS))
def test_array_metadata_is_checked_against_the_spec_and_restored(small, edit):
    """Before: a changed data_type, codecs, fill value or attributes passed verify; a JSON list was a traceback; a
    deleted one made the shard bad (un-committed by --repair) although its chunks were intact."""
    import zarr

    name, change, words = ARRAY_EDITS[edit]
    meta = small / "shards" / "000001" / name / "zarr.json"
    original = meta.read_bytes()
    if change is None:
        meta.unlink()
    elif isinstance(change, bytes):
        meta.write_bytes(change)
    else:
        edit_json(meta, change)
    code, out = verify_cli(small)
    assert code == 1 and not lines(out, "BAD shard"), out
    bad = lines(out, "BAD metadata")
    assert len(bad) == 1 and bad[0].startswith(f"BAD metadata shards/000001/{name}/zarr.json: ") and words in bad[0], out
    assert "--repair rewrites it from the cache's spec" in bad[0]
    row_equal(dflash_cache.open(str(small))[2], all_rows(make_spec(**SPEC)), 2)  # dflash reads through the spec
    code, out = verify_cli(small, "--repair")
    assert code == 0 and "OK (after repair)" in out and "un-committed" not in out, out
    assert meta.read_bytes() == original and committed(small) == [0, 1, 2, 3]
    got = zarr.open_array(str(small), path=f"shards/000001/{name}", mode="r")[...]  # a plain zarr client, too
    np.testing.assert_array_equal(got, all_rows(make_spec(**SPEC))[name][2:4])


def test_unreadable_shard_group_is_a_named_bad_shard(small):
    """A shard's group zarr.json (its commit record) that is a JSON list: before, a traceback in verify and in every
    reader. Now the shard is named (its checksums are lost), readers see it uncommitted, --repair un-commits it and the
    next write redoes it."""
    (small / "shards" / "000002" / "zarr.json").write_text("[]")
    code, out = verify_cli(small)
    assert code == 1 and lines(out, "BAD shard") == [
        "BAD shard 000002: shards/000002/zarr.json: a JSON list, not an object: the shard's commit record is lost"], out
    with pytest.raises(CacheIncompleteError, match="first: 2"):
        dflash_cache.open(str(small))
    code, out = verify_cli(small, "--repair")
    assert code == 1 and "un-committed 1 shard(s) 000002" in out, out
    write_cache(small, make_spec(**SPEC))  # the rerun redoes exactly it
    assert verify_cli(small)[0] == 0


def test_foreign_entries_are_listed_as_a_note_and_never_deleted(small):
    """Before: never mentioned. Now verify lists each (a folder once), stays OK, and --repair deletes none of them."""
    foreign = {"notes.txt": "mine", "analysis/plot.txt": "x", "shards/README": "y", "shards/000001/backup/a": "z",
               "shards/000099/zarr.json": "{}", "shards/000000/hidden/c/0/0/0.orig": "w", "shards/000003/hidden/c/7/0/0": ""}
    for rel, text in foreign.items():
        (small / rel).parent.mkdir(parents=True, exist_ok=True)
        (small / rel).write_text(text)
    (small / "empty_dir").mkdir()
    _flip_hidden_chunk(small, 3)  # so that --repair acts
    code, out = verify_cli(small, "--repair")
    assert code == 1 and "un-committed 1 shard(s) 000003" in out, out
    note = lines(out, "note: 8 entries not written by dflash")
    assert note and note[0].endswith(": analysis/, empty_dir/, notes.txt, shards/000000/hidden/c/0/0/0.orig, "
                                     "shards/000001/backup/, shards/000003/hidden/c/7/, shards/000099/, shards/README"), out
    assert all((small / rel).read_text() == text for rel, text in foreign.items()) and (small / "empty_dir").is_dir()
    write_cache(small, make_spec(**SPEC))
    code, out = verify_cli(small)
    assert code == 0 and out.endswith("OK\n") and "note: 8 entries" in out, out


def _flip_hidden_chunk(cache: Path, shard: int) -> None:
    f = cache / "shards" / f"{shard:06d}" / "hidden" / "c" / "0" / "1" / "0"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))


# ------------------------------------------------------------------------------------------------ 3. wrong data


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def test_moved_or_copied_shard_directories_are_caught(small, tmp_path):
    """Two shard directories swapped, and a shard copied in from another cache of the same shape: each decodes and
    matches its own checksums. Before: verify said OK and the reader served the rows in the wrong place."""
    other = tmp_path / "other"
    write_cache(other, make_spec(**SPEC, info={"data_fingerprint": "another dataset"}), seed=1)
    _swap(small / "shards" / "000000", small / "shards" / "000001")
    shutil.rmtree(small / "shards" / "000003")
    shutil.copytree(other / "shards" / "000003", small / "shards" / "000003")
    code, out = verify_cli(small)
    assert code == 1 and lines(out, "BAD shard") == [
        "BAD shard 000000: commit record: written as shard 1, found at shard 0 (a moved or swapped shard)",
        "BAD shard 000001: commit record: written as shard 0, found at shard 1 (a moved or swapped shard)",
        "BAD shard 000003: " + lines(out, "BAD shard 000003")[0].split(": ", 1)[1]], out
    assert "commit record: written for another cache" in lines(out, "BAD shard 000003")[0]
    cache = dflash_cache.open(str(small))
    for row, shard in ((0, 0), (3, 1), (7, 3)):
        with pytest.raises(CacheCorruptError, match=f"shard {shard}: commit record: written"):
            cache[row]
    row_equal(cache[4], all_rows(make_spec(**SPEC)), 4)  # shard 2 is intact


def _train_env_cache(env, tmp_path, name: str) -> Path:
    cache = tmp_path / name
    shutil.copytree(env["cache"], cache)
    return cache


def test_train_exits_2_naming_a_shard_holding_another_rows_chunk(env, tmp_path):
    """Row 0's hidden chunk of shard 1 swapped for row 1's: both decode, only the checksums can tell. `train` (which
    reads with checksums on) and its --val-cache reader stop with one line naming the cache and the shard."""
    cache = _train_env_cache(env, tmp_path, "swapped")
    c = cache / "shards" / "000001" / "hidden" / "c"
    assert (c / "0" / "0" / "0").read_bytes() != (c / "1" / "0" / "0").read_bytes()
    _swap(c / "0" / "0" / "0", c / "1" / "0" / "0")
    error_line(*cli(*train_args(env, tmp_path / "run", "--epochs", 1, cache=cache)), str(cache), "shard 1",
               "checksum mismatch", "shards/000001/hidden/c/")
    error_line(*cli(*train_args(env, tmp_path / "run_val", "--max-steps", 1, "--val-cache", cache)), str(cache),
               "shard 1", "checksum mismatch")


def test_train_exits_2_naming_a_moved_shard(env, tmp_path):
    """Two whole shard directories swapped (records and chunks agree with each other): before, train read the rows
    in the wrong places without a word; now it stops naming the shard."""
    cache = _train_env_cache(env, tmp_path, "moved")
    _swap(cache / "shards" / "000000", cache / "shards" / "000001")
    error_line(*cli(*train_args(env, tmp_path / "run", "--epochs", 1, cache=cache)), str(cache),
               "commit record: written as shard")


# ------------------------------------------------------------------------------------------------ 4. --overwrite


def test_extract_overwrite_keeps_what_dflash_did_not_write(env, tmp_path):
    """Before: `extract --overwrite` deleted everything in the directory but its lock. Now only the old cache goes;
    the user's files and folders stay, and the command names them."""
    cache = _train_env_cache(env, tmp_path, "cache")
    mine = {"notes.txt": "mine", "analysis/plot.txt": "x", "shards/README": "y", "shards/000001/backup/a": "z"}
    for rel, text in mine.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_text(text)
    out = ok(*extract_args(env["target"], env["data"], cache, "--overwrite"))
    assert "--overwrite kept 4 entries dflash did not write: analysis/, notes.txt, shards/000001/backup/, shards/README" in out
    assert all((cache / rel).read_text() == text for rel, text in mine.items())
    for rel in ("notes.txt", "analysis", "shards/README", "shards/000001/backup"):  # the rest is a fresh cache
        shutil.rmtree(cache / rel) if (cache / rel).is_dir() else (cache / rel).unlink()
    assert_same_but_volatile(env["cache"], cache)


# ------------------------------------------------------------------------------------------------ 5. the lock

CONTENDER = r"""
import os, sys, time
from dflash_cache.lock import LockedError, OutputLock

root, me, rounds, per_round, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
print("ready", flush=True)
sys.stdin.readline()  # all have started (no one spins while the others import)


def barrier(name):
    open(os.path.join(root, f"{name}.{me}"), "w").close()
    while sum(f.startswith(name + ".") for f in os.listdir(root)) < n:
        time.sleep(0.0002)


for r in range(rounds):
    barrier(f"go{r}")  # all leave it within microseconds, and take over the round's stale locks one after the other
    held = []
    for t in range(r * per_round, (r + 1) * per_round):
        try:
            held.append(OutputLock(os.path.join(root, f"out{t}"), "racer").acquire())
        except LockedError:
            print(t, 0, flush=True)
        else:
            print(t, 1, flush=True)
    barrier(f"tried{r}")  # hold them until everyone has tried: a release would let the next one in, legitimately
    for lock in held:
        lock.release()
"""


def test_stale_lock_taken_over_by_8_processes_at_once_admits_exactly_one(tmp_path):
    """8 real processes take over the same 300 stale locks (a dead pid's, or a pid that now runs a newer process),
    reaching each at nearly the same moment. Before: the takeover renamed the lock aside and created a new one, so a
    process that had read the stale record could set aside the winner's fresh lock: two holders in 3-5% of the
    locks. Now the compare-and-replace runs under an flock: exactly one process holds each lock."""
    n, rounds, per_round = 8, 3, 100
    dead = dead_pid()
    for t in range(rounds * per_round):  # odd: a live pid that started after the record (reused): stale too
        write_lock(tmp_path / f"out{t}", **({"pid": dead} if t % 2 == 0 else {"pid": os.getpid(), "started_unix": 0.0}))
    procs = [subprocess.Popen([PY, "-c", CONTENDER, str(tmp_path), str(i), str(rounds), str(per_round), str(n)],
                              cwd=REPO, env=env_for_subprocess(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(n)]
    try:
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * n, [p.stderr.read()[-2000:] for p in procs]
        for p in procs:
            p.stdin.write("start\n")
            p.stdin.close()
        outs = [(p.stdout.read(), p.stderr.read(), p.wait(timeout=120))[:2] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    holders = np.zeros(rounds * per_round, int)
    for out, _ in outs:
        for line in out.splitlines():
            t, won = map(int, line.split())
            holders[t] += won
    assert np.bincount(holders, minlength=3).tolist()[:3] == [0, rounds * per_round, 0], np.bincount(holders)
    assert not any(f.startswith(LOCK_NAME) for t in range(rounds * per_round) for f in os.listdir(tmp_path / f"out{t}"))


@pytest.mark.parametrize("content", [b"", b'{"host": "gpu-node-7", "pi', b"\x00\x00\x00\x00", b'{"host": "h", "pid": "x"}'])
def test_unreadable_lock_record_is_stale(tmp_path, content):
    """An empty lock (a full disk when an older dflash created it), one cut short, garbage, or a record whose pid is
    not a number: before, refused forever as 'pid ? on host ?' (or a traceback). Now taken over, with a note."""
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_bytes(content)
    lock = OutputLock(str(out), "test").acquire()
    assert "took over an unreadable lock record" in lock.note
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert os.listdir(out) == []


def test_extract_takes_over_an_empty_lock(env, tmp_path):
    cache = _train_env_cache(env, tmp_path, "cache")
    (cache / LOCK_NAME).write_bytes(b"")
    out = ok(*extract_args(env["target"], env["data"], cache))
    assert "took over an unreadable lock record" in out and not (cache / LOCK_NAME).exists()


FULL_DISK = r"""
import resource, signal, sys
from dflash_cache import CacheError
from dflash_cache.lock import OutputLock

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) like one on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
try:
    OutputLock(sys.argv[1], "full disk").acquire()
except CacheError as e:
    print(e)
"""


def test_lock_creation_on_a_full_disk_leaves_no_lock(tmp_path):
    """Before: the record was written into the created lock file: a full disk left it empty or cut short, and every
    later run was refused. Now the record is written whole to a temp file first: the error names the lock, and
    nothing is left behind; the next run takes the lock."""
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run([PY, "-c", FULL_DISK, str(out)], cwd=REPO, env=env_for_subprocess(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith(f"cannot create the lock {out / LOCK_NAME}: "), res
    assert os.listdir(out) == []
    lock = OutputLock(str(out), "next").acquire()
    assert lock.note == ""
    lock.release()
