"""The eager batch decoder for targets with linear-attention or sliding-window layers (Qwen3.5 / 3.6, Qwen3.5-MoE,
gpt-oss): extract/generation/generate.py's Engine (its queue, refills, compactions, continuations, sampling and statistics)
over transformers' own cache laid out per layer kind (dflash.core.decode_state decoding_cache) and transformers'
own masks.

What differs from Engine (whose SlabCache and 4D boolean mask assume every layer is full attention):
  * the forward gets a 2D real-token mask [B, columns] (left padding) and builds each layer kind's mask itself: the
    causal mask, the sliding window (a query sees the last W positions, pads hidden) with attention sinks in
    gpt-oss's eager attention, and the Gated DeltaNet's padding mask (padding inputs zeroed before the
    convolution and the delta rule, so a left-padded row's state is that of its real tokens alone);
  * a refill's prefilled chunks join the batch right-aligned by decode_state.stack_rows (attention keys padded on
    the left, linear layers' conv and recurrent states per row); a compaction keeps rows with
    decode_state.select_rows and cuts the leading columns that are padding for every kept row, as Engine does.

No CUDA graphs: extract/generation/slot_engine.py's static KV cache has no per-slot recurrent state or window yet. Greedy rows
decode the target's own greedy text (tests/test_hybrid_decoding.py), whatever the batch they ran in.
"""

from __future__ import annotations

import torch

from dflash.core.decode_state import decoding_cache, select_rows, stack_rows
from dflash.core.target import decode_sdpa

from dflash.extract.generation.engine import Engine, Result, _Chunk, _Row


class KindEngine(Engine):
    """Engine's interface (add, step, busy, its statistics) over a cache laid out per layer kind (module
    docstring)."""

    def _forward(self, ids, pos, real2d, cache):
        kw = {"input_ids": ids, "position_ids": pos, "attention_mask": real2d.long(), self._cache_kw: cache,
              "use_cache": True}
        if self._keep_kw:
            kw[self._keep_kw] = 1
        with decode_sdpa():
            logits = self.model(**kw).logits
        return logits[:, -1].float()

    @torch.inference_mode()
    def _prefill(self, reqs, width: int) -> _Chunk:
        k, dev = len(reqs), self.device
        ids = torch.full((k, width), self.pad_id, dtype=torch.long)
        real = torch.zeros((k, width), dtype=torch.bool)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.long)
            real[i, width - len(r.prompt):] = True
        ids, real = ids.to(dev), real.to(dev)
        pos = (real.long().cumsum(-1) - 1).clamp_(min=0)
        cache = decoding_cache(self.model)
        logits = self._forward(ids, pos, real, cache)
        rows = [_Row(r) for r in reqs]
        self.prefills += 1
        self.prompt_tokens += sum(len(r.prompt) for r in reqs)
        self.prefill_columns += k * width
        return _Chunk(cache, real, self._sample(logits, rows), rows, width)

    def _merge(self, chunks: list[_Chunk]) -> list[Result]:
        parts = [(self.cache, self.mask, self.last, self.pos)] if self.rows else []
        parts += [(c.cache, c.real, c.first, c.real.sum(-1)) for c in chunks]
        if len(parts) == 1:
            self.cache, self.mask, self.last, self.pos = parts[0]
        else:
            w = max(p[1].shape[1] for p in parts)
            pad = torch.nn.functional.pad
            self.copied_columns += sum(p[1].shape[0] for p in parts) * w
            self.cache = stack_rows([p[0] for p in parts], w)
            self.mask = torch.cat([pad(p[1], (w - p[1].shape[1], 0)) for p in parts], 0)
            self.last = torch.cat([p[2] for p in parts])
            self.pos = torch.cat([p[3] for p in parts])
        base = len(self.rows)
        for c in chunks:
            self.rows.extend(c.rows)
        return self._emit(torch.cat([c.first for c in chunks]).tolist(), start=base)

    @torch.inference_mode()
    def _decode(self) -> list[Result]:
        B = len(self.rows)
        self.mask = torch.cat([self.mask, torch.ones(B, 1, dtype=torch.bool, device=self.device)], 1)
        logits = self._forward(self.last[:, None], self.pos[:, None], self.mask, self.cache)
        self.decode_columns += B * self.mask.shape[1]
        self._decode_real = self._decode_real + (self.pos.sum() + B)
        self.pos = self.pos + 1
        self.last = self._sample(logits, self.rows)
        self.steps += 1
        fed = [i for i, r in enumerate(self.rows) if r.forced and not r.done] if self.follow is not None else []
        if fed:
            self.last[fed] = torch.tensor([self.rows[i].forced.popleft() for i in fed], device=self.device)
        return self._emit(self.last.tolist(), start=0, skip=set(fed))

    def _retain(self, keep: list[int]) -> None:
        self.dead = 0
        self.compactions += 1
        if not keep:
            self.rows, self.cache, self.mask, self.last, self.pos = [], None, None, None, None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self.mask[idx]
        trim = int(mask.any(0).long().argmax())  # leading columns that are padding for every kept row
        self.mask = mask[:, trim:]
        self.copied_columns += len(keep) * self.mask.shape[1]
        self.last, self.pos = self.last[idx], self.pos[idx]
        select_rows(self.cache, idx, trim)
        self.rows = [self.rows[i] for i in keep]
