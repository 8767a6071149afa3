"""A real serving client in the tests: speculators 0.9.0 reads a drafter that `dflash train` wrote.

speculators (PyPI, Apache-2.0; the Makefile installs it without its dependencies, which pin other transformers and
datasets versions, plus the few packages it needs to import) is vLLM's format for speculative decoders and ships its
own DFlash model class and converter. Here, on CPU in float32:

1. `dflash train` writes RUN/final (a tiny Qwen3 target built in code, a cache extracted from it, 2 steps).
2. `dflash export --format zlab`, then speculators' own DFlashConverter converts, validates and saves it; and
   `dflash export --format speculators` is loaded as it is. Both load in `DFlashDraftModel.from_pretrained`.
3. The same text goes through the target once. Each side builds its context features its own way: dflash from its
   layer ids (output of layer i, through the extraction's LayerCapture hooks), speculators from its
   aux_hidden_state_layer_ids (HF `hidden_states[j]`, the input of layer j). dflash's drafter drafts the block after
   anchor a (its context cache, `draft_block`); speculators' model runs its training forward with that one anchor
   (`_backbone_forward`, the loss mask selecting a). The logits of slots 1..B-1 agree within 1e-4 absolute
   (float32 reassociation: measured 1.8e-7 on logits up to 0.6), and so do their argmax tokens.
4. A drafter whose config names layer ids shifted by one (the classic off-by-one) fails step 3: speculators reads
   other target layers, and the logits differ (asserted), while `dflash check` names every engine's target layers.
5. A DFlash2 drafter (the trained drafter's shape, --arch dflash2, its convolutions and selector away from their
   identity start) exported with `--format speculators` is speculators' DFlash2: `DFlash2DraftModel.from_pretrained`
   loads every tensor (the conv and selector sizes read from the top level, not its defaults), and its logits
   agree with dflash's as in step 3. The zlab export of it is checked as what it is: SGLang, vLLM and TensorRT-LLM
   (and speculators' DFlashConverter) serve DFlash only, and the export says so (README, check, a warning line).
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("speculators", reason="speculators 0.9.0 is installed by `make venv`")

from dflash.cli import main as cli_main  # noqa: E402
from dflash.core.target import LayerCapture, load_causal_lm  # noqa: E402
from dflash.train.drafter.checkpoint import load_drafter  # noqa: E402
from tests.tiny import chat_rows, make_tiny_target, write_jsonl  # noqa: E402

ATOL = 1e-4  # float32 logits of the same computation in two code bases (measured 1.8e-7)
ANCHOR = 9


def invoke(args):
    return CliRunner().invoke(cli_main, args, catch_exceptions=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("specclient")
    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "chat.jsonl", chat_rows(12, seed=3))
    r = invoke(["extract", "--target", target, "--data", data, "--out", str(root / "cache"), "--seq-len", "128",
                "--no-progress"])
    assert r.exit_code == 0, r.output
    r = invoke(["train", "--cache", str(root / "cache"), "--target", target, "--out", str(root / "run"),
                "--drafter-layers", "2", "--block-size", "4", "--max-steps", "2", "--batch-rows", "2",
                "--num-anchors", "8", "--attn", "sdpa", "--no-progress"])
    assert r.exit_code == 0, r.output
    return {"root": root, "target": target, "final": str(root / "run" / "final"), "train_output": r.output}


def speculators_model(path, arch: str = "dflash"):
    if arch == "dflash2":
        from speculators.models.dflash2 import DFlash2DraftModel as Model
        from speculators.models.dflash2 import DFlash2SpeculatorConfig as Config
    else:
        from speculators.models.dflash import DFlashDraftModel as Model
        from speculators.models.dflash import DFlashSpeculatorConfig as Config

    config = Config.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "sdpa"  # dense masks on CPU (flex is compiled)
    # float32 from the start: loaded in bf16 and cast, its RoPE frequencies would keep bf16 rounding
    return Model.from_pretrained(path, config=config, dtype=torch.float32, use_kernels=False).eval()


def convert_with_speculators(zlab_dir, out, target) -> str:
    from speculators.convert.dflash import DFlashConverter

    DFlashConverter().convert(zlab_dir, out, base_model=target, validate=True)
    return str(out)


def draft_logits(run, speculators_dir, final=None, arch="dflash") -> tuple[torch.Tensor, torch.Tensor]:
    """(dflash's, speculators') logits of slots 1..B-1 for the block after ANCHOR of one text, float32 (DFlash2:
    the unary logits, before the selector reranks the top-k)."""
    target = load_causal_lm(run["target"]).eval()
    drafter = load_drafter(final or run["final"], dtype=torch.float32).eval()
    drafter.set_target_head(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    cfg = drafter.cfg
    B, H, T = cfg.block_size, cfg.hidden_size, ANCHOR + cfg.block_size + 4
    ids = torch.randint(3, cfg.vocab_size - 16, (1, T), generator=torch.Generator().manual_seed(5))
    capture = LayerCapture(target, cfg.target_layer_ids)  # dflash's own reading: output of layer i
    capture.out = torch.zeros(1, T, len(cfg.target_layer_ids) * H)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    capture.remove()
    ours = capture.out
    with torch.no_grad():
        cache = drafter.new_cache(1, T)
        drafter.extend_context(cache, ours[:, :ANCHOR], torch.arange(ANCHOR)[None])
        block = torch.full((1, B), cfg.mask_token_id)
        block[0, 0] = ids[0, ANCHOR]
        d_logits = drafter.draft_block(cache, block, torch.arange(ANCHOR, ANCHOR + B)[None])[0]

    model = speculators_model(speculators_dir, arch)
    theirs = torch.cat([hs[j] for j in model.config.aux_hidden_state_layer_ids], -1)  # speculators' reading
    loss_mask = torch.zeros(1, T)
    loss_mask[0, ANCHOR] = 1  # the one anchor its forward may select
    with torch.no_grad():
        _, s_logits, _, _, _ = model._backbone_forward(theirs, ids, loss_mask, torch.zeros(1, T, H),
                                                       torch.zeros(1, T, dtype=torch.long), max_anchors=1)
    return d_logits, s_logits[0, 1:B]


def assert_same_draft(d_logits, s_logits):
    assert d_logits.shape == s_logits.shape, (d_logits.shape, s_logits.shape)
    err = (d_logits - s_logits).abs().max().item()
    assert err <= ATOL, f"draft logits differ by {err:.3g} (tolerance {ATOL})"
    assert torch.equal(d_logits.argmax(-1), s_logits.argmax(-1))


def test_train_prints_the_serving_verdict_and_writes_final_world_readable(run):
    assert "train: serving check: SGLang, vLLM, TensorRT-LLM, speculators read final/ as trained" in run["train_output"]
    umask = os.umask(0)
    os.umask(umask)
    mode = stat.S_IMODE(os.stat(os.path.join(run["final"], "model.safetensors")).st_mode)
    assert mode == 0o666 & ~umask, oct(mode)  # what open() makes, not safetensors' 0600


def test_speculators_converter_loads_a_dflash_drafter_with_equal_logits(run, tmp_path):
    zlab = tmp_path / "zlab"
    assert invoke(["export", run["final"], "--format", "zlab", "--out", str(zlab)]).exit_code == 0
    converted = convert_with_speculators(str(zlab), tmp_path / "converted", run["target"])
    assert_same_draft(*draft_logits(run, converted))


def test_dflash_speculators_export_loads_with_equal_logits(run, tmp_path):
    out = tmp_path / "spec"
    r = invoke(["export", run["final"], "--format", "speculators", "--out", str(out), "--check"])
    assert r.exit_code == 0, r.output
    assert "speculators read" in r.output
    cfg = json.loads((out / "config.json").read_text())
    final_cfg = json.loads((run["root"] / "run" / "final" / "config.json").read_text())
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in final_cfg["dflash_config"]["target_layer_ids"]]
    assert_same_draft(*draft_logits(run, str(out)))


def test_layer_ids_shifted_by_one_fail_the_logit_test_and_the_check(run, tmp_path):
    shifted = tmp_path / "shifted"
    assert invoke(["export", run["final"], "--format", "zlab", "--out", str(shifted)]).exit_code == 0
    cfg = json.loads((shifted / "config.json").read_text())
    trained_ids = cfg["dflash_config"]["target_layer_ids"]
    cfg["dflash_config"]["target_layer_ids"] = [i + 1 for i in trained_ids]  # HF indices written as layer ids
    (shifted / "config.json").write_text(json.dumps(cfg))
    converted = convert_with_speculators(str(shifted), tmp_path / "converted", run["target"])
    with pytest.raises(AssertionError, match="draft logits differ"):
        assert_same_draft(*draft_logits(run, converted))
    r = CliRunner().invoke(cli_main, ["check", str(shifted)])
    assert r.exit_code == 2, r.output
    error = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(error) == 1, r.output
    for engine in ("SGLang", "vLLM", "TensorRT-LLM", "speculators"):
        assert f"{engine}: target layers: would hook {[i + 1 for i in trained_ids]} (trained {trained_ids})" in error[0]
    shutil.rmtree(tmp_path / "converted")


@pytest.fixture(scope="module")
def dflash2_final(run, tmp_path_factory):
    """A DFlash2 drafter for the run's target, saved as `dflash train --arch dflash2` saves final/: its convolutions
    and selector moved away from their identity start, so that a reader that drops them drafts otherwise."""
    import dataclasses

    from dflash.train.drafter.checkpoint import read_drafter_config, save_drafter
    from dflash.train.drafter.dflash2 import DFlash2Drafter

    cfg = dataclasses.replace(read_drafter_config(run["final"]), arch="dflash2", conv_kernel_size=2,
                              conv_group_size=16, selector_rank=8, selector_top_k=4)
    model = DFlash2Drafter(cfg)
    model.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
    final = tmp_path_factory.mktemp("dflash2") / "final"
    save_drafter(model, str(final), dtype=torch.float32)
    return str(final)


def test_dflash2_speculators_export_is_speculators_dflash2_with_equal_logits(run, dflash2_final, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "spec2"
    r = invoke(["export", dflash2_final, "--format", "speculators", "--target", run["target"], "--out", str(out),
                "--check"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash2" and cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["speculators_config"]["algorithm"] == "dflash2"
    assert (cfg["conv_kernel_size"], cfg["conv_group_size"], cfg["selector_rank"], cfg["selector_top_k"]) == (2, 16, 8, 4)
    model = speculators_model(str(out), "dflash2")
    theirs = model.state_dict()
    for name, t in load_file(os.path.join(dflash2_final, "model.safetensors")).items():  # every tensor, conv and selector
        assert torch.equal(theirs[name], t), name
    d_logits, s_logits = draft_logits(run, str(out), final=dflash2_final, arch="dflash2")
    assert_same_draft(d_logits, s_logits)
    readme = (out / "README.md").read_text()
    assert "DFlash2DraftModel" in readme and "serve DFlash only" in readme and "DFlashDraftModel" not in readme


def test_dflash2_zlab_export_names_the_engines_that_serve_dflash_only(run, dflash2_final, tmp_path):
    out = tmp_path / "zlab2"
    r = CliRunner().invoke(cli_main, ["export", dflash2_final, "--out", str(out)])
    assert r.exit_code == 0, r.output
    warning = [ln for ln in r.output.splitlines() if ln.startswith("warning:")]
    assert len(warning) == 1 and "SGLang: architecture: would build DFlash (trained DFlash2)" in warning[0], r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_trained"]["arch"] == "dflash2"
    assert cfg["selector_top_k"] == cfg["dflash_config"]["selector_top_k"] == 4
    readme = (out / "README.md").read_text()
    assert "serve DFlash only" in readme and "--speculative-algorithm DFLASH" not in readme
    r = CliRunner().invoke(cli_main, ["check", str(out)])
    assert r.exit_code == 2, r.output
    assert "note: SGLang, vLLM, TensorRT-LLM serve DFlash only" in r.output
    error = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    for engine in ("SGLang", "vLLM", "TensorRT-LLM", "speculators"):
        assert f"{engine}: architecture: would build DFlash (trained DFlash2)" in error[0], engine


def test_a_dflash2_config_with_sizes_only_in_the_layer_config_is_a_misread(run, dflash2_final, tmp_path):
    """How dflash wrote it before: speculators' DFlash2 would build its default sizes (rank 256, top-k 16)."""
    out = tmp_path / "spec2"
    assert invoke(["export", dflash2_final, "--format", "speculators", "--target", run["target"], "--out",
                   str(out)]).exit_code == 0
    cfg = json.loads((out / "config.json").read_text())
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        cfg["transformer_layer_config"][k] = cfg.pop(k)
    (out / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(cli_main, ["check", str(out)])
    assert r.exit_code == 2 and "speculators: DFlash2 sizes: would build selector_rank 256 (trained 8)" in r.output, \
        r.output
