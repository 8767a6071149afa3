"""The target in speculative decoding (train/evaluate/decode.py's loop): its KV cache, the layers it captures for the
drafter, and the attention it decodes with.

Target.forward(ids, start, hidden) runs ids at positions start.. on the cached prefix: a prefill, a one-token step
of the target alone, or the verify of a drafted block, all through the same model and attention. On a GPU in
bf16/fp16 that attention is _lower_right_sdpa (registered as "dflash_decode"): causal to the bottom right of the
[block, cache + block] square with no mask tensor and grouped KV heads read in place, where HF's sdpa would build
a 4D mask and copy the KV cache per query head for every multi-token forward.
"""

from __future__ import annotations

import functools

import torch

from dflash.core.decode_state import decoding_cache, needs_kind_cache, record, rollback
from dflash.core.target import LayerCapture, decoder_layers


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions (a negative count removes from the end in every transformers version)."""
    cur = cache.get_seq_length()
    if length < cur:
        cache.crop(length - cur)


def _lower_right_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """HF attention function (registered as "dflash_decode") for ONE sequence decoded with a KV cache: query
    position i sees every cached key and the block's keys up to i (causal, aligned to the bottom right of the
    [q, kv] square), with no mask tensor at all. Grouped KV heads are read in place (enable_gqa). HF's own sdpa
    path builds a 4D mask for every multi-token forward and then repeats the whole KV cache per query head
    (repeat_kv: two copies per layer): on a launch-bound verify forward that is ~200 more host operations than a
    one-token step (SmolLM2, 30 layers)."""
    q, n = query.shape[2], key.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=None if q == 1 else _lower_right(q, n), scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=4)
def _lower_right(q: int, n: int):
    """torch's lower-right causal bias for a [q, n] attention (no tensor behind it): made once per forward, not
    once per layer."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(q, n)


DECODE_ATTENTION = "dflash_decode"


def decode_attention_ok(model, require_flash: bool = False) -> str | None:
    """None when the target can decode with _lower_right_sdpa, else why not (sliding windows, soft-capped
    logits or attention sinks need HF's own masks; another attention implementation than sdpa is kept).
    require_flash: also only where SDPA's flash kernel takes the bottom-right causal block with grouped KV heads
    in place (CUDA, 16-bit weights, head dim <= 256). Elsewhere torch materialises the mask and runs its math
    kernel: float32 on the H200 measured slower than HF's path (verify 27.5 vs 20.2 ms for the target's step)."""
    cfg = model.config
    tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if require_flash:
        p = next(model.parameters())
        head_dim = getattr(tc, "head_dim", 0) or 0
        if p.device.type != "cuda" or p.dtype not in (torch.bfloat16, torch.float16) or head_dim > 256:
            return f"no flash attention for {p.dtype} on {p.device.type}"
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", DECODE_ATTENTION):
        return f"the model uses {getattr(cfg, '_attn_implementation', None)} attention"
    kinds = set(getattr(tc, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)}"
    if getattr(tc, "sliding_window", None) and getattr(tc, "use_sliding_window", True):
        return "a sliding window"
    if getattr(tc, "attn_logit_softcapping", None):
        return "soft-capped attention logits"
    if any(hasattr(m, "sinks") for m in model.modules()):
        return "attention sinks"
    return None


class Target:
    """The target model with a KV cache (DynamicCache) and, given layer_ids, the captured layers.

    attention="auto": the target decodes with _lower_right_sdpa where it runs on SDPA's flash kernel (a CUDA
    GPU in bf16/fp16) and decode_attention_ok(model) (both the target-only baseline and the verify forwards: the
    same code path); "decode" wherever the model allows it (the CPU tests); "model" keeps the model's own.

    A target with linear-attention or sliding-window layers decodes on transformers' cache laid out per layer kind
    (dflash.core.decode_state): every forward records the linear layers' state after each of its tokens, and
    crop() rolls every layer back to the accepted prefix (the recurrent and conv states too, not only the keys)."""

    def __init__(self, model, layer_ids: list[int] | None, attention: str = "auto"):
        if attention not in ("auto", "decode", "model"):
            raise ValueError(f"attention must be auto, decode or model, got {attention!r}")
        self.model = model
        self.device = next(model.parameters()).device
        why = (decode_attention_ok(model, require_flash=attention == "auto") if attention != "model"
               else "asked for the model's own")
        if why is None:
            from transformers import AttentionInterface

            AttentionInterface.register(DECODE_ATTENTION, _lower_right_sdpa)
            model.config._attn_implementation = DECODE_ATTENTION
        elif getattr(model.config, "_attn_implementation", None) == DECODE_ATTENTION:
            model.config._attn_implementation = "sdpa"
        self.attention = model.config._attn_implementation
        self.capture = None
        if layer_ids:
            L = len(decoder_layers(model))
            self.capture = LayerCapture(model, layer_ids, final_norm_for=L - 1 if L - 1 in layer_ids else None)
        self.cache = None
        self.by_kind = needs_kind_cache(model)  # linear-attention / sliding-window layers: decode_state's cache
        self.length = 0  # positions in the cache
        import inspect  # transformers >= 5.2x renamed past_key_values to cache

        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def reset(self):
        from transformers import DynamicCache

        self.cache = decoding_cache(self.model) if self.by_kind else DynamicCache()
        self.length = 0

    def crop(self, length: int) -> None:
        """Keep the first `length` positions of the cache (every layer's state rolled back to them)."""
        if self.by_kind:
            rollback(self.cache, self.length, length)
        else:
            crop_cache(self.cache, length)
        self.length = min(self.length, length)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [1, L, V] (and captured hidden [1, L, K*H]) for ids [1, L] at positions start..start+L-1."""
        L = ids.shape[1]
        pos = torch.arange(start, start + L, device=self.device)[None]
        out_h = None
        if hidden and self.capture is not None:
            K, H = len(self.capture.layer_ids), self.model.config.get_text_config().hidden_size
            out_h = torch.empty(1, L, K * H, device=self.device, dtype=next(self.model.parameters()).dtype)
            self.capture.out = out_h
        if self.by_kind:
            if start != self.length:
                raise ValueError(f"a forward at position {start} on a cache of {self.length} positions")
            record(self.cache, 0 if start == 0 else L)
        try:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self._cache_kw: self.cache})
        finally:
            if self.capture is not None:
                self.capture.out = None
        self.length = start + L
        if self.by_kind and start == 0:
            rollback(self.cache, L, L)  # the prefill's conv windows and sliding keys trimmed to their working size
        return out.logits, out_h


class StaticTarget:
    """The target of Target's interface over dflash.core.static_decode's static KV cache: the prompt's prefill
    eagerly, then every step (a 1-token step of the target alone, or the verify of a drafted block padded to the
    block size) as one CUDA-graph replay per (length, bucket) on a GPU. Nothing is cropped: a rejected draft's keys
    and values lie past the confirmed length, are never attended to, and the next step writes over them.

    max_len bounds prompt + generated + one block; block_size: the verify length drafts are padded to (n-gram
    lookup drafts fewer than B-1 tokens at times; a padded block costs a memory-bound target the same).

    A hybrid target (dflash.core.static_hybrid) has linear-attention states that a verify has already advanced past
    a rejected draft: its verify records the state after each token, and crop() takes the state after the last
    accepted one (HybridDecoder.accept, device ops only)."""

    def __init__(self, model, layer_ids: list[int] | None, max_len: int, block_size: int, graphs: bool = True):
        from dflash.core.static import static_decoder

        self.model = model
        self.device = next(model.parameters()).device
        self.block_size = int(block_size)
        self.dec = static_decoder(model, slots=1, max_len=max_len + self.block_size, layer_ids=layer_ids,
                                  graphs=graphs, max_q=max(1, self.block_size))
        self._verified: tuple[int, int] | None = None  # (start, q) of the last recorded verify, until crop()
        self.attention = "static-graph" if self.dec.graphs_on else "static"
        self.capture = bool(layer_ids)
        self._start = torch.zeros(1, dtype=torch.long, device=self.device)
        self._row = torch.zeros(1, dtype=torch.long, device=self.device)
        self.cache = None

    def reset(self):
        self._verified = None  # a new prompt's prefill sets every state; nothing of the last decode is accepted

    def prepare(self) -> int:
        """Capture now every step this target can take (the 1-token step and the block's verify at every span
        bucket: StaticDecoder.prepare), so that decoding after it captures and compiles nothing. Returns how many
        shapes it ran."""
        return self.dec.prepare(1, sorted({1, self.block_size}))

    def crop(self, length: int) -> None:
        """Positions past the confirmed length are never attended to; a hybrid target's linear states go back to
        the last kept token of the verify."""
        if self._verified is not None:
            start, q = self._verified
            self._verified = None
            if length - start < q:
                self.dec.accept(length - start)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [1, L, V] (and captured hidden [1, L, K*H]) for ids [1, L] at positions start..start+L-1."""
        L = ids.shape[1]
        if start == 0:
            logits, h = self.dec.prefill(ids, self._row, all_logits=True)
        else:
            q = 1 if L == 1 else self.block_size
            if L > q:
                raise ValueError(f"a verify of {L} tokens is longer than the block size {q}")
            if L < q:
                ids = torch.cat([ids, ids[:, -1:].expand(1, q - L)], 1)
            self._start.fill_(start)
            logits, h = self.dec.step(ids, self._start, start + q)  # a verify (q > 1) records: crop() accepts
            self._verified = (start, q) if self.dec.recurrent and q > 1 else None
            logits = logits[:, :L]
            h = None if h is None else h[:, :L].clone()  # the next replay overwrites the static output
        return logits, (h if hidden else None)
