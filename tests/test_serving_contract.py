"""The serving contract: how each engine reads a drafter, pinned as tables, and `dflash export` / `dflash check`.

Coverage:
- each engine's reading rules (train/serve/engines.py) as table tests, one table per engine, each naming the engine file and
  commit its rules come from (SGLang and vLLM cannot be imported offline: they pull in serving stacks; speculators is
  also run for real in tests/test_speculators_client.py);
- `dflash check` on a default drafter: every engine's reading named and equal to the trained semantics (exit 0);
- the known misreads, each exit 2 with one `error:` line naming the engine and field: layer ids shifted by one,
  vLLM's capture-before ids written as dflash ids, a missing mask token (TensorRT-LLM's vocab_size), a sliding window
  not recorded for the engines (TensorRT-LLM's use_swa, vLLM's causality), a weight missing;
- `dflash export`: both layouts check clean, a sliding-window drafter's zlab export is read as trained by vLLM and
  TensorRT-LLM (SGLang still named: it makes sliding layers causal), files of the mode the umask gives (not
  safetensors' 0600), the README names each engine's flags, the trained record holds the chat template kwargs;
- bad input to both commands (missing, file, garbled or non-drafter directories, bad flags) is one `error:` line.
"""

from __future__ import annotations

import json
import os
import re
import stat

import pytest
from click.testing import CliRunner

from dflash.cli import main as cli_main
from dflash.train.drafter.checkpoint import save_drafter
from dflash.train.serve.engines import read, spread_ids
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig

BIDIR, BIDIR_W8, CAUSAL_W8 = (False, None), (False, 8), (True, 8)


def z(**over):
    """A z-lab config of a 2-layer drafter for a 12-layer target (what dflash's final/ holds), fields overridden."""
    d = {"num_hidden_layers": 2, "vocab_size": 512, "block_size": 16, "num_target_layers": 12,
         "layer_types": ["full_attention", "full_attention"], "sliding_window": None,
         "dflash_config": {"target_layer_ids": [1, 5, 9], "mask_token_id": 500}}
    for k, v in over.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


SLIDE = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}

# (case, config, expected (target_layers, block_size, mask_token_id, layers))
SGLANG = [  # python/sglang/srt/speculative/dflash_utils.py @ 00731f0bc9fa81c39802754fb4b62e9cce967582
    ("default", z(), ([1, 5, 9], 16, 500, [BIDIR, BIDIR])),
    ("block in dflash_config wins", z(dflash_config={"target_layer_ids": [1], "mask_token_id": 3, "block_size": 8}),
     ([1], 8, 3, [BIDIR, BIDIR])),
    ("no block anywhere: 16", z(block_size=None), ([1, 5, 9], 16, 500, [BIDIR, BIDIR])),
    ("no ids: spread 1..N-3 over the draft layers", z(dflash_config={"mask_token_id": 500}),
     ([1, 9], 16, 500, [BIDIR, BIDIR])),
    ("top-level ids", z(dflash_config={"mask_token_id": 500}, target_layer_ids=[2, 4]), ([2, 4], 16, 500, [BIDIR, BIDIR])),
    ("no mask id: the tokenizer's <|MASK|>", z(dflash_config={"target_layer_ids": [1, 5, 9]}),
     ([1, 5, 9], 16, None, [BIDIR, BIDIR])),
    ("sliding layer: causal with its window", z(**SLIDE), ([1, 5, 9], 16, 500, [CAUSAL_W8, BIDIR])),
]
VLLM = [  # vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d00d449d02dce9babdd15a5b4d06c9,
    #       vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424
    ("default", z(), ([1, 5, 9], None, 500, [BIDIR, BIDIR])),
    ("eagle ids are capture-before", z(eagle_aux_hidden_state_layer_ids=[2, 6, 10]), ([1, 5, 9], None, 500, [BIDIR, BIDIR])),
    ("eagle ids win over dflash_config", z(eagle_aux_hidden_state_layer_ids=[1, 5, 9]),
     ([0, 4, 8], None, 500, [BIDIR, BIDIR])),
    ("top-level ids", z(dflash_config={"mask_token_id": 500}, target_layer_ids=[2, 4]), ([2, 4], None, 500, [BIDIR, BIDIR])),
    ("no ids: EAGLE-3's layers", z(dflash_config={"mask_token_id": 500}), ([1, 5, 8], None, 500, [BIDIR, BIDIR])),
    ("top-level mask id", z(dflash_config={"target_layer_ids": [1]}, mask_token_id=7), ([1], None, 7, [BIDIR, BIDIR])),
    ("sliding layer: causal by default", z(**SLIDE), ([1, 5, 9], None, 500, [CAUSAL_W8, BIDIR])),
    ("dflash_config.causal false", z(**SLIDE, dflash_config={"target_layer_ids": [1], "mask_token_id": 5,
                                                            "causal": False}), ([1], None, 5, [BIDIR_W8, BIDIR])),
    ("use_swa with no sliding layer: all slide", z(dflash_config={"target_layer_ids": [1], "mask_token_id": 5,
                                                                  "use_swa": True, "swa_window_size": 8}),
     ([1], None, 5, [BIDIR_W8, BIDIR_W8])),
]
TRTLLM = [  # tensorrt_llm/_torch/models/modeling_dflash.py @ 009d8fa431bd3de92245aab80f8b57dc70da1ac4
    ("default", z(), ([1, 5, 9], 16, 500, [BIDIR, BIDIR])),
    ("block from the top level only", z(block_size=None, dflash_config={"target_layer_ids": [1], "mask_token_id": 5,
                                                                         "block_size": 8}), ([1], None, 5, [BIDIR, BIDIR])),
    ("no mask id: vocab_size", z(dflash_config={"target_layer_ids": [1]}), ([1], 16, 512, [BIDIR, BIDIR])),
    ("top-level mask id", z(dflash_config={"target_layer_ids": [1]}, mask_token_id=7), ([1], 16, 7, [BIDIR, BIDIR])),
    ("sliding_window alone is not read", z(**SLIDE), ([1, 5, 9], 16, 500, [BIDIR, BIDIR])),
    ("use_swa windows the sliding layers", z(**SLIDE, dflash_config={"target_layer_ids": [1], "mask_token_id": 5,
                                                                    "use_swa": True, "swa_window_size": 8}),
     ([1], 16, 5, [BIDIR_W8, BIDIR])),
]
SPECULATORS = [  # speculators 0.9.0: convert/dflash/converter.py, models/dflash/{config,core,attention}.py
    ("z-lab through DFlashConverter", z(), ([1, 5, 9], 16, 500, [BIDIR, BIDIR])),
    ("the target's last layer is dropped", z(dflash_config={"target_layer_ids": [1, 11], "mask_token_id": 5}),
     ([1], 16, 5, [BIDIR, BIDIR])),
    ("z-lab sliding layer: causal", z(**SLIDE), ([1, 5, 9], 16, 500, [CAUSAL_W8, BIDIR])),
    ("its own format", {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 6], "block_size": 8,
                        "mask_token_id": 9, "sliding_window_non_causal": True,
                        "transformer_layer_config": {"num_hidden_layers": 2, **SLIDE}},
     ([1, 5], 8, 9, [BIDIR_W8, BIDIR])),
]


SOURCES = {  # where each table's rules were read (train/serve/engines.py says the same)
    "SGLang": "sgl-project/sglang python/sglang/srt/speculative/dflash_utils.py @ 00731f0bc9fa81c39802754fb4b62e9cce967582",
    "vLLM": "vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d00d449d02dce9babdd15a5b4d06c9, "
            "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424",
    "TensorRT-LLM": "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_dflash.py @ "
                    "009d8fa431bd3de92245aab80f8b57dc70da1ac4",
    "speculators": "speculators 0.9.0 (PyPI) speculators/convert/dflash/converter.py, speculators/models/dflash/",
}


@pytest.mark.parametrize("engine,table", [("SGLang", SGLANG), ("vLLM", VLLM), ("TensorRT-LLM", TRTLLM),
                                          ("speculators", SPECULATORS)])
def test_each_engine_reads_configs_by_its_own_rules(engine, table):
    import dflash.train.serve.engines as engines

    for commit in re.findall(r"[0-9a-f]{40}", SOURCES[engine]):  # the module names the same sources
        assert commit in engines.__doc__, commit
    for case, config, (ids, block, mask, layers) in table:
        r = read(engine, json.loads(json.dumps(config)), 12)
        got = (r.target_layers, r.block_size, r.mask_token_id, r.layers)
        assert got == (ids, block, mask, layers), f"{engine} ({SOURCES[engine]}), {case}: got {got}"


def test_sglang_default_spread_is_dflash_default_for_five_layers():
    from dflash.core.layers import default_layer_ids

    assert spread_ids(36, 5) == default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert spread_ids(36, 1) == [18]


# ------------------------------------------------------------------------------------------------ check, export


def drafter(path, **over) -> str:
    cfg = DrafterConfig.named("tiny", num_target_layers=12, target_layer_ids=[1, 5, 9], **over)
    model = DFlashDrafter(cfg)
    model.reset_parameters(seed=0)
    save_drafter(model, str(path))
    return str(path)


def exported(tmp_path, **over) -> str:
    """An export of a drafter: its config records what was trained (dflash_trained), so edits are misreads."""
    out = tmp_path / "export"
    r = CliRunner().invoke(cli_main, ["export", drafter(tmp_path / "final", **over), "--out", str(out)])
    assert r.exit_code == 0, r.output
    return str(out)


def edit(path, fn) -> str:
    p = os.path.join(path, "config.json")
    with open(p) as f:
        d = json.load(f)
    fn(d)
    with open(p, "w") as f:
        json.dump(d, f)
    return path


def check(path):
    r = CliRunner().invoke(cli_main, ["check", str(path)])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    return r, errors


def test_check_names_each_engines_reading_of_a_default_drafter(tmp_path):
    r, errors = check(drafter(tmp_path / "final"))
    assert r.exit_code == 0 and not errors, r.output
    rows = {ln.split()[0]: ln for ln in r.output.splitlines()[2:] if ln.startswith("  ") and "note" not in ln}
    for engine in ("SGLang", "vLLM", "TensorRT-LLM", "speculators"):
        assert "[1, 5, 9]" in rows[engine] and " 511 " in rows[engine] and "25 matched, 0 missing, 0 unexpected" in \
            rows[engine], rows[engine]
    assert " 4 " in rows["SGLang"] and " flag " in rows["vLLM"]
    assert r.output.strip().endswith("as trained (target layers, block, mask token, attention, weights)")


@pytest.mark.parametrize("case,change,want", [
    ("ids shifted by one", lambda d: d["dflash_config"].update(target_layer_ids=[2, 6, 10]),
     ["SGLang: target layers: would hook [2, 6, 10] (trained [1, 5, 9])", "vLLM: target layers",
      "TensorRT-LLM: target layers", "speculators: target layers"]),
    ("vLLM's capture-before ids written as dflash ids", lambda d: d.update(eagle_aux_hidden_state_layer_ids=[1, 5, 9]),
     ["vLLM: target layers: would hook [0, 4, 8] (trained [1, 5, 9])"]),
    ("missing mask token", lambda d: (d["dflash_config"].pop("mask_token_id"), d.pop("mask_token_id")),
     ["TensorRT-LLM: mask token: would use 512 (trained 511)", "SGLang: mask token: would use a token looked up by name",
      "vLLM: mask token", "speculators: mask token"]),
    ("block size only in dflash_config", lambda d: d.pop("block_size"),
     []),  # SGLang and speculators read it there; TensorRT-LLM then takes its serving flag (a note, not a misread)
])
def test_known_misreads_exit_2_naming_engine_and_field(tmp_path, case, change, want):
    path = edit(exported(tmp_path), change)
    r, errors = check(path)
    if not want:
        assert r.exit_code == 0, (case, r.output)
        return
    assert r.exit_code == 2 and len(errors) == 1, (case, r.output)
    for w in want:
        assert w in errors[0], (case, w, errors[0])


def test_sliding_window_not_recorded_for_the_engines_is_named(tmp_path):
    final = drafter(tmp_path / "final", num_layers=2, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=8)
    r, errors = check(final)
    assert r.exit_code == 2, r.output
    assert "TensorRT-LLM: layer 0 window: would see all context (trained 8)" in errors[0]
    assert "vLLM: layer 0 causality: would be causal within the block (trained bidirectional)" in errors[0]
    assert "SGLang: layer 0 causality" in errors[0] and "speculators: layer 0 causality" in errors[0]
    # the export records what vLLM and TensorRT-LLM need; SGLang makes sliding layers causal whatever the config says
    out = tmp_path / "export"
    r = CliRunner().invoke(cli_main, ["export", final, "--out", str(out), "--check"])
    assert r.exit_code == 2, r.output
    error = [ln for ln in r.output.splitlines() if ln.startswith("error:")][0]
    assert "SGLang: layer 0 causality" in error and "vLLM" not in error and "TensorRT-LLM" not in error
    assert "speculators: layer 0 causality" in error  # its converter does not set sliding_window_non_causal
    r = CliRunner().invoke(cli_main, ["export", final, "--format", "speculators", "--out", str(tmp_path / "spec"),
                                      "--target", str(tmp_path), "--check"])
    assert r.exit_code == 2 and "--target" in r.output, r.output  # no target there: named before anything is written


def test_a_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    final = drafter(tmp_path / "final")
    w = os.path.join(final, "model.safetensors")
    sd = load_file(w)
    del sd["layers.1.mlp.up_proj.weight"]
    save_file(sd, w)
    r, errors = check(final)
    assert r.exit_code == 2 and "weights: missing ['layers.1.mlp.up_proj.weight']" in errors[0], r.output


def test_export_is_world_readable_with_a_readme_and_the_trained_record(tmp_path):
    final = drafter(tmp_path / "final")
    assert stat.S_IMODE(os.stat(os.path.join(final, "model.safetensors")).st_mode) & 0o044 == 0o044
    out = tmp_path / "export"
    old = os.umask(0o022)
    try:
        r = CliRunner().invoke(cli_main, ["export", final, "--out", str(out), "--chat-template-kwargs",
                                          "enable_thinking=false", "--check"])
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    for name in ("config.json", "model.safetensors", "README.md"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o644, name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_trained"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert cfg["dflash_config"]["block_size"] == cfg["block_size"] == 4 and cfg["mask_token_id"] == 511
    readme = (out / "README.md").read_text()
    for flag in ("--speculative-algorithm DFLASH", '"method": "dflash"', "decoding_type: DFlash", "DFlashConverter",
                 '"enable_thinking": false'):
        assert flag in readme, flag
    # the engines' commands name this export's own path, not a placeholder to fill in
    assert "DRAFTER" not in readme and f"--speculative-draft-model-path {out.resolve()}" in readme
    # an export is replaced by a new one; a folder that is not an export is refused
    assert CliRunner().invoke(cli_main, ["export", final, "--out", str(out)]).exit_code == 0
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    r = CliRunner().invoke(cli_main, ["export", final, "--out", str(tmp_path / "notes")])
    assert r.exit_code == 2 and "is not a dflash export" in r.output, r.output
    assert (tmp_path / "notes" / "todo.txt").read_text() == "x"


def test_bad_input_to_export_and_check_is_one_error_line(tmp_path):
    final = drafter(tmp_path / "final")
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text('{"num_target_layers": 6')
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2}')
    cases = [
        (["check", str(tmp_path / "missing")], "no such directory"),
        (["check", str(tmp_path / "file.txt")], "is a file, not a directory"),
        (["check", str(tmp_path / "garbled")], "config.json cannot be read as JSON"),
        (["check", str(tmp_path / "model")], "is not a DFlash drafter"),
        (["export", final], "--out is required"),
        (["export", final, "--format", "gguf", "--out", str(tmp_path / "x")], "--format"),
        (["export", final, "--out", str(tmp_path / "file.txt")], "--out"),
        (["export", final, "--format", "speculators", "--out", str(tmp_path / "y")], "--target: speculators needs"),
        (["export", final, "--format", "speculators", "--out", str(tmp_path / "y"), "--target",
          str(tmp_path / "missing")], "--target"),
    ]
    for args, want in cases:
        r = CliRunner().invoke(cli_main, args)
        errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert r.exit_code == 2 and len(errors) == 1 and want in errors[0], (args, r.output, r.exception)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
