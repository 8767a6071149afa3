"""`dflash train --val-cache`: held-out loss, decoding and expected tau at every checkpoint (train/fit/validate.py).

A tiny target, a training cache and a held-out cache from other conversations, both by the real `dflash extract`.
What is checked: the records at the checkpoint steps carry the held-out metrics, summary.json the last of them;
they are the figures of the saved drafter measured again from its files; the training itself (losses, weights) is
bit for bit the run without validation; the split attention the validation uses on a GPU (in place of flex)
gives the dense reference's figures; the decoding tau is the walk of greedy speculative decoding over blocks drafted
one at a time; a held-out cache with other layers, or of another target, is refused naming --val-cache.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import dflash_cache
from dflash.train.drafter.checkpoint import load_drafter
from dflash.train.drafter.target_head import load_target_head
from dflash.train.fit.validate import Validator, anchor_positions, decode_walk
from tests.test_train import SMALL, assert_clean_error, cli, dflash, metrics, ok, read_json, weights
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

SEQ = 128


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    target = make_tiny_target(root / "target")
    train = write_jsonl(root / "train.jsonl", chat_rows(40, seed=3))
    held = write_jsonl(root / "held.jsonl", chat_rows(16, seed=11))
    for data, out in ((train, "cache"), (held, "val")):
        dflash("extract", "--target", target, "--data", data, "--out", root / out, "--seq-len", SEQ,
               "--rows-per-shard", 8)
    return {"root": root, "target": target, "cache": root / "cache", "val": root / "val"}


def run_args(env, out, *more):
    return ["train", "--cache", env["cache"], "--target", env["target"], "--out", out, *SMALL, "--max-steps", 6,
            "--save-every", 3, "--log-every", 3, "--lr", 3e-3, *map(str, more)]


def measure(env, drafter_dir, impl: str, rows: int = 0) -> dict:
    """The held-out figures of a saved drafter, measured from its files."""
    model = load_drafter(str(drafter_dir), attn_impl=impl, dtype=torch.float32)
    emb, head = load_target_head(str(env["target"]))
    model.set_target_head(emb, head)
    train = dflash_cache.open(str(env["cache"]))
    v = Validator(str(env["val"]), train, {}, rows, 2, 16, 7.0, torch.device("cpu"))
    return v(model)


def test_held_out_metrics_at_every_checkpoint_without_changing_training(env, tmp_path):
    plain, val = tmp_path / "plain", tmp_path / "val"
    ok(*run_args(env, plain))
    out = ok(*run_args(env, val, "--val-cache", env["val"], "--val-rows", 0))
    recs = metrics(val)
    held = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in held] == [3, 6]
    n_val = len(dflash_cache.open(str(env["val"])))
    for r in held:
        assert r["val_rows"] == n_val and r["val_blocks"] > 0
        assert 1.0 <= r["val_tau_expected"] <= 4.0 and len(r["val_slot_acc"]) == 3
        assert 1.0 <= r["val_tau_decode"] <= 4.0
        assert r["val_loss"] > 0 and r["val_s"] >= 0
    assert held[1]["val_loss"] < held[0]["val_loss"]  # it learns something that carries over
    assert "held-out" in out and f"{held[1]['val_tau_expected']:.2f}" in out
    assert f"decoding tau {held[1]['val_tau_decode']:.2f}" in out
    summary = read_json(val / "summary.json")
    assert summary["val"] == held[1]

    # the validation does not touch training: the same losses and the same final weights, bit for bit
    assert [r["loss"] for r in metrics(plain)] == [r["loss"] for r in recs]
    a, b = weights(plain / "final"), weights(val / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_json(plain / "summary.json")["val"] is None

    # the figures are the saved drafter's, measured again from its files (a block at every anchor position)
    again = measure(env, val / "final", "split")
    for k in ("val_loss", "val_tau_expected", "val_tau_decode", "val_blocks"):
        assert again[k] == pytest.approx(held[1][k], rel=1e-5), k

    # bench/val_curve.py: the same points against the context tokens trained on (steps x rows per step x SEQ)
    from bench.val_curve import main as val_curve

    (label, curve), = val_curve(["--run", str(val)])
    rows_per_step = read_json(val / "run.json")["config"]["batch_rows"]
    assert label == "val" and curve["tokens_per_step"] == rows_per_step * SEQ
    assert curve["points"] == [(r["step"], r["step"] * rows_per_step * SEQ, r["val_tau_decode"], r["val_tau_expected"])
                               for r in held]


def test_split_attention_gives_the_dense_references_figures(env, tmp_path):
    run = tmp_path / "run"
    ok(*run_args(env, run))
    dense = measure(env, run / "final", "sdpa", rows=5)
    split = measure(env, run / "final", "split", rows=5)
    assert dense["val_rows"] == 5 and dense["val_blocks"] == split["val_blocks"]
    assert split["val_loss"] == pytest.approx(dense["val_loss"], rel=1e-5)
    assert split["val_tau_expected"] == pytest.approx(dense["val_tau_expected"], abs=1e-6)
    assert split["val_tau_decode"] == pytest.approx(dense["val_tau_decode"], abs=1e-6)
    assert split["val_slot_acc"] == pytest.approx(dense["val_slot_acc"], abs=1e-6)


def test_a_val_cache_that_does_not_fit_is_refused_naming_the_flag(env, tmp_path):
    # other layers
    other = tmp_path / "other"
    dflash("extract", "--target", env["target"], "--data", env["root"] / "held.jsonl", "--out", other,
           "--seq-len", SEQ, "--num-context-layers", 2)
    code, _, err = cli(*run_args(env, tmp_path / "r1", "--val-cache", other))
    assert_clean_error(code, err, "--val-cache", "layers")
    assert not (tmp_path / "r1").exists()

    # another target's cache (same shapes, another config)
    tgt = tmp_path / "tgt"
    shutil.copytree(env["target"], tgt)
    conf = read_json(tgt / "config.json")
    conf["rms_norm_eps"] = 1e-5
    (tgt / "config.json").write_text(json.dumps(conf))
    foreign = tmp_path / "foreign"
    dflash("extract", "--target", tgt, "--data", env["root"] / "held.jsonl", "--out", foreign, "--seq-len", SEQ)
    code, _, err = cli(*run_args(env, tmp_path / "r2", "--val-cache", foreign))
    assert_clean_error(code, err, "--val-cache", "target.config_hash")

    # a missing one
    code, _, err = cli(*run_args(env, tmp_path / "r3", "--val-cache", tmp_path / "nope"))
    assert code == 2 and "--val-cache" in err and "Traceback" not in err, err


def test_an_fp8_val_cache_is_read_as_stored_and_gives_nearly_the_bf16_figures(env, tmp_path):
    """A quantised held-out cache: the validation takes its bytes and scales (dequantised in the drafter's step,
    as training does) and measures what the bf16 copy gives, within fp8's rounding."""
    run = tmp_path / "run"
    ok(*run_args(env, run))
    fp8 = tmp_path / "val-fp8"
    dflash("extract", "--target", env["target"], "--data", env["root"] / "held.jsonl", "--out", fp8, "--seq-len", SEQ,
           "--rows-per-shard", 8, "--hidden-dtype", "fp8")
    bf = measure(env, run / "final", "split")
    q = measure(dict(env, val=fp8), run / "final", "split")
    assert q["val_blocks"] == bf["val_blocks"] and q["val_loss"] != bf["val_loss"]
    assert q["val_loss"] == pytest.approx(bf["val_loss"], rel=0.02)
    assert q["val_tau_expected"] == pytest.approx(bf["val_tau_expected"], abs=0.05)


def test_decode_walk_steps_through_each_answer_as_greedy_speculative_decoding_does():
    """Each supervised span (an answer) starts with the token the prompt's forward gives; every step drafts after
    the last token p, accepts accepted[p] drafts and adds the bonus token; tokens / steps is eval's tau."""
    #           prompt    answer of doc 1 (7 tokens)   | doc 2: answer, user turn, answer | padding
    doc = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0])
    lm = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0])
    acc = np.zeros(len(doc), np.int64)
    acc[3], acc[6] = 2, 3  # doc 1: from 3 accept 2 (-> 6), from 6 accept 3 (-> 10 = the span's end): 2 steps, 7 tokens
    acc[10] = 1  # doc 2's first span [10, 13): from 10 accept 1 (-> 12 = its last token): 1 step, 2 tokens
    acc[15], acc[16] = 0, 1  # its second span [15, 19): 15 -> 16 (1 token), 16 -> 18 (2 tokens): 2 steps
    assert decode_walk(acc, lm, doc) == (7 + 2 + 3, 2 + 1 + 2)
    assert decode_walk(np.zeros_like(acc), lm, doc) == (6 + 2 + 3, 6 + 2 + 3)  # no draft accepted: tau 1
    # stopped after 4 tokens of each answer, as eval --max-new-tokens 4 stops (the prompt's forward gives the first)
    assert decode_walk(acc, lm, doc, max_new_tokens=4) == (3 + 2 + 3, 1 + 1 + 2)
    # a span's last token anchors nothing; padding and unsupervised tokens are never walked
    valid = anchor_positions(torch.from_numpy(lm)[None], torch.from_numpy(doc)[None])[0].numpy()
    assert valid.nonzero()[0].tolist() == [3, 4, 5, 6, 7, 8, 10, 11, 15, 16, 17]


def test_decoding_tau_is_the_walk_over_one_block_at_a_time(env, tmp_path):
    """The validation drafts every anchor position of a row at once and walks the answers on the result; drafting
    only the blocks the walk reaches, one forward each, gives the same steps (blocks do not see each other).
    Measured on the training rows, which the drafter has started to learn, so that some drafts are accepted."""
    run = tmp_path / "run"
    ok(*run_args(env, run, "--max-steps", 40, "--save-every", 40, "--lr", 1e-2))
    model = load_drafter(str(run / "final"), attn_impl="split", dtype=torch.float32)
    emb, head = load_target_head(str(env["target"]))
    model.set_target_head(emb, head)
    val = dflash_cache.open(str(env["cache"]))
    rows = 4
    v = Validator(str(env["cache"]), val, {}, rows, 2, 16, 7.0, torch.device("cpu"), keep_accepted=True)
    got = v(model)
    assert got["val_blocks"] > 0
    tokens = steps = 0
    with torch.no_grad():
        for i in range(rows):
            x = val.read_rows([i], raw=True)
            lm, doc = x["loss_mask"][0].numpy(), x["doc_ids"][0].numpy()
            valid = anchor_positions(x["loss_mask"], x["doc_ids"])

            def accepted(p: int) -> int:  # one block anchored at p, alone in its forward
                scores = torch.zeros(1, len(lm))
                scores[0, p] = 1.0
                _, met = model.forward_train(x["hidden"], x["input_ids"], x["loss_mask"], x["doc_ids"], scores, 1)
                return int(met["accepted"][0, 0])

            sup = (lm > 0) & (doc > 0)
            p = 0
            while p < len(lm):
                if not sup[p]:
                    p += 1
                    continue
                e = p
                while e < len(lm) and sup[e] and doc[e] == doc[p]:
                    e += 1
                while p < e - 1:
                    assert valid[0, p]
                    n = accepted(p) + 1
                    tokens, steps = tokens + n, steps + 1
                    p += n
                p = e
    assert steps > 0 and tokens > steps  # some drafts were accepted: the walk is not trivially tau 1
    assert got["val_tau_decode"] == pytest.approx(tokens / steps, abs=1e-9)
    # the accepted lengths it keeps for other walks (bench/val_decode.py) give the same walk
    walks = [decode_walk(*row) for row in v.accepted]
    assert len(v.accepted) == rows and (sum(w[0] for w in walks), sum(w[1] for w in walks)) == (tokens, steps)
    # bench/val_decode.py: the same pass from the drafter's files, walked whole and stopped at 8 tokens
    from bench.val_decode import main as val_decode

    out = val_decode(["--drafter", str(run / "final"), "--val-cache", str(env["cache"]), "--target", str(env["target"]),
                      "--rows", str(rows), "--batch-rows", "2", "--num-anchors", "16", "--max-new-tokens", "0,8",
                      "--device", "cpu"])
    whole, short = out["results"]
    assert whole["val_tau_decode"] == pytest.approx(tokens / steps) and whole["val_blocks"] == got["val_blocks"]
    cut = [decode_walk(*row, 8) for row in v.accepted]
    assert (short["tokens"], short["steps"]) == (sum(w[0] for w in cut), sum(w[1] for w in cut)) != (tokens, steps)
    want_blocks = sum(int(anchor_positions(*(val.read_rows([i], raw=True)[k] for k in ("loss_mask", "doc_ids"))).sum())
                      for i in range(rows))
    assert got["val_blocks"] == want_blocks
