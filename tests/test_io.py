"""dflash.core.io: the one atomic write (no half file, no temporary left behind) and the one short content hash."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.core.io import atomic_json, atomic_jsonl, atomic_write, short_hash, temporary_name  # noqa: E402


@pytest.mark.parametrize("durable", [False, True])
def test_atomic_write_replaces_whole_and_cleans_up(tmp_path, durable):
    p = tmp_path / "f.txt"
    p.write_text("old")
    atomic_write(str(p), "new é", durable=durable)
    assert p.read_text(encoding="utf-8") == "new é"
    atomic_write(str(p), b"\x00bytes")
    assert p.read_bytes() == b"\x00bytes"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("keep")  # a non-empty directory in the way: the rename fails
    with pytest.raises(OSError):
        atomic_write(str(tmp_path / "d"), "data", durable=durable)
    assert sorted(os.listdir(tmp_path)) == ["d", "f.txt"]  # no temporary left behind
    assert os.path.basename(temporary_name(str(p))).startswith(".f.txt.tmp-")


def test_atomic_json_and_jsonl(tmp_path):
    atomic_json(str(tmp_path / "a.json"), {"b": 1, "p": tmp_path})
    assert json.loads((tmp_path / "a.json").read_text()) == {"b": 1, "p": str(tmp_path)}
    atomic_jsonl(str(tmp_path / "r.jsonl"), [{"t": "ü"}, {"t": 2}], ensure_ascii=False)
    assert (tmp_path / "r.jsonl").read_text(encoding="utf-8") == '{"t": "ü"}\n{"t": 2}\n'


def test_short_hash():
    assert short_hash(b"abc") == hashlib.sha256(b"abc").hexdigest()[:16]
    assert short_hash("é") == hashlib.sha256("é".encode()).hexdigest()[:16]
    assert short_hash(iter([b"a", b"bc"])) == short_hash(b"abc")  # chunks hash as their concatenation
    assert short_hash(b"abc", chars=24) == hashlib.sha256(b"abc").hexdigest()[:24]
    assert short_hash(b"abc") != short_hash(b"abd")
