"""bench/regenerate.py's --engine: the eager Engine and the slot engine, booking each step one step late or at once,
run over the same prompts write the same number of tokens (the slot engine's outputs themselves are
tests/test_slot_engine.py's)."""

from __future__ import annotations

import json

import pytest

from tests.tiny import make_tiny_target


def test_every_engine_generates_the_same_tokens(tmp_path, capsys, monkeypatch):
    import bench.regenerate as bench

    target = make_tiny_target(tmp_path / "target")
    out = tmp_path / "r.json"
    monkeypatch.setattr("sys.argv", ["regenerate.py", "--model", str(target), "--prompts", "6", "--batch-size", "4",
                                     "--max-new-tokens", "6", "--ignore-eos", "--device", "cpu",
                                     "--engine", "eager,slots,slots-at-once", "--json", str(out)])
    bench.main()
    rows = json.loads(out.read_text())
    assert [r["engine"] for r in rows] == ["eager", "slots", "slots-at-once"]
    assert {r["generated_tokens"] for r in rows} == {36} and all(r["decode_steps"] >= 5 for r in rows)
    printed = capsys.readouterr().out
    assert "         slots" in printed and " slots-at-once" in printed
    monkeypatch.setattr("sys.argv", ["regenerate.py", "--model", str(target), "--prompts", "2", "--device", "cpu",
                                     "--engine", "fast"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--engine: 'fast' is not one of eager, slots, slots-at-once" in capsys.readouterr().err
