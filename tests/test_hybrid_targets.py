"""Today's target families in the cache: hybrid linear attention, the multimodal layout, experts, sliding windows
with attention sinks. CPU, float32, tiny random targets built from transformers' own config classes
(tests/tiny.py make_tiny_family), no mocks:

- every conversation of every packed row, first or not, equals the conversation run alone through transformers'
  own model class (the multimodal ForConditionalGeneration itself for its layout), for every layer: Qwen3.5 text
  (Gated DeltaNet + full attention), Qwen3.5 ForConditionalGeneration, Qwen3.5-MoE, gpt-oss (sliding window of 24
  with sinks, alternating with full attention, experts); conversations are longer than the window;
- the separation is what makes it exact: the same rows with the linear layers' state carried over (today's
  transformers forward with one mask) differ by more than 1% in later conversations;
- `dflash extract` writes a verified cache from each family and `dflash train` trains a drafter on it, which
  exports and is read as trained; the multimodal layout loads its language model only (no vision tower);
- a layer kind dflash cannot separate is one `error:` line naming it, before any work.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from dflash.core.hybrid import DocLayout, check_layer_kinds, doc_conv, document_mask, layer_kinds
from dflash.core.target import load_causal_lm, load_config
from dflash.extract.pack import materialize, pack
from dflash.extract.target import PackedTarget
from tests.test_extract import packed_docs, run_packed
from tests.tiny import FAMILIES, chat_rows, make_tiny_family, write_jsonl

NUM_LAYERS = 6
HIDDEN = 64
WINDOW = 24


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def family_targets(work):
    return {f: make_tiny_family(work / f, f, num_layers=NUM_LAYERS, seed=i, sliding_window=WINDOW)
            for i, f in enumerate(FAMILIES)}


def reference_model(path: str, family: str):
    """transformers' own full model as a user loads it (the multimodal class for its layout), float32."""
    import transformers as tf

    cls = tf.Qwen3_5ForConditionalGeneration if family == "qwen3_5_vl" else tf.AutoModelForCausalLM
    impl = "eager" if family == "gpt_oss" else "sdpa"  # gpt-oss refuses SDPA (sinks)
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation=impl, use_kernels=False).eval()


def alone(model, ids: np.ndarray, device="cpu"):
    with torch.inference_mode():
        hs = model(input_ids=torch.as_tensor(ids, dtype=torch.long, device=device)[None], output_hidden_states=True,
                   use_cache=False).hidden_states
    return [h.cpu() for h in hs]


def packed_rows(T=128, seed=7):
    lengths = [60, 50, 40, 30, 17, 5, 1, 100, 33, 71, 26]
    docs = packed_docs(seed=seed, lengths=lengths)
    plan = pack([len(ids) for ids, _ in docs], T)
    arrays = materialize(plan, docs, T, pad_id=0, start=0, stop=len(plan))
    return docs, plan, arrays


def errors_by_position(out, arrays, plan, docs, ref, layer_ids, device="cpu"):
    """{(row, index in row): worst relative error over the layers} of each conversation against it run alone."""
    errs = {}
    for r, row in enumerate(plan):
        t = 0
        for j, d in enumerate(row):
            ids = docs[d][0]
            m = len(ids)
            assert np.array_equal(arrays["input_ids"][r, t:t + m], ids)
            hs = alone(ref, ids, device)
            worst = 0.0
            for k, i in enumerate(layer_ids):
                got = out[r, t:t + m, k * HIDDEN:(k + 1) * HIDDEN].double()
                want = hs[i + 1][0].double()
                worst = max(worst, float((got - want).norm() / want.norm()))
            errs[r, j] = worst
            t += m
    return errs


@pytest.mark.parametrize("family", FAMILIES)
def test_every_packed_conversation_equals_it_alone(family_targets, family):
    path = family_targets[family]
    docs, plan, arrays = packed_rows()
    assert max(len(r) for r in plan) >= 3 and max(len(ids) for ids, _ in docs) > 2 * WINDOW
    layer_ids = list(range(NUM_LAYERS))  # every layer (each kind), the last with the final norm
    target = PackedTarget(path, layer_ids, dtype=torch.float32)
    out = run_packed(target, arrays)
    errs = errors_by_position(out, arrays, plan, docs, reference_model(path, family), layer_ids)
    later = [e for (r, j), e in errs.items() if j > 0]
    assert later, "no conversation after the first of a row"
    assert max(errs.values()) < 1e-5, f"{family}: worst relative error {max(errs.values()):.3g} ({errs})"
    pad = torch.from_numpy(arrays["doc_ids"] == 0)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_without_separation_later_conversations_differ(family_targets, family):
    """The rows through the plain transformers forward with a single document mask (the linear layers' state and
    convolution carried over; gpt-oss's windowed layers unwindowed): later conversations are off by > 1%, so the
    exactness above is the separation's doing."""
    path = family_targets[family]
    docs, plan, arrays = packed_rows()
    model = load_causal_lm(path, dtype=torch.float32, with_head=False)
    ids = torch.from_numpy(arrays["input_ids"]).long()
    doc = torch.from_numpy(arrays["doc_ids"]).long()
    mask = document_mask(doc)[:, None]
    if family == "gpt_oss":  # eager attention adds the mask
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    with torch.inference_mode():
        hs = model(input_ids=ids, position_ids=torch.from_numpy(arrays["position_ids"]).long(), attention_mask=mask,
                   output_hidden_states=True, use_cache=False).hidden_states
    out = torch.cat([hs[i + 1] for i in range(NUM_LAYERS)], dim=-1)
    errs = errors_by_position(out, arrays, plan, docs, reference_model(path, family), list(range(NUM_LAYERS)))
    assert max(e for (r, j), e in errs.items() if j > 0) > 1e-2


def test_doc_conv_equals_each_conversation_convolved_alone():
    torch.manual_seed(0)
    doc = torch.tensor([[1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 0, 0], [1] * 7 + [2] * 7])
    x = torch.randn(2, 14, 6)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=True)
    got = doc_conv(x, conv.weight.squeeze(1), conv.bias, DocLayout.of(doc))
    for r in range(2):
        for d in doc[r].unique().tolist():
            idx = (doc[r] == d).nonzero().flatten()
            want = conv(x[r, idx].t()[None])[0, :, :len(idx)].t()
            assert (got[r, idx] - want).abs().max() < 1e-6


def test_layout_segments_and_cu_seqlens():
    doc = torch.tensor([[1, 1, 2, 0], [3, 3, 3, 3]])
    lay = DocLayout.of(doc)
    assert lay.segments == [(0, 0, 2), (0, 2, 3), (0, 3, 4), (1, 0, 4)]
    assert lay.real == [True, True, False, True]
    assert lay.cu_seqlens.tolist() == [0, 2, 3, 4, 8] == lay.cu_seqlens_cpu.tolist()
    long = torch.tensor([[1] * 130 + [2] * 3])
    lay = DocLayout.of(long, host=long.clone())  # a host copy: no device-to-host copy needed
    assert lay.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]  # flash-linear-attention's chunks of 64
    assert lay.segments == [(0, 0, 130), (0, 130, 133)] and lay.real == [True, True]


def test_layer_kinds_of_each_family(family_targets):
    kinds = {f: layer_kinds(load_config(p)) for f, p in family_targets.items()}
    assert kinds["qwen3_5"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    assert kinds["qwen3_5_vl"] == kinds["qwen3_5"] == kinds["qwen3_5_moe"]
    assert kinds["gpt_oss"] == ["sliding_attention", "full_attention"] * 3


def test_multimodal_layout_loads_the_language_model_only(family_targets):
    model = load_causal_lm(family_targets["qwen3_5_vl"], dtype=torch.float32, with_head=False, num_layers=2)
    names = [n for n, _ in model.named_parameters()]
    assert type(model).__name__ == "Qwen3_5TextModel" and len(model.layers) == 2
    assert not any("visual" in n for n in names) and not any("lm_head" in n for n in names)


def test_unsupported_layer_kind_is_one_error_line(work, hf_cli):
    """LFM2's short-convolution layers ("conv") are not separated per conversation: extract refuses the target in
    one line naming the kind and layer, and writes nothing."""
    import transformers as tf

    from tests.tiny import make_tiny_tokenizer

    bad = str(work / "lfm2")
    tok = make_tiny_tokenizer()
    cfg = tf.Lfm2Config(vocab_size=len(tok) + 16, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2,
                        layer_types=["full_attention", "conv", "full_attention", "conv", "full_attention", "conv"])
    tf.Lfm2ForCausalLM(cfg).save_pretrained(bad)
    tok.save_pretrained(bad)
    with pytest.raises(ValueError, match="layer type 'conv' \\(layer 1 of lfm2\\)"):
        check_layer_kinds(load_config(bad), "--target X")
    data = write_jsonl(work / "few.jsonl", chat_rows(4, seed=3))
    res = hf_cli("extract", "--config", "tiny", "--target", bad, "--data", data, "--out", work / "never",
                 "--no-progress")
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and "'conv'" in lines[-1] and "Traceback" not in res.output
    assert not os.path.exists(work / "never")


@pytest.fixture(scope="module")
def hf_cli(work):
    """`dflash ARGS` in this process (click's runner), with the datasets cache under the test's folder."""
    import datasets
    from click.testing import CliRunner

    from dflash.cli import main

    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(work / "hf_datasets"))
    mp.setenv("DFLASH_TOKENIZE_CACHE", str(work / "tokenized"))

    def invoke(*args):
        return CliRunner().invoke(main, [str(a) for a in args])

    yield invoke
    mp.undo()


@pytest.mark.parametrize("family", FAMILIES)
def test_extract_train_export_each_family(work, family_targets, hf_cli, family):
    """The whole stage on each family: a verified cache, a drafter trained on it, exported and read as trained."""
    path = family_targets[family]
    data = write_jsonl(work / "chat.jsonl", chat_rows(16, seed=5))
    cache, run, out = work / f"cache-{family}", work / f"run-{family}", work / f"export-{family}"
    res = hf_cli("extract", "--config", "tiny", "--target", path, "--data", data, "--out", cache, "--no-progress",
                 "--seq-len", 192)
    assert res.exit_code == 0, res.output
    res = hf_cli("cache", "verify", cache)
    assert res.exit_code == 0, res.output
    res = hf_cli("train", "--config", "tiny", "--target", path, "--cache", cache, "--out", run, "--max-steps", 3,
                 "--no-progress")
    assert res.exit_code == 0, res.output
    with open(run / "final" / "config.json") as f:
        drafter = json.load(f)
    assert drafter["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    # a Qwen3 drafter with full rotary embeddings: the target's partial rotary is not claimed for it
    assert "partial_rotary_factor" not in json.dumps(drafter)
    res = hf_cli("export", run / "final", "--format", "zlab", "--out", out, "--check")
    assert res.exit_code == 0, res.output
    assert "read" in res.output and "as trained" in res.output
    # what the engine's verify must do for this target: in the export's README and config, and in `check`
    kinds = {"gpt_oss": {"sliding_attention": 3, "full_attention": 3}}.get(
        family, {"linear_attention": 5, "full_attention": 1})
    with open(out / "config.json") as f:
        assert json.load(f)["dflash_trained"]["target_layer_kinds"] == kinds
    readme = (out / "README.md").read_text()
    want = "within their window" if family == "gpt_oss" else "recurrent and convolution state back"
    assert "## The target's layers" in readme and want in readme
    for path in (out, run / "final"):
        res = hf_cli("check", path)
        assert res.exit_code == 0 and want in res.output, res.output


def test_gpt_oss_drafter_rope_is_the_targets_yarn():
    """A drafter of a gpt-oss target takes its YaRN RoPE: the inverse frequencies and the attention factor on cos
    and sin equal transformers' own rotary embedding of that config."""
    import transformers as tf

    from dflash.train.drafter.model import DrafterConfig
    from dflash.train.drafter.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq

    cfg = tf.GptOssConfig()
    d = DrafterConfig.from_target(cfg, num_layers=2, layer_ids=[1, 6, 11, 16, 21], block_size=8, mask_token_id=200000)
    assert d.rope_scaling["rope_type"] == "yarn"
    pos = torch.tensor([[0, 1, 7, 64, 512, 4095, 4096, 8191, 100_000]])
    cos, sin = tf.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(cfg)(torch.zeros(1, 9, 64), pos)
    mine_cos, mine_sin = rope_cos_sin(rope_inv_freq(d), pos, torch.float32, rope_attention_factor(d))
    half = cos.shape[-1]  # gpt-oss keeps one copy of each frequency; the drafter rotates halves (Qwen3's layout)
    assert rope_attention_factor(d) > 1.3
    assert (mine_cos[..., :half] - cos).abs().max() < 1e-5 and (mine_sin[..., half:] - sin).abs().max() < 1e-5


@pytest.mark.parametrize("preset,config,params", [
    ("qwen3.6-27b", "Qwen3_5Config", None),
    ("gpt-oss-20b", "GptOssConfig", (0.75e9, 0.85e9)),
])
def test_presets_shape_the_published_drafters(preset, config, params):
    """The presets for today's targets give the published drafters' shapes on the real targets' configs: layer ids,
    block, mask token, drafter layers and their kinds, heads and MLP (gpt-oss-20b's drafter has ~0.8B parameters)."""
    import transformers as tf

    from dflash.core.config import build, read_preset
    from dflash.extract.run import ExtractConfig
    from dflash.train.fit.config import TrainConfig, draft_layer_types
    from dflash.train.drafter.model import DFlashDrafter, DrafterConfig

    ext = build(ExtractConfig, preset, "extract", {"target": "t", "data": "d", "out": "o"})
    tr = build(TrainConfig, preset, "train", {"target": "t", "cache": "c", "out": "o"})
    if config == "Qwen3_5Config":  # the released checkpoint's layout: 64 layers, H 5120, 48 linear + 16 full
        text = tf.Qwen3_5TextConfig(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                    num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                                    linear_num_value_heads=48, linear_num_key_heads=16, vocab_size=248320)
        target = tf.Qwen3_5Config(text_config=text.to_dict())
        want = dict(layers=[1, 16, 31, 46, 61], block=16, mask=248070, heads=(32, 8, 128), mlp=17408,
                    kinds=["sliding_attention"] * 4 + ["full_attention"], window=2048)
    else:
        target = tf.GptOssConfig()
        want = dict(layers=[1, 6, 11, 16, 21], block=8, mask=200000, heads=(64, 8, 64), mlp=7680,
                    kinds=["full_attention"] * 8, window=None)
    assert ext.layers == want["layers"]
    d = DrafterConfig.from_target(target, num_layers=tr.drafter_layers, layer_ids=ext.layers,
                                  block_size=tr.block_size, mask_token_id=tr.mask_token_id,
                                  sliding_window=tr.draft_window, layer_types=draft_layer_types(tr) or [],
                                  **(tr.drafter_shape or {}))
    assert (d.target_layer_ids, d.block_size, d.mask_token_id) == (want["layers"], want["block"], want["mask"])
    assert (d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size) == (*want["heads"], want["mlp"])
    assert d.layer_types == want["kinds"] and d.sliding_window == want["window"]
    assert "partial_rotary_factor" not in (d.rope_scaling or {})
    if params:
        with torch.device("meta"):
            n = sum(p.numel() for p in DFlashDrafter(d).parameters())
        assert params[0] < n < params[1], n


def test_qwen3_next_layers_run_their_own_forward_per_conversation(work):
    """Qwen3-Next (Qwen3-Coder-Next's layout: fused q/k/v/z projections, experts) has linear-attention layers of
    another form: each runs its own forward once per conversation, exact in float32."""
    import transformers as tf

    from tests.tiny import make_tiny_tokenizer

    path = str(work / "qwen3_next")
    tok = make_tiny_tokenizer()
    cfg = tf.Qwen3NextConfig(vocab_size=len(tok) + 16, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch.manual_seed(3)
    tf.Qwen3NextForCausalLM(cfg).float().save_pretrained(path)
    tok.save_pretrained(path)
    docs, plan, arrays = packed_rows()
    target = PackedTarget(path, [0, 1, 2, 3], dtype=torch.float32)
    assert target.linear_layers == 3
    out = run_packed(target, arrays)
    ref = reference_model(path, "qwen3_next")
    errs = errors_by_position(out, arrays, plan, docs, ref, [0, 1, 2, 3])
    assert max(errs.values()) < 1e-5 and any(j > 0 for _, j in errs)
