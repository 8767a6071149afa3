"""`dflash train --follow` beside a live `dflash extract`: real processes, a tiny target, CPU, one thread each.

The extraction is slowed (every target forward sleeps, numerics untouched: SLOW_EXTRACT) so that it really
interleaves with training: 16 shards of 2 rows, windows of 4 rows (2 shards), a 1-layer drafter whose step takes
milliseconds. The reference is `dflash train` over the finished cache with the same seed (no --follow).

What is covered:
    the order rule (dflash_cache.reader): shard_order is a permutation that spreads every window over the whole
        cache; epoch 0 is windows of it, each shuffled, later epochs one permutation; a cache of one window reads
        exactly as before windows (one permutation per epoch); a followed cache indexes the plan's rows
    a follower trained beside a live extraction equals the reference bit for bit (every loss in metrics.jsonl, the
        final and checkpoint weights), logged its first step before the extraction's last commit, and said that
        it waited (shards ready / planned, both rates)
    kill -9 of the extraction mid-way: the follower names the dead extraction in one `error:` line (exit 2) with
        the way out; rerunning the extraction and then the follower resumes and still equals the reference
    kill -9 of the follower mid-way: rerunning it resumes to the same result
    without --follow an incomplete cache is refused, and the message names --follow
    `dflash pipeline` (extraction and a following trainer as two processes, both on the CPU)
"""

from __future__ import annotations

import json
import os
import re
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
from dflash.cli import main as cli_main
from dflash_cache import CacheSpec, CacheWriter, shard_order
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
SEQ = 256
EXTRACT = ["--seq-len", SEQ, "--rows-per-shard", 2, "--batch-rows", 2, "--tokenize-cache", "off", "--no-progress"]
SMALL = ["--drafter-layers", 1, "--block-size", 4, "--num-anchors", 16, "--batch-rows", 2, "--log-every", 1, "--lr", 3e-3,
         "--seed", 7, "--no-progress"]
TRAIN = [*SMALL, "--shuffle-window", 4, "--epochs", 2, "--save-every", 4]

# `dflash extract` with every target forward slowed by argv[1] seconds (numerics untouched)
SLOW_EXTRACT = """
import sys, time
import dflash.extract.target as t
_run, delay = t.PackedTarget.run, float(sys.argv[1])
def slow(self, *a, **k):
    time.sleep(delay)
    return _run(self, *a, **k)
t.PackedTarget.run = slow
from dflash.cli import main
sys.argv = ["dflash", *sys.argv[2:]]
main()
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def start(args: list, log: Path, slow: float | None = None) -> subprocess.Popen:
    """`python -m dflash ARGS` (or the slowed extraction) as a process of its own, output to `log`."""
    cmd = [PY, "-c", SLOW_EXTRACT, str(slow)] if slow is not None else [PY, "-m", "dflash"]
    f = open(log, "w")
    p = subprocess.Popen(cmd + [str(a) for a in args], cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)
    f.close()
    return p


def first_checkpoint(run: Path, alive: list[subprocess.Popen], log: Path, timeout: float = 180) -> None:
    """Wait until RUN/checkpoints/latest exists, every process in `alive` still running meanwhile."""
    deadline = time.monotonic() + timeout
    while not (run / "checkpoints" / "latest").exists():
        assert all(p.poll() is None for p in alive), log.read_text()
        assert time.monotonic() < deadline
        time.sleep(0.02)


def finish(p: subprocess.Popen, log: Path, rc: int = 0, timeout: float = 240) -> str:
    p.wait(timeout=timeout)
    text = log.read_text()
    assert p.returncode == rc, f"exit {p.returncode} (wanted {rc})\n{text[-4000:]}"
    return text


def metrics(run: Path) -> list[dict]:
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def commits_on_disk(cache: Path) -> list[float]:
    """The modification times of the committed shards' zarr.json (a commit is the last write to that file)."""
    times = []
    for p in (cache / "shards").glob("*/zarr.json"):
        try:
            if "dflash_commit" in p.read_text():
                times.append(p.stat().st_mtime)
        except (OSError, ValueError):
            pass
    return times


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def assert_same_run(ref: Path, run: Path) -> None:
    """Every logged loss and the weights (final/ and the last float32 checkpoint) bit for bit."""
    a, b = metrics(ref), metrics(run)
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) >= 10
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in a] == [(r["step"], r["loss"], r["grad_norm"]) for r in b]
    for sub in ("final", f"checkpoints/step_{a[-1]['step']:08d}"):
        wa, wb = weights(ref / sub), weights(run / sub)
        assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa), sub


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny target, data, a finished cache and the reference run over it (in this process, one thread)."""
    root = tmp_path_factory.mktemp("follow")
    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "chat.jsonl", chat_rows(40, seed=3))
    cache = root / "cache"
    r = CliRunner().invoke(cli_main, ["extract", "--target", target, "--data", data, "--out", str(cache),
                                      *map(str, EXTRACT)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    c = dflash_cache.open(str(cache))
    assert c.spec.num_shards >= 10, c.spec.num_shards
    ref = root / "ref"
    r = CliRunner().invoke(cli_main, ["train", "--cache", str(cache), "--target", target, "--out", str(ref),
                                      *map(str, TRAIN)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return {"root": root, "target": target, "data": data, "cache": cache, "ref": ref, "shards": c.spec.num_shards}


def extract_args(env, out: Path) -> list:
    return ["extract", "--target", env["target"], "--data", env["data"], "--out", out, *EXTRACT]


def train_args(env, cache: Path, out: Path) -> list:
    return ["train", "--follow", "--cache", cache, "--target", env["target"], "--out", out, *TRAIN]


# ------------------------------------------------------------------------------------------------ the order rule


def test_shard_order_spreads_every_window_over_the_cache():
    for n in range(1, 200):
        order = shard_order(n)
        assert sorted(order) == list(range(n)), n
    for n, w in ((100, 5), (100, 10), (1000, 10), (37, 3)):  # any w consecutive shards of the order (a window)
        order = shard_order(n)  # are spread over the whole cache: no gap between them beyond twice the even n / w
        for k in range(0, n - w + 1):
            s = sorted(order[k:k + w])
            assert max([b - a for a, b in zip(s, s[1:])] + [s[0] + n - s[-1]]) <= 2 * n / w, (n, w, k, s)


def _cache(path: Path, rows: int, per_shard: int, skip=()) -> None:
    spec = CacheSpec(seq_len=4, hidden_size=2, layer_ids=[1], num_rows=rows, rows_per_shard=per_shard, codec="none")
    with CacheWriter(str(path), spec) as w:
        for s in range(spec.num_shards):
            if s in skip:
                continue
            a, n = spec.shard_rows(s)
            ids = np.repeat(np.arange(a, a + n, dtype=np.int32)[:, None], 4, 1)
            w.write_shard(s, ids, np.ones((n, 4), np.uint8), np.ones((n, 4), np.int32), np.zeros((n, 4, 2), np.uint16))


def test_epoch_zero_reads_windows_of_the_shard_order_and_later_epochs_one_permutation(tmp_path):
    _cache(tmp_path / "c", rows=23, per_shard=3)
    c = dflash_cache.open(str(tmp_path / "c"))
    order = shard_order(c.spec.num_shards)  # 8 shards, the last of 2 rows
    rows = c.epoch_rows(0, seed=5, window_rows=5)  # 5 rows -> windows of 2 shards
    assert sorted(rows) == list(range(23))
    at = 0
    for k in range(0, 8, 2):
        want = sorted(r for s in order[k:k + 2] for r in range(3 * s, min(23, 3 * s + 3)))
        assert sorted(rows[at:at + len(want)]) == want, k  # the window's rows, and only those
        at += len(want)
    assert not np.array_equal(rows, np.sort(rows))  # shuffled
    assert np.array_equal(c.epoch_rows(0, 5, 5), rows) and not np.array_equal(c.epoch_rows(0, 6, 5), rows)
    # later epochs, and a window as large as the cache: one permutation per (seed, epoch), as before windows
    for epoch, window in ((1, 5), (2, 5), (0, 23), (0, 1000), (0, 0), (0, None)):
        assert np.array_equal(c.epoch_rows(epoch, 5, window), np.random.default_rng([5, epoch]).permutation(23))
    idx, valid = c.epoch_order(4, 1, 2, 0, 5, window_rows=5)  # rank 1 of 2 takes every other batch slot
    assert np.array_equal(idx[valid], np.concatenate([rows, rows[:1]]).reshape(3, 2, 4)[:, 1][valid])


def test_a_followed_cache_has_the_plans_rows_and_waits_for_its_shards(tmp_path):
    _cache(tmp_path / "c", rows=11, per_shard=2, skip=(3,))
    with pytest.raises(dflash_cache.CacheIncompleteError):
        dflash_cache.open(str(tmp_path / "c"))
    c = dflash_cache.open(str(tmp_path / "c"), follow=True)
    assert len(c) == 11 and not c.complete and c.committed_rows == 9 and c.locate(7) == (3, 1)
    waits = []

    def wait(missing, served):
        waits.append((missing, served))
        if len(waits) == 3:  # the extraction commits shard 3 meanwhile
            spec = c.spec
            with CacheWriter(str(tmp_path / "c"), spec, create=False) as w:
                a, n = spec.shard_rows(3)
                ids = np.repeat(np.arange(a, a + n, dtype=np.int32)[:, None], 4, 1)
                w.write_shard(3, ids, np.ones((n, 4), np.uint8), np.ones((n, 4), np.int32),
                              np.zeros((n, 4, 2), np.uint16))

    got = [b["input_ids"][:, 0].tolist() for b in c.batches(2, seed=1, window_rows=4, wait=wait, threads=1, check=True)]
    order = c.epoch_order(2, 0, 1, 0, 1, window_rows=4)[0]
    assert got == order.tolist() and c.complete
    first = next(k for k, b in enumerate(order) if {6, 7} & set(b.tolist()))  # the first batch that needs shard 3
    assert [m for m, _ in waits] == [[3]] * 3 and {s for _, s in waits} == {2 * first}
    _cache(tmp_path / "c2", rows=11, per_shard=2, skip=(3,))
    with pytest.raises(dflash_cache.CacheIncompleteError, match="shard 3"):  # no wait: a missing shard is an error
        list(dflash_cache.open(str(tmp_path / "c2"), follow=True).batches(2, seed=1, window_rows=4, threads=1))


def test_a_run_begun_before_windows_resumes_in_its_own_order(env, tmp_path):
    """A run directory whose run.json has no shuffle_window (written before windows existed) resumes with one
    permutation per epoch, the order it began with, and is not refused as another run."""
    import shutil

    def train(out, *more):
        r = CliRunner().invoke(cli_main, ["train", "--cache", str(env["cache"]), "--target", env["target"], "--out",
                                          str(out), *map(str, SMALL), "--max-steps", 6, "--save-every", 3, *more])
        assert r.exit_code == 0, (r.output, r.exception)
        return r.output

    ref, old = tmp_path / "ref", tmp_path / "old"
    train(ref, "--shuffle-window", 0)
    train(old, "--shuffle-window", 0)
    doc = json.loads((old / "run.json").read_text())
    del doc["config"]["shuffle_window"]  # as an older dflash wrote it
    (old / "run.json").write_text(json.dumps(doc))
    shutil.rmtree(old / "checkpoints" / "step_00000006")
    shutil.rmtree(old / "final")
    (old / "summary.json").unlink()
    (old / "checkpoints" / "latest").write_text("step_00000003")
    out = train(old, "--shuffle-window", 4)  # windows of 4 rows would read another order
    assert "resumed from" in out and "one permutation of the cache per epoch" in out, out
    assert [(r["step"], r["loss"]) for r in metrics(old)] == [(r["step"], r["loss"]) for r in metrics(ref)]


def test_ranks_of_a_follower_wait_for_the_shards_of_the_whole_global_batch(tmp_path):
    """With several ranks a rank waits for every shard of the step's global batch, its own rows' or not: the ranks
    wait in the reader together, never one in the step's all-reduce while another waits for data."""
    _cache(tmp_path / "c", rows=11, per_shard=2, skip=(3,))
    c = dflash_cache.open(str(tmp_path / "c"), follow=True)
    glob = c.epoch_order(2, 0, 1, 0, 1, window_rows=4)[0]  # 2 ranks x 1 row: the global batch of each step
    step = next(k for k, b in enumerate(glob) if {6, 7} & set(b.tolist()))  # the first step that needs shard 3
    rank = next(r for r in (0, 1) if glob[step][r] not in (6, 7))  # the rank whose own row is elsewhere
    waits = []

    def wait(missing, served):
        waits.append((missing, served))
        raise RuntimeError("stop")  # one look is enough

    got = []
    with pytest.raises(RuntimeError, match="stop"):
        for b in c.batches(1, rank=rank, world=2, seed=1, window_rows=4, wait=wait, threads=1, prefetch=1):
            got.append(int(b["input_ids"][0, 0]))
    assert got == [int(glob[k][rank]) for k in range(step)] and waits == [([3], step)]


def test_a_waiting_follower_reports_both_rates_as_soon_as_they_are_measured(monkeypatch):
    """The first report of a wait comes before any rate is known; the next one comes as soon as both are, not
    REPORT_S later; the closing line gives both. Clock, commits and the lock's holder are the test's own."""
    import dflash.train.fit.follow as f

    clock = [100.0]
    monkeypatch.setattr(f.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(f.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(f, "holder", lambda path: ({"pid": 7, "host": "h", "command": "dflash extract"}, None))

    class Cache:  # what the follower reads of a followed cache
        commits, committed_rows = [0], 2
        spec = type("Spec", (), {"num_shards": 10, "num_rows": 20})

        def refresh(self):
            pass

    said = []
    fol = f.Follower("/nowhere", world=1, say=said.append)
    cache = Cache()
    fol.attach(cache)
    for _ in range(12):  # a 3 s wait for shard 4 (12 looks of 0.25 s): one report, no rates yet
        fol([4], 2)
    assert len(said) == 1 and "rate not measured yet" in said[0] and "waiting for shard 4" in said[0], said
    clock[0] += 6.0  # 8 rows trained in 6 s; the extraction committed 2 shards meanwhile
    cache.commits, cache.committed_rows = [0, 1, 4], 6
    for _ in range(12):
        fol([5], 10)
    assert len(said) == 2, said  # not 30 s later: at once
    assert "extraction" in said[1] and "training 1.33 rows/s" in said[1] and "not measured" not in said[1], said
    for _ in range(12):  # rates known and said: the next report waits REPORT_S
        fol([5], 10)
    assert len(said) == 2, said
    line = f.closing_line(fol.summary(), 30.0)
    assert re.fullmatch(r"train: --follow: waited \d+\.\d s \(\d+% of the run\) in 2 waits for the extraction; "
                        r"extraction [\d.]+ rows/s, training 1\.33 rows/s", line), line
    assert f.closing_line(fol.summary(trained_rows_per_s=9.0), 30.0).endswith("training 1.33 rows/s")  # measured


def test_a_follower_that_waited_only_at_its_start_closes_with_the_trainers_own_rate(monkeypatch):
    """A run whose one wait came before its first step measured no rate between two waits: the closing line gives
    the rate the trainer measured (its last log window), not "not measured"."""
    import dflash.train.fit.follow as f

    clock = [0.0]
    monkeypatch.setattr(f.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(f.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(f, "holder", lambda path: ({"pid": 7, "host": "h", "command": "dflash extract"}, None))
    fol = f.Follower("/nowhere", world=1, say=lambda line: None)
    for _ in range(4):
        fol([0], 0)
    assert f.closing_line(fol.summary(), 400.0).endswith("training rate not measured")
    line = f.closing_line(fol.summary(trained_rows_per_s=157.0), 400.0)
    assert re.fullmatch(r"train: --follow: waited 1\.0 s \(0% of the run\) in 1 wait for the extraction; "
                        r"extraction rate not measured, training 157 rows/s", line), line


# ------------------------------------------------------------------------------------------------ real processes


@pytest.mark.slow
def test_follower_beside_a_live_extraction_equals_a_run_over_the_finished_cache(env, tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    ext = start(extract_args(env, cache), tmp_path / "extract.log", slow=0.6)
    tr = start(train_args(env, cache, run), tmp_path / "train.log")
    first_step = None
    while tr.poll() is None:  # when the follower logs its first step
        if first_step is None and metrics(run):
            first_step = time.time()
        time.sleep(0.02)
    out = finish(tr, tmp_path / "train.log")
    finish(ext, tmp_path / "extract.log")
    assert first_step is not None and first_step < max(commits_on_disk(cache)), \
        "the follower did not train before the extraction's last commit"
    assert "--follow: waiting for shard" in out and f"of {env['shards']} shards are committed" in out, out
    closing = [ln for ln in out.splitlines() if ln.startswith("train: --follow: waited")]
    assert len(closing) == 1 and re.search(r"extraction [\d.e+-]+ rows/s, training [\d.e+-]+ rows/s$", closing[0]), out
    assert_same_run(env["ref"], run)
    s = json.loads((run / "summary.json").read_text())
    assert s["follow"]["waits"] >= 1 and s["follow"]["waited_s"] > 0, s["follow"]


@pytest.mark.slow
def test_killed_extraction_is_named_and_both_reruns_resume_to_the_same_run(env, tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    ext = start(extract_args(env, cache), tmp_path / "extract.log", slow=0.6)
    tr = start(train_args(env, cache, run), tmp_path / "train.log")
    first_checkpoint(run, [ext, tr], tmp_path / "train.log")  # the follower has trained 4 steps: kill the extraction
    ext.send_signal(signal.SIGKILL)
    ext.wait(timeout=30)
    out = finish(tr, tmp_path / "train.log", rc=2, timeout=120)
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out
    line = errors[0]
    for needle in ("--follow: the extraction writing", str(cache), "is gone", "no longer runs", "Rerun the extract",
                   "rerun this command (it resumes from its last checkpoint, step"):
        assert needle in line, (needle, line)
    committed = len(commits_on_disk(cache))
    assert committed < env["shards"] and f"{committed} of {env['shards']} shards are committed" in line, line

    ext = start(extract_args(env, cache), tmp_path / "extract2.log")  # the same command, then the same follower
    tr = start(train_args(env, cache, run), tmp_path / "train2.log")
    finish(ext, tmp_path / "extract2.log")
    out = finish(tr, tmp_path / "train2.log")
    assert "resumed from" in out, out
    assert_same_run(env["ref"], run)


@pytest.mark.slow
def test_killed_follower_resumes_to_the_same_run(env, tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    ext = start(extract_args(env, cache), tmp_path / "extract.log", slow=0.4)
    tr = start(train_args(env, cache, run), tmp_path / "train.log")
    first_checkpoint(run, [tr], tmp_path / "train.log")
    tr.send_signal(signal.SIGKILL)
    tr.wait(timeout=30)
    assert not (run / "final").exists()
    tr = start(train_args(env, cache, run), tmp_path / "train2.log")
    out = finish(tr, tmp_path / "train2.log")
    finish(ext, tmp_path / "extract.log")
    assert "resumed from" in out, out
    assert_same_run(env["ref"], run)


def test_without_follow_an_incomplete_cache_is_refused_naming_follow(env, tmp_path):
    import shutil

    from dflash_cache.inspect import uncommit

    cache = tmp_path / "cache"
    shutil.copytree(env["cache"], cache)
    uncommit(str(cache), [3])
    r = CliRunner().invoke(cli_main, ["train", "--cache", str(cache), "--target", env["target"], "--out",
                                      str(tmp_path / "run"), *map(str, TRAIN)])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "incomplete" in lines[0] and "--follow" in lines[0]


# ------------------------------------------------------------------------------------------------ dflash pipeline


@pytest.mark.slow
def test_pipeline_runs_extraction_and_a_following_trainer_on_the_cpu(env, tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    p = subprocess.run([PY, "-m", "dflash", "pipeline", "--target", env["target"], "--data", env["data"], "--cache",
                        str(cache), "--out", str(run), "--status-every", "2",
                        "--extract-args", " ".join(map(str, EXTRACT)), "--train-args", " ".join(map(str, TRAIN))],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    out = p.stdout
    assert p.returncode == 0, out[-4000:] + p.stderr[-3000:]
    assert "[extract] extract: wrote" in out and "[train] train: step" in out, out
    assert "pipeline: extraction:" in out  # the status lines
    last = out.strip().splitlines()[-1]
    assert last.startswith("pipeline: extraction 9,620 tokens") and "tok/s" in last and "training 40 steps" in last, last
    assert "from start to the trained drafter" in last, last
    assert_same_run(env["ref"], run)


def test_pipeline_refuses_flags_it_sets_itself(env, tmp_path):
    r = CliRunner().invoke(cli_main, ["pipeline", "--target", env["target"], "--data", env["data"], "--cache",
                                      str(tmp_path / "c"), "--out", str(tmp_path / "r"), "--train-args",
                                      "--epochs 2 --cache elsewhere"])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == [
        "error: --train-args: --cache is set by `dflash pipeline` itself (--target, --cache, --out, --config, --gpus, "
        "--follow); give it to the pipeline"]
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()
