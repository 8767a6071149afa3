"""A resume never mixes two inputs, and a damaged run file is named or healed, never a traceback.

    1. cache identity   run.json records the identity of --cache and --val-cache (the root attributes that define
                        their content: data, tokenizer, template and weights fingerprints, extraction settings,
                        rows); a resume on another cache at the same path is one error line naming the field, the
                        run and the cache; the same content re-extracted resumes
    2. regenerate       resumed with other target weights (same shapes): refused naming the first tensor that
                        differs; resumed after the data file was replaced in place (same rows): refused by the
                        data's content fingerprint; an output recorded before the fingerprints resumes with a note
    3. stale data       a data file rewritten with its mtime restored is read as it is now (datasets' own cache,
                        also with --tokenize-cache off), and dflash's tokenise cache is keyed by content
    4. tokenise cache   a damaged entry (bytes changed, a file cut short, meta.json garbled) is found by its
                        checksums and rebuilt with a note: never wrong ids under an unchanged fingerprint
    5. partial regen    --data at an unfinished regenerate output (OUT, OUT/data, a glob of its parts) is refused
                        naming how many parts are committed and which are missing
    6. metrics.jsonl    a partial last line (disk full while appending) is dropped with a note on resume
    7. latest           `checkpoints/latest` naming a missing step: resume from the newest intact checkpoint
    8. damaged newest   a truncated model.safetensors / optimizer.pt / trainer.json in the newest checkpoint: one
                        note, resume from the older intact one, and the result equals the run before the damage;
                        no intact checkpoint at all: one error line
    9. bad JSON         invalid JSON in a jsonl (or .json) names the file and the line
   10. fewer steps      a finished run given fewer steps: refused in one line (a resume cannot go back), run.json
                        kept; with --overwrite it starts over and run.json, final/ and summary.json agree

Everything runs on CPU with the tiny target of tests/tiny.py, in process (click's runner), through the helpers of
tests/test_trust.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import dflash_cache
from dflash.core.chat import DataError, load_chat_dataset
from dflash.extract.data import ChatTokenizer, data_fingerprint, tokenize_dataset
from tests.test_trust import cli, error_line, extract_args, ok, train_args
from tests.tiny import chat_rows, make_tiny_target, make_tiny_tokenizer, write_jsonl

RUN = ["--save-every", 1, "--keep-checkpoints", 3]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, 40 conversations, and a cache extracted from them; datasets' and dflash's tokenise caches
    live under the test's directory."""
    import datasets

    root = tmp_path_factory.mktemp("identity")
    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf_datasets"))
    mp.setenv("DFLASH_TOKENIZE_CACHE", str(root / "tokenized"))
    target = make_tiny_target(root / "target", seed=0)
    data = write_jsonl(root / "chat.jsonl", chat_rows(40, seed=3))
    cache = root / "cache"
    ok(*extract_args(target, data, cache))
    yield {"root": root, "target": target, "data": data, "cache": cache}
    mp.undo()


# ------------------------------------------------------------------------------------------------ 1. cache identity


def test_train_refuses_another_cache_at_the_same_path(world, tmp_path):
    cache, val = tmp_path / "cache", tmp_path / "val"
    shutil.copytree(world["cache"], cache)
    shutil.copytree(world["cache"], val)
    other = write_jsonl(tmp_path / "other.jsonl", chat_rows(40, seed=5))
    env = {"cache": cache, "target": world["target"]}
    run = tmp_path / "run"
    val_args = ["--val-cache", val, "--val-rows", 2, "--val-max-new-tokens", 4]
    ok(*train_args(env, run, "--max-steps", 2, *RUN, *val_args))
    recorded = json.loads((run / "run.json").read_text())["caches"]
    assert recorded["cache"]["identity"]["info.data_fingerprint"] == \
        dflash_cache.open(str(cache)).metadata["info"]["data_fingerprint"]
    assert recorded["cache"]["identity"]["num_rows"] == len(dflash_cache.open(str(cache)))

    ok(*extract_args(world["target"], other, cache, "--overwrite"))  # other data, same path
    line = error_line(*cli(*train_args(env, run, "--max-steps", 3, *RUN, *val_args)),
                      "--cache", str(run), str(cache), "info.data_fingerprint", "--overwrite")
    assert "re-extracted" in line or "another cache" in line
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000001", "step_00000002"]  # untouched

    ok(*extract_args(world["target"], world["data"], cache, "--overwrite"))  # the same content again: resumes
    out = ok(*train_args(env, run, "--max-steps", 3, *RUN, *val_args))
    assert "at step 2" in out

    ok(*extract_args(world["target"], other, val, "--overwrite"))  # the held-out cache replaced in place
    error_line(*cli(*train_args(env, run, "--max-steps", 4, *RUN, *val_args)),
               "--val-cache", str(val), str(run), "info.data_fingerprint")
    out = ok(*train_args(env, run, "--max-steps", 4, *RUN, *val_args, "--overwrite"))
    assert "resumed" not in out


# ------------------------------------------------------------------------------------------------ 2. regenerate


@pytest.fixture(scope="module")
def regen(world, tmp_path_factory):
    """A complete `dflash regenerate` output: 6 conversations in 3 parts."""
    root = tmp_path_factory.mktemp("regen")
    data = write_jsonl(root / "prompts.jsonl", chat_rows(6, seed=7, turns=(1, 1)))
    out = root / "out"
    ok("regenerate", "--target", world["target"], "--data", data, "--out", out, "--max-new-tokens", 4,
       "--part-size", 2, "--no-progress")
    return {"data": data, "out": out}


def unfinished(src: Path, dst: Path, missing: int = 1) -> Path:
    """A copy of a regenerate output as a run killed before committing part `missing` leaves it."""
    shutil.copytree(src, dst)
    (dst / "data" / f"part-{missing:05d}.jsonl").unlink()
    (dst / "data" / f".part-{missing:05d}.stats.json").unlink()
    meta = json.loads((dst / "dflash_regenerate.json").read_text())
    meta.pop("counts", None)
    (dst / "dflash_regenerate.json").write_text(json.dumps(dict(meta, complete=False)))
    return dst


def regen_args(target, data, out) -> list:
    return ["regenerate", "--target", target, "--data", data, "--out", out, "--max-new-tokens", 4, "--part-size", 2,
            "--no-progress"]


def test_regenerate_resume_refuses_other_weights_naming_the_tensor(world, regen, tmp_path):
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-target"
    shutil.copytree(world["target"], other)
    sd = load_file(str(other / "model.safetensors"))
    sd["model.layers.2.mlp.up_proj.weight"] = sd["model.layers.2.mlp.up_proj.weight"] * 1.01  # same shapes
    save_file(sd, str(other / "model.safetensors"), metadata={"format": "pt"})

    out = unfinished(regen["out"], tmp_path / "out")
    error_line(*cli(*regen_args(other, regen["data"], out)), "--target", str(out), "model.layers.2.mlp.up_proj.weight")
    assert not (out / "data" / "part-00001.jsonl").exists()  # nothing written from the other weights
    ok(*regen_args(world["target"], regen["data"], out))  # the target it was started with: resumes, completes
    assert (out / "data" / "part-00001.jsonl").read_bytes() == (regen["out"] / "data" / "part-00001.jsonl").read_bytes()


def test_regenerate_resume_refuses_data_replaced_in_place(world, regen, tmp_path):
    data = Path(shutil.copy(regen["data"], tmp_path / "prompts.jsonl"))
    out = tmp_path / "out"
    ok(*regen_args(world["target"], data, out))
    unfinished(out, tmp_path / "out2")
    write_jsonl(data, chat_rows(6, seed=8, turns=(1, 1)))  # same path, same row count, other prompts
    error_line(*cli(*regen_args(world["target"], data, tmp_path / "out2")), "--data", str(data), "changed")
    assert not (tmp_path / "out2" / "data" / "part-00001.jsonl").exists()


def test_regenerate_output_recorded_before_fingerprints_resumes_with_a_note(world, regen, tmp_path):
    out = unfinished(regen["out"], tmp_path / "out")
    meta = json.loads((out / "dflash_regenerate.json").read_text())
    meta.pop("weights", None)
    meta["identity"].pop("data_fingerprint", None)
    (out / "dflash_regenerate.json").write_text(json.dumps(meta))
    text = ok(*regen_args(world["target"], regen["data"], out))
    assert "note:" in text and "weights" in text
    assert json.loads((out / "dflash_regenerate.json").read_text())["complete"]


# ------------------------------------------------------------------------------------------------ 3. stale data


def _rewrite_keeping_mtime(path, rows) -> None:
    st = os.stat(path)
    write_jsonl(path, rows)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_data_rewritten_with_its_mtime_restored_is_read_as_it_is_now(world, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(40, seed=3))
    assert len(load_chat_dataset(path)) == 40  # now in datasets' own cache
    _rewrite_keeping_mtime(path, chat_rows(40, seed=3)[:20])  # cut to half its lines
    assert len(load_chat_dataset(path)) == 20
    out = ok(*extract_args(world["target"], path, tmp_path / "cache", "--tokenize-cache", "off"))
    assert "20 conversations" in out

    # same row count, other content, mtime restored: dflash's tokenise cache serves the new content too
    import dflash.extract.tokenize_cache as tc

    chat_tok = ChatTokenizer(make_tiny_tokenizer())
    same = write_jsonl(tmp_path / "s.jsonl", chat_rows(20, seed=1))
    first = tc.tokenize_cached(load_chat_dataset(same), chat_tok, 128, same, str(tmp_path / "tok"), workers=1,
                               progress=False)
    _rewrite_keeping_mtime(same, chat_rows(20, seed=2))
    fresh = tokenize_dataset(load_chat_dataset(write_jsonl(tmp_path / "fresh.jsonl", chat_rows(20, seed=2))),
                             chat_tok, 128, "fresh", progress=False)
    again = tc.tokenize_cached(load_chat_dataset(same), chat_tok, 128, same, str(tmp_path / "tok"), workers=1,
                               progress=False)
    assert data_fingerprint(again) == data_fingerprint(fresh) != data_fingerprint(first)


def test_data_content_fingerprint_is_of_the_bytes(tmp_path):
    """Content, not path or mtime: a copy elsewhere has the same fingerprint, one byte changed another."""
    from dflash.core.chat import content_fingerprint

    a = write_jsonl(tmp_path / "a.jsonl", chat_rows(10, seed=1))
    b = shutil.copy(a, tmp_path / "b.jsonl")
    fa = content_fingerprint([a])
    assert fa == content_fingerprint([b]) and load_chat_dataset(a).dflash_content == fa
    raw = bytearray(Path(b).read_bytes())
    raw[100] ^= 1
    Path(b).write_bytes(bytes(raw))
    assert content_fingerprint([b]) != fa


# ------------------------------------------------------------------------------------------------ 4. tokenise cache


@pytest.mark.parametrize("damage", ["ids changed", "mask cut short", "meta garbled"])
def test_damaged_tokenize_cache_entry_is_rebuilt(tmp_path, capsys, damage):
    import dflash.extract.tokenize_cache as tc

    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(30, seed=4))
    ds, chat_tok = load_chat_dataset(path), ChatTokenizer(make_tiny_tokenizer())
    cache = tmp_path / "tok"
    good = tc.tokenize_cached(ds, chat_tok, 128, path, str(cache), workers=1, progress=False)
    want = data_fingerprint(good)
    good_docs = [(np.array(i), np.array(m)) for i, m in good.docs]  # copies: the entry's maps are about to change
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    victim = {"ids changed": "ids.npy", "mask cut short": "mask.npy", "meta garbled": "meta.json"}[damage]
    raw = bytearray((entry / victim).read_bytes())
    if damage == "ids changed":
        raw[-3] ^= 0x01  # a token id, not the header: np.load still reads it
    elif damage == "mask cut short":
        raw = raw[: len(raw) - 5]
    else:
        raw = raw[: len(raw) // 2]
    (entry / victim).write_bytes(bytes(raw))
    capsys.readouterr()

    again = tc.tokenize_cached(ds, chat_tok, 128, path, str(cache), workers=1, progress=False)
    note = capsys.readouterr().out
    assert victim in note and "rebuil" in note, note
    assert data_fingerprint(again) == want == again.fingerprint
    assert len(again.docs) == len(good_docs)
    for (i1, m1), (i2, m2) in zip(good_docs, again.docs):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(m1, m2)
    tc.tokenize_cached(ds, chat_tok, 128, path, str(cache), workers=1, progress=False)
    assert "rebuil" not in capsys.readouterr().out  # healed: read as it is


# ------------------------------------------------------------------------------------------------ 5. partial regen


def test_unfinished_regenerate_output_is_refused_as_data(world, regen, tmp_path):
    out = unfinished(regen["out"], tmp_path / "regen")
    for data in (out, out / "data", out / "data" / "*.jsonl"):
        with pytest.raises(DataError, match=r"2 of 3 parts committed.*part-00001.*dflash regenerate"):
            load_chat_dataset(str(data))
    error_line(*cli(*extract_args(world["target"], out / "data", tmp_path / "cache")),
               str(out), "2 of 3 parts committed", "dflash regenerate")
    assert not (tmp_path / "cache").exists()

    # a part removed from a complete output (its record says complete): refused too
    done = tmp_path / "done"
    shutil.copytree(regen["out"], done)
    (done / "data" / "part-00002.jsonl").unlink()
    with pytest.raises(DataError, match=r"2 of 3 parts committed"):
        load_chat_dataset(str(done / "data"))
    assert len(load_chat_dataset(str(regen["out"] / "data"))) == 6  # the complete one is read


# ------------------------------------------------------------------------------------------------ 6. metrics.jsonl


def test_partial_last_metrics_line_is_dropped_on_resume(world, tmp_path):
    run = tmp_path / "run"
    ok(*train_args(world, run, "--max-steps", 3, *RUN))
    shutil.rmtree(run / "checkpoints" / "step_00000003")
    (run / "checkpoints" / "latest").write_text("step_00000002")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])  # disk full mid-line
    out = ok(*train_args(world, run, "--max-steps", 3, *RUN))
    assert "at step 2" in out
    notes = [ln for ln in out.splitlines() if "metrics.jsonl" in ln]
    assert len(notes) == 1 and "line 3" in notes[0], out
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    ok(*train_args(world, run, "--max-steps", 4, *RUN))  # and every later resume


# ------------------------------------------------------------------------------------------------ 7-8. checkpoints


def test_latest_naming_a_missing_step_resumes_from_the_newest_intact_one(world, tmp_path):
    run = tmp_path / "run"
    ok(*train_args(world, run, "--max-steps", 2, *RUN))
    (run / "checkpoints" / "latest").write_text("step_00000009")
    out = ok(*train_args(world, run, "--max-steps", 3, *RUN))
    assert "resumed from" in out and "step_00000002 at step 2" in out, out
    notes = [ln for ln in out.splitlines() if "step_00000009" in ln]
    assert len(notes) == 1 and "step_00000002" in notes[0]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"


def _weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("victim,manifest", [("model.safetensors", True), ("optimizer.pt", True),
                                             ("trainer.json", True), ("model.safetensors", False),
                                             ("optimizer.pt", False)])
def test_damaged_newest_checkpoint_falls_back_to_the_older_intact_one(world, tmp_path, victim, manifest):
    """manifest=False: a checkpoint written before manifests, judged by whether its files are whole."""
    run = tmp_path / "run"
    ok(*train_args(world, run, "--max-steps", 3, *RUN))
    before = _weights(run / "final")
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    if not manifest:
        for d in (run / "checkpoints").iterdir():
            if d.is_dir():
                (d / "manifest.json").unlink()
    f = run / "checkpoints" / "step_00000003" / victim
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated (a full disk, a torn copy)

    out = ok(*train_args(world, run, "--max-steps", 3, *RUN))
    notes = [ln for ln in out.splitlines() if "step_00000003" in ln]
    assert len(notes) == 1 and victim in notes[0] and "step_00000002" in notes[0], out
    assert "resumed from" in out and "at step 2" in out
    after = _weights(run / "final")
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)  # exact
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss"] == last["loss"]
    assert any(n.startswith("damaged-") for n in os.listdir(run / "checkpoints"))  # kept aside, not deleted


def test_no_intact_checkpoint_is_one_error_line(world, tmp_path):
    run = tmp_path / "run"
    ok(*train_args(world, run, "--max-steps", 2, *RUN))
    for d in ("step_00000001", "step_00000002"):
        (run / "checkpoints" / d / "model.safetensors").write_bytes(b"\0" * 10)
    error_line(*cli(*train_args(world, run, "--max-steps", 3, *RUN)), str(run), "no intact checkpoint", "--overwrite")
    ok(*train_args(world, run, "--max-steps", 1, *RUN, "--overwrite"))


# ------------------------------------------------------------------------------------------------ 9. bad JSON


def test_invalid_json_names_the_file_and_line(world, tmp_path):
    lines = [json.dumps(r) for r in chat_rows(10, seed=2)]
    lines[7] = '{"messages": [{"role": "user", "content": "hi"}'  # line 8: cut short
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl as json: line 8: invalid JSON"):
        load_chat_dataset(str(bad))
    error_line(*cli(*extract_args(world["target"], bad, tmp_path / "cache")), str(bad), "line 8")

    doc = tmp_path / "bad.json"  # one JSON document (an array), broken on its line 4
    doc.write_text('[\n {"messages": []},\n {"messages": []},\n {"messages": [}\n]\n')
    with pytest.raises(DataError, match=r"bad\.json as json: line 4: invalid JSON"):
        load_chat_dataset(str(doc))


# ------------------------------------------------------------------------------------------------ 10. fewer steps


def test_fewer_steps_on_a_finished_run_refuse_or_start_over(world, tmp_path):
    """Before: --max-steps 2 (with or without --overwrite) on a 3-step run said "nothing to do", and run.json then said
    2 steps while final/ was the 3-step drafter."""
    run = tmp_path / "run"
    ok(*train_args(world, run, "--max-steps", 3, *RUN))
    record = (run / "run.json").read_text()
    error_line(*cli(*train_args(world, run, "--max-steps", 2, *RUN)), str(run), "at step 3", "--overwrite")
    assert (run / "run.json").read_text() == record
    out = ok(*train_args(world, run, "--max-steps", 2, *RUN, "--overwrite"))
    assert "nothing to do" not in out and "resumed" not in out
    assert json.loads((run / "run.json").read_text())["config"]["total_steps"] == 2
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000001", "step_00000002"]
