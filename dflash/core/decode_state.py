"""The target's decoding state for every layer kind, and how speculative decoding rolls it back.

A target's state after a prefix is one entry per decoder layer (dflash.core.hybrid layer_kinds):

    full_attention     keys and values of every position (transformers' DynamicLayer)
    sliding_attention  keys and values of the last W - 1 positions (DynamicSlidingWindowLayer): a query at
                       position p sees p - W + 1 .. p, as the target's own forward does
    linear_attention   Gated DeltaNet (Qwen3.5 / 3.6, Qwen3.5-MoE, Qwen3-Next): the convolution's last K - 1 inputs
                       and one recurrent state per head, of fixed size whatever the length (LinearAttentionLayer)

A speculative verify runs n + 1 tokens ([last, d1 .. dn]) on the confirmed prefix and keeps the first a + 1 of
them. Attention layers drop the rejected positions' keys and values. A linear-attention layer's state has no
positions to drop: it must be replaced by the state after the a + 1-th token.

Method: capture, not recompute. Before each forward the cache is told to record the past
(transformers' Cache.activate_past_recording(recurrent_states_to_keep=L) for a forward of L tokens): the Gated
DeltaNet then runs those L tokens through its recurrent delta rule one at a time and hands the cache the state
after each of them (get_recurrent_states_to_keep in Qwen3_5GatedDeltaNet.forward), the convolution keeps its whole
input window, and sliding-window layers keep their keys until the crop. rollback(cache, keep) then takes the
state after the last kept token (Cache.crop(-removed): the recorded recurrent state, the conv window ending there,
the attention keys before it) and drops the rest of the record, so the cache is back to its minimal size after
every step. Recomputing instead (re-running the accepted tokens from a copy of the pre-verify state) costs a
second target forward on every partially accepted step; the capture costs only the verify's delta rule run
token by token instead of chunked (a few tokens, the same arithmetic a one-token decoding step does). A prefill
records nothing (L = 0: its delta rule stays chunked); the first rollback after it is a plain trim.

    cache = decoding_cache(model)               # transformers' DynamicCache laid out per layer kind
    record(cache, L)                            # before a forward of L tokens that may be rolled back
    rollback(cache, keep)                       # after it: the state after the first `keep` positions

decoding_cache is also what the eager batch decoder of `dflash regenerate` / `dflash prompts` runs on for a target
with linear-attention or sliding-window layers (no rollback there: it only appends).
"""

from __future__ import annotations

import torch

from dflash.core.hybrid import HybridError, check_layer_kinds, is_hybrid, layer_kinds


def needs_kind_cache(model) -> bool:
    """Whether the target has a layer that is not plain full attention (its cache must be laid out per kind)."""
    return is_hybrid(model.config)


def eager_reason(model) -> str | None:
    """Why the target decodes on the eager path (transformers' own cache, no CUDA graphs), in words
    ("linear_attention layers", "sliding_attention layers"), or None for a plain full-attention target."""
    kinds = [k for k in dict.fromkeys(layer_kinds(model.config)) if k != "full_attention"]
    return " and ".join(kinds) + " layers" if kinds else None


def decoding_cache(model, where: str = "--target"):
    """A transformers DynamicCache with one layer of the right kind per decoder layer of `model` (a HybridError
    naming `where` for a kind dflash does not decode)."""
    from transformers import DynamicCache

    check_layer_kinds(model.config, where)
    if not hasattr(DynamicCache, "activate_past_recording"):
        import transformers

        raise HybridError(f"{where}: decoding a target with {eager_reason(model)} needs transformers >= 5.25 (its "
                          f"cache records the linear layers' states for the rollback); this is {transformers.__version__}")
    return DynamicCache(config=model.config)


def record(cache, tokens: int) -> None:
    """Before a forward of `tokens` tokens that rollback() may cut: keep the recurrent state after each of them
    (0: a prefill or a one-token step, nothing to capture beyond the state before it)."""
    cache.activate_past_recording(recurrent_states_to_keep=int(tokens))


def rollback(cache, length: int, keep: int) -> None:
    """After a recorded forward that made the cache `length` positions long: keep the state after the first `keep`
    positions (keep <= length) in every layer, and drop the record (Cache.crop: a crop of 0 still trims the conv
    windows and sliding-window keys back to their working size)."""
    if not 0 <= keep <= length:
        raise ValueError(f"rollback to {keep} positions of a cache of {length}")
    cache.crop(keep - length)


def recorded_states(cache) -> int:
    """The number of recurrent states a linear-attention layer of the cache holds in its record (0 after rollback;
    tests read it)."""
    n = 0
    for layer in cache.layers:
        hist = getattr(layer, "recurrent_states_history", None)
        if hist:
            n = max(n, max(len(h) for h in hist.values()))
    return n


def layer_state(cache, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(conv window, recurrent state) of linear-attention layer i (tests compare them with a fresh run)."""
    layer = cache.layers[i]
    return layer.conv_states.get(0), layer.recurrent_states.get(0)


# ------------------------------------------------------------------------------------------------ batch rows
# The eager batch decoder (extract/generation/kind_engine.py) keeps rows left-padded to one width: the attention layers' keys
# right-aligned (padding columns masked by the 2D attention mask), the linear layers' states per row.


def _layer_kind(layer) -> str:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

    if isinstance(layer, (LinearAttentionLayer,)) and not isinstance(layer, DynamicLayer):
        return "linear"
    if isinstance(layer, DynamicSlidingWindowLayer):
        return "sliding"
    if type(layer) is DynamicLayer:
        return "full"
    raise TypeError(f"a decoding cache layer of type {type(layer).__name__} (not laid out by decoding_cache)")


def _left_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, t, D] padded with zeros on the left of dim 2 to n columns."""
    return torch.nn.functional.pad(x, (0, 0, n - x.shape[2], 0)) if x.shape[2] < n else x


def stack_rows(caches: list, width: int):
    """One cache holding the rows of `caches` in turn, each right-aligned to `width` columns (every cache's rows
    share its own width <= width: the positions before a row's first real token are padding)."""
    import copy

    out = copy.copy(caches[0])
    out.layers = []
    for layers in zip(*(c.layers for c in caches)):
        kind = _layer_kind(layers[0])
        new = copy.copy(layers[0])
        if kind == "linear":
            new.conv_states = {0: torch.cat([la.conv_states[0] for la in layers])}
            new.recurrent_states = {0: torch.cat([la.recurrent_states[0] for la in layers])}
            new.has_previous_state = {0: True}
            new.cumulative_length_linear = torch.tensor(width, dtype=torch.long, device=new.conv_states[0].device)
        else:
            keep = width if kind == "full" else min(width, layers[0].sliding_window - 1)
            new.keys = torch.cat([_left_pad(la.keys, keep) for la in layers])
            new.values = torch.cat([_left_pad(la.values, keep) for la in layers])
            if kind == "sliding":
                new.cumulative_length = width
        out.layers.append(new)
    return out


def select_rows(cache, rows: torch.Tensor, trim: int = 0) -> None:
    """Keep batch rows `rows` of every layer and drop the first `trim` columns (padding for every kept row), in
    place: full-attention keys lose those columns, a sliding-window layer keeps at most its new width, the linear
    layers' states (per row, of fixed size) only count the shorter width."""
    for layer in cache.layers:
        kind = _layer_kind(layer)
        if kind == "linear":
            layer.conv_states = {0: layer.conv_states[0][rows]}
            layer.recurrent_states = {0: layer.recurrent_states[0][rows]}
            layer.cumulative_length_linear = layer.cumulative_length_linear - trim
            continue
        keys, values = layer.keys[rows], layer.values[rows]
        if kind == "full":
            keys, values = keys[:, :, trim:], values[:, :, trim:]
        else:
            layer.cumulative_length -= trim
            width = min(keys.shape[2], layer.cumulative_length)
            keys, values = keys[:, :, keys.shape[2] - width:], values[:, :, values.shape[2] - width:]
        layer.keys, layer.values = keys, values
