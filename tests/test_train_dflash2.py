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
    --val-cache with dflash2: held-out loss, decoding and expected tau at every checkpoint, measured again from
        the checkpoint; each held-out block's accepted drafts are those of drafting it alone with the selector's greedy
        path (eval's) and checking them against the target's argmax
    a dflash2 run on a cache, or a --val-cache, without the last hidden state: one error line
"""

from __future__ import annotations

import pytest
import torch

import dflash_cache
from dflash.train.drafter.blocks import anchor_positions
from dflash.train.drafter.checkpoint import load_drafter
from dflash.train.drafter.dflash2 import DFlash2Drafter
from dflash.train.evaluate.dflash2_drafting import greedy_selector_path
from dflash.train.drafter.target_head import load_target_head
from dflash.train.fit.validate import Validator
from tests.test_train import (SEQ, assert_clean_error, cli, dflash, kill_when, latest_step, logged_steps, losses,
                              metrics, ok, read_json, weights)
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

SMALL2 = ["--arch", "dflash2", "--drafter-layers", "1", "--block-size", "4", "--num-anchors", "16", "--batch-rows", "2",
          "--no-progress"]
PRESET = "train:\n  selector_rank: 8\n  selector_top_k: 4\n"


@pytest.fixture(scope="module")
def env2(tmp_path_factory):
    """A tiny target, two caches of the same data (one with the target's last hidden state, one without) and one with
    it of held-out conversations."""
    root = tmp_path_factory.mktemp("train2")
    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "chat.jsonl", chat_rows(40, seed=3))
    caches = {}
    held = write_jsonl(root / "held.jsonl", chat_rows(8, seed=11))
    for name, source, more in (("last", data, ["--last-hidden"]), ("plain", data, []),
                               ("val", held, ["--last-hidden"])):
        caches[name] = root / name
        dflash("extract", "--target", target, "--data", source, "--out", caches[name], "--seq-len", SEQ,
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
    model = AutoModelForCausalLM.from_pretrained(str(env2["target"]), dtype=torch.float32, use_kernels=False)
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
    assert_clean_error(code, err, "--val-cache", str(env2["plain"]), "last hidden state", "--last-hidden")
    code, _, err = cli(*base2(env2, tmp_path / "run", "--max-steps", 2, "--draft-layer-types", "sliding_attention"))
    assert_clean_error(code, err, "--draft-layer-types", "--draft-window")


def test_dflash2_held_out_metrics_follow_the_selectors_greedy_path(env2, tmp_path):
    run = tmp_path / "run"
    out = ok(*base2(env2, run, "--max-steps", 30, "--save-every", 15, "--log-every", 15, "--lr", 1e-2,
                    "--val-cache", env2["val"], "--val-rows", 0))
    held = [r for r in metrics(run) if "val_loss" in r]
    assert [r["step"] for r in held] == [15, 30]
    for r in held:
        assert r["val_blocks"] > 0 and r["val_loss"] > 0 and len(r["val_slot_acc"]) == 3
        assert 1.0 <= r["val_tau_expected"] <= 4.0 and 1.0 <= r["val_tau_decode"] <= 4.0
    assert f"decoding tau {held[1]['val_tau_decode']:.2f}" in out and read_json(run / "summary.json")["val"] == held[1]

    model = load_drafter(str(run / "checkpoints" / "step_00000030"), attn_impl="split")  # float32, as it trained
    model.set_target_head(*load_target_head(str(env2["target"])))
    val = dflash_cache.open(str(env2["val"]))
    v = Validator(str(env2["val"]), val, {}, 0, 2, 16, 7.0, torch.device("cpu"), keep_accepted=True, last_hidden=True)
    again = v(model)
    for k in ("val_loss", "val_tau_expected", "val_tau_decode", "val_blocks"):
        assert again[k] == pytest.approx(held[1][k], rel=1e-5), k

    # every held-out anchor drafted alone, after its document's context, by the selector's greedy path
    B, H = model.cfg.block_size, model.cfg.hidden_size
    checked = accepted_somewhere = 0
    with torch.no_grad():
        for i in range(len(val)):
            x = val.read_rows([i], raw=True)
            ids, lm, doc, hidden = x["input_ids"][0].long(), x["loss_mask"][0], x["doc_ids"][0], x["hidden"].float()
            target_next = (hidden[0, :, -H:] @ model.lm_head_weight.t()).argmax(-1)  # the target's token after t
            for p in anchor_positions(x["loss_mask"], x["doc_ids"])[0].nonzero()[:, 0].tolist():
                start = int((doc == doc[p]).nonzero()[0])
                cache = model.new_cache(1, SEQ)
                model.extend_context(cache, hidden[:, start:p], torch.arange(p - start)[None])
                block = torch.full((1, B), model.cfg.mask_token_id)
                block[0, 0] = ids[p]
                h = model.draft_states(cache, block, (p - start + torch.arange(B))[None])[0]
                drafts = greedy_selector_path(model, h, ids[p])
                n = 0
                while n < B - 1 and p + n + 1 < SEQ and lm[p + n + 1] > 0 and doc[p + n + 1] == doc[p] \
                        and drafts[n] == target_next[p + n]:
                    n += 1
                assert v.accepted[i][0][p] == n, (i, p)
                checked += 1
                accepted_somewhere += n > 0
    assert checked > 20 and accepted_somewhere > 0


def pipeline_config(env2, tmp_path, **kw):
    from dflash.pipeline import PipelineConfig

    return PipelineConfig(target=str(env2["target"]), data=str(env2["root"] / "chat.jsonl"),
                          cache=str(tmp_path / "cache"), out=str(tmp_path / "run"), **kw)


def test_a_dflash2_pipeline_extracts_the_last_hidden_state_however_dflash2_is_asked(env2, tmp_path):
    from dflash.pipeline import commands

    def extract_argv(**kw) -> list[str]:
        return commands(pipeline_config(env2, tmp_path, **kw), "summary.json")["extract"][0]

    assert "--last-hidden" not in extract_argv()
    assert "--last-hidden" not in extract_argv(train_args="--arch dflash")
    assert extract_argv(arch="dflash2").count("--last-hidden") == 1
    assert extract_argv(train_args="--arch=dflash2 --max-steps 3").count("--last-hidden") == 1
    assert extract_argv(arch="dflash2", extract_args="--last-hidden").count("--last-hidden") == 1
    preset = tmp_path / "p.yaml"
    preset.write_text("train:\n  arch: dflash2\n")
    assert extract_argv(preset=str(preset)).count("--last-hidden") == 1
    assert "--last-hidden" not in extract_argv(preset=str(preset), arch="dflash")  # the flag wins
    train = commands(pipeline_config(env2, tmp_path, arch="dflash2"), "summary.json")["train"][0]
    assert train[train.index("--arch") + 1] == "dflash2"


def test_a_dflash2_pipeline_runs_end_to_end_and_refuses_a_cache_without_the_last_hidden_state(env2, tmp_path):
    small = "--drafter-layers 1 --block-size 4 --num-anchors 16 --batch-rows 2 --max-steps 3"
    common = ["pipeline", "--target", env2["target"], "--data", env2["root"] / "chat.jsonl", "--arch", "dflash2",
              "--config", env2["preset"], "--status-every", "30",
              "--extract-args", f"--seq-len {SEQ} --rows-per-shard 8"]
    ok(*common, "--cache", tmp_path / "cache", "--out", tmp_path / "run", "--train-args", small)
    assert dflash_cache.open(str(tmp_path / "cache")).last_hidden
    assert isinstance(load_drafter(str(tmp_path / "run" / "final")), DFlash2Drafter)

    code, out, err = cli(*common, "--cache", env2["plain"], "--out", tmp_path / "run2", "--train-args", small)
    assert_clean_error(code, err, "--cache", str(env2["plain"]), "last hidden state", "--arch dflash2")
    assert "pipeline:" not in out and not (tmp_path / "run2").exists()  # no job started
    code, _, err = cli(*common, "--cache", tmp_path / "c3", "--out", tmp_path / "run3", "--train-args", "--arch dflash")
    assert_clean_error(code, err, "--train-args", "--arch dflash", "contradicts")


def test_dflash2_settings_are_flags_refused_with_dflash_and_preset_keys_noted(env2, tmp_path):
    run = tmp_path / "run"
    flags = ["--conv-kernel-size", 3, "--conv-group-size", 8, "--selector-rank", 6, "--selector-top-k", 5,
             "--selector-loss-alpha", 0.5]
    ok(*base2(env2, run, "--max-steps", 2, *flags))  # flags over the preset's selector_rank 8, selector_top_k 4
    conf = read_json(run / "final" / "config.json")
    assert (conf["conv_kernel_size"], conf["conv_group_size"], conf["selector_rank"], conf["selector_top_k"]) == \
        (3, 8, 6, 5)
    assert read_json(run / "run.json")["config"]["selector_loss_alpha"] == 0.5
    w = weights(run / "final")
    assert tuple(w["layers.0.attention_conv.base_kernel"].shape) == (2, 3, 64)
    assert tuple(w["layers.0.mlp_conv.kernel_projection.weight"].shape) == (2 * 3 * 64 // 8, 64)
    assert tuple(w["candidate_selector.predecessor_codebook"].shape)[1] == 6

    plain = ["train", "--cache", env2["plain"], "--target", env2["target"], "--out", tmp_path / "r2", "--max-steps", 2]
    for name, value in zip(flags[::2], flags[1::2]):  # refused with --arch dflash, the default
        code, _, err = cli(*plain, name, value)
        assert_clean_error(code, err, name, "--arch dflash2")
    code, _, err = cli(*plain, "--arch", "dflash", "--selector-top-k", 16)  # even at its default
    assert_clean_error(code, err, "--selector-top-k", "--arch dflash2")
    assert not (tmp_path / "r2").exists()
    # a preset's keys serve a dflash2 run beside (one preset for both archs): unused here, and said so
    out = ok(*base2(env2, tmp_path / "r3", "--max-steps", 2, "--arch", "dflash", cache="plain"))
    assert "selector_rank, selector_top_k are settings of --arch dflash2, unused by this --arch dflash run" in out

    out = ok("train", "--help")
    for name, default in zip(flags[::2], (2, 16, 256, 16, 1.0)):
        text = " ".join(out.split(f"  {name} ", 1)[1].split("\n  --", 1)[0].split())  # its help, unwrapped
        assert text.startswith(("INTEGER dflash2: ", "FLOAT dflash2: ")), text
        assert text.endswith(f"[default: {default}]"), text
