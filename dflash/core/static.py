"""Which static decoder a target takes (the decode step replayable as CUDA graphs): dflash.core.static_decode's
StaticDecoder for full-attention targets (Llama, Qwen2/3, Mistral), dflash.core.static_hybrid's HybridDecoder for
Qwen3.5 / 3.6 hybrids (Gated DeltaNet + gated full attention). Both have one interface (prefill, step with record,
accept, prepare, move, grow); callers (the slot engine of regenerate and prompts, eval's StaticTarget) ask here.

    why = unsupported(model)                    # None, or why neither runs it (the caller keeps the HF forward)
    why = why or not_by_default(model)          # with --target-graph left to its default
    dec = static_decoder(model, slots=.., max_len=.., ...)

The hybrid decoder equals the HF forward in float32 on a CPU (tests/test_hybrid_static.py), with graphs off; its
captured steps have not yet run on a GPU (tests/test_gpu.py holds their check). Until they have, a hybrid target
decodes on the eager path unless --target-graph asks for the graphs: not_by_default names why.
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


# What keeps a decoder that can run a model from being the default (--target-graph left unset), by decoder.
UNCHECKED = {HybridDecoder: "its CUDA-graph decoder (dflash/core/static_hybrid.py) has not yet been checked on a GPU; "
                            "--target-graph turns it on"}


def not_by_default(model) -> str | None:
    """Why `model` decodes on the eager path when --target-graph is left unset although a static decoder runs it
    (UNCHECKED), or None."""
    return UNCHECKED.get(HybridDecoder if _hybrid(model) else StaticDecoder)
