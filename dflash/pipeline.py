"""`dflash pipeline`: extraction and a trainer that follows it, at the same time, as two jobs joined only by the cache.

    dflash pipeline --target T --data D --cache C --out RUN [--config P] \\
        --extract-gpus 0,1,2,3,4 --train-gpus 5,6,7 --extract-args "--seq-len 4096" --train-args "--epochs 2"

runs `dflash extract --out C ...` on --extract-gpus and `dflash train --follow --cache C --out RUN ...` on
--train-gpus, each a torchrun job of one process per GPU (as their own --gpus would launch it) or, without a GPU list,
one plain process on its default device (the GPU if there is one, else the CPU). They share nothing but the cache:
the trainer reads each shard once it is committed (train/fit/follow.py) and its run equals, bit for bit, a run over the
finished cache. Their output is forwarded line by line behind `[extract] ` and `[train] `; every --status-every
seconds and at the end the pipeline says how far each is and at what rate (extraction: committed rows and tokens per
second; training: rows per second and the share of time it waited for data), and the wall clock of the whole; --json
writes both summaries and the wall clock.

A DFlash2 trainer (--arch dflash2, given to the pipeline, in --train-args or by the preset) learns from the
target's last hidden state: the extraction then records it (extract --last-hidden), and an existing --cache without it
is refused in one line before either job starts.

Rerunning the same command resumes both (extract skips committed shards, train resumes from its last checkpoint).
When one of them fails the pipeline stops the other (SIGTERM; a kill of either resumes exactly) and exits with the
failure's code. The jobs end with the pipeline: on Linux each is started with a parent-death signal (prctl
PR_SET_PDEATHSIG, SIGTERM), so a pipeline killed even by kill -9 leaves no job running as an orphan (a torchrun job's
agent passes the SIGTERM to its workers), and a rerun takes their locks over and resumes.

One GPU for both (--extract-gpus 0 --train-gpus 0): the two processes share the device. The GPU time-slices
between their kernels, so each is slower than alone and the GPU work adds up; what the pipeline saves on one GPU is
what is not GPU work: the trainer's start (imports, its compile, which is CPU-bound) and its first epoch overlap the
extraction, and the trained drafter is ready about one shuffle window after the last shard instead of a whole
training run after it. Both must fit in its memory (at the Qwen3-8B shape: the target's 16 GB and the extraction's
buffers beside the trainer's ~35 GB).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from dflash.core.config import ConfigError

# flags the pipeline sets itself (one cache, one run): given in --extract-args / --train-args they are an error
OWN_FLAGS = {"extract": ("--target", "--data", "--out", "--config", "--gpus", "--json"),
             "train": ("--target", "--cache", "--out", "--config", "--gpus", "--follow")}


@dataclass
class PipelineConfig:
    target: str
    data: str
    cache: str
    out: str
    preset: str | None = None
    extract_gpus: str | None = None
    train_gpus: str | None = None
    extract_args: str = ""
    train_args: str = ""
    status_every: float = 60.0
    json_out: str | None = None
    arch: str | None = None  # train's --arch (None: --train-args', else the preset's, else dflash)


def split_args(text: str, part: str) -> list[str]:
    """--extract-args / --train-args as a list, refusing the flags the pipeline sets (one error line naming it)."""
    try:
        args = shlex.split(text or "")
    except ValueError as e:
        raise ConfigError(f"--{part}-args {text!r}: {e}") from None
    for a in args:
        if a.split("=", 1)[0] in OWN_FLAGS[part]:
            raise ConfigError(f"--{part}-args: {a.split('=', 1)[0]} is set by `dflash pipeline` itself "
                              f"({', '.join(OWN_FLAGS[part])}); give it to the pipeline")
    return args


def flag_value(args: list[str], name: str) -> str | None:
    """The value of `name` in an argument list (`--arch X` or `--arch=X`; the last one wins, as click reads it)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def train_arch(cfg: PipelineConfig) -> str:
    """The drafter the trainer will train: the pipeline's --arch, else --train-args' --arch, else the preset's."""
    from dflash.core.config import read_preset

    given = flag_value(split_args(cfg.train_args, "train"), "--arch")
    if cfg.arch and given and given != cfg.arch:
        raise ConfigError(f"--train-args: --arch {given} contradicts the pipeline's --arch {cfg.arch}: give one")
    return str(cfg.arch or given or read_preset(cfg.preset, "train").get("arch") or "dflash")


def extract_last_hidden(cfg: PipelineConfig) -> bool:
    """Whether the extraction must record the target's last hidden state: --arch dflash2 trains on it."""
    return train_arch(cfg) == "dflash2"


def check_cache(cfg: PipelineConfig) -> None:
    """An existing --cache that a dflash2 trainer cannot read (no last hidden state) is refused before any work: the
    extraction the pipeline starts would find its settings changed, and the trainer could not train on it."""
    if not extract_last_hidden(cfg) or "--overwrite" in split_args(cfg.extract_args, "extract"):
        return
    import dflash_cache

    try:
        cache = dflash_cache.open(cfg.cache, follow=True)
    except dflash_cache.CacheError:
        return  # none yet (or not one): the extraction makes it, with --last-hidden
    if not cache.last_hidden:
        raise ConfigError(f"--cache {cfg.cache} was extracted without the target's last hidden state, which --arch "
                          "dflash2 trains on: give another --cache (the pipeline extracts it with --last-hidden), or "
                          "--extract-args --overwrite to extract this one again")


def commands(cfg: PipelineConfig, summary_json: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The two jobs: name -> (command, environment). With --arch dflash2 (train_arch) the extraction records the
    target's last hidden state (extract --last-hidden)."""
    from dflash.core.dist import check_gpu_ids, torchrun_command

    preset = ["--config", cfg.preset] if cfg.preset else []
    extract_more = split_args(cfg.extract_args, "extract")
    if extract_last_hidden(cfg) and "--last-hidden" not in extract_more:
        extract_more.append("--last-hidden")
    arch = ["--arch", cfg.arch] if cfg.arch else []
    argv = {
        "extract": ["extract", "--target", cfg.target, "--data", cfg.data, "--out", cfg.cache, *preset,
                    "--json", summary_json, "--no-progress", *extract_more],
        "train": ["train", "--follow", "--target", cfg.target, "--cache", cfg.cache, "--out", cfg.out, *preset, *arch,
                  "--no-progress", *split_args(cfg.train_args, "train")],
    }
    gpus = {"extract": cfg.extract_gpus, "train": cfg.train_gpus}
    out = {}
    for name, args in argv.items():
        if gpus[name]:
            cmd, env = torchrun_command("dflash", args, gpus[name], os.environ)
            check_gpu_ids(env["CUDA_VISIBLE_DEVICES"].split(","))
        else:
            cmd, env = [sys.executable, "-m", "dflash", *args], dict(os.environ)
        env.update(PYTHONUNBUFFERED="1")
        out[name] = (cmd, env)
    return out


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent():
    """A Popen preexec_fn that makes the child get SIGTERM when this process dies (however it dies), or None where
    the platform has no parent-death signal. libc is resolved here, in the parent: the child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the pipeline died before the signal was set: end now
            os._exit(1)

    return in_child


def forward_lines(name: str, stream, lock: threading.Lock) -> None:
    """Copy a job's output to ours, each line behind `[name] ` (a thread that only moves bytes)."""
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[{name}] {line if line.endswith(chr(10)) else line + chr(10)}")
            sys.stdout.flush()
    stream.close()


class Progress:
    """How far each job is, from what they write: the cache's commit records and RUN/metrics.jsonl."""

    def __init__(self, cache: str, out: str):
        self.cache_path, self.out = cache, out
        self.cache = None
        self.first: tuple[float, int, int] | None = None  # (time, rows, tokens) at the first look at the cache
        self.last: tuple[float, int, int] | None = None  # the same when they last grew

    def extraction(self) -> str:
        import dflash_cache

        if self.cache is None:
            try:
                self.cache = dflash_cache.open(self.cache_path, follow=True)
            except dflash_cache.CacheError:
                return "extraction: no cache yet"
        c = self.cache
        c.refresh()
        rows, tokens, now = c.committed_rows, c.real_tokens, time.monotonic()
        if self.first is None:
            self.first = self.last = (now, rows, tokens)
        elif rows > self.last[1]:
            self.last = (now, rows, tokens)
        (t0, r0, k0), (t1, r1, k1) = self.first, self.last
        rate = f", {(k1 - k0) / (t1 - t0):,.0f} tok/s ({(r1 - r0) / (t1 - t0):.3g} rows/s)" if r1 > r0 else ""
        state = "complete" if c.complete else f"{len(c.commits)}/{c.spec.num_shards} shards"
        return f"extraction: {state}, {rows}/{c.spec.num_rows} rows{rate}"

    def training(self) -> str:
        from dflash.train.fit.run_dir import read_metrics

        try:
            recs = read_metrics(self.out)
        except (OSError, ValueError):
            recs = []
        if not recs:
            return "training: no step logged yet"
        r = recs[-1]
        T = self.cache.spec.seq_len if self.cache is not None else None
        rows = f", {r['ctx_tokens_per_s'] / T:.3g} rows/s" if T else ""
        return (f"training: step {r['step']}, loss {r['loss']:.4f}{rows}, "
                f"data wait {100 * r.get('data_wait_frac', 0.0):.0f}%")


def run_pipeline(cfg: PipelineConfig) -> int:
    """Run both jobs to the end; returns the exit code (0, or the first failure's)."""
    check_cache(cfg)
    tmp = tempfile.mkdtemp(prefix="dflash-pipeline-")
    summary_json = os.path.join(tmp, "extract.json")
    jobs = commands(cfg, summary_json)
    lock = threading.Lock()

    def say(msg: str) -> None:
        with lock:
            print(msg, flush=True)

    t0 = time.monotonic()
    procs: dict[str, subprocess.Popen] = {}
    threads = []
    for name, (cmd, env) in jobs.items():
        say(f"pipeline: {name}: {' '.join(shlex.quote(c) for c in cmd)}")
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             preexec_fn=end_with_parent())
        procs[name] = p
        th = threading.Thread(target=forward_lines, args=(name, p.stdout, lock), daemon=True)
        th.start()
        threads.append(th)
    progress = Progress(cfg.cache, cfg.out)
    code, failed, ended = 0, None, {}
    next_status = time.monotonic() + cfg.status_every
    try:
        while len(ended) < len(procs):
            for name, p in procs.items():
                if name not in ended and p.poll() is not None:
                    ended[name] = time.monotonic() - t0
                    if p.returncode != 0 and failed is None:
                        failed, code = name, p.returncode if p.returncode > 0 else 1
                        say(f"pipeline: {name} failed (exit {p.returncode}); stopping the other job (rerunning this "
                            "command resumes both)")
                        for other, q in procs.items():
                            if other != name and q.poll() is None:
                                q.send_signal(signal.SIGTERM)
            if time.monotonic() >= next_status and failed is None:
                next_status += cfg.status_every
                say(f"pipeline: {progress.extraction()}; {progress.training()}")
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        raise
    finally:
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        for th in threads:
            th.join(timeout=5)
    wall = time.monotonic() - t0
    if failed is None:
        say(report(cfg, summary_json, wall, ended))
    if cfg.json_out:
        from dflash.core.io import atomic_json

        atomic_json(cfg.json_out, {"exit": code, "failed": failed, "wall_s": wall, "ended_s": ended,
                                   "extract": _read(summary_json), "train": _read(os.path.join(cfg.out, "summary.json"))})
    shutil.rmtree(tmp, ignore_errors=True)
    return code


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def report(cfg: PipelineConfig, summary_json: str, wall: float, ended: dict[str, float]) -> str:
    """The closing line: both rates and the wall clock."""
    parts = []
    try:
        with open(summary_json) as f:
            e = json.load(f)
        parts.append(f"extraction {e['tokens_all_ranks']:,} tokens in {e['slowest_rank_s']:.0f} s "
                     f"({e['tokens_per_s_all_ranks']:,.0f} tok/s; ended at {ended.get('extract', 0):.0f} s)")
    except (OSError, ValueError, KeyError):
        parts.append("extraction: no summary")
    try:
        with open(os.path.join(cfg.out, "summary.json")) as f:
            s = json.load(f)
        fol = s.get("follow") or {}
        last = (s.get("history") or [{}])[-1]
        parts.append(f"training {s['steps_this_run']} steps in {s['elapsed_s']:.0f} s "
                     f"({last.get('ctx_tokens_per_s', 0):,.0f} ctx tok/s in the last window; waited "
                     f"{fol.get('waited_s', 0):.0f} s for shards; ended at {ended.get('train', 0):.0f} s)")
    except (OSError, ValueError, KeyError):
        parts.append("training: no summary")
    return f"pipeline: {'; '.join(parts)}; {wall:.0f} s from start to the trained drafter ({cfg.out}/final)"
