"""`dflash train` end to end on CPU: real extracted cache, real CLI processes, real torchrun, no mocks.

One cache per module, made by the real `dflash extract` from a tiny Qwen3 target (~20 packed rows of 128
tokens, layers [1, 2, 3]). Runs use a 1-layer drafter, blocks of 4, 16 anchors per row and 2 rows per
batch, so an eager CLI run costs a few seconds (mostly imports); runs that need no process of their own
go through the same click command in this process. The one compiled run costs ~60-180 s of inductor
compile on 2 cores the first time, ~15 s once inductor's on-disk cache is warm.

What is covered:
    the CLI run: run.json, metrics.jsonl (loss goes down, grad norms finite, lr = train.trainer.lr_at),
        checkpoints (keep_checkpoints), summary.json, the servable final/ (load_drafter, dflash_config)
    compiled vs eager: the same losses, no recompiles after warm-up; also with bf16 weights, an untied head,
        GQA and a multi-chunk cross-entropy (in process)
    SIGKILL after a checkpoint + rerun: the same losses and weights, bit for bit, as an uninterrupted run;
        also when killed before the first checkpoint; no duplicate steps in metrics.jsonl; gradient
        accumulation (and its resume)
    errors: exit code 2, one `error:` line naming the flag/field, no traceback
    a non-finite loss: error naming the step and the last good checkpoint, no final/
    data parallel under torchrun (2 CPU processes, gloo)
    wandb offline (no account, no network); no wandb directory without --wandb-project
    lr_at and resolve_mask_token_id
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import dflash_cache
from dflash.cli import main as cli_main
from dflash.core.config import ConfigError
from dflash.train.drafter.checkpoint import load_drafter
from dflash.train.fit.trainer import TrainConfig, lr_at, resolve_mask_token_id
from tests.tiny import chat_rows, make_tiny_target, make_tiny_tokenizer, write_jsonl
from tests.workload import slowed_steps

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
SEQ = 128
# the small drafter/batch every run here uses
SMALL = ["--drafter-layers", "1", "--block-size", "4", "--num-anchors", "16", "--batch-rows", "2", "--no-progress"]


def _env(**extra) -> dict[str, str]:
    # one intra-op thread: these models are tiny, and on a busy 2-core machine a spinning OpenMP pool is 10x
    # slower; in-process runs use one thread too (see single_thread), so numbers match bit for bit
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WANDB_MODE", "WANDB_PROJECT"):
        env.pop(k, None)
    env.update(extra)
    return env


def dflash(*args, env=None, timeout=300, check=True) -> subprocess.CompletedProcess:
    """`python -m dflash ARGS` in a fresh process."""
    p = subprocess.run([PY, "-m", "dflash", *map(str, args)], cwd=REPO, env=env or _env(), capture_output=True,
                       text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def cli(*args) -> tuple[int, str, str]:
    """The same click command in this process (fast: no imports), as (exit code, stdout, stderr)."""
    r = CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback

        raise AssertionError("".join(traceback.format_exception(r.exception))) from r.exception
    return r.exit_code, r.stdout, r.stderr


def ok(*args) -> str:
    """cli(...) that must succeed; returns its stdout."""
    code, out, err = cli(*args)
    assert code == 0, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
    return out


def metrics(run: Path) -> list[dict]:
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run)}


def read_json(p: Path):
    with open(p) as f:
        return json.load(f)


def assert_clean_error(code: int, err: str, *needles: str) -> str:
    """Exit code 2 and exactly one line, `error: ...`, containing every needle; no traceback."""
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny target and a cache extracted from it by the real `dflash extract`."""
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "chat.jsonl", chat_rows(40, seed=3))
    cache = root / "cache"
    dflash("extract", "--target", target, "--data", data, "--out", cache, "--seq-len", SEQ, "--rows-per-shard", 8)
    c = dflash_cache.open(str(cache))
    assert c.complete and len(c) >= 12, len(c)
    return {"root": root, "target": target, "cache": cache, "rows": len(c), "layer_ids": c.layer_ids,
            "meta": c.metadata}


def base(env, out, *more) -> list[str]:
    return ["train", "--cache", env["cache"], "--target", env["target"], "--out", out, *SMALL, *map(str, more)]


# ------------------------------------------------------------------------------------------------ 1. a CLI run


def test_cli_run_writes_run_metrics_checkpoints_summary_and_servable_final(env, tmp_path):
    keep = tmp_path / "keep.yaml"  # keep_checkpoints has no flag: set it through a preset
    keep.write_text("train:\n  keep_checkpoints: 2\n")
    run = tmp_path / "run"
    lr, warm, floor, steps = 1e-2, 0.1, 0.1, 40
    p = dflash(*base(env, run, "--config", keep, "--max-steps", steps, "--lr", lr, "--warmup-ratio", warm,
                     "--min-lr-ratio", floor, "--log-every", 1, "--save-every", 10))
    assert "Traceback" not in p.stderr

    # run.json: the resolved settings
    rj = read_json(run / "run.json")["config"]
    tok = make_tiny_tokenizer()
    assert rj["lr"] == lr and rj["world"] == 1 and rj["total_steps"] == steps and rj["keep_checkpoints"] == 2
    assert rj["mask_token_id"] == len(tok)  # the tiny target's table has 16 rows beyond the tokenizer
    assert rj["cache"] == str(env["cache"]) and rj["param_dtype"] == "float32" and rj["attn"] == "split"
    assert rj["drafter"]["target_layer_ids"] == env["layer_ids"]

    # metrics.jsonl: one record per step, finite, lr on the schedule, loss going down
    recs = metrics(run)
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    for r in recs:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
        assert 1.0 <= r["tau_expected"] <= 4.0 and len(r["slot_acc"]) == 3
    cfg = TrainConfig(cache="c", target="t", out="o", lr=lr, warmup_ratio=warm, min_lr_ratio=floor)
    for r in recs:  # the record of step s is written after the update that used lr_at(s - 1)
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, steps, cfg), rel=1e-12), r["step"]
    lrs = [r["lr"] for r in recs]
    assert lrs[0] == pytest.approx(lr / 4) and lrs[3] == pytest.approx(lr)  # 4 warm-up steps
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # then the cosine only goes down
    assert lr * floor < lrs[-1] < lr * floor * 1.05
    first, last = [r["loss"] for r in recs[:5]], [r["loss"] for r in recs[-10:]]
    assert sum(last) / len(last) < sum(first) / len(first) - 0.04, (first, last)  # ~0.1 here; noise ~0.02
    assert recs[-1]["epoch"] == pytest.approx(steps / math.ceil(env["rows"] / 2))

    # checkpoints: every 10 steps, the last 2 kept, `latest` points to the newest
    ck = run / "checkpoints"
    assert sorted(os.listdir(ck)) == ["latest", "step_00000030", "step_00000040"]
    assert (ck / "latest").read_text().strip() == "step_00000040"
    for name in ("config.json", "model.safetensors", "optimizer.pt", "trainer.json"):
        assert (ck / "step_00000040" / name).exists(), name
    assert read_json(ck / "step_00000040" / "trainer.json")["step"] == steps

    # summary.json
    s = read_json(run / "summary.json")
    assert s["steps"] == steps and s["steps_this_run"] == steps and s["recompiles_after_warmup"] == 0
    assert len(s["history"]) == steps and s["final"] == str(run / "final") and s["params"] > 0

    # final/: the servable layout (bf16), the same weights as the last checkpoint
    final = run / "final"
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors"]
    conf = read_json(final / "config.json")
    assert conf["dflash_config"] == {"target_layer_ids": env["layer_ids"], "mask_token_id": len(tok)}
    assert conf["block_size"] == 4 and conf["num_hidden_layers"] == 1 and conf["num_target_layers"] == 6
    assert conf["model_type"] == "qwen3" and conf["hidden_size"] == 64
    m = load_drafter(str(final))
    assert m.cfg.target_layer_ids == env["layer_ids"] and m.cfg.mask_token_id == len(tok) and m.cfg.block_size == 4
    w, wck = weights(final), weights(ck / "step_00000040")
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.q_norm.weight", "layers.0.mlp.gate_proj.weight",
            "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"} <= set(w)
    assert set(w) == set(wck)
    for k in w:
        assert w[k].dtype == torch.bfloat16 and wck[k].dtype == torch.float32
        assert torch.equal(w[k], wck[k].to(torch.bfloat16)), k
    assert not (run / "wandb").exists()  # no --wandb-project: no wandb at all


# ------------------------------------------------------------------------------------------------ 2. compiled


@pytest.mark.slow
@pytest.mark.cxx
def test_compiled_matches_eager_with_no_recompiles(env, tmp_path, monkeypatch):
    # an inductor cache of its own: one warmed by an earlier run would build nothing (and time no inductor phase)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    common = ["--max-steps", 10, "--lr", 3e-3, "--log-every", 1, "--seed", 5]
    ok(*base(env, tmp_path / "eager", *common, "--compile", "off"))  # in this process (no import cost)
    p = dflash(*base(env, tmp_path / "compiled", *common, "--compile", "on"), timeout=590)
    assert "compiled on cpu" in p.stdout, p.stdout
    eager, comp = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert [r["step"] for r in comp] == list(range(1, 11))
    for a, b in zip(eager, comp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (a["step"], a["grad_norm"], b["grad_norm"])
    s = read_json(tmp_path / "compiled" / "summary.json")
    assert s["recompiles_after_warmup"] == 0 and s["steps"] == 10
    c = s["compile_check"]  # the compiled step checked itself against the eager one on the first batch, and passed
    assert s["compiled"] and c["ran"] and c["passed"] and "agree" in p.stdout, p.stdout
    assert c["loss_compiled"] == pytest.approx(c["loss_eager"], rel=1e-5) and c["grad_rel_err"] < 1e-3
    ph = c["compile_phases"]  # where the first compiled call's time went, from torch's own counters
    assert ph["dynamo"] > 0 and ph["inductor forward"] > 0 and ph["inductor backward"] > 0, ph
    assert ph["dynamo"] + ph["aot autograd"] + ph["inductor forward"] + ph["inductor backward"] <= c["compiled_s"], c
    assert 0 < c["compiled_s"] and 0 < c["eager_s"] and c["compiled_s"] + c["eager_s"] <= c["seconds"] + 1e-6, c
    assert f"first compiled call {c['compiled_s']:.0f} s (" in p.stdout, p.stdout
    for name, secs in ph.items():  # each phase of half a second or more, rounded (dynamo's may take less)
        assert (f"{name} {secs:.0f}" in p.stdout) == (secs >= 0.5), (name, secs, p.stdout)
    assert read_json(tmp_path / "compiled" / "run.json")["config"]["compile"] == "on"


@pytest.mark.slow
def test_compiled_matches_eager_bf16_untied_gqa_chunked_loss(tmp_path, monkeypatch):
    """What the 8B shape has and the run above lacks: bf16 weights, an untied LM head, GQA 4:1, B = 16 and a
    cross-entropy over several chunks (forced to 256 slots each). Eager and compiled agree on CPU."""
    import dflash.train.drafter.loss as loss
    import dflash.train.drafter.model as model
    from bench.common import random_target_dir
    from bench.train import synthetic_cache
    from dflash.train.fit.trainer import Trainer, TrainConfig

    monkeypatch.setattr(loss, "ce_chunk", lambda vocab, budget_bytes=0: 256)  # 2 rows x 32 anchors x 15 slots: 4 chunks
    shape = dict(vocab_size=8000, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)
    target = random_target_dir(str(tmp_path / "target"), shape, device="cpu", head_only=True)
    cache = synthetic_cache(str(tmp_path / "cache"), target, 256, 16, model.default_layer_ids(8))
    hist = {}
    for comp in ("off", "on"):
        cfg = TrainConfig(cache=cache, target=target, out=str(tmp_path / comp), drafter_layers=1, block_size=16,
                          num_anchors=32, batch_rows=2, max_steps=4, log_every=1, save_every=10**9, compile=comp,
                          attn="sdpa", param_dtype="bfloat16", progress=False, lr=6e-4)
        res = Trainer(cfg).train()
        assert res["recompiles_after_warmup"] == 0
        if comp == "on":  # the first-batch check ran and passed: the run stayed compiled
            assert res["compiled"] and res["compile_check"]["passed"], res["compile_check"]
            assert res["compile_check"]["grad_rel_err"] < 0.05, res["compile_check"]
        hist[comp] = res["history"]
    assert len(hist["on"]) == len(hist["off"]) == 4
    for a, b in zip(hist["off"], hist["on"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=3e-2), (a["step"], a["grad_norm"], b["grad_norm"])


def test_a_compiled_step_that_disagrees_with_eager_is_replaced_by_the_eager_one(env, tmp_path, capsys):
    """The first-batch check catches a compiled step whose gradients are wrong (here: its loss scaled by 1.3, as a
    faulty graph would do) and the run continues eagerly: the same trajectory as an eager run, said out loud."""
    from dflash.train.fit.trainer import Trainer

    cache, target = env["cache"], env["target"]
    common = dict(cache=str(cache), target=str(target), drafter_layers=1, block_size=4, num_anchors=16, batch_rows=2,
                  max_steps=4, log_every=1, save_every=10**9, progress=False, seed=3)
    eager = Trainer(TrainConfig(out=str(tmp_path / "eager"), compile="off", **common)).train()
    tr = Trainer(TrainConfig(out=str(tmp_path / "faulty"), compile="on", **common))
    assert tr.compiled
    right = tr.model.forward_train

    def faulty(*args):  # stands in for a compiled graph (not compiled here: the test is about what follows)
        loss, met = right(*args)
        return loss * 1.3, met

    tr.fwd = faulty
    res = tr.train()
    out = capsys.readouterr().out
    c = res["compile_check"]
    assert c["ran"] and not c["passed"] and not res["compiled"]
    assert c["grad_rel_err"] == pytest.approx(0.3, rel=1e-3) and c["loss_compiled"] == pytest.approx(1.3 * c["loss_eager"])
    assert "DISAGREE" in out and "continuing with the eager step" in out, out
    assert c["compile_phases"] == {k: 0.0 for k in c["compile_phases"]}, c  # nothing compiled: no phase took time
    assert "first compiled call" in out and "eager reference" in out, out
    assert [h["loss"] for h in res["history"]] == pytest.approx([h["loss"] for h in eager["history"]], rel=1e-6)
    assert read_json(tmp_path / "faulty" / "summary.json")["compile_check"]["passed"] is False


def test_no_compile_check_flag(env, tmp_path):
    """--no-compile-check skips the check (the summary says so) and is part of `dflash train --help`."""
    from dflash.train.fit.trainer import Trainer

    p = dflash("train", "--help")
    assert "--no-compile-check" in p.stdout
    cfg = TrainConfig(cache=str(env["cache"]), target=str(env["target"]), out=str(tmp_path / "r"), drafter_layers=1,
                      block_size=4, num_anchors=16, batch_rows=2, max_steps=1, progress=False, compile="on",
                      compile_check=False)
    tr = Trainer(cfg)
    tr.fwd = tr.model.forward_train  # no compilation needed to see that the check does not run
    res = tr.train()
    assert res["compile_check"] is None and res["compiled"]


# ------------------------------------------------------------------------------------------------ 3. resume

# `dflash train`, with every micro-step slowed by 0.1 s (numerics untouched), so that a SIGKILL lands
# reliably where the test wants it rather than after the end of the run.
THROTTLED = slowed_steps(0.1) + """
from dflash.cli import main
sys.argv = ["dflash", *sys.argv[1:]]
main()
"""


def logged_steps(run: Path) -> list[int]:
    """Steps in RUN/metrics.jsonl, read while a run may be appending to it."""
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    steps = []
    for line in text.splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass  # a line being written
    return steps


def latest_step(run: Path) -> int:
    try:
        return int((run / "checkpoints" / "latest").read_text().strip()[len("step_"):])
    except (FileNotFoundError, ValueError):
        return 0


def kill_when(args: list, run: Path, ready) -> None:
    """Start the throttled `dflash train ARGS`, SIGKILL it as soon as ready(run) holds."""
    p = subprocess.Popen([PY, "-c", THROTTLED, *map(str, args)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    try:
        while not ready(run):
            assert p.poll() is None, f"the run ended before it could be killed: {p.communicate()}"
            assert time.monotonic() < deadline, "the run did not get there in time"
            time.sleep(0.005)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=30)
        p.stdout.close()
        p.stderr.close()
    assert p.returncode == -signal.SIGKILL
    assert not (run / "final").exists() and not (run / "summary.json").exists()


def test_sigkill_then_rerun_resumes_bit_exactly(env, tmp_path):
    args = ["--max-steps", 20, "--save-every", 5, "--log-every", 1, "--lr", 3e-3, "--seed", 1]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(*base(env, ref, *args))  # the uninterrupted reference, in this process

    # 1. killed before its first checkpoint: the rerun starts over (and forgets what was logged)
    kill_when(base(env, run, *args), run, lambda r: max(logged_steps(r), default=0) >= 2)
    assert latest_step(run) == 0, "killed too late: the step-5 checkpoint was already written"
    # 2. that rerun is killed right after the step-10 checkpoint, once records past it were logged
    kill_when(base(env, run, *args), run, lambda r: latest_step(r) >= 10 and max(logged_steps(r), default=0) > latest_step(r))
    resume_at = latest_step(run)
    assert resume_at in (10, 15), resume_at
    assert max(logged_steps(run)) > resume_at  # records past the checkpoint: the rerun must drop them
    assert max(d for d in os.listdir(run / "checkpoints") if not d.endswith(".tmp")) == f"step_{resume_at:08d}"

    # 3. the same command again
    q = dflash(*base(env, run, *args))
    assert f"resumed from {run / 'checkpoints' / f'step_{resume_at:08d}'} at step {resume_at}" in q.stdout, q.stdout
    assert logged_steps(run) == list(range(1, 21))  # no duplicates, no gaps
    a, b = losses(ref), losses(run)
    assert a == b  # bit-exact (float32, eager): model, optimizer, schedule, data position, anchors restored
    s = read_json(run / "summary.json")
    assert s["steps"] == 20 and s["steps_this_run"] == 20 - resume_at
    wr, wk = weights(ref / "final"), weights(run / "final")
    assert all(torch.equal(wr[k], wk[k]) for k in wr)
    wr, wk = weights(ref / "checkpoints" / "step_00000020"), weights(run / "checkpoints" / "step_00000020")
    assert all(torch.equal(wr[k], wk[k]) for k in wr)  # float32 checkpoints: exact too

    # rerunning a finished run changes nothing: not the metrics, the summary, nor final/ (so what was measured on
    # final/, e.g. RUN/eval-*.json by the demo, stays current)
    before = (run / "summary.json").read_bytes(), (run / "final" / "model.safetensors").stat().st_mtime_ns
    out = ok(*base(env, run, *args))
    assert "nothing to do" in out and "finished its 20 steps" in out
    assert logged_steps(run) == list(range(1, 21))
    assert ((run / "summary.json").read_bytes(), (run / "final" / "model.safetensors").stat().st_mtime_ns) == before


def test_grad_accum_run_and_its_resume(env, tmp_path):
    run = tmp_path / "run"
    args = ["--grad-accum", 2, "--epochs", 1, "--log-every", 1, "--save-every", 3, "--lr", 3e-3]
    ok(*base(env, run, *args))
    spe = math.ceil(env["rows"] / 2)  # micro-batches per epoch
    want = math.ceil(spe / 2)
    recs, s = metrics(run), read_json(run / "summary.json")
    assert s["steps"] == want == read_json(run / "run.json")["config"]["total_steps"]
    assert [r["step"] for r in recs] == list(range(1, want + 1))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in recs)
    assert recs[-1]["epoch"] == pytest.approx(2 * want / spe)
    assert (run / "final" / "model.safetensors").exists()

    # resume with accumulation: the run as a crash after the step-3 checkpoint would leave it
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    for p in ("final", "summary.json", f"checkpoints/step_{want:08d}"):
        shutil.rmtree(cut / p) if (cut / p).is_dir() else (cut / p).unlink()
    (cut / "checkpoints" / "latest").write_text("step_00000003")
    assert "at step 3" in ok(*base(env, cut, *args))
    assert losses(cut) == losses(run)
    wr, wc = weights(run / "final"), weights(cut / "final")
    assert all(torch.equal(wr[k], wc[k]) for k in wr)


# ------------------------------------------------------------------------------------------------ 4. errors


def test_cache_from_another_target_is_refused_naming_the_field(env, tmp_path):
    # same shapes, another config (rms_norm_eps): the config hash differs -- checked in a real process
    other = tmp_path / "other"
    shutil.copytree(env["target"], other)
    conf = read_json(other / "config.json")
    conf["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(conf))
    p = dflash("train", "--cache", env["cache"], "--target", other, "--out", tmp_path / "r1", *SMALL,
               "--max-steps", 1, check=False)
    assert_clean_error(p.returncode, p.stderr, "target.config_hash", "--target", str(other))
    assert not (tmp_path / "r1").exists()

    # another hidden size: named before anything else
    narrow = make_tiny_target(tmp_path / "narrow", hidden=32)
    code, _, err = cli("train", "--cache", env["cache"], "--target", narrow, "--out", tmp_path / "r2", *SMALL,
                       "--max-steps", 1)
    assert_clean_error(code, err, "hidden_size", "64", "32")
    assert not (tmp_path / "r2").exists()


def test_bad_settings_are_refused_naming_the_flag(env, tmp_path):
    out = tmp_path / "r"
    code, _, err = cli(*base(env, out, "--max-steps", 1, "--num-anchors", SEQ))
    assert_clean_error(code, err, "--num-anchors", str(SEQ), f"at most {SEQ - 1}")
    code, _, err = cli(*base(env, out, "--max-steps", 1, "--batch-rows", env["rows"] + 1))
    assert_clean_error(code, err, "--batch-rows", f"the cache has {env['rows']}")
    code, _, err = cli(*base(env, out, "--max-steps", 1, "--epochs", 1))
    assert_clean_error(code, err, "--max-steps", "--epochs")
    code, _, err = cli(*base(env, out, "--max-steps", 1, "--mask-token-id", 10_000))
    assert_clean_error(code, err, "--mask-token-id", "10000")
    assert not out.exists()  # nothing was created for a refused run


def test_out_holding_another_run_or_other_files(env, tmp_path):
    run = tmp_path / "run"
    ok(*base(env, run, "--max-steps", 2, "--lr", 1e-3))
    before = (run / "run.json").read_text()
    code, _, err = cli(*base(env, run, "--max-steps", 2, "--lr", 2e-3))
    assert_clean_error(code, err, str(run), "different run", "'lr'", "--overwrite")
    assert (run / "run.json").read_text() == before  # untouched

    code, _, err = cli(*base(env, run, "--max-steps", 2, "--lr", 2e-3, "--overwrite"))
    assert code == 0, err
    assert read_json(run / "run.json")["config"]["lr"] == 2e-3
    assert [r["step"] for r in metrics(run)] == [2]  # a fresh run, not appended to the old one
    assert read_json(run / "summary.json")["steps_this_run"] == 2

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    code, _, err = cli(*base(env, junk, "--max-steps", 1))
    assert_clean_error(code, err, str(junk), "not a dflash run directory", "--overwrite")
    assert os.listdir(junk) == ["notes.txt"]


# ------------------------------------------------------------------------------------------------ 5. non-finite


def test_non_finite_loss_stops_naming_the_step_and_last_good_checkpoint(env, tmp_path):
    """A cache like the real one whose rows used at step 7 hold inf: the check at step 9 (log every 3) names
    step 7 and the step-6 checkpoint, and the run writes no final/."""
    real = dflash_cache.open(str(env["cache"]))
    spec = dflash_cache.CacheSpec.from_metadata(real.metadata)
    bad_step, seed = 7, 0
    order, _ = real.epoch_order(2, 0, 1, 0, seed)
    poisoned = {int(i) for i in order[bad_step - 1]}
    bad = tmp_path / "bad"
    w = dflash_cache.CacheWriter(str(bad), spec)
    for s in range(spec.num_shards):
        start, n = spec.shard_rows(s)
        rows = real.read_rows(list(range(start, start + n)))
        for j in range(n):
            if start + j in poisoned:
                rows["hidden"][j] = float("inf")
        w.write_shard(s, rows["input_ids"], rows["loss_mask"], rows["doc_ids"], rows["hidden"])
    w.close()
    assert dflash_cache.open(str(bad)).metadata == real.metadata  # same target, layers, fingerprints

    run = tmp_path / "run"
    code, _, err = cli("train", "--cache", bad, "--target", env["target"], "--out", run, *SMALL,
                       "--max-steps", 12, "--log-every", 3, "--save-every", 3, "--seed", seed)
    line = assert_clean_error(code, err, "non-finite", f"step {bad_step} ", "step_00000006")
    assert "of 12" in line, line
    assert not (run / "final").exists() and not (run / "summary.json").exists()
    assert [r["step"] for r in metrics(run)] == [3, 6]  # nothing from the bad window was logged
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000006"

    # one check at the end and no checkpoint before it: none to name
    code, _, err = cli("train", "--cache", bad, "--target", env["target"], "--out", tmp_path / "run3", *SMALL,
                       "--max-steps", 12, "--log-every", 12, "--save-every", 100, "--seed", seed)
    assert_clean_error(code, err, "non-finite", f"step {bad_step} ", "none (no checkpoint yet)")
    assert not (tmp_path / "run3" / "final").exists()


# ------------------------------------------------------------------------------------------------ 6. torchrun


def test_data_parallel_under_torchrun(env, tmp_path):
    run = tmp_path / "run"
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dflash",
                        *map(str, base(env, run, "--epochs", 1, "--log-every", 1, "--lr", 3e-3))],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    want = math.ceil(env["rows"] / (2 * 2))
    rj = read_json(run / "run.json")["config"]
    assert rj["world"] == 2 and rj["total_steps"] == want
    assert [r["step"] for r in metrics(run)] == list(range(1, want + 1))  # written once (rank 0), not twice
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in metrics(run))
    assert read_json(run / "summary.json")["steps"] == want
    assert sorted(os.listdir(run)) == ["checkpoints", "final", "metrics.jsonl", "run.json", "summary.json"]
    assert load_drafter(str(run / "final")).cfg.target_layer_ids == env["layer_ids"]
    assert p.stdout.count("train: drafter") == 1  # print0: rank 0 only


# ------------------------------------------------------------------------------------------------ 7. wandb


def test_wandb_offline(env, tmp_path):
    run, wdir = tmp_path / "run", tmp_path / "wandb_home"
    wdir.mkdir()
    e = _env(WANDB_DIR=str(wdir), WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
             WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"), WANDB_DISABLE_GIT="true")
    e.pop("WANDB_API_KEY", None)
    dflash(*base(env, run, "--max-steps", 3, "--log-every", 1, "--wandb-project", "p", "--wandb-mode", "offline"),
           env=e)
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, os.listdir(run / "wandb")
    logs = list(runs[0].glob("run-*.wandb"))
    assert len(logs) == 1
    blob = logs[0].read_bytes()
    assert blob.count(b"tau_expected") >= 3 and b"slot_acc/3" in blob  # the 3 logged records
    assert read_json(run / "summary.json")["steps"] == 3


# ------------------------------------------------------------------------------------------------ 8. units


def test_lr_schedule():
    cfg = TrainConfig(cache="c", target="t", out="o", lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(1e-4)  # warm-up starts at lr / warm-up steps
    assert lr_at(4, 100, cfg) == pytest.approx(5e-4)
    assert lr_at(9, 100, cfg) == pytest.approx(1e-3)  # and ends at the peak
    assert lr_at(10, 100, cfg) == pytest.approx(1e-3)  # the cosine starts at the peak
    assert lr_at(55, 100, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half way
    assert lr_at(100, 100, cfg) == pytest.approx(1e-4)  # and ends at lr * min_lr_ratio
    assert lr_at(500, 100, cfg) == pytest.approx(1e-4)  # and stays there
    seq = [lr_at(s, 100, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(seq, seq[1:]))
    nowarm = TrainConfig(cache="c", target="t", out="o", lr=1e-3, warmup_ratio=0.0)
    assert lr_at(0, 50, nowarm) == pytest.approx(1e-3) and lr_at(50, 50, nowarm) == pytest.approx(0.0, abs=1e-15)
    one = TrainConfig(cache="c", target="t", out="o", lr=1e-3)  # default warm-up on a 1-step run
    assert lr_at(0, 1, one) == pytest.approx(1e-3)


def test_mask_token_id():
    tok = make_tiny_tokenizer()
    n = len(tok)
    # Qwen-like: the embedding table is larger than the tokenizer -> the first id beyond it
    assert resolve_mask_token_id(tok, n + 16, None) == n
    # equal sizes: a reserved special token the template does not use
    tok2 = copy.deepcopy(tok)
    tok2.add_special_tokens({"additional_special_tokens": ["<|reserved_0|>", "<|reserved_1|>"]})
    m = resolve_mask_token_id(tok2, len(tok2), None)
    assert m in (n, n + 1)
    name = tok2.convert_ids_to_tokens(m)
    assert name.startswith("<|reserved_") and name not in tok2.chat_template
    assert m not in (tok2.eos_token_id, tok2.pad_token_id, tok2.unk_token_id, tok2.bos_token_id)
    tok2.chat_template = tok2.chat_template.replace("<|im_end|>", "<|im_end|><|reserved_1|>")  # now used
    assert resolve_mask_token_id(tok2, len(tok2), None) == tok2.convert_tokens_to_ids("<|reserved_0|>")
    # equal sizes and every special token in use (eos, pad, template tokens): no unused id -> an error
    with pytest.raises(ConfigError, match="--mask-token-id"):
        resolve_mask_token_id(tok, n, None)
    # an override: used as given inside the vocabulary, refused outside it
    assert resolve_mask_token_id(tok, n + 16, 5) == 5
    for bad in (n + 16, -1, 10**6):
        with pytest.raises(ConfigError, match=r"--mask-token-id .*outside"):
            resolve_mask_token_id(tok, n + 16, bad)
