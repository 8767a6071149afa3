"""Which static decoder a target takes (the decode step replayable as CUDA graphs): dflash.core.static_decode's
StaticDecoder for full-attention targets (Llama, Qwen2/3, Mistral), dflash.core.static_hybrid's HybridDecoder for
Qwen3.5 / 3.6 hybrids (Gated DeltaNet + gated full attention). Both have one interface (prefill, step with record,
accept, prepare, move, grow); callers (the slot engine of regenerate and prompts, eval's StaticTarget) ask here.

    why = unsupported(model)                    # None, or why neither runs it (the caller keeps the HF forward)
    why = graphs_unsupported(model, flag)       # or "--no-target-graph", "not on a CUDA device": None = CUDA graphs
    dec = static_decoder(model, slots=.., max_len=.., ...)

The hybrid decoder equals the HF forward in float32 on a CPU (tests/test_hybrid_static.py), with graphs off, and its
captured steps equal its eager ones and the HF forward on a GPU (tests/test_gpu.py): on a GPU a hybrid target takes
it by default, as a dense one takes StaticDecoder; --no-target-graph keeps the eager path.
"""

from __future__ import annotations

from .static_decode import HYBRID_LAYERS, StaticDecoder
from .static_decode import unsupported as dense_unsupported
from .static_hybrid import HybridDecoder, hybrid_unsupported
from .target import decoder_layers


def _hybrid(model) -> bool:
    try:
        return {type(layer).__name__ for layer in decoder_layers(model)} <= set(HYBRID_LAYERS)
    except Exception:  # noqa: BLE001  (no layer list: dense_unsupported names it)
        return False


def unsupported(model) -> str | None:
    """None when a static decoder can run `model`, else why not (in words)."""
    return hybrid_unsupported(model) if _hybrid(model) else dense_unsupported(model)


def static_decoder(model, **kwargs) -> StaticDecoder:
    """The static decoder of `model` (StaticDecoder's arguments): HybridDecoder for a Qwen3.5 / 3.6 hybrid, else
    StaticDecoder; a ValueError naming what stops it otherwise."""
    return (HybridDecoder if _hybrid(model) else StaticDecoder)(model, **kwargs)


def graphs_unsupported(model, target_graph: bool | None = None) -> str | None:
    """None when `model` decodes in CUDA graphs here under --target-graph=target_graph (None: its default, on a CUDA
    device where a static decoder runs it), else why not (in words): "--no-target-graph", "not on a CUDA device", or
    what no static decoder runs."""
    if target_graph is False:
        return "--no-target-graph"
    if next(model.parameters()).device.type != "cuda":
        return "not on a CUDA device"
    return unsupported(model)
