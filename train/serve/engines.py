"""How each serving engine reads a DFlash drafter's config, replayed offline, in dflash's terms.

An engine that reads a drafter with other semantics than it was trained with does not fail: it drafts badly and
the acceptance falls (peers report 98% in training and 10% in serving). SGLang and vLLM cannot be imported here
(they pull in serving stacks), so their rules are written down below, each from the engine file and commit it was
read in, and pinned by table tests (tests/test_serving_contract.py). speculators is a real client in the tests.

`read(engine, config)` returns a `Reading`: what that engine would use, expressed the way dflash trains:

    target_layers   ids of the target layers whose OUTPUT the drafter reads (dflash's and z-lab's ids: id i is
                    HF `hidden_states[i + 1]`); None when the engine has no layers it would read
    block_size      the block it drafts; None when the engine takes it from a serving flag
    mask_token_id   the id it fills the block's slots 1..B-1 with; None when it would take a token by name
    layers          one (causal, window) per draft layer: causal within the block or not, and the number of
                    context positions a query sees (None: all of them)
    arch            the drafter it builds: "dflash", or "dflash2" with `dflash2` its convolution and selector sizes
                    (conv_kernel_size, conv_group_size, selector_rank, selector_top_k)
    notes           what the engine fell back to, in words

The rules, per engine (the file and commit each was read in):

SGLang, python/sglang/srt/speculative/dflash_utils.py @ 00731f0bc9fa81c39802754fb4b62e9cce967582
    block_size: dflash_config.block_size, else the top-level block_size, else 16.
    target layers: dflash_config.target_layer_ids, else a top-level target_layer_ids, else spread evenly from 1 to
    N-3 over as many ids as the drafter has layers (N // 2 for a 1-layer drafter); ids are "output of layer i"
    (its hook adds 1). mask: dflash_config.mask_token_id, else the token named by dflash_config.mask_token
    (default "<|MASK|>") looked up in the tokenizer. Layers: layer_types[i] == "sliding_attention" makes layer i
    causal within the block with `sliding_window`; every other layer is bidirectional over the whole context.
vLLM, vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d00d449d02dce9babdd15a5b4d06c9 (layers, mask) and
vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424 (target layers)
    target layers: eagle_aux_hidden_state_layer_ids first, read as capture-before ids (id j is the input of layer
    j, the output of layer j - 1), else dflash_config.target_layer_ids (+1 internally: the same layers), else a
    top-level target_layer_ids (+1 likewise), else the target model's EAGLE-3 default capture points (2, N // 2,
    N - 3 for Qwen3 and Llama), with only a warning. block_size: the serving flag
    num_speculative_tokens (+1). mask: dflash_config.mask_token_id, else top-level mask_token_id. Layers: causal
    is the top-level is_causal, else dflash_config.causal, else "layer_types[i] is sliding_attention"; a layer
    slides when layer_types says so (dflash_config.use_swa with no sliding layer makes every layer slide), with
    dflash_config.swa_window_size, else the top-level sliding_window.
TensorRT-LLM, tensorrt_llm/_torch/models/modeling_dflash.py @ 009d8fa431bd3de92245aab80f8b57dc70da1ac4
    block_size: the top-level block_size only (else the serving flag max_draft_len + 1). target layers:
    dflash_config.target_layer_ids, as "output of layer i". mask: dflash_config.mask_token_id, else top-level
    mask_token_id, else vocab_size (an id past the embedding table). Layers: bidirectional; a window only when
    dflash_config.use_swa is true, then swa_window_size on the layers layer_types marks sliding_attention (all
    layers when layer_types is absent); `sliding_window` alone is not read.
speculators 0.9.0 (PyPI), speculators/convert/dflash/converter.py and speculators/models/dflash/{config,core,attention}.py
    From a z-lab config (DFlashConverter): block_size top-level, else dflash_config.block_size; aux layers =
    target_layer_ids + 1 (capture-before ids), the target's last layer dropped (it is fed apart as the verifier's
    last hidden state); mask: dflash_config.mask_token_id; sliding_window_non_causal false. From its own format:
    aux_hidden_state_layer_ids, block_size, mask_token_id, sliding_window_non_causal, transformer_layer_config.
    Layers: full layers bidirectional; sliding layers causal unless sliding_window_non_causal; a sliding window
    is anchored at the block's anchor (context positions >= anchor - window), not at each query.

DFlash2 (train/drafter/dflash2.py): SGLang, vLLM and TensorRT-LLM (at the commits above) and speculators' DFlashConverter
build DFlash drafters only: a DFlash2 checkpoint is read as DFlash, its convolution and selector tensors unused.
speculators builds DFlash2 from its own format with speculators_model_type "dflash2" (DFlash2DraftModel), the sizes
read from the top level of config.json, with its defaults (kernel 2, group 16, rank 256, top-k 16) where absent.

dflash itself (train/drafter/model.py) trains full layers bidirectional within the block, and sliding layers
bidirectional within the block with each query seeing context positions p where q - p < window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ENGINES = ("SGLang", "vLLM", "TensorRT-LLM", "speculators")
SLIDING = "sliding_attention"


@dataclass
class Reading:
    engine: str
    target_layers: list[int] | None
    block_size: int | None
    mask_token_id: int | None
    layers: list[tuple[bool, int | None]]
    notes: list[str] = field(default_factory=list)
    window_from: str = "query"  # where a sliding window is measured from: each query, or the block's "anchor"
    arch: str = "dflash"  # the drafter the engine builds
    dflash2: dict[str, int] | None = None  # DFlash2's sizes as the engine reads them (arch "dflash2")


DFLASH2_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SPECULATORS_DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                                "selector_top_k": 16}  # speculators 0.9.0's DFlash2SpeculatorConfig
DFLASH_ONLY = "serves DFlash only"


def _dc(config: dict) -> dict:
    dc = config.get("dflash_config")
    return dc if isinstance(dc, dict) else {}


def _layer_types(config: dict) -> list[str] | None:
    lt = config.get("layer_types")
    return list(lt) if isinstance(lt, list) else None


def _num_layers(config: dict) -> int:
    return int(config.get("num_hidden_layers") or 0)


def spread_ids(num_target_layers: int, k: int) -> list[int]:
    """SGLang's default: k ids spread evenly from 1 to N-3 (N // 2 when k is 1)."""
    if k == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


def read_sglang(config: dict, num_target_layers: int) -> Reading:
    dc, notes = _dc(config), []
    block = dc.get("block_size", config.get("block_size"))
    if block is None:
        block = 16
        notes.append("no block_size: 16")
    ids = dc.get("target_layer_ids", config.get("target_layer_ids"))
    if ids is None:
        ids = spread_ids(num_target_layers, _num_layers(config))
        notes.append("no target_layer_ids: spread from 1 to N-3")
    mask = dc.get("mask_token_id")
    if mask is None:
        notes.append(f"no mask_token_id: the tokenizer's {dc.get('mask_token', '<|MASK|>')!r}")
    lt = _layer_types(config) or ["full_attention"] * _num_layers(config)
    window = config.get("sliding_window")
    layers = [(True, window) if t == SLIDING else (False, None) for t in lt]
    return Reading("SGLang", [int(i) for i in ids], int(block), mask, layers, notes)


def read_vllm(config: dict, num_target_layers: int) -> Reading:
    dc, notes = _dc(config), []
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        ids = [int(j) - 1 for j in aux]  # capture-before: input of layer j = output of layer j - 1
        notes.append("eagle_aux_hidden_state_layer_ids read as capture-before ids")
    elif dc.get("target_layer_ids"):
        ids = [int(i) for i in dc["target_layer_ids"]]
    elif config.get("target_layer_ids"):
        ids = [int(i) for i in config["target_layer_ids"]]
    else:
        N = num_target_layers
        ids = [j - 1 for j in (2, N // 2, N - 3)]
        notes.append("no target layer ids: EAGLE-3's default layers, with a warning only")
    mask = dc.get("mask_token_id", config.get("mask_token_id"))
    lt = _layer_types(config)
    n = _num_layers(config)
    use_swa = bool(dc.get("use_swa", False))
    any_sliding = bool(lt) and SLIDING in lt
    causal_all = config.get("is_causal", dc.get("causal"))
    layers = []
    for i in range(n):
        sliding = use_swa if (lt is None or (use_swa and not any_sliding)) else lt[i] == SLIDING
        window = dc.get("swa_window_size", config.get("sliding_window")) if sliding else None
        causal = bool(causal_all) if causal_all is not None else bool(lt) and lt[i] == SLIDING
        layers.append((causal, window))
    notes.append("block size from --speculative-config num_speculative_tokens (+1)")
    return Reading("vLLM", ids, None, mask, layers, notes)


def read_tensorrt_llm(config: dict, num_target_layers: int) -> Reading:
    dc, notes = _dc(config), []
    block = config.get("block_size")
    if block is None:
        notes.append("no top-level block_size: max_draft_len + 1")
    ids = dc.get("target_layer_ids")
    mask = dc.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        mask = config.get("vocab_size")
        notes.append("no mask_token_id: vocab_size")
    lt = _layer_types(config)
    use_swa = bool(dc.get("use_swa", False))
    window = int(dc.get("swa_window_size") or 0)
    layers = [(False, window if use_swa and (lt is None or lt[i] == SLIDING) else None)
              for i in range(_num_layers(config))]
    return Reading("TensorRT-LLM", None if ids is None else [int(i) for i in ids], block, mask, layers, notes)


def read_speculators(config: dict, num_target_layers: int) -> Reading:
    """speculators 0.9.0, from its own format (speculators_model_type) or through DFlashConverter (z-lab)."""
    notes, arch, sizes = [], "dflash", None
    kind = config.get("speculators_model_type")
    if kind == "dflash2":
        arch = "dflash2"
        sizes = {k: config.get(k, SPECULATORS_DFLASH2_DEFAULTS[k]) for k in DFLASH2_SIZES}
        absent = [k for k in DFLASH2_SIZES if k not in config]
        if absent:
            notes.append(f"no top-level {', '.join(absent)}: its defaults")
    if kind in ("dflash", "dflash2"):
        aux = config.get("aux_hidden_state_layer_ids")
        block, mask = config.get("block_size"), config.get("mask_token_id")
        non_causal = bool(config.get("sliding_window_non_causal", False))
        tl = config.get("transformer_layer_config") or {}
    else:
        dc = _dc(config)
        block = config.get("block_size") or dc.get("block_size")
        ids = dc.get("target_layer_ids")
        aux = None if ids is None else [int(i) + 1 for i in ids if int(i) + 1 != num_target_layers]
        if ids is not None and len(aux) != len(ids):
            notes.append("the target's last layer is dropped from the aux layers")
        mask, non_causal, tl = dc.get("mask_token_id"), False, config
    lt = _layer_types(tl) or ["full_attention"] * _num_layers(tl)
    window = tl.get("sliding_window")
    layers = [(not non_causal, window) if t == SLIDING else (False, None) for t in lt]
    ids = None if aux is None else [int(j) - 1 for j in aux]
    return Reading("speculators", ids, block, mask, layers, notes, window_from="anchor", arch=arch, dflash2=sizes)


READERS = {"SGLang": read_sglang, "vLLM": read_vllm, "TensorRT-LLM": read_tensorrt_llm,
           "speculators": read_speculators}


def read(engine: str, config: dict[str, Any], num_target_layers: int) -> Reading:
    return READERS[engine](config, num_target_layers)
