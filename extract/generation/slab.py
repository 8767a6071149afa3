"""The KV cache and the attention `dflash regenerate`'s engine (extract/generation/generate.py) decodes with.

  * SlabCache: a transformers DynamicCache whose layers (SlabLayer) write into preallocated [B, Hkv, capacity, D]
    buffers that grow by amortised steps, instead of a torch.cat of the whole cache at every token; rows can be
    selected (finished rows dropped, leading all-padding columns cut) and caches stacked, right-aligned;
  * plan_engine: the batch size, KV budget (tokens) and prefill chunk that fit the free memory;
  * dflash_sdpa: SDPA with the engine's boolean 4D mask that folds grouped query heads onto their KV head for a
    one-token query, so the cache is never repeated per query head.
"""

from __future__ import annotations

import torch

from dflash.core.target import TargetError, text_config


# ----------------------------------------------------------------------------------------------------------------
# the KV cache: a DynamicCache whose layers keep preallocated buffers (no torch.cat of the whole cache per token)


def _query_length(args, kwargs) -> int:
    q = args[0] if args else kwargs.get("query_length", kwargs.get("cache_position"))
    return int(q) if isinstance(q, int) else int(q.shape[0])


def _dynamic_layer_cls():
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):
        """keys/values live in buf[:, :, :n] of [B, Hkv, capacity, D] buffers; capacity grows by >= 25%."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.n = 0
            self.kbuf = self.vbuf = None

        def _set(self, kbuf, vbuf, n):
            self.kbuf, self.vbuf, self.n = kbuf, vbuf, n
            self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]
            self.is_initialized = True
            self.dtype, self.device = kbuf.dtype, kbuf.device

        def update(self, key_states, value_states, *args, **kwargs):
            t = key_states.shape[-2]
            need = self.n + t
            if self.kbuf is None or need > self.kbuf.shape[2]:
                B, H, _, D = key_states.shape
                cap = need + max(64, need // 4)
                kb = key_states.new_empty(B, H, cap, D)
                vb = value_states.new_empty(B, H, cap, value_states.shape[-1])
                if self.n:
                    kb[:, :, : self.n] = self.kbuf[:, :, : self.n]
                    vb[:, :, : self.n] = self.vbuf[:, :, : self.n]
                self.kbuf, self.vbuf = kb, vb
            self.kbuf[:, :, self.n: need] = key_states
            self.vbuf[:, :, self.n: need] = value_states
            self._set(self.kbuf, self.vbuf, need)
            return self.keys, self.values

        def get_seq_length(self, *args, **kwargs) -> int:
            return self.n

        def get_mask_sizes(self, *args, **kwargs):
            return self.n + _query_length(args, kwargs), 0

        def crop(self, tokens_to_remove: int) -> None:  # not used here; keep the semantics of DynamicLayer
            if tokens_to_remove:
                n = self.n - abs(tokens_to_remove) if tokens_to_remove < 0 else tokens_to_remove
                self._set(self.kbuf, self.vbuf, max(0, n))

        def batch_select_indices(self, indices):
            self.select(indices, 0)

        def select(self, rows: torch.Tensor, trim: int) -> None:
            """Keep batch rows `rows` and drop the first `trim` columns."""
            if self.kbuf is None:
                return
            n = self.n - trim
            kb = self.kbuf.new_empty(len(rows), self.kbuf.shape[1], n + max(64, n // 4), self.kbuf.shape[3])
            vb = self.vbuf.new_empty(len(rows), self.vbuf.shape[1], kb.shape[2], self.vbuf.shape[3])
            kb[:, :, :n] = self.kbuf[rows, :, trim: self.n]
            vb[:, :, :n] = self.vbuf[rows, :, trim: self.n]
            self._set(kb, vb, n)

        def zero_columns(self, pad: torch.Tensor) -> None:
            """Zero the keys/values where pad [B, n] is True (left padding of a prefill)."""
            m = pad[:, None, :, None]
            self.kbuf[:, :, : self.n].masked_fill_(m, 0)
            self.vbuf[:, :, : self.n].masked_fill_(m, 0)

        @staticmethod
        def stack(layers: list[SlabLayer], width: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Buffers holding each layer's rows in turn, each right-aligned to `width` columns, zeros on the left."""
            rows = sum(x.kbuf.shape[0] for x in layers)
            cap = width + max(64, width // 4)
            out = []
            for name in ("kbuf", "vbuf"):
                src0 = getattr(layers[0], name)
                buf = src0.new_empty(rows, src0.shape[1], cap, src0.shape[3])
                lo = 0
                for x in layers:
                    src, n = getattr(x, name), x.n
                    hi, pad = lo + src.shape[0], width - n
                    if pad:
                        buf[lo:hi, :, :pad].zero_()
                    buf[lo:hi, :, pad:width] = src[:, :, :n]
                    lo = hi
                out.append(buf)
            return out[0], out[1]

    return SlabLayer


_SLAB_LAYER = None


def slab_cache():
    """A new empty SlabCache (a transformers DynamicCache of SlabLayers, created lazily, one per decoder layer)."""
    global _SLAB_LAYER
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    if _SLAB_LAYER is None:
        _SLAB_LAYER = _dynamic_layer_cls()
    cache = DynamicCache.__new__(DynamicCache)
    Cache.__init__(cache, layer_class_to_replicate=_SLAB_LAYER)
    return cache


def cache_select(cache, rows: torch.Tensor, trim: int) -> None:
    for layer in cache.layers:
        layer.select(rows, trim)


def cache_stack(caches: list, width: int):
    """One cache holding the rows of `caches` in turn, right-aligned to `width` columns: one copy of each."""
    out = slab_cache()
    for layers in zip(*(c.layers for c in caches)):
        layer = _SLAB_LAYER()
        layer._set(*_SLAB_LAYER.stack(list(layers), width), width)
        out.layers.append(layer)
    return out


def check_attention_only(cfg, name: str) -> None:
    kinds = set(getattr(text_config(cfg), "layer_types", None) or ["full_attention"])
    bad = kinds - {"full_attention", "sliding_attention"}
    if bad:
        raise TargetError(f"{name}: layer types {sorted(bad)} are not supported by the generator "
                          "(attention layers only)")


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """HF attention function (registered as "dflash_sdpa"): SDPA with our boolean 4D mask. For one query token
    with grouped KV heads the query heads are folded onto their KV head ([B, Hkv, rep, D] against [B, Hkv, N, D]),
    so the cache is never copied rep times (transformers < 5.2x calls repeat_kv on the whole cache whenever a mask
    is given: 4x the cache written and read per layer and step for Qwen3-8B)."""
    B, H, q, D = query.shape
    Hkv = key.shape[1]
    if q == 1 and H != Hkv:
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(B, Hkv, H // Hkv, D), key, value, attn_mask=attention_mask, scale=scaling)
        out = out.reshape(B, H, 1, value.shape[-1])
    else:
        if H != Hkv:
            key = key.repeat_interleave(H // Hkv, dim=1)
            value = value.repeat_interleave(H // Hkv, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_ATTN = "dflash_sdpa"
_ATTN_REGISTERED = False


def attention_impl(model):
    """Context: the model's sdpa attention replaced by _gqa_sdpa for the duration of a forward."""
    import contextlib

    global _ATTN_REGISTERED
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return contextlib.nullcontext()
    if not _ATTN_REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(_ATTN, _gqa_sdpa)
        _ATTN_REGISTERED = True

    @contextlib.contextmanager
    def swap():
        cfg._attn_implementation = _ATTN
        try:
            yield
        finally:
            cfg._attn_implementation = "sdpa"

    return swap()


# ----------------------------------------------------------------------------------------------------------------
# sizing: the engine's batch, KV budget and prefill chunk from the free memory


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    c = text_config(cfg)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8


def plan_engine(cfg_hf, dtype, device: torch.device, batch_size=0, max_batch_tokens=0, prefill_tokens=0):
    """(batch_size, max_batch_tokens, prefill_tokens) with the defaults filled in."""
    cuda = device.type == "cuda"
    batch = batch_size or (256 if cuda else 32)
    prefill = prefill_tokens or (16384 if cuda else 2048)
    if not max_batch_tokens:
        per = kv_bytes_per_token(cfg_hf, dtype)
        if cuda:
            free, _ = torch.cuda.mem_get_info(device)
            c = text_config(cfg_hf)
            act = prefill * (6 * getattr(c, "intermediate_size", 4 * c.hidden_size) + 16 * c.hidden_size) * 2
            budget = int(0.85 * free) - act - (2 << 30)
        else:
            budget = 4 << 30
        # A slab holds 25% more columns than its width, and a refill stacks its prefilled slabs beside the old
        # one into a new slab before the old ones are freed: the peak is ~2.5x the budgeted tokens (the H200 ran
        # out of memory at batch 1024 with 2,600-token histories when this was 1x).
        max_batch_tokens = max(budget * 2 // (5 * per), 4096)
    return batch, int(max_batch_tokens), prefill
