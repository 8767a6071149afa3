"""Prompts in, Results out: the engine a target decodes with, and a whole generation through it (tests, bench, the
commands). The engines are extract/generation/engine.py's Engine (the HF causal LM over a growing cache), extract/generation/slot_engine.py's
SlotEngine (a static cache, CUDA graphs on a GPU) and extract/generation/kind_engine.py's KindEngine (transformers' cache per
layer kind, for linear-attention and sliding-window targets):

    generate(model, prompts, eos_ids=..., max_new_tokens=256)      # eos ids: dflash.core.chat.eos_ids_of
    eager_engine(model)                                             # Engine, or KindEngine for such targets
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dflash.core.decode_state import needs_kind_cache

from dflash.extract.generation.engine import (  # noqa: F401  (the engine's names stay importable from here)
    Continuation,
    Engine,
    Request,
    Result,
    kv_bytes_per_token,
    plan_engine,
    rng_key,
)
from dflash.extract.generation.kind_engine import KindEngine
from dflash.core.static import graphs_unsupported
from dflash.extract.generation.slot_engine import SlotEngine


def eager_engine(model) -> type:
    """Engine for a target of full-attention layers only; extract/generation/kind_engine.py's KindEngine (transformers' cache
    and masks per layer kind) for one with linear-attention or sliding-window layers."""
    if needs_kind_cache(model):
        return KindEngine
    return Engine


def generate(model, prompts: Sequence[Sequence[int]], *, eos_ids: Iterable[int], max_new_tokens: int | Sequence[int],
             batch_size: int = 32, max_batch_tokens: int = 1 << 20, prefill_tokens: int = 8192,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, pad_id: int = 0,
             refill: int | None = None, on_result=None, first_row: int = 0, engine: str = "auto",
             decoder=None) -> list[Result]:
    """Generate for every prompt (token ids); Results in prompt order. Longest prompts are admitted first.
    max_new_tokens may be one int or one per prompt. Sampling stream of prompt i: rng_key(seed, first_row + i)
    (a call over rows 100..199 samples what one call over rows 0..199 samples for them).
    engine: "eager" (Engine), "static" (extract/generation/slot_engine.py's SlotEngine: CUDA graphs on a GPU, the same
    static-cache code eagerly elsewhere) or "auto" (static on a GPU where the model allows it, else eager).
    decoder: a StaticDecoder to reuse (with its captured graphs) when it is large enough."""
    mnt = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if engine not in ("auto", "eager", "static"):
        raise ValueError(f"engine must be auto, eager or static, got {engine!r}")
    static = engine == "static" or (engine == "auto" and graphs_unsupported(model) is None)
    if static and prompts:
        longest = max(len(p) + m for p, m in zip(prompts, mnt))
        eng = SlotEngine(model, eos_ids=eos_ids, slots=min(batch_size, len(prompts)), max_len=longest,
                         prefill_tokens=prefill_tokens, temperature=temperature, top_p=top_p, pad_id=pad_id,
                         refill=refill, decoder=decoder)
    else:
        eng = eager_engine(model)(model, eos_ids=eos_ids, batch_size=batch_size, max_batch_tokens=max_batch_tokens,
                     prefill_tokens=prefill_tokens, temperature=temperature, top_p=top_p, pad_id=pad_id,
                     refill=refill)
    for i, p in enumerate(prompts):
        eng.add(Request(list(map(int, p)), int(mnt[i]), key=i, rng_key=rng_key(seed, first_row + i),
                        priority=(-len(p), i)))
    out: list[Result | None] = [None] * len(prompts)
    while eng.busy:
        for r in eng.step():
            out[r.key] = r
            if on_result is not None:
                on_result(r)
    return out  # type: ignore[return-value]
