"""The fields of a drafter's config.json that engines and dflash read as numbers, checked for their kind.

A field of the wrong kind is never read as something else: `"block_size": "4"` or `4.0` is not the block 4 (an
engine that reads it as a string or a float fails or drafts otherwise), `"target_layer_ids": "1,3,5"` is not three
layers, and a `layer_types` one entry short of the layers leaves a layer without a kind. `field_problem(config)`
names the first such field (None when every one present is of its kind); the readers (train/drafter/checkpoint.py
`read_drafter_config`, train/serve/contract.py `check_drafter`) turn it into one DrafterError naming the file and field.

What is checked, where present (absent fields take the readers' documented defaults):
    integers       num_target_layers, num_hidden_layers, hidden_size, intermediate_size, num_attention_heads,
                   num_key_value_heads, head_dim, vocab_size, block_size, mask_token_id, sliding_window (or null),
                   DFlash2's conv_kernel_size, conv_group_size, selector_rank, selector_top_k; the same names inside
                   dflash_config, and, in speculators' format, at its top level and in transformer_layer_config
    id lists       dflash_config.target_layer_ids, target_layer_ids, eagle_aux_hidden_state_layer_ids,
                   aux_hidden_state_layer_ids: lists of integers
    layer_types    a list of strings, one per layer (num_hidden_layers)
"""

from __future__ import annotations

import json
from typing import Any

INTEGERS = ("num_target_layers", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "block_size", "mask_token_id", "conv_kernel_size",
            "conv_group_size", "selector_rank", "selector_top_k", "draft_vocab_size")
OPTIONAL_INTEGERS = ("sliding_window",)  # an integer or null
ID_LISTS = ("target_layer_ids", "eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")


def is_int(value: Any) -> bool:
    """A JSON integer: not a bool, a float (4.0) or a string ("4")."""
    return type(value) is int


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _section_problem(d: dict, prefix: str) -> str | None:
    for name in INTEGERS:
        if name in d and not is_int(d[name]) and not (d[name] is None and name == "mask_token_id"):
            return f"{prefix}{name} is {_show(d[name])}, not an integer"
    for name in OPTIONAL_INTEGERS:
        if d.get(name) is not None and not is_int(d[name]):
            return f"{prefix}{name} is {_show(d[name])}, not an integer or null"
    for name in ID_LISTS:
        if d.get(name) is not None and not (isinstance(d[name], list) and all(is_int(i) for i in d[name])):
            return f"{prefix}{name} is {_show(d[name])}, not a list of integer layer ids"
    if "layer_types" in d and d["layer_types"] is not None:
        lt = d["layer_types"]
        if not (isinstance(lt, list) and all(isinstance(t, str) for t in lt)):
            return f"{prefix}layer_types is {_show(lt)}, not a list of layer kinds"
        n = d.get("num_hidden_layers")
        if is_int(n) and lt and len(lt) != n:
            return f"{prefix}layer_types has {len(lt)} entries for {n} layers (num_hidden_layers)"
    return None


def field_problem(config: dict) -> str | None:
    """The first field of `config` (a drafter's config.json, either layout) of the wrong kind, in words."""
    for section, prefix in ((config, ""), (config.get("dflash_config"), "dflash_config."),
                            (config.get("transformer_layer_config"), "transformer_layer_config."),
                            (config.get("dflash_trained"), "dflash_trained.")):
        if section is None:
            continue
        if not isinstance(section, dict):
            return f"{prefix.rstrip('.')} is {_show(section)}, not a mapping"
        problem = _section_problem(section, prefix)
        if problem:
            return problem
    return None
