"""`dflash export`: a trained drafter (RUN/final) as a checkpoint each serving engine reads as it was trained.

Two layouts, each writing the drafter as what it is, DFlash or DFlash2 (train/drafter/dflash2.py):

    zlab         the layout DFlash drafters are published in (SGLang, vLLM, TensorRT-LLM, the reference code, and
                 speculators' DFlashConverter read it): final/'s Qwen3 config with every field an engine looks for
                 written where it looks (block_size at the top level and in dflash_config; mask_token_id in
                 dflash_config and at the top level; for sliding-window layers dflash_config.use_swa,
                 swa_window_size and causal: false), rope_theta at the top level beside rope_parameters
                 (transformers 4.x reads the former, 5.x the latter), and model.safetensors as trained.
                 A DFlash2 drafter keeps architectures ["DFlash2DraftModel"] and its convolution and selector sizes
                 at the top level and in dflash_config: SGLang, vLLM and TensorRT-LLM serve DFlash only, and the
                 README says so rather than giving their flags.
    speculators  speculators' own format (`DFlashDraftModel.from_pretrained` loads it; vLLM serves DFlash from it):
                 aux_hidden_state_layer_ids = dflash's ids + 1 (capture-before), transformer_layer_config, the
                 block, the mask token, sliding_window_non_causal for sliding layers, and the verifier (the target
                 the drafter was trained for, whose embedding and LM head speculators loads from it). A DFlash2
                 drafter is written as speculators' DFlash2 (speculators_model_type and algorithm "dflash2",
                 architectures ["DFlash2DraftModel"], conv_kernel_size, conv_group_size, selector_rank and
                 selector_top_k at the top level, where its DFlash2SpeculatorConfig reads them).

Both add `dflash_trained` to config.json (what the run trained, from RUN/run.json when it records it, else final/'s
config: the architecture, the ids, their meaning, block, mask, attention kinds, and the chat template kwargs the
cache was extracted with when the cache records them) and a README.md naming, per engine, whether and how it serves
the drafter. The files get the mode the umask gives new files (0644 under the usual umask 022: readable by a server
of another user, not safetensors' fixed 0600; 0600 under 077). OUT is written whole or not at all, under its lock,
and only what dflash wrote is ever removed (train/serve/export_dir.py). `dflash check OUT` (train/serve/contract.py) replays
each engine's reading of the result; the CLI runs it after every export and names any misread.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from dflash.core.io import atomic_json, atomic_write
from dflash.core.paths import inside, real
from dflash.train.drafter.checkpoint import CONFIG_NAME, DFLASH2_FIELDS, WEIGHTS_NAME, read_drafter_config, servable_config
from dflash.train.serve.contract import Trained, run_drafter, shape_misreads, weight_shapes
from dflash.train.serve.engines import SLIDING
from dflash.train.serve.export_dir import ExportError, export_dir, own_entry
from dflash.train.drafter.model import DrafterConfig
from dflash.train.serve.target_record import KEY as KINDS_KEY, run_record, serving_note, target_layer_kinds

FORMATS = ("zlab", "speculators")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format is written (and whose code the tests run)

__all__ = ["FORMATS", "ExportError", "export", "readme", "speculators_config", "zlab_config"]


def zlab_config(cfg: DrafterConfig, trained: Trained, dtype: str) -> dict[str, Any]:
    d = servable_config(cfg, dtype)
    d["mask_token_id"] = cfg.mask_token_id
    d["dflash_config"] = {**d["dflash_config"], "block_size": cfg.block_size}
    if SLIDING in cfg.layer_types:  # what vLLM and TensorRT-LLM need to keep the window bidirectional in the block
        d["dflash_config"].update(use_swa=True, swa_window_size=cfg.sliding_window, causal=False)
    d["dflash_trained"] = trained.record(cfg.layer_types)
    return d


def speculators_config(cfg: DrafterConfig, trained: Trained, dtype: str, target: str, target_cfg) -> dict[str, Any]:
    base = servable_config(cfg, dtype)
    top = ("architectures", "block_size", "num_target_layers", "dflash_config", "torch_dtype",
           "sliding_window_non_causal", *DFLASH2_FIELDS)  # the speculator's own fields, not the layers'
    layer = {k: v for k, v in base.items() if k not in top}
    aux = [i + 1 for i in cfg.target_layer_ids]  # capture-before ids: the input of layer i + 1
    kind = "dflash2" if cfg.arch == "dflash2" else "dflash"
    sizes = {k: getattr(cfg, k) for k in DFLASH2_FIELDS} if kind == "dflash2" else {}
    return {
        "architectures": ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": aux,
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": SLIDING in cfg.layer_types,
        "sample_from_anchor": False,
        **sizes,  # DFlash2SpeculatorConfig reads them here (in transformer_layer_config they would be its defaults)
        "tie_word_embeddings": False,
        "dtype": dtype,
        "speculators_config": {
            "algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": target, "architectures": list(getattr(target_cfg, "architectures", None)
                                                                       or [])},
        },
        "dflash_trained": trained.record(cfg.layer_types),
    }


def readme(fmt: str, cfg: DrafterConfig, trained: Trained, target: str | None, kinds: dict | None = None,
           drafter: str = "DRAFTER") -> str:
    """The export's README.md: the engines' commands with this drafter's path (`drafter`, the export's absolute
    path) and the target's."""
    t, d = target or "TARGET", drafter
    k = cfg.block_size - 1
    dflash2 = cfg.arch == "dflash2"
    name = "DFlash2" if dflash2 else "DFlash"
    thinking = (f"Serve and benchmark with the chat template kwargs it was trained with: "
                f"`{json.dumps(trained.chat_template_kwargs)}`." if trained.chat_template_kwargs else
                "The cache it was trained on records no chat template kwargs: serve with the template settings "
                "(thinking on or off) the training data was rendered with.")
    sizes = (f" Each layer convolves within the block (kernel {cfg.conv_kernel_size}, group {cfg.conv_group_size}) and "
             f"a candidate selector (rank {cfg.selector_rank}) reranks each slot's top {cfg.selector_top_k}."
             if dflash2 else "")
    head = [f"# {name} drafter ({fmt} layout), exported by dflash", "",
            f"Target: `{t}` ({cfg.num_target_layers} layers). Reads the outputs of target layers "
            f"{cfg.target_layer_ids} (HF `hidden_states[i + 1]`), drafts blocks of {cfg.block_size} with mask token "
            f"{cfg.mask_token_id}; attention in the block is bidirectional"
            + (f", sliding layers see {cfg.sliding_window} context positions" if SLIDING in cfg.layer_types else "")
            + "." + sizes, "", thinking, "", "`dflash check .` replays how each engine reads this directory.", ""]
    dflash_only = ["## SGLang, vLLM, TensorRT-LLM", "",
                   "They serve DFlash only: they would read this DFlash2 drafter as a DFlash one, its convolutions and "
                   "candidate selector unused, and draft otherwise than it was trained. Do not serve it with them."]
    if fmt == "speculators" and dflash2:
        body = ["## speculators", "", "```python", "from speculators.models.dflash2 import DFlash2DraftModel",
                f"DFlash2DraftModel.from_pretrained('{d}')", "```", "", *dflash_only]
    elif fmt == "speculators":
        body = ["## speculators / vLLM", "", "```bash",
                f"vllm serve {t} --speculative-config '{{\"model\": \"{d}\", \"num_speculative_tokens\": {k}}}'",
                "```", "", f"In Python: `speculators.models.dflash.DFlashDraftModel.from_pretrained('{d}')`."]
    elif dflash2:
        body = [*dflash_only, "", "## speculators", "",
                "Its DFlashConverter converts DFlash only. `dflash export --format speculators` writes this drafter "
                "in speculators' DFlash2 format, which `speculators.models.dflash2.DFlash2DraftModel` loads."]
    else:
        body = ["## SGLang", "", "```bash",
                f"python -m sglang.launch_server --model-path {t} --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {d}", "```", "",
                f"(SGLang reads the block, {cfg.block_size}, the layer ids and the mask token from config.json.)", "",
                "## vLLM", "", "```bash",
                f"vllm serve {t} --speculative-config '{{\"method\": \"dflash\", \"model\": \"{d}\", "
                f"\"num_speculative_tokens\": {k}}}'", "```", "",
                "## TensorRT-LLM", "", "```yaml", "speculative_config:", "  decoding_type: DFlash",
                f"  speculative_model_dir: {d}", f"  max_draft_len: {k}", "```", "",
                "## speculators", "", "```python", "from speculators.convert.dflash import DFlashConverter",
                f"DFlashConverter().convert('{d}', 'OUT', base_model='{t}')", "```"]
    if SLIDING in cfg.layer_types and not dflash2:
        body += ["", "Sliding-window layers are trained bidirectional within the block: SGLang makes them causal "
                 "(`dflash check` names it)."]
    note = serving_note(kinds)
    if note:
        body += ["", "## The target's layers", "", note[0].upper() + note[1:] + "."]
    return "\n".join(head + body) + "\n"


def export(final: str, fmt: str, out: str, target: str | None = None, chat_template_kwargs: dict | None = None) -> str:
    """Write the export of the drafter at `final` into `out` (new, empty, or an earlier export, which it replaces
    whole: train/serve/export_dir.py). An `out` inside `final`, or `final` inside `out`, is refused."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    cfg = read_drafter_config(final)
    if cfg.basis_rank:  # a training checkpoint on a cache's basis: its fc reads z = P x, which no engine has
        raise ExportError(f"{final}: its fc reads features on a cache's basis (dflash_config.basis_rank "
                          f"{cfg.basis_rank} in its {CONFIG_NAME}): export the run's final/, written with the composed "
                          "fc = fc' P that reads the target's layers as they are")
    weights = os.path.join(final, WEIGHTS_NAME)
    if not os.path.exists(weights):
        raise ExportError(f"{final} is not a complete drafter checkpoint: {WEIGHTS_NAME} is missing")
    check_apart(final, out)
    with open(os.path.join(final, CONFIG_NAME)) as f:
        wrong = shape_misreads(final, json.load(f), "zlab", weight_shapes(final))
    if wrong:
        raise ExportError(f"{final}: {wrong[0]}: the weights do not fit their config; nothing was written")
    record = run_record(final)
    target = target or record.get("target")
    kwargs = chat_template_kwargs if chat_template_kwargs is not None else record.get("chat_template_kwargs")
    recorded = run_drafter(final)  # what the run trained: the record an edited final/config.json is checked against
    trained = Trained.of(recorded or cfg, kwargs)
    with open(os.path.join(final, CONFIG_NAME)) as f:
        dtype = json.load(f).get("dtype", "bfloat16")
    if fmt == "speculators":
        if not target:
            raise ExportError("--target: speculators needs the target the drafter was trained for (its embedding "
                              f"and LM head); {final} does not record one")
        from dflash.core.target import load_config, text_config

        target_cfg = load_config(target)
        if text_config(target_cfg).num_hidden_layers != cfg.num_target_layers:
            raise ExportError(f"--target {target} has {text_config(target_cfg).num_hidden_layers} layers; {final} "
                              f"was trained for a target of {cfg.num_target_layers}")
        config = speculators_config(cfg, trained, dtype, os.path.abspath(target) if os.path.exists(target) else
                                    target, target_cfg)
    else:
        config = zlab_config(cfg, trained, dtype)
    kinds = target_layer_kinds(target)
    if kinds:
        config["dflash_trained"][KINDS_KEY] = kinds
    with export_dir(out, precheck=_check_out) as stage:
        atomic_json(os.path.join(stage, CONFIG_NAME), config)
        shutil.copyfile(weights, os.path.join(stage, WEIGHTS_NAME))
        atomic_write(os.path.join(stage, "README.md"), readme(fmt, cfg, trained, target, kinds, os.path.abspath(out)))
    return out


def check_apart(final: str, out: str) -> None:
    """--out is neither inside the drafter it reads nor holding it (replacing --out would delete the input)."""
    if inside(out, final):
        raise ExportError(f"--out {out} {'is' if real(out) == real(final) else 'lies inside'} the drafter {final} it "
                          "exports: choose an --out outside it")
    if inside(final, out):
        raise ExportError(f"--out {out} holds the drafter {final} it exports (the export would replace it): choose "
                          "an --out apart from it")


def _check_out(out: str) -> None:
    if os.path.exists(out) and not (os.path.isdir(out) and _is_export(out)):
        raise ExportError(f"--out {out} exists and is not a dflash export: choose a new directory")


def _is_export(path: str) -> bool:
    try:
        with open(os.path.join(path, CONFIG_NAME)) as f:
            return "dflash_trained" in json.load(f)
    except (OSError, ValueError, TypeError):
        return not [n for n in os.listdir(path) if not own_entry(n)]  # an empty directory may be written into
