"""The eager batch decoder for targets with linear-attention or sliding-window layers (Qwen3.5-MoE, gpt-oss, and
Qwen3.5 / 3.6 on a CPU, with --no-target-graph, or beside the slot engine for a request too long for its slots):
extract/generation/generate.py's Engine (its queue, refills, compactions, continuations, sampling and statistics)
over transformers' own cache laid out per layer kind (dflash.core.decode_state decoding_cache) and transformers' own
masks.

What differs from Engine (whose SlabCache and 4D boolean mask assume every layer is full attention):
  * the forward gets a 2D real-token mask [B, columns] (left padding) and builds each layer kind's mask itself: the
    causal mask, the sliding window (a query sees the last W positions, pads hidden) with attention sinks in
    gpt-oss's eager attention, and the Gated DeltaNet's padding mask (padding inputs zeroed before the
    convolution and the delta rule, so a left-padded row's state is that of its real tokens alone);
  * a refill's prefilled chunks join the batch right-aligned by decode_state.stack_rows (attention keys padded on
    the left, linear layers' conv and recurrent states per row); a compaction keeps rows with
    decode_state.select_rows and cuts the leading columns that are padding for every kept row, as Engine does.

No CUDA graphs (on a GPU a Qwen3.5 / 3.6 hybrid takes extract/generation/slot_engine.py's, over
dflash.core.static_hybrid's per-slot recurrent states and windows). Greedy rows decode the target's own greedy text
(tests/test_hybrid_decoding.py), whatever the batch they ran in.
"""

from __future__ import annotations

import torch

from dflash.core.decode_state import decoding_cache, select_rows, stack_rows
from dflash.core.target import decode_sdpa

from dflash.extract.generation.engine import Engine


class KindEngine(Engine):
    """Engine's interface (add, step, busy, its statistics) and its refill, decode and compaction steps over a cache
    laid out per layer kind: only the forward, the cache's creation, stacking and selection and the mask differ
    (module docstring)."""

    def _forward(self, ids, pos, real2d, cache):
        kw = {"input_ids": ids, "position_ids": pos, "attention_mask": real2d.long(), self._cache_kw: cache,
              "use_cache": True}
        if self._keep_kw:
            kw[self._keep_kw] = 1
        with decode_sdpa():
            logits = self.model(**kw).logits
        return logits[:, -1].float()

    def _prefill_forward(self, ids, pos, real):
        cache = decoding_cache(self.model)
        return self._forward(ids, pos, real, cache), cache

    def _decode_mask(self) -> torch.Tensor:
        return self.mask

    def _stack(self, caches: list, width: int):
        return stack_rows(caches, width)

    def _select(self, cache, idx: torch.Tensor, trim: int) -> None:
        select_rows(cache, idx, trim)
