"""Checkpoint I/O in the servable layout: a Qwen3 config with the DFlash fields plus safetensors weights.

`save_drafter` writes `config.json` + `model.safetensors` (HF `save_pretrained` layout, the one DFlash
drafters are served from); `load_drafter` reads them back into a `DFlashDrafter` (a `DFlash2Drafter` for a DFlash2
checkpoint). train/drafter/model.py's docstring lists the config fields. The target's embedding and
LM head are buffers, never saved: install them with `DFlashDrafter.set_target_head` after loading.

A directory that is not such a checkpoint (a target model, a missing or garbled file, weights cut short or of
other shapes than the config's) is a DrafterError whose message starts with the directory and names the file;
`check_fits_target` tells a drafter made for another target (width, vocabulary, layers) before anything loads.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from dflash.core.io import shared_mode
from dflash.core.layers import default_layer_ids
from dflash.train.drafter.dflash2 import make_drafter
from dflash.train.drafter.drafter_fields import field_problem
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig, DrafterError

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def servable_config(cfg: DrafterConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A Qwen3 config dict carrying the DFlash fields, as drafters are served from."""
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "layer_types": cfg.layer_types,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "torch_dtype": dtype,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"target_layer_ids": cfg.target_layer_ids, "mask_token_id": cfg.mask_token_id},
    }
    if cfg.sliding_window is not None:  # how a sliding layer's block sees itself: bidirectionally (train/drafter/blocks.py)
        out["sliding_window_non_causal"] = cfg.sliding_window_non_causal
        out["dflash_config"]["sliding_window_non_causal"] = cfg.sliding_window_non_causal
    if cfg.basis_rank:  # a training checkpoint on a cache's basis (final/ is composed: basis_rank 0, fc on K*H)
        out["dflash_config"]["basis_rank"] = cfg.basis_rank
    if cfg.arch == "dflash2":  # speculators' DFlash2 fields, top level (as its config has them) and in dflash_config
        extra = {k: getattr(cfg, k) for k in DFLASH2_FIELDS}
        out.update(architectures=["DFlash2DraftModel"], **extra)
        out["dflash_config"].update(arch="dflash2", **extra)
    return out


DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def config_from_servable(d: dict[str, Any]) -> DrafterConfig:
    dc = d.get("dflash_config") or {}
    arch = dc.get("arch") or ("dflash2" if "DFlash2DraftModel" in (d.get("architectures") or []) else "dflash")
    dflash2 = {k: dc.get(k, d.get(k)) for k in DFLASH2_FIELDS if dc.get(k, d.get(k)) is not None} \
        if arch == "dflash2" else {}
    rope = d.get("rope_parameters") or {}
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or d.get("rope_scaling")
    if scaling and scaling.get("rope_type", "default") == "default" and len(scaling) == 1:
        scaling = None
    L = d["num_hidden_layers"]
    return DrafterConfig(
        hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"], num_heads=d["num_attention_heads"],
        num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"], vocab_size=d["vocab_size"],
        target_layer_ids=list(dc.get("target_layer_ids") or default_layer_ids(d["num_target_layers"], L)),
        num_target_layers=d["num_target_layers"], num_layers=L, block_size=d.get("block_size", 16),
        mask_token_id=dc.get("mask_token_id", 0), rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=d.get("max_position_embeddings", 40960),
        sliding_window=d.get("sliding_window") if d.get("use_sliding_window", d.get("sliding_window")) else None,
        layer_types=list(d.get("layer_types") or []), attention_bias=d.get("attention_bias", False),
        sliding_window_non_causal=dc.get("sliding_window_non_causal", d.get("sliding_window_non_causal", True)),
        arch=arch, basis_rank=int(dc.get("basis_rank", 0) or 0), **dflash2,
    )


def drafter_state_dict(model: DFlashDrafter, dtype: torch.dtype | None = torch.bfloat16) -> dict[str, torch.Tensor]:
    sd = model.state_dict()  # buffers (embedding, LM head, rope) are not persistent: never saved
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in sd.items()}


def composed(model: DFlashDrafter, basis, dtype: torch.dtype | None) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(config, weights) of a drafter trained on a cache's basis P [R, K*H] (its fc' [H, R]), as the drafter of the
    usual layout: fc = fc' P [H, K*H] (computed in float64, then cast), basis_rank 0. Exact: the drafter only ever
    saw features P x, and fc' (P x) = (fc' P) x."""
    import dataclasses

    p = torch.as_tensor(basis, dtype=torch.float64)
    cfg = model.cfg
    if tuple(p.shape) != (cfg.basis_rank, cfg.num_context_layers * cfg.hidden_size):
        raise DrafterError(f"basis of shape {list(p.shape)} does not compose with a drafter of basis_rank "
                           f"{cfg.basis_rank} over {cfg.num_context_layers} x {cfg.hidden_size} features")
    sd = drafter_state_dict(model, None)
    fc = sd["fc.weight"]
    sd["fc.weight"] = (fc.double() @ p).to(fc.dtype)
    sd = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in sd.items()}
    return dataclasses.replace(cfg, basis_rank=0), sd


def save_drafter(model: DFlashDrafter, path: str, dtype: torch.dtype = torch.bfloat16, basis=None) -> None:
    """Write config.json + model.safetensors (HF save_pretrained layout) into path. basis: the P of the cache a
    drafter with basis_rank R was trained on; the drafter is written composed (`composed`), as engines read it."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    name = str(dtype).replace("torch.", "")
    cfg, sd = composed(model, basis, dtype) if basis is not None else (model.cfg, drafter_state_dict(model, dtype))
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(servable_config(cfg, name), f, indent=2)
    save_file(sd, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
    shared_mode(os.path.join(path, WEIGHTS_NAME))  # save_file makes it 0600: a server of another user must read it


def not_a_checkpoint(path: str, why: str) -> DrafterError:
    """'PATH is not a drafter checkpoint: WHY', pointing at PATH/final when PATH is a run directory."""
    final = os.path.join(path, "final")
    if os.path.isfile(os.path.join(final, CONFIG_NAME)) or os.path.isfile(os.path.join(path, "run.json")):
        return DrafterError(f"{path} is a training run directory, not a drafter checkpoint: give its drafter, {final}")
    return DrafterError(f"{path} is not a drafter checkpoint: {why}")


def read_drafter_config(path: str) -> DrafterConfig:
    """The DrafterConfig of the checkpoint directory `path` (its config.json); a DrafterError says what is wrong."""
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isdir(path):
        raise DrafterError(f"{path} is not a drafter checkpoint: not a directory")
    if not os.path.exists(cfg_path):
        raise not_a_checkpoint(path, f"{CONFIG_NAME} is missing")
    try:
        with open(cfg_path, "rb") as f:
            d = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise DrafterError(f"{path}: {CONFIG_NAME} cannot be read as JSON ({e})") from None
    if not isinstance(d, dict):
        raise DrafterError(f"{path}: {CONFIG_NAME} holds a {type(d).__name__}, not a drafter config")
    problem = field_problem(d)
    if problem:
        raise DrafterError(f"{path}: {CONFIG_NAME}: {problem}")
    if "num_target_layers" not in d:
        raise DrafterError(f"{path} is not a DFlash drafter checkpoint: its {CONFIG_NAME} has no num_target_layers "
                           f"or dflash_config{' (it is a target model config)' if 'dflash_config' not in d else ''}; "
                           "give the final/ directory of a `dflash train` run")
    try:
        return config_from_servable(d)
    except KeyError as e:
        raise DrafterError(f"{path}: {CONFIG_NAME} lacks the field {e}") from None
    except (TypeError, ValueError) as e:
        raise DrafterError(f"{path}: {CONFIG_NAME} has a value of the wrong kind ({e})") from None


def check_fits_target(cfg: DrafterConfig, path: str, target_cfg, target: str) -> None:
    """A DrafterError when the drafter at `path` cannot draft for the target of HF text config `target_cfg`: another
    hidden size or vocabulary, or context layers the target does not have; or a training checkpoint whose fc reads
    features on a cache's basis (z = P x), which no forward of the target gives."""
    if cfg.basis_rank:
        raise DrafterError(f"{path} reads the target's features on a cache's basis (dflash_config.basis_rank "
                           f"{cfg.basis_rank}), not its layers: use the run's final/, written with the composed fc")
    L = target_cfg.num_hidden_layers
    if cfg.hidden_size != target_cfg.hidden_size:
        raise DrafterError(f"{path} drafts for a target of hidden size {cfg.hidden_size}; --target {target} has hidden "
                           f"size {target_cfg.hidden_size}")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise DrafterError(f"{path} drafts for a vocabulary of {cfg.vocab_size} tokens; --target {target} has "
                           f"{target_cfg.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < L]
    if bad:
        raise DrafterError(f"{path} reads target layer {bad[0]} (of {cfg.num_target_layers}); --target {target} has "
                           f"{L} layers: it was trained for another target")


def load_drafter(path: str, attn_impl: str = "sdpa", dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> DFlashDrafter:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = read_drafter_config(path)
    weights = os.path.join(path, WEIGHTS_NAME)
    if not os.path.exists(weights):
        raise DrafterError(f"{path} is not a complete drafter checkpoint: {WEIGHTS_NAME} is missing")
    try:
        sd = load_file(weights)
    except (SafetensorError, OSError) as e:
        raise DrafterError(f"{path}: {WEIGHTS_NAME} cannot be read ({e}): cut short or damaged") from None
    model = make_drafter(cfg, attn_impl=attn_impl)
    expected = model.state_dict()
    for name, t in sd.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            raise DrafterError(f"{path}: {WEIGHTS_NAME} does not match its {CONFIG_NAME}: {name} is "
                               f"{list(t.shape)} in the file, {list(expected[name].shape)} by the config")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise DrafterError(f"{path}: {WEIGHTS_NAME} does not match its {CONFIG_NAME} (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    dtype = dtype or next(iter(sd.values())).dtype
    return model.to(device=device, dtype=dtype)
