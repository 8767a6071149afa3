"""`dflash extract --last-hidden`, `dflash train --arch dflash2` and `--draft-window` end to end on CPU: real
extracted caches from a tiny Qwen3 target, real CLI processes, no mocks (the helpers are tests/test_train.py's).

What is covered:
    the cache: format version 3, the last layer after the context layers, stored after the target's final norm
        (equal to the target's own final hidden state), its extra bytes per token (2H in bf16); the DFlash
        drafter still trains from it (its context layers only)
    a dflash2 run: loss goes down; final/ holds the DFlash2 layout (config fields, attention_conv / mlp_conv /
        candidate_selector tensors) and loads back as a DFlash2Drafter
    SIGKILL after a checkpoint + rerun: the same losses and weights, bit for bit, as an uninterrupted run
    a windowed DFlash run: final/ names each layer's kind, the window and the bidirectional block for the engines
    a dflash2 run with --val-cache: held-out loss and decoding tau at every checkpoint, those of the DFlash2
        objective (the selector's choice against the target's argmax), equal to a Validator call on final/
    a dflash2 run on a cache without the last hidden state (or a --val-cache without it): one error line
"""

from __future__ import annotations

import pytest
import torch

import dflash_cache
from dflash.train.checkpoint import load_drafter
from dflash.train.dflash2 import DFlash2Drafter
from tests.test_train import (SEQ, assert_clean_error, cli, dflash, kill_when, latest_step, logged_steps, losses,
                              metrics, ok, read_json, weights)
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

SMALL2 = ["--arch", "dflash2", "--drafter-layers", "1", "--block-size", "4", "--num-anchors", "16", "--batch-rows", "2",
          "--no-progress"]
PRESET = "train:\n  selector_rank: 8\n  selector_top_k: 4\n"


@pytest.fixture(scope="module")
def env2(tmp_path_factory):
    """A tiny target and two caches of the same data: one with the target's last hidden state, one without."""
    root = tmp_path_factory.mktemp("train2")
    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "chat.jsonl", chat_rows(40, seed=3))
    caches = {}
    for name, more in (("last", ["--last-hidden"]), ("plain", [])):
        caches[name] = root / name
        dflash("extract", "--target", target, "--data", data, "--out", caches[name], "--seq-len", SEQ,
               "--rows-per-shard", 8, *more)
    preset = root / "dflash2.yaml"
    preset.write_text(PRESET)
    return {"root": root, "target": target, "preset": preset, **caches}


def base2(env2, out, *more, cache="last") -> list[str]:
    return ["train", "--cache", env2[cache], "--target", env2["target"], "--out", out, "--config", env2["preset"],
            *SMALL2, *map(str, more)]


def test_last_hidden_cache_holds_the_targets_final_state(env2):
    from transformers import AutoModelForCausalLM

    last, plain = dflash_cache.open(str(env2["last"])), dflash_cache.open(str(env2["plain"]))
    assert last.last_hidden and not plain.last_hidden
    assert last.metadata["format_version"] == 3 and plain.metadata["format_version"] == 1
    assert last.layer_ids == [*plain.layer_ids, 5] and last.context_layer_ids == plain.layer_ids
    H = last.hidden_size
    assert last.spec.hidden_bytes_per_token - plain.spec.hidden_bytes_per_token == 2 * H  # bf16: 2H bytes more
    row = last[0]
    assert row["hidden"].shape[-1] == (len(plain.layer_ids) + 1) * H
    # the context layers are the plain cache's, bit for bit; the last H channels the target's final hidden state
    assert torch.equal(torch.as_tensor(row["hidden"][:, :-H]), torch.as_tensor(plain[0]["hidden"]))
    doc = torch.as_tensor(row["doc_ids"])
    n = int((doc == 1).sum())
    ids = torch.as_tensor(row["input_ids"][:n]).long()[None]
    model = AutoModelForCausalLM.from_pretrained(str(env2["target"]), dtype=torch.float32)
    with torch.no_grad():
        final = model(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm
    stored = torch.as_tensor(row["hidden"][:n, -H:]).float()
    torch.testing.assert_close(stored, final.to(torch.bfloat16).float(), rtol=0, atol=0.02 * float(final.abs().max()))


def test_dflash2_trains_saves_and_resumes_bit_exactly_after_sigkill(env2, tmp_path):
    args = ["--max-steps", 20, "--save-every", 5, "--log-every", 1, "--lr", 3e-3, "--seed", 1]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(*base2(env2, ref, *args))
    recs = metrics(ref)
    first, last = [r["loss"] for r in recs[:5]], [r["loss"] for r in recs[-5:]]
    assert sum(last) / 5 < sum(first) / 5 - 0.1, (first, last)
    assert all(1.0 <= r["tau_expected"] <= 4.0 and len(r["slot_acc"]) == 3 for r in recs)

    conf = read_json(ref / "final" / "config.json")
    assert conf["architectures"] == ["DFlash2DraftModel"] and conf["dflash_config"]["arch"] == "dflash2"
    assert (conf["conv_kernel_size"], conf["conv_group_size"], conf["selector_rank"], conf["selector_top_k"]) == \
        (2, 16, 8, 4)
    w = weights(ref / "final")
    for name in ("layers.0.attention_conv.base_kernel", "layers.0.attention_conv.kernel_projection.weight",
                 "layers.0.mlp_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight",
                 "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight"):
        assert name in w, name
    assert not torch.equal(w["layers.0.mlp_conv.kernel_projection.weight"],
                           torch.zeros_like(w["layers.0.mlp_conv.kernel_projection.weight"]))  # it trained
    loaded = load_drafter(str(ref / "final"))
    assert isinstance(loaded, DFlash2Drafter) and loaded.cfg.selector_top_k == 4
    assert all(torch.equal(loaded.state_dict()[k].to(v.dtype), v) for k, v in w.items())

    kill_when(base2(env2, run, *args), run,
              lambda r: latest_step(r) >= 10 and max(logged_steps(r), default=0) > latest_step(r))
    resume_at = latest_step(run)
    q = dflash(*base2(env2, run, *args))
    assert f"at step {resume_at}" in q.stdout, q.stdout
    assert logged_steps(run) == list(range(1, 21))
    assert losses(ref) == losses(run)
    wr, wk = weights(ref / "checkpoints" / "step_00000020"), weights(run / "checkpoints" / "step_00000020")
    assert all(torch.equal(wr[k], wk[k]) for k in wr)


def test_dflash_trains_from_a_last_hidden_cache(env2, tmp_path):
    """The DFlash drafter reads only the context layers of such a cache: its drafter config names them."""
    run = tmp_path / "run"
    ok("train", "--cache", env2["last"], "--target", env2["target"], "--out", run, "--drafter-layers", "1",
       "--block-size", "4", "--num-anchors", "16", "--batch-rows", "2", "--no-progress", "--max-steps", 3)
    assert read_json(run / "final" / "config.json")["dflash_config"]["target_layer_ids"] == \
        dflash_cache.open(str(env2["plain"])).layer_ids


def test_a_windowed_run_records_its_layers_and_window_for_the_engines(env2, tmp_path):
    run = tmp_path / "run"
    ok("train", "--cache", env2["plain"], "--target", env2["target"], "--out", run, "--drafter-layers", "2",
       "--draft-window", "8", "--draft-layer-types", "sliding_attention,full_attention", "--block-size", "4",
       "--num-anchors", "16", "--batch-rows", "2", "--no-progress", "--max-steps", 3)
    conf = read_json(run / "final" / "config.json")
    assert conf["layer_types"] == ["sliding_attention", "full_attention"] and conf["sliding_window"] == 8
    assert conf["use_sliding_window"] and conf["sliding_window_non_causal"] is True
    assert conf["dflash_config"]["sliding_window_non_causal"] is True and conf["architectures"] == ["DFlashDraftModel"]
    d = load_drafter(str(run / "final"))
    assert [layer.self_attn.window for layer in d.layers] == [8, None]
    rj = read_json(run / "run.json")["config"]
    assert rj["draft_window"] == 8 and rj["draft_layer_types"] == ["sliding_attention", "full_attention"]


def test_dflash2_without_the_last_hidden_state_is_one_error_line(env2, tmp_path):
    code, _, err = cli(*base2(env2, tmp_path / "run", "--max-steps", 2, cache="plain"))
    assert_clean_error(code, err, "--arch dflash2", "--last-hidden", str(env2["plain"]))
    code, _, err = cli(*base2(env2, tmp_path / "run", "--max-steps", 2, "--val-cache", env2["plain"]))
    assert_clean_error(code, err, "--val-cache", str(env2["plain"]))  # its layers lack the last one
    code, _, err = cli(*base2(env2, tmp_path / "run", "--max-steps", 2, "--draft-layer-types", "sliding_attention"))
    assert_clean_error(code, err, "--draft-layer-types", "--draft-window")


def test_dflash2_validates_on_a_held_out_cache_at_every_checkpoint(env2, tmp_path):
    from dflash.train.validate import Validator

    run = tmp_path / "run"
    ok(*base2(env2, run, "--max-steps", 4, "--save-every", 2, "--log-every", 2, "--val-cache", env2["last"],
              "--val-rows", 4))
    recs = [r for r in metrics(run) if "val_loss" in r]
    assert [r["step"] for r in recs] == [2, 4]
    for r in recs:
        assert 1.0 <= r["val_tau_decode"] <= 4.0 and 1.0 <= r["val_tau_expected"] <= 4.0 and r["val_loss"] > 0
    from dflash.train.target_head import load_target_head

    drafter = load_drafter(str(run / "final"), attn_impl="split", dtype=torch.float32)  # the trainer's on CPU
    drafter.set_target_head(*load_target_head(str(env2["target"])))
    assert isinstance(drafter, DFlash2Drafter)
    cache = dflash_cache.open(str(env2["last"]))
    val = Validator(str(env2["last"]), cache, {}, 4, 2, 16, 7.0, torch.device("cpu"))(drafter)
    assert val["val_tau_decode"] == pytest.approx(recs[-1]["val_tau_decode"], abs=1e-6)
    assert val["val_loss"] == pytest.approx(recs[-1]["val_loss"], rel=1e-4)
    # the DFlash2 objective (KL to the target's distribution + the selector's loss), not the unary cross-entropy
    x = {k: v for k, v in cache.read_rows([0, 1], raw=True).items()}
    from dflash.train.blocks import anchor_positions

    valid = anchor_positions(x["loss_mask"], x["doc_ids"])
    blocks, masks = drafter.prepare(x["input_ids"], x["loss_mask"], x["doc_ids"], valid.float(), int(valid.sum(1).max()))
    with torch.no_grad():
        loss2, met2 = drafter.forward_blocks(x["hidden"], blocks, masks)
        loss1, _ = super(DFlash2Drafter, drafter).forward_blocks(x["hidden"], blocks, masks)
    assert "selector_loss" in met2 and float(loss2) != pytest.approx(float(loss1), rel=1e-3)
