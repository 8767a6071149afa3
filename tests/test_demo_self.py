"""The GPU recipe's `self` source (dflash/recipes/self_prompts.py): user turns sampled from the target after its chat
template's user header, then answered by the target like every other source's prompts.

  * the prefix is the template up to the user's words (SmolLM2's: its default system prompt, then the user header);
  * kept: turns that ended on their own, not empty, the first of equal ones; the counts say what was dropped;
  * sampling is counter-based: the same turns whatever the batch; the files are read back on a rerun with the same
    settings and target, and sampled again (saying why) when a setting changes;
  * the real SmolLM2-135M-Instruct writes user requests, distinct, most of them ending on their own;
  * the recipe end to end on a tiny target with `self` beside chitchat: its turns reach training and the in-source
    eval set (held out by the same hash split), none equal to an MT-Bench prompt (the held-out source).
"""

import json
import os

import pytest

from dflash.core.config import ConfigError
from dflash.recipes.gpu_config import GpuRecipe
from dflash.recipes.mix import prepare_data
from dflash.recipes.self_prompts import self_prompts
from dflash.extract.generation.prompts import MARKER, keep, prefix_of, sample
from dflash.recipes.sources import Conversation, as_messages
from tests.tiny import make_tiny_target, make_tiny_tokenizer, smollm2_gguf, smollm2_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("self") / "target")


def test_keep_drops_unended_empty_and_repeated_turns_and_counts_them():
    kept, dropped = keep([" Hi there ", "cut", "", "Hi there", "Write a poem.", "  "],
                         [True, False, True, True, True, True])
    assert kept == [(0, "Hi there"), (4, "Write a poem.")]
    assert dropped == {"not_ended": 1, "empty": 2, "repeated": 1}


def test_the_prefix_is_the_template_up_to_the_users_words():
    tok = make_tiny_tokenizer()
    p = prefix_of(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False)
    assert full.startswith(p) and full[len(p):].startswith("Hello") and MARKER not in p
    real = smollm2_tokenizer()
    if real is not None:  # SmolLM2's template adds its default system prompt before the user header
        assert prefix_of(real) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                   "Hugging Face<|im_end|>\n<|im_start|>user\n")


def test_the_recipe_refuses_bad_self_settings():
    assert GpuRecipe(sources={"chitchat": 0.8, "self": 0.2}).sources["self"] == 0.2
    for kw, flag in (({"self_prompts": 0}, "--self-prompts"), ({"self_prompt_tokens": 0}, "--self-prompt-tokens"),
                     ({"self_temperature": 0.0}, "--self-temperature"), ({"self_top_p": 1.5}, "--self-top-p"),
                     ({"self_batch_size": -1}, "--self-batch-size"), ({"heldout_source": "self"}, "--heldout-source"),
                     ({"sources": {"chitchat": 1, "selfie": 1}}, "--sources")):
        with pytest.raises(ConfigError, match=flag):
            GpuRecipe(**kw)


def test_sampling_is_the_same_in_any_batch_and_a_rerun_reads_what_was_sampled(tiny, tmp_path, monkeypatch, capsys):
    settings = {"prompts": 24, "max_new_tokens": 48, "temperature": 1.0, "top_p": 1.0, "seed": 3}
    one = sample(tiny, settings, "cpu", batch_size=24, progress=False)
    other = sample(tiny, settings, "cpu", batch_size=5, progress=False)
    assert one[:3] == other[:3]  # texts, ended, lengths: counter-based streams, not the batch's
    assert len(set(one[0])) == 24 and sum(one[1]) >= 1

    r = GpuRecipe(sources={"chitchat": 0.8, "self": 0.2}, self_prompts=24, self_prompt_tokens=48, self_top_p=1.0,
                  self_seed=3, self_batch_size=24)
    convs, rec = self_prompts(str(tmp_path), tiny, r, "cpu", progress=False)
    kept, _ = keep(one[0], one[1])
    assert [c.messages for c in convs] == [as_messages([t, ""]) for _, t in kept]
    assert [c.key for c in convs] == [f"self:{i:02d}" for i, _ in kept]
    assert rec["sampled"] == 24 and rec["kept"] == len(kept) and sum(rec["dropped"].values()) == 24 - len(kept)
    assert rec["settings"] == settings and rec["prefix"] == one[3] and set(rec["target"]) == {"config", "weights"}
    rows = [json.loads(x) for x in (tmp_path / "data" / "self-prompts.jsonl").read_text().splitlines()]
    assert [(x["key"], x["prompt"]) for x in rows] == [(c.key, c.messages[0]["content"]) for c in convs]

    import dflash.extract.generation.prompts as pr

    def no_sampling(*a, **k):
        raise AssertionError("sampled again")

    monkeypatch.setattr(pr, "sample", no_sampling)
    again, rec2 = self_prompts(str(tmp_path), tiny, r, "cpu", progress=False)
    assert again == convs and rec2 == rec
    monkeypatch.undo()
    from dataclasses import replace

    changed, rec3 = self_prompts(str(tmp_path), tiny, replace(r, self_seed=4), "cpu", progress=False)
    assert "sampling the self prompts again: the settings changed" in capsys.readouterr().out
    assert rec3["settings"]["seed"] == 4 and changed != convs


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs the demo's model package (make venv)")
def test_the_real_target_writes_distinct_user_requests(tmp_path):
    d, name = smollm2_gguf()
    texts, ended, lengths, _ = sample(os.path.join(d, name), {"prompts": 8, "max_new_tokens": 40, "temperature": 1.0,
                                                             "top_p": 0.99, "seed": 0}, "cpu", 8, progress=False)
    kept, dropped = keep(texts, ended)
    # half or more end within 40 tokens (5 of 8 with torch 2.13 on x86; 78 of 96 within 64), distinct
    assert len(kept) >= 4 and dropped["repeated"] == 0, texts
    for _, t in kept:  # words of a user's request, not the template's markup nor an assistant's answer header
        assert "<|im_" not in t and sum(c.isalpha() for c in t) >= 0.6 * len(t) and len(t.split()) >= 3, t


def test_prepare_data_drops_self_turns_equal_to_a_held_out_source_prompt(tmp_path):
    from dflash.recipes.sources import load_source

    mt = load_source("mt_bench")
    same = "  " + mt[5].messages[0]["content"].upper() + " "  # equal but for case and spacing
    convs = [Conversation(f"self:{i}", as_messages([t, ""]))
             for i, t in enumerate([same] + [f"Tell me about topic number {i}." for i in range(60)])]
    r = GpuRecipe(heldout_percent=20, eval_prompts=4, sources={"chitchat": 0.9, "self": 0.1}, heldout_source="mt_bench",
                  heldout_source_prompts=8, max_conversations=40)
    train, held, counts, _ = prepare_data(str(tmp_path), r, convs, {"sampled": 80, "kept": 61, "dropped": {}})
    texts = [json.loads(x)["messages"][0]["content"] for x in open(train)]
    assert same not in texts and any(t.startswith("Tell me about topic") for t in texts)
    assert counts["self_prompts"]["dropped"]["equal_to_heldout_source"] == 1
    assert counts["sources"]["self"]["conversations"] == 60
    with pytest.raises(ValueError, match="sample its prompts first"):
        prepare_data(str(tmp_path), r)


def test_the_recipe_end_to_end_with_self_prompts_beside_chitchat(tiny, tmp_path, capsys):
    from dflash.recipes.gpu import run_gpu_demo
    from tests.test_demo_gpu_recipe import TINY_RECIPE

    preset = tmp_path / "tiny.yaml"
    preset.write_text(TINY_RECIPE.replace("recipe:\n  heldout_percent: 5\n", "recipe:\n  heldout_percent: 25\n"
                                          "  history: dataset\n  sources: {chitchat: 0.7, self: 0.3}\n"
                                          "  self_prompts: 128\n  self_prompt_tokens: 64\n  self_batch_size: 128\n"
                                          "  heldout_source: mt_bench\n  heldout_source_prompts: 2\n"
                                          ).replace("eval_prompts: 3", "eval_prompts: 4"))
    work = tmp_path / "w"
    s = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False, target=str(tiny))
    out = capsys.readouterr().out
    d = s["data"]
    rec = json.loads((work / "data" / "self-prompts.json").read_text())
    assert d["self_prompts"]["kept"] == rec["kept"] >= 8 and rec["sampled"] == 128
    assert f"demo-gpu: self prompts: {rec['kept']} of 128 user turns sampled from the target kept" in out
    assert "self prompts  (~" in out  # its stage line
    own = {json.loads(x)["prompt"] for x in (work / "data" / "self-prompts.jsonl").read_text().splitlines()}
    train = [json.loads(x) for x in (work / "data" / "train.jsonl").read_text().splitlines()]
    in_train = {r["messages"][0]["content"] for r in train} & own
    assert in_train and d["sources"]["self"]["train_samples"] == round(
        d["sources"]["chitchat"]["train_samples"] / 0.7 * 0.3)
    held = [json.loads(x) for x in (work / "data" / "heldout.jsonl").read_text().splitlines()]
    self_eval = [r for r in held if r["source"] == "self"]
    assert len(self_eval) == 1 and self_eval[0]["set"] == "in-source"
    assert self_eval[0]["messages"][0]["content"] in own and self_eval[0]["messages"][0]["content"] not in in_train
    ev = json.loads((work / "run" / "eval-float32.json").read_text())
    assert list(ev["sets"]["in-source"]["categories"]) == ["chitchat", "self"] and ev["dflash"]["identical"] == 6
