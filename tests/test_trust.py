"""Fault injection: what a user can do wrong, or what can go wrong around dflash, and what dflash then promises.

Every failure of issue 14 is reproduced here and must now end as the README's "Guarantees" section says:

    1. other weights     a target with the same config, file names and sizes but other weights: `train` refuses it
                         (naming the embedding or LM head), an interrupted `extract` refuses to resume with it;
                         content digests checked against the bytes (safetensors, GGUF, tree of pieces, tied head);
                         a cache from before fingerprints: a note, no crash
    2. --overwrite       never removes a user's folder, another cache, the cache in use (or a cache inside --out);
                         replaces only dflash's own run / cache (and keeps a user's file inside a run directory)
    3. two writers       a live lock holder is refused in one line naming host and pid (a real second `train`
                         process, and a lock held by another process for extract/regenerate); a stale lock
                         (dead pid) is taken over with a note; another host's lock is refused; one torchrun job
    4. bad input         each bad flag/path is one `error:` line, exit 2, naming the flag; --json checked before
                         the work (no output, no temp file); disk full while `train` writes a checkpoint (a real
                         small tmpfs when mounting is allowed, else RLIMIT_FSIZE): names the file, last good
                         checkpoint intact and resumable
    5. smaller truths    `cache verify --repair` un-commits bad shards, the next extract redoes them; a rerun on
                         a complete cache points at verify; `cache info` says it reads metadata only; a resumed
                         cache is byte-identical file by file except the documented volatile fields

Everything runs on CPU with the tiny targets of tests/tiny.py, mostly in process (click's runner).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
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
from dflash_cache.inspect import VOLATILE_COMMIT_FIELDS
from dflash_cache.lock import LOCK_NAME, LockedError, OutputLock
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
SEQ = 128
SMALL = ["--drafter-layers", "1", "--block-size", "4", "--num-anchors", "16", "--batch-rows", "2", "--no-progress"]


# ------------------------------------------------------------------------------------------------ helpers


def cli(*args) -> tuple[int, str]:
    """`dflash ARGS` in this process: (exit code, stdout + stderr). An unexpected exception fails the test."""
    r = CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback

        raise AssertionError("".join(traceback.format_exception(r.exception))) from r.exception
    return r.exit_code, r.stdout + r.stderr


def ok(*args) -> str:
    code, out = cli(*args)
    assert code == 0, f"exit {code}\n{out[-4000:]}"
    return out


def error_line(code: int, out: str, *needles: str) -> str:
    """Exit 2 and exactly one `error:` line holding every needle; no traceback."""
    assert code == 2, (code, out[-3000:])
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, out
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def env_for_subprocess(**extra) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    env.update(extra)
    return env


def extract_args(target, data, out, *more) -> list:
    return ["extract", "--target", target, "--data", data, "--out", out, "--seq-len", SEQ, "--rows-per-shard", 4,
            "--writer-threads", 1, "--no-progress", *more]


def train_args(env, out, *more, target=None, cache=None) -> list:
    return ["train", "--cache", cache or env["cache"], "--target", target or env["target"], "--out", out, *SMALL, *more]


def tree_files(root) -> dict[str, bytes]:
    """relative path -> bytes of every file under root (the lock excluded)."""
    out = {}
    for f in glob.glob(os.path.join(str(root), "**"), recursive=True):
        if os.path.isfile(f) and not os.path.basename(f).startswith(LOCK_NAME):
            out[os.path.relpath(f, str(root))] = Path(f).read_bytes()
    return out


def dead_pid() -> int:
    p = subprocess.Popen([PY, "-c", "pass"])
    p.wait()
    return p.pid


def write_lock(path, **rec) -> None:
    os.makedirs(path, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": 1, "job": None, "command": "dflash test",
            "started": "2026-01-01T00:00:00Z", "started_unix": time.time()}
    Path(path, LOCK_NAME).write_text(json.dumps({**base, **rec}))


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Target A (Qwen3, untied head), target B (same config, other weights), a cache extracted from A."""
    import datasets

    root = tmp_path_factory.mktemp("trust")
    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf_datasets"))
    a = make_tiny_target(root / "targetA", seed=0)
    b = make_tiny_target(root / "targetB", seed=1)
    data = write_jsonl(root / "chat.jsonl", chat_rows(40, seed=3))
    cache = root / "cache"
    ok(*extract_args(a, data, cache))
    c = dflash_cache.open(str(cache))
    assert c.complete and c.spec.num_shards >= 3, (c.complete, c.spec.num_shards)
    yield {"root": root, "target": a, "other": b, "data": data, "cache": cache, "shards": c.spec.num_shards}
    mp.undo()


# ------------------------------------------------------------------------------------------------ 1. other weights


def test_fingerprint_digests_are_those_of_the_tensor_bytes(env, monkeypatch, tmp_path):
    """Per-tensor digests equal a hash of the tensor's own bytes (from safetensors, independently), with pieces
    hashed as a tree (tested with 1 KiB pieces so tensors span many); a tensor changed changes only its digest."""
    import hashlib

    from safetensors.numpy import load_file, save_file

    import dflash.core.weights as W

    monkeypatch.setattr(W, "PIECE", 1024)
    src = Path(env["target"]) / "model.safetensors"
    tensors = load_file(str(src))

    def tree(b: bytes) -> str:
        h = hashlib.sha256()
        for i in range(0, max(len(b), 1), 1024):
            h.update(hashlib.sha256(b[i:i + 1024]).digest() if b else b"")
        return h.hexdigest()[:W.DIGEST_CHARS]

    fp = W.fingerprint(env["target"], threads=4)
    assert set(fp.tensors) == set(tensors)
    for name, arr in tensors.items():
        assert fp.tensors[name] == tree(np.ascontiguousarray(arr).tobytes()), name
    assert fp.roles == {"embedding": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}

    d = tmp_path / "t"
    shutil.copytree(env["target"], d)
    changed = dict(tensors)
    w = changed["model.layers.3.mlp.up_proj.weight"].copy()
    w.flat[7] += 1.0
    changed["model.layers.3.mlp.up_proj.weight"] = w
    save_file(changed, str(d / "model.safetensors"), metadata={"format": "pt"})
    fp2 = W.fingerprint(str(d))
    assert {k for k in fp.tensors if fp.tensors[k] != fp2.tensors[k]} == {"model.layers.3.mlp.up_proj.weight"}
    assert "model.layers.3.mlp.up_proj.weight differs" in W.compare_full(fp.as_dict(), fp2)
    assert W.compare_full(fp.as_dict(), W.fingerprint(env["target"])) is None


def test_gguf_target_gets_per_tensor_digests(tmp_path):
    """GGUF: the same per-tensor content digests, located by the gguf reader's tensor offsets."""
    import gguf

    from dflash.core.weights import fingerprint

    def write(path, emb):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tensor("token_embd.weight", emb)
        w.add_tensor("blk.0.attn_q.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    emb = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    write(tmp_path / "a.gguf", emb)
    emb2 = emb.copy()
    emb2[3, 3] = 0.5
    write(tmp_path / "b.gguf", emb2)
    fa, fb = fingerprint(str(tmp_path / "a.gguf")), fingerprint(str(tmp_path / "b.gguf"))
    assert fa.roles == {"embedding": "token_embd.weight", "lm_head": "token_embd.weight"}  # no output.weight: tied
    import hashlib

    want = hashlib.sha256(hashlib.sha256(emb.tobytes()).digest()).hexdigest()[:32]
    assert fa.tensors["token_embd.weight"] == want
    assert fa.tensors["blk.0.attn_q.weight"] == fb.tensors["blk.0.attn_q.weight"]
    assert fa.tensors["token_embd.weight"] != fb.tensors["token_embd.weight"] and fa.digest != fb.digest


def test_cache_records_the_fingerprint(env):
    from dflash.core.weights import fingerprint

    meta = dflash_cache.open(str(env["cache"])).metadata
    assert meta["info"]["weights"] == fingerprint(env["target"]).as_dict()


def test_train_refuses_a_target_with_other_weights(env, tmp_path):
    """Before: B has the config, file names and sizes of A (so the old names+sizes "hash" matched) and
    `train --cache C(A) --target B` trained and exited 0. Now: one line naming the cache, the target and the tensor."""
    from dflash.core.target import target_info

    ia, ib = target_info(env["target"]), target_info(env["other"])
    assert ia.config_hash == ib.config_hash and ia.weights_hash == ib.weights_hash  # what fooled the old check
    line = error_line(*cli(*train_args(env, tmp_path / "run", "--max-steps", 1, target=env["other"])),
                      str(env["cache"]), str(env["other"]), "embedding", "model.embed_tokens.weight")
    assert "other weights" in line
    assert not (tmp_path / "run" / "checkpoints").exists()

    # only the LM head differs: named as such
    from safetensors.torch import load_file, save_file

    head_only = tmp_path / "head_only"
    shutil.copytree(env["target"], head_only)
    sd = load_file(str(head_only / "model.safetensors"))
    sd["lm_head.weight"] = sd["lm_head.weight"] * 1.001
    save_file(sd, str(head_only / "model.safetensors"), metadata={"format": "pt"})
    error_line(*cli(*train_args(env, tmp_path / "run2", "--max-steps", 1, target=head_only)), "lm_head")

    # other layers changed (not used by train: the hidden states come from the cache): accepted
    sd = load_file(str(Path(env["target"]) / "model.safetensors"))
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"] * 2
    body = tmp_path / "body"
    shutil.copytree(env["target"], body)
    save_file(sd, str(body / "model.safetensors"), metadata={"format": "pt"})
    ok(*train_args(env, tmp_path / "run3", "--max-steps", 1, target=body))


def test_tied_head_target(tmp_path, env):
    """A tied target (Llama here): the LM head is the embedding; other embedding weights are refused."""
    a = make_tiny_target(tmp_path / "llamaA", arch="llama", seed=0)
    b = make_tiny_target(tmp_path / "llamaB", arch="llama", seed=1)
    cache = tmp_path / "cache"
    ok(*extract_args(a, env["data"], cache))
    roles = dflash_cache.open(str(cache)).metadata["info"]["weights"]["roles"]
    assert roles == {"embedding": "model.embed_tokens.weight", "lm_head": "model.embed_tokens.weight"}
    ok(*train_args(env, tmp_path / "ok", "--max-steps", 1, cache=cache, target=a))
    error_line(*cli(*train_args(env, tmp_path / "bad", "--max-steps", 1, cache=cache, target=b)), "embedding")


def test_extract_resume_refuses_replaced_weights(env, tmp_path):
    """Before: an extraction interrupted, then resumed after the target's weights were replaced, finished
    "complete" with shards of both. Now: the resume refuses, naming the tensor; nothing is written."""
    from dflash_cache.inspect import uncommit

    target = tmp_path / "target"
    shutil.copytree(env["target"], target)
    cache = tmp_path / "cache"
    ok(*extract_args(target, env["data"], cache))
    uncommit(str(cache), list(range(1, env["shards"])))  # as an interrupted run leaves it: shard 0 committed
    before = tree_files(cache)
    shutil.copy(Path(env["other"]) / "model.safetensors", target / "model.safetensors")  # same names and sizes
    line = error_line(*cli(*extract_args(target, env["data"], cache)), str(target), str(cache), "other weights",
                      "differs")
    assert "tensor lm_head.weight differs" in line and "44 of 69 tensors differ" in line  # norms are equal (ones)
    assert tree_files(cache) == before and not os.path.exists(cache / LOCK_NAME)

    shutil.copy(Path(env["target"]) / "model.safetensors", target / "model.safetensors")  # the right weights again
    ok(*extract_args(target, env["data"], cache))
    assert dflash_cache.open(str(cache)).complete


def test_cache_without_fingerprint_is_checked_with_a_note(env, tmp_path):
    """A cache written before content fingerprints: `train` says the check could not be done and trains;
    `extract` resumes it with a note (decided: old caches keep working; the README says so)."""
    from tests.test_cache import as_an_older_dflash_wrote_it

    cache = tmp_path / "old"
    shutil.copytree(env["cache"], cache)
    as_an_older_dflash_wrote_it(cache, lambda attrs: attrs["info"].pop("weights"))
    out = ok(*train_args(env, tmp_path / "run", "--max-steps", 1, cache=cache))
    assert "records no content fingerprint" in out and "cannot check" in out
    from dflash_cache.inspect import uncommit

    uncommit(str(cache), [1])
    out = ok(*extract_args(env["target"], env["data"], cache))
    assert "records no content fingerprint" in out
    assert dflash_cache.open(str(cache)).complete


# ------------------------------------------------------------------------------------------------ 2. --overwrite


def test_train_overwrite_never_deletes_what_dflash_did_not_write(env, tmp_path):
    """Before: `train --out DIR --overwrite` deleted a user's folder, a dflash cache, even the cache it read."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("precious")
    error_line(*cli(*train_args(env, user, "--overwrite", "--max-steps", 1)), str(user), "not a dflash run directory",
               "thesis.tex", "--overwrite only replaces")
    assert (user / "thesis.tex").read_text() == "precious" and sorted(os.listdir(user)) == ["thesis.tex"]

    other_cache = tmp_path / "other_cache"
    shutil.copytree(env["cache"], other_cache)
    before = tree_files(other_cache)
    error_line(*cli(*train_args(env, other_cache, "--overwrite", "--max-steps", 1)), "zarr store")
    assert tree_files(other_cache) == before

    before = tree_files(env["cache"])
    error_line(*cli(*train_args(env, env["cache"], "--overwrite", "--max-steps", 1)), "is the cache this run reads")
    holder = tmp_path / "holder"
    (holder / "c").parent.mkdir()
    shutil.copytree(env["cache"], holder / "c")
    error_line(*cli(*train_args(env, holder, "--overwrite", "--max-steps", 1, cache=holder / "c")),
               "contains the cache this run reads")
    assert tree_files(env["cache"]) == before

    # its own run directory: replaced (a user's file inside it stays)
    run = tmp_path / "run"
    ok(*train_args(env, run, "--max-steps", 2, "--save-every", 1))
    (run / "notes.txt").write_text("mine")
    error_line(*cli(*train_args(env, run, "--max-steps", 2, "--lr", 1e-3)), "different run", "lr")
    ok(*train_args(env, run, "--max-steps", 1, "--lr", 1e-3, "--overwrite"))
    assert (run / "notes.txt").read_text() == "mine"
    assert json.loads((run / "run.json").read_text())["config"]["lr"] == 1e-3
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000001"]


def test_extract_and_regenerate_overwrite_refuse_what_is_not_theirs(env, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "a.txt").write_text("x")
    error_line(*cli(*extract_args(env["target"], env["data"], user, "--overwrite")), str(user), "not a dflash cache")
    run = tmp_path / "run"
    ok(*train_args(env, run, "--max-steps", 1))
    before = tree_files(run)
    error_line(*cli(*extract_args(env["target"], env["data"], run, "--overwrite")), "not a dflash cache")
    assert tree_files(run) == before
    error_line(*cli("regenerate", "--target", env["target"], "--data", env["data"], "--out", user, "--overwrite",
                    "--no-progress"), "not a dflash regenerate output", "a.txt")
    assert sorted(os.listdir(user)) == ["a.txt"]

    # an input inside the output (here the data inside a cache, which --overwrite would delete): refused
    cache = tmp_path / "cache"
    shutil.copytree(env["cache"], cache)
    shutil.copy(env["data"], cache / "chat.jsonl")
    error_line(*cli(*extract_args(env["target"], cache / "chat.jsonl", cache, "--overwrite")), "contains --data")
    assert (cache / "chat.jsonl").exists() and (cache / "zarr.json").exists()
    error_line(*cli("regenerate", "--target", env["target"], "--data", user, "--out", user, "--overwrite"), "is --data")


# ------------------------------------------------------------------------------------------------ 3. two writers


def test_second_train_process_is_refused_naming_the_holder(env, tmp_path):
    """Before: two `train` on one --out both ran (duplicated metrics, one died on a missing file). Now the second
    is refused in one line naming host and pid of the first, which finishes normally."""
    run = tmp_path / "run"
    first = subprocess.Popen([PY, "-m", "dflash", *map(str, train_args(env, run, "--max-steps", 400, "--save-every", 400))],
                             cwd=REPO, env=env_for_subprocess(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not (run / LOCK_NAME).exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert (run / LOCK_NAME).exists(), first.communicate()[0] if first.poll() is not None else "no lock"
        line = error_line(*cli(*train_args(env, run, "--max-steps", 400, "--save-every", 400)),
                          f"pid {first.pid}", f"host {socket.gethostname()}", "in use by another dflash process")
        assert "dflash train" in line
        out = first.communicate(timeout=300)[0]
        assert first.returncode == 0, out[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 400  # one writer: no duplicated records
    assert not (run / LOCK_NAME).exists()  # released at the end


def test_extract_and_regenerate_refuse_a_live_lock(env, tmp_path):
    """A lock held by another live process (the real OutputLock, in a subprocess) refuses extract and regenerate."""
    out = tmp_path / "cache"
    holder = subprocess.Popen(
        [PY, "-c", "import sys, time; from dflash_cache.lock import OutputLock; l = OutputLock(sys.argv[1], 'holder')"
                   ".acquire(); print('held', flush=True); time.sleep(60)", str(out)],
        cwd=REPO, env=env_for_subprocess(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        error_line(*cli(*extract_args(env["target"], env["data"], out)), f"pid {holder.pid}", "holder")
        error_line(*cli("regenerate", "--target", env["target"], "--data", env["data"], "--out", out, "--no-progress"),
                   f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert os.listdir(out) == [LOCK_NAME]  # nothing was written


def test_stale_lock_is_taken_over_and_said(env, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(env["cache"], cache)
    pid = dead_pid()
    write_lock(cache, pid=pid)
    out = ok(*extract_args(env["target"], env["data"], cache))
    assert f"took over the stale lock of pid {pid}" in out
    assert not (cache / LOCK_NAME).exists()


def test_lock_rules(tmp_path, monkeypatch):
    """Another host's lock is refused (its liveness cannot be checked); a lock is exclusive even within one
    process; the rank-0 restart of the same torchrun job takes over its own job's lock."""
    p = tmp_path / "out"
    write_lock(p, host="gpu-node-7", pid=4242)
    with pytest.raises(LockedError, match="pid 4242 on host gpu-node-7.*delete"):
        OutputLock(str(p)).acquire()
    os.remove(p / LOCK_NAME)
    a = OutputLock(str(p), "a").acquire()
    with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
        OutputLock(str(p), "b").acquire()
    a.release()
    assert not (p / LOCK_NAME).exists()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    write_lock(p, pid=os.getppid(), job="job-1")  # a live pid, but of this same job
    lk = OutputLock(str(p)).acquire()
    assert "same torchrun job" in lk.note
    lk.release()
    write_lock(p, pid=os.getppid(), job="job-2")
    with pytest.raises(LockedError):
        OutputLock(str(p)).acquire()


# ------------------------------------------------------------------------------------------------ 4. bad input


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe is a machine without CUDA")
def test_device_and_gpus_on_a_machine_without_cuda(env, tmp_path):
    for dev in ("cuda", "cuda:1"):
        error_line(*cli(*train_args(env, tmp_path / "r", "--device", dev)), f"--device {dev}", "no usable CUDA")
        error_line(*cli(*extract_args(env["target"], env["data"], tmp_path / "c", "--device", dev)), "--device")
    error_line(*cli(*train_args(env, tmp_path / "r", "--gpus", "0")), "--gpus 0", "no usable CUDA")
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()


def test_bad_flags_and_paths_are_one_error_line(env, tmp_path):
    t, d = env["target"], env["data"]
    error_line(*cli(*train_args(env, tmp_path / "r", "--device", "tpu")), "--device", "tpu")
    error_line(*cli(*train_args(env, tmp_path / "r", "--attn", "flex")), "--attn flex", "CUDA")
    error_line(*cli(*train_args(env, tmp_path / "r", "--loader-threads", 0)), "--loader-threads")
    f = tmp_path / "afile"
    f.write_text("x")
    error_line(*cli(*train_args(env, f)), "--out", str(f), "existing file")
    error_line(*cli(*extract_args(t, d, f)), "--out", str(f))
    error_line(*cli(*extract_args(t, d, tmp_path / "c", "--chat-template", tmp_path / "missing.jinja")),
               "--chat-template", "no such file")
    error_line(*cli(*extract_args(t, d, tmp_path / "c", "--num-context-layers", 99)), "--num-context-layers 99")
    error_line(*cli("eval", "--target", t, "--drafter", tmp_path, "--data", d, "--max-prompts", 1, "--no-progress"),
               "not a drafter checkpoint")
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("where", ["directory", "missing_directory"])
def test_json_output_checked_before_the_work(env, tmp_path, where):
    """Before: a bad --json failed only after the whole job, leaving a temporary file. Now: at once, nothing written."""
    target = tmp_path / "adir" if where == "directory" else tmp_path / "nope" / "summary.json"
    (tmp_path / "adir").mkdir()
    out = tmp_path / "cache"
    error_line(*cli(*extract_args(env["target"], env["data"], out, "--json", target)), "--json", str(target))
    error_line(*cli("regenerate", "--target", env["target"], "--data", env["data"], "--out", tmp_path / "regen",
                    "--json", target), "--json")
    error_line(*cli("eval", "--target", env["target"], "--drafter", tmp_path, "--data", env["data"], "--json", target),
               "--json")
    assert not out.exists() and not (tmp_path / "regen").exists()
    assert sorted(os.listdir(tmp_path)) == ["adir"] and os.listdir(tmp_path / "adir") == []  # no temp file


def test_unexpected_exceptions_keep_their_traceback(env, tmp_path, monkeypatch):
    """Only known errors become one line: a bug still shows where it is."""
    import dflash.train.fit.trainer

    def boom(cfg):
        raise KeyError("a bug")

    monkeypatch.setattr(dflash.train.fit.trainer, "run_train", boom)
    r = CliRunner().invoke(cli_main, [str(a) for a in train_args(env, tmp_path / "r")])
    assert isinstance(r.exception, KeyError)


def _can_mount_tmpfs(path: Path) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                          capture_output=True).returncode == 0 and subprocess.run(["umount", str(path)]).returncode == 0


@pytest.mark.parametrize("disk", ["tmpfs", "rlimit"])
def test_disk_full_while_train_writes_a_checkpoint(env, tmp_path, disk):
    """Before: torch's RuntimeError traceback. Now: one line naming the file; the last good checkpoint is intact,
    no partial checkpoint is left, and rerunning with space resumes from it. A real full disk (a small tmpfs)
    where this process may mount one, else a file-size limit (the same EFBIG/ENOSPC path) in a subprocess."""
    run = tmp_path / "run"
    ok(*train_args(env, run, "--max-steps", 2, "--save-every", 1))
    ck = run / "checkpoints"
    ck_bytes = sum(f.stat().st_size for f in (ck / "step_00000002").iterdir())
    mnt = tmp_path / "mnt"
    if disk == "tmpfs" and not _can_mount_tmpfs(mnt):
        pytest.skip("this process may not mount a tmpfs (the rlimit case covers the same path)")
    if disk == "tmpfs":
        used = sum(len(b) for b in tree_files(run).values())
        size_kb = (used + ck_bytes // 2) // 1024 + 64  # room for the run, not for one more checkpoint
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)], check=True)
        try:
            shutil.copytree(run, mnt / "run")
            frun = mnt / "run"
            code, out = cli(*train_args(env, frun, "--max-steps", 4, "--save-every", 1))
            line = error_line(code, out, "cannot write", str(frun / "checkpoints"), "last good checkpoint")
            assert "disk full" in line or "No space" in line, line
            latest = (frun / "checkpoints" / "latest").read_text().strip()
            assert latest in os.listdir(frun / "checkpoints")
            assert not [n for n in os.listdir(frun / "checkpoints") if n.endswith(".tmp")]
            assert latest in line
            shutil.rmtree(run)
            shutil.copytree(frun, run)  # "free space": the same run on a disk with room
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    else:
        import resource

        limit = ck_bytes // 3

        def fsize():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        p = subprocess.run([PY, "-m", "dflash", *map(str, train_args(env, run, "--max-steps", 4, "--save-every", 1))],
                           cwd=REPO, env=env_for_subprocess(), capture_output=True, text=True, preexec_fn=fsize)
        line = error_line(p.returncode, p.stdout + p.stderr, "cannot write", str(run / "checkpoints"), "last good")
        assert "file too large" in line and "step_00000002" in line
        assert (ck / "latest").read_text().strip() == "step_00000002"
        assert not [n for n in os.listdir(ck) if n.endswith(".tmp")]
    out = ok(*train_args(env, run, "--max-steps", 4, "--save-every", 1))
    assert "resumed from" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"


# ------------------------------------------------------------------------------------------------ 5. smaller truths


def _flip_a_chunk(cache: Path, shard: int) -> None:
    chunk = sorted(glob.glob(str(cache / "shards" / f"{shard:06d}" / "hidden" / "c" / "**" / "*"), recursive=True))
    chunk = [c for c in chunk if os.path.isfile(c)][0]
    b = bytearray(Path(chunk).read_bytes())
    b[len(b) // 2] ^= 0xFF
    Path(chunk).write_bytes(bytes(b))


def test_repair_uncommits_bad_shards_and_extract_redoes_them(env, tmp_path):
    """Before: a rerun on a corrupted cache said "cache complete" and nothing could repair it. Now the rerun points
    at verify, `verify --repair` un-commits the bad shard (naming it), the next extract rewrites it: the cache is
    then file for file the one that was never corrupted."""
    cache = tmp_path / "cache"
    shutil.copytree(env["cache"], cache)
    _flip_a_chunk(cache, 1)
    out = ok(*extract_args(env["target"], env["data"], cache))
    assert "cache verify" in out and "--repair" in out
    code, out = cli("cache", "verify", cache)
    assert code == 1 and "BAD shard 000001" in out
    code, out = cli("cache", "verify", cache, "--repair")
    assert code == 1 and "un-committed 1 shard(s) 000001" in out
    assert 1 not in dflash_cache.open(str(cache), allow_incomplete=True).commits
    ok(*extract_args(env["target"], env["data"], cache))
    code, out = cli("cache", "verify", cache)
    assert code == 0 and out.strip().endswith("OK"), out
    assert_same_but_volatile(env["cache"], cache)


def test_cache_info_says_it_reads_metadata_only(env):
    out = ok("cache", "info", env["cache"])
    assert "metadata only" in out and "dflash cache verify" in out


def assert_same_but_volatile(a: Path, b: Path) -> None:
    """Every file of two caches byte-identical, except the documented volatile fields: info.run in the root's
    zarr.json (and in its record in shards/zarr.json, with the record's digest) and VOLATILE_COMMIT_FIELDS (time,
    writer) in each shard's commit record."""
    fa, fb = tree_files(a), tree_files(b)
    assert sorted(fa) == sorted(fb)
    differ = []
    for name in fa:
        if fa[name] == fb[name]:
            continue
        differ.append(name)
        ja, jb = json.loads(fa[name]), json.loads(fb[name])
        if name == "zarr.json":
            ja["attributes"]["info"].pop("run"), jb["attributes"]["info"].pop("run")
        elif name == "shards/zarr.json":  # the root's record (format.root_record_json): its info.run, and its digest
            for j in (ja, jb):
                j["attributes"]["dflash_root"]["info"].pop("run"), j["attributes"].pop("dflash_root_digest")
        else:
            assert name.startswith("shards") and name.endswith("zarr.json"), name
            for j in (ja, jb):
                for k in VOLATILE_COMMIT_FIELDS:
                    j["attributes"]["dflash_commit"].pop(k)
        assert ja == jb, name
    return differ


def test_resumed_cache_is_byte_identical_but_the_volatile_fields(env, tmp_path):
    """An interrupted extraction (some shards committed, one half-written, the rest absent) resumed: every chunk
    file and array metadata byte-identical to an uninterrupted run's; the root and commit records differ only in
    the volatile fields the README lists."""
    cache = tmp_path / "cache"
    shutil.copytree(env["cache"], cache)
    for s in range(1, env["shards"]):
        shutil.rmtree(cache / "shards" / f"{s:06d}")
    half = cache / "shards" / f"{env['shards'] - 1:06d}" / "hidden" / "c" / "0" / "0"
    half.mkdir(parents=True)
    (half / "0.abc.partial").write_bytes(b"\0" * 100)  # a write cut short
    time.sleep(1.1)  # the commit time (second resolution) differs: the volatile fields are really exercised
    ok(*extract_args(env["target"], env["data"], cache))
    differ = assert_same_but_volatile(env["cache"], cache)
    assert differ and all(n.startswith("shards/") and n.endswith("/zarr.json") for n in differ), differ  # the root
    # is written once, when the cache is created: a resume does not touch it


def test_two_fresh_single_thread_cpu_runs_are_bit_identical(env, tmp_path):
    """What the README says is bit-reproducible: on one CPU thread (as here), two fresh runs give the same weights
    bit for bit. (With several threads the reductions may add in another order: the last bits may differ.)"""
    from safetensors.torch import load_file

    assert torch.get_num_threads() == 1
    for name in ("a", "b"):
        ok(*train_args(env, tmp_path / name, "--max-steps", 3))
    ck = Path("checkpoints") / "step_00000003" / "model.safetensors"  # float32 (final/ is rounded to bf16)
    wa, wb = (load_file(str(tmp_path / n / ck)) for n in ("a", "b"))
    assert wa["fc.weight"].dtype == torch.float32
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lock_on_an_fsspec_url_is_best_effort_but_refuses_a_later_writer():
    """Object stores have no exclusive create: the lock is written, read back after a pause, and a writer that
    comes later is refused (README, Guarantees); released, it can be taken again."""
    url = f"memory://trust-{os.getpid()}/out"
    a = OutputLock(url, "first").acquire()
    with pytest.raises(LockedError, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
        OutputLock(url, "second").acquire()
    a.release()
    OutputLock(url, "third").acquire().release()
