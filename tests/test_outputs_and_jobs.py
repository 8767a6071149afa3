"""Outputs apart from inputs, jobs that end with their parent, and files others can read (README, Guarantees).

- an output inside a data folder (extract's cache in --data, regenerate's parts in --data, answers inside a prompts
  output) is refused before any work: otherwise every later run reads the output's own files as data;
- `dflash pipeline` with its cache equal to, inside or holding its run directory is refused before extraction starts;
- kill -9 of `dflash pipeline` ends both of its jobs (a parent-death signal), and a rerun takes their locks over and
  resumes the training from its checkpoint (real processes);
- train --follow-timeout also bounds the wait for a cache that never appears (it was a fixed 120 s);
- a run resumes from its cache moved to another path (the identity recorded in run.json is the same), and another
  cache there is refused saying why and how to go on; extract resumes with its data and target moved,
  regenerate with its data moved (the same content);
- what dflash writes for others to read (the drafter's model.safetensors and config, checkpoints, a tokenise-cache
  entry) has the mode the umask gives, not 0600 / 0700.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_hostile_input import command
from tests.test_trust import cli, env_for_subprocess, error_line, ok
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
SEQ = 128


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("outputs")
    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf_datasets"))
    mp.setenv("DFLASH_TOKENIZE_CACHE", str(root / "tokenized"))
    target = make_tiny_target(root / "target", num_layers=4)
    data = write_jsonl(root / "chat.jsonl", chat_rows(12, seed=3))
    yield {"root": root, "target": target, "data": data, "cache": None, "drafter": None}  # (no cache: command()'s)
    mp.undo()


def data_folder(w: dict, tmp: Path, name: str = "dd") -> Path:
    d = tmp / name
    d.mkdir()
    (d / "chat.jsonl").write_bytes(Path(w["data"]).read_bytes())
    return d


@pytest.mark.parametrize("cmd, sub", [("extract", "cache"), ("regenerate", "regen"), ("extract", "a/b/cache")])
def test_an_output_inside_a_data_folder_is_refused_before_any_work(world, tmp_path, cmd, sub):
    """Before: accepted once, and every later run failed reading the output's own files as data."""
    dd = data_folder(world, tmp_path)
    out = dd / sub
    error_line(*cli(*command(cmd, world, tmp_path, data=dd, out=out)), f"--out {out} lies inside --data {dd}")
    assert sorted(p.name for p in dd.iterdir()) == ["chat.jsonl"]


def test_answers_inside_the_prompts_they_answer_are_refused(world, tmp_path):
    """A folder of prompts (what `dflash prompts` writes: prompts.jsonl of `prompt` rows) answered into itself."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    write_jsonl(prompts / "prompts.jsonl", [{"prompt": f"Say {i}."} for i in range(4)])
    error_line(*cli(*command("regenerate", world, tmp_path, data=prompts, out=prompts / "answers")),
               "lies inside --data")
    assert sorted(p.name for p in prompts.iterdir()) == ["prompts.jsonl"]


@pytest.mark.parametrize("cache, run", [("same", "same"), ("run/cache", "run"), ("cache", "cache/run")])
def test_pipeline_refuses_a_cache_that_is_or_holds_its_run_before_extraction(world, tmp_path, cache, run):
    """Before: refused only by train, after the extraction had started writing."""
    cache, run = tmp_path / cache, tmp_path / run
    error_line(*cli("pipeline", "--target", world["target"], "--data", world["data"], "--cache", cache,
                    "--out", run), "--cache", "a run directory must be apart from its cache")
    assert sorted(os.listdir(tmp_path)) == []


def test_pipeline_refuses_a_cache_inside_its_data(world, tmp_path):
    dd = data_folder(world, tmp_path)
    error_line(*cli("pipeline", "--target", world["target"], "--data", dd, "--cache", dd / "cache",
                    "--out", tmp_path / "run"), f"--cache {dd / 'cache'} lies inside --data")


# ------------------------------------------------------------------------------------------------ jobs and parents


def children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is pid."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_pipeline(world: dict, tmp: Path, log: Path) -> subprocess.Popen:
    train = "--drafter-layers 1 --block-size 4 --num-anchors 8 --batch-rows 2 --max-steps 100000 --save-every 5 " \
            "--log-every 5 --shuffle-window 0"
    extract = f"--seq-len {SEQ} --rows-per-shard 4 --writer-threads 1 --tokenize-cache off"
    return subprocess.Popen([PY, "-m", "dflash", "pipeline", "--target", world["target"], "--data", world["data"],
                             "--cache", str(tmp / "cache"), "--out", str(tmp / "run"), "--extract-args", extract,
                             "--train-args", train], cwd=tmp, env=env_for_subprocess(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def wait_for(what, timeout: float, log: Path) -> None:
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < timeout, log.read_text()[-4000:]
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_kill_9_of_pipeline_ends_its_jobs_and_a_rerun_resumes(world, tmp_path):
    """Before: both jobs ran on as orphans, and a rerun was refused by their locks until they ended."""
    log = tmp_path / "first.log"
    p = start_pipeline(world, tmp_path, log)
    jobs = []
    try:
        wait_for(lambda: (tmp_path / "run" / "checkpoints" / "latest").exists(), 180, log)
        jobs = children(p.pid)
        assert len(jobs) == 2, (jobs, log.read_text()[-3000:])
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        wait_for(lambda: not any(alive(j) for j in jobs), 30, log)
    finally:
        for j in [p.pid, *jobs]:
            if alive(j):
                os.kill(j, signal.SIGKILL)
    log2 = tmp_path / "rerun.log"
    q = start_pipeline(world, tmp_path, log2)
    try:
        wait_for(lambda: "resumed from" in log2.read_text(), 180, log2)
        text = log2.read_text()
        assert "in use by another dflash process" not in text, text[-3000:]
        os.kill(q.pid, signal.SIGKILL)  # the rerun's jobs end with it too
        q.wait()
        wait_for(lambda: not children(q.pid) and "took over" in text, 30, log2)
    finally:
        for j in [q.pid, *children(q.pid)]:
            if alive(j):
                os.kill(j, signal.SIGKILL)


def test_follow_timeout_bounds_the_wait_for_a_cache_that_never_appears(world, tmp_path):
    """Before: a fixed 120 s whatever --follow-timeout said."""
    from dflash.train.fit.follow import ExtractionGone, Follower

    t0 = time.monotonic()
    with pytest.raises(ExtractionGone, match="no `dflash extract` is writing one.*--follow-timeout 1"):
        Follower(str(tmp_path / "never"), timeout_s=1.0, say=lambda *_: None).wait_for_cache()
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    error_line(*cli(*command("train", world, tmp_path, cache=tmp_path / "never"), "--follow", "--follow-timeout", 2),
               "--follow-timeout 2")
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------------------------ modes


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_for_others_have_the_umask_mode(world, tmp_path, umask, monkeypatch):
    """Before: the drafter's model.safetensors was 0600 (a serving container of another user could not read it) and
    a tokenise-cache entry 0700."""
    old = os.umask(umask)
    try:
        monkeypatch.setenv("DFLASH_TOKENIZE_CACHE", str(tmp_path / "tok"))
        cache = tmp_path / "cache"
        ok(*command("extract", world, tmp_path, out=cache))
        ok(*command("train", world, tmp_path, cache=cache, out=tmp_path / "run", **{"save-every": 1}))
    finally:
        os.umask(old)
    want_file, want_dir = 0o666 & ~umask, 0o777 & ~umask
    files = [tmp_path / "run" / "final" / n for n in ("model.safetensors", "config.json")]
    files += list((tmp_path / "run" / "checkpoints").glob("step_*/*")) + list((tmp_path / "tok").glob("*/*"))
    files += [f for f in cache.rglob("*") if f.is_file()]
    assert len(files) > 10
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == want_file, (f, oct(f.stat().st_mode))
    for d in [*(tmp_path / "tok").iterdir(), tmp_path / "run" / "final"]:
        assert stat.S_IMODE(d.stat().st_mode) == want_dir, (d, oct(d.stat().st_mode))


# ------------------------------------------------------------------------------------------------ a moved cache


def test_a_moved_cache_resumes_and_another_one_is_refused_saying_how(world, tmp_path):
    """Before: a cache moved to another path could not be resumed from without --overwrite, and the refusal said only
    that the setting 'cache' changed."""
    cache, other = tmp_path / "cache", tmp_path / "other"
    ok(*command("extract", world, tmp_path, out=cache))
    run = tmp_path / "run"
    ok(*command("train", world, tmp_path, cache=cache, out=run, **{"max-steps": 2, "save-every": 1}))
    moved = tmp_path / "moved" / "cache"
    moved.parent.mkdir()
    os.rename(cache, moved)
    out = ok(*command("train", world, tmp_path, cache=moved, out=run, **{"max-steps": 3, "save-every": 1}))
    assert f"--cache {moved} is not the path" in out and "holds the same cache" in out, out[-3000:]
    assert "resumed from" in out, out[-3000:]
    rows = chat_rows(12, seed=4)  # other conversations: another cache
    ok(*command("extract", world, tmp_path, out=other, data=write_jsonl(tmp_path / "other.jsonl", rows)))
    error_line(*cli(*command("train", world, tmp_path, cache=other, out=run, **{"max-steps": 4})),
               f"trained on the cache at {moved}", "is another one", "field 'info.data_fingerprint'",
               f"give --cache {moved}", "--overwrite")


def test_extract_resumes_with_its_data_and_target_moved(world, tmp_path):
    """Data and target are known by their content: the same files at other paths resume the cache (a note says so) to
    the bytes of an uninterrupted run. Before: refused on field 'info.data.path' unless --overwrite."""
    from tests.test_trust import assert_same_but_volatile

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    ok(*command("extract", world, tmp_path, out=whole))
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "shards" / "000001")
    data, target = tmp_path / "moved" / "chat.jsonl", tmp_path / "moved" / "target"
    data.parent.mkdir()
    shutil.copy(world["data"], data)
    shutil.copytree(world["target"], target)
    out = ok(*command("extract", world, tmp_path, out=resumed, data=data, target=target))
    assert f"--data {data} (recorded: {world['data']})" in out and f"--target {target}" in out, out[-3000:]
    assert "1 of this rank's 2 shards already committed" in out, out[-3000:]
    assert_same_but_volatile(whole, resumed)


def test_regenerate_resumes_with_its_data_moved(world, tmp_path):
    """Before: refused on data='...' (the path) although the record's content fingerprint of the data was the same."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    argv = ["regenerate", "--target", world["target"], "--max-samples", 4, "--part-size", 2, "--max-new-tokens", 4,
            "--no-progress"]
    ok(*argv, "--data", world["data"], "--out", whole)
    shutil.copytree(whole, resumed)
    for name in ("part-00001.jsonl", ".part-00001.stats.json"):
        (resumed / "data" / name).unlink()
    data = tmp_path / "moved" / "chat.jsonl"
    data.parent.mkdir()
    shutil.copy(world["data"], data)
    out = ok(*argv, "--data", data, "--out", resumed)
    assert f"--data {data} is not the path" in out and "content is the same" in out, out[-3000:]
    for name in ("part-00000.jsonl", "part-00001.jsonl"):
        assert (resumed / "data" / name).read_bytes() == (whole / "data" / name).read_bytes()
