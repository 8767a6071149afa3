"""Every small file dflash writes and later reads (records, pointers, manifests, locks, JSON summaries), damaged
each way a file is damaged: empty, cut short, the wrong JSON type, not UTF-8, a directory in its place.

The rule (README, Guarantees): a damaged file is never a traceback. What can be rebuilt or passed over is (a summary
rewritten, a tokenise-cache entry rebuilt; a pointer, a compile record and a lock passed over with a note naming
them; a shard's commit record: the shard counts as not committed); what vouches for work that cannot be redone
without the user's word (run.json, regenerate's record and counts, a cache's root) is one `error:` line naming the
file, and so is a directory where dflash keeps a file (not its own: never removed). The table (SMALL_FILES) gives, per file, the command that reads it again and what it must end as.

Also here: a compile record set aside (not a traceback at every rerun), a compile payload torch cannot read
reported as ignored (not "loaded"), a lock record described as what it is, and a jsonl with an invalid UTF-8 byte
named by file and line in `extract` and `regenerate`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_hostile_input import REGEN, command, world  # noqa: F401  (world: the module's fixture)
from tests.test_trust import cli, error_line, ok

DAMAGE = {
    "empty": lambda f: f.write_bytes(b""),
    "cut_short": lambda f: f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 2)]),
    "a_list": lambda f: f.write_text("[1, 2]"),
    "null": lambda f: f.write_text("null"),
    "not_utf8": lambda f: f.write_bytes(b"\xff\xfe" + f.read_bytes()[:20] + b"\xc3("),
    "a_directory": lambda f: (f.unlink(), f.mkdir(), (f / "x").write_text("x")),
}

# file (relative to its output) -> (output in `world`, what reads it again, expected end): ("ok", needle of the note
# in the output, or None) or ("error", needle of the one error line)
SMALL_FILES = {
    "run.json": ("run", "train", ("error", "run.json")),
    "summary.json": ("run", "train", ("ok", None)),
    "metrics.jsonl": ("run", "train", ("ok", None)),
    "checkpoints/latest": ("run", "train", ("ok", "checkpoints/latest")),
    "dflash_regenerate.json": ("regen", "regenerate", ("error", "dflash_regenerate.json")),
    "data/.part-00000.stats.json": ("regen", "regenerate", ("error", ".part-00000.stats.json")),
    "checkpoints/step_00000002/trainer.json": ("run", "train", ("error", "no intact checkpoint")),
    "checkpoints/step_00000002/manifest.json": ("run", "train", ("error", "no intact checkpoint")),
    ".dflash.lock": ("cache", "extract", ("ok", "took over an unreadable lock record")),
    "zarr.json": ("cache", "train_on", ("error", "zarr.json")),
    "shards/000000/zarr.json": ("cache", "train_on", ("error", "not committed (first: 0)")),
    "*/meta.json": ("tokenized", "extract_with", ("ok", None)),
}


def rerun(kind: str, w: dict, tmp: Path, out: Path) -> list:
    if kind == "train_on":
        return command("train", w, tmp, cache=out)
    if kind == "extract_with":
        return command("extract", w, tmp, **{"tokenize-cache": out})
    if kind == "train":
        return command("train", w, tmp, out=out, **{"max-steps": 2})
    if kind == "regenerate":
        return [*REGEN, "--target", w["target"], "--data", w["data"], "--out", out]
    return command("extract", w, tmp, out=out)


CASES = [pytest.param(f, how, id=f"{f}:{how}") for f in SMALL_FILES for how in DAMAGE
         if not (f == ".dflash.lock" and how == "a_directory")]  # a lock that is a directory: test below


@pytest.mark.parametrize("name, how", CASES)
def test_a_damaged_small_file_is_a_note_or_one_line(world, tmp_path, name, how):  # noqa: F811
    where, kind, (end, needle) = SMALL_FILES[name]
    out = tmp_path / where
    shutil.copytree(world[where] if where in world else world["root"] / where, out)
    f = next(out.glob(name), out / name)
    if not f.exists():
        f.write_text(json.dumps({"host": "h", "pid": 1}))
    DAMAGE[how](f)
    code, text = cli(*rerun(kind, world, tmp_path, out))
    if how == "a_directory" and name in ("summary.json", "metrics.jsonl", "zarr.json", "shards/000000/zarr.json"):
        end, needle = "error", "is a directory"  # not dflash's: never removed, named
    if end == "error":
        error_line(code, text, needle)
        return
    assert code == 0, text[-3000:]
    assert "Traceback" not in text
    if needle:
        assert needle in text, text[-3000:]


# ------------------------------------------------------------------------------------------------ compile records


def _saved_artifacts(tmp_path, monkeypatch, payload: bytes = b"compiled state " * 100):
    from dflash.train.fit.compile_step import CompileArtifacts

    art = tmp_path / "artifacts"
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload, None))
    saved = CompileArtifacts(str(art), {"what": "step-a"})
    assert saved.save().startswith("saved compile artifacts")
    monkeypatch.undo()
    return saved


@pytest.mark.parametrize("how", [*DAMAGE, "env_not_an_object"])
def test_a_damaged_compile_record_is_set_aside_with_a_note(tmp_path, monkeypatch, how):
    """Before: a record that was a JSON list or null, or whose env was not an object, was an AttributeError at train
    start, and every rerun failed until the file was deleted by hand."""
    from dflash.train.fit.compile_step import CompileArtifacts

    saved = _saved_artifacts(tmp_path, monkeypatch)
    data_path, rec_path = map(Path, saved.paths)
    if how == "env_not_an_object":
        rec = json.loads(rec_path.read_text())
        rec_path.write_text(json.dumps({**rec, "env": "cpu"}))
    else:
        DAMAGE[how](rec_path)
    loads = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loads.append)
    note = CompileArtifacts(saved.dir, {"what": "step-a"}).load()
    assert "is damaged" in note and "kept aside as damaged-" in note, note
    assert loads == [] and not rec_path.exists() and not data_path.exists()
    assert (rec_path.parent / ("damaged-" + rec_path.name)).exists()
    assert (data_path.parent / ("damaged-" + data_path.name)).exists()
    again = CompileArtifacts(saved.dir, {"what": "step-a"})  # the rerun: nothing to load, a good pair saved after
    assert again.load().startswith("no compile artifacts")
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"new state", None))
    assert again.save().startswith("saved compile artifacts") and json.loads(rec_path.read_text())["bytes"] == 9


def test_a_checked_payload_torch_cannot_read_is_reported_as_ignored(tmp_path, monkeypatch):
    """Before: "loaded ... (checked)" was printed although torch rejected the payload (it returns None and logs)."""
    from dflash.train.fit.compile_step import CompileArtifacts

    saved = _saved_artifacts(tmp_path, monkeypatch, payload=b"not a torch payload")  # size and checksum match
    art = CompileArtifacts(saved.dir, {"what": "step-a"})
    note = art.load()
    assert "ignored: checked, but torch could not load them" in note and not art.loaded, note


# ------------------------------------------------------------------------------------------------ locks


@pytest.mark.parametrize("content, what", [
    (b"", "empty"), (b'{"host": "h", "pid', "not JSON"), (b"\xff\xfe\x00", "not UTF-8"), (b"[1]", "a JSON list"),
    (b'{"host": "h", "pid": "abc"}', "a record whose pid is 'abc', not a process id"),
    (b'{"host": 3, "pid": 1}', "a record whose host is 3, not a host name")])
def test_an_unreadable_lock_is_described_as_what_it_is(tmp_path, content, what):
    """Before: a lock whose pid is not a number was described as "empty or cut short"."""
    from dflash_cache.lock import LOCK_NAME, OutputLock

    (tmp_path / LOCK_NAME).write_bytes(content)
    lock = OutputLock(str(tmp_path), "test").acquire()
    assert f"took over an unreadable lock record ({what}" in lock.note, lock.note
    lock.release()


def test_a_lock_that_is_a_directory_is_one_line(world, tmp_path):  # noqa: F811
    from dflash_cache.lock import LOCK_NAME

    out = tmp_path / "cache"
    shutil.copytree(world["cache"], out)
    (out / LOCK_NAME).mkdir()
    error_line(*cli(*rerun("extract", world, tmp_path, out)), LOCK_NAME)


# ------------------------------------------------------------------------------------------------ data not UTF-8


def _bad_utf8_jsonl(w: dict, tmp: Path, byte: bytes) -> Path:
    """The world's data with one invalid UTF-8 byte inside a string of line 3."""
    lines = Path(w["data"]).read_bytes().splitlines(keepends=True)
    assert b'"content": "' in lines[2]
    lines[2] = lines[2].replace(b'"content": "', b'"content": "' + byte, 1)
    bad = tmp / "bad.jsonl"
    bad.write_bytes(b"".join(lines))
    return bad


@pytest.mark.parametrize("byte", [b"\xe9", b"\xff"])
@pytest.mark.parametrize("cmd", ["extract", "regenerate"])
def test_a_jsonl_with_an_invalid_utf8_byte_is_one_line_naming_file_and_line(world, tmp_path, cmd, byte,  # noqa: F811
                                                                            monkeypatch):
    """Before: a traceback in extract (the tokenise cache) and in regenerate (pyarrow)."""
    bad = _bad_utf8_jsonl(world, tmp_path, byte)
    monkeypatch.setenv("DFLASH_TOKENIZE_CACHE", str(tmp_path / "tok"))
    error_line(*cli(*command(cmd, world, tmp_path, data=bad)), "bad.jsonl", "line 3", "UTF-8")
