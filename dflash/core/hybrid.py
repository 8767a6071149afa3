"""Packed rows through every kind of token-mixing layer a target has: each conversation sees only itself.

A packed row holds several conversations (doc ids 1, 2, ...; 0 = padding). A layer mixes tokens by one of:

    full_attention     causal attention: a document mask (a token attends to its own conversation, up to itself)
    sliding_attention  the same within the layer's window: kv > q - W (transformers' rule), as gpt-oss's even
                       layers and Mistral-style targets do; attention sinks (gpt-oss) are a per-head logit inside
                       the attention function and need no mask of their own
    linear_attention   Gated DeltaNet (Qwen3.5/3.6 and Qwen3.5-MoE: a causal depthwise convolution of kernel 4
                       and a recurrent state per head): the convolution's taps and the state restart at each
                       conversation (varlen_gated_delta_net). Other linear-attention modules (Qwen3-Next's fused
                       projections) run their own forward once per conversation, which is exact by construction.

Routed experts mix nothing across tokens. Any other kind is refused, naming it, before any work
(check_layer_kinds): dflash never writes features that serving would not produce.

    kinds = layer_kinds(cfg)                                # per decoder layer, from the config
    check_layer_kinds(cfg, "--target X")                    # HybridError naming an unsupported kind
    docs = DocLayout.of(doc_ids, host=doc_host)             # per forward: conv tap masks, segments, cu_seqlens
    with_documents(model, get_docs)                         # linear layers read get_docs() in each forward
    masks = attention_masks(cfg, doc_ids, impl)             # a mask per attention kind (bool / float / BlockMask)

How the Gated DeltaNet is separated (the same arithmetic as transformers' Qwen3_5GatedDeltaNet.forward without a
cache): the projections are per token; the convolution is written as K shifted products, each tap kept only where
token t - j is in t's conversation (identical to a conversation's own left-zero-padded convolution); the delta rule
runs per conversation: with flash-linear-attention on a GPU one varlen kernel over `cu_seqlens` (its Triton
`chunk_gated_delta_rule`, the kernel transformers itself calls when fla is installed), elsewhere transformers'
own chunked delta rule once per conversation (what a conversation run alone calls). Exact in float32 on CPU
(tests/test_hybrid_targets.py).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from dflash.core.errors import DflashError

ATTENTION_KINDS = ("full_attention", "sliding_attention")
SUPPORTED_KINDS = (*ATTENTION_KINDS, "linear_attention")
GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


class HybridError(DflashError, ValueError):
    """A target with a token-mixing layer dflash cannot run exactly (one line naming the kind)."""


def _text(cfg):
    return getattr(cfg, "text_config", None) or cfg


def layer_kinds(cfg) -> list[str]:
    """Each decoder layer's kind: the config's layer_types, else sliding_attention for every layer of a target with a
    sliding window (Mistral's layout), else full_attention."""
    c = _text(cfg)
    types = getattr(c, "layer_types", None)
    if types:
        return [str(t) for t in types][: c.num_hidden_layers]
    windowed = getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True) is not False
    return ["sliding_attention" if windowed else "full_attention"] * c.num_hidden_layers


def sliding_window(cfg) -> int | None:
    c = _text(cfg)
    w = getattr(c, "sliding_window", None)
    return int(w) if w else None


def check_layer_kinds(cfg, where: str, num_layers: int | None = None) -> list[str]:
    """The kinds of the first `num_layers` layers; a HybridError naming the first unsupported kind."""
    kinds = layer_kinds(cfg)[:num_layers]
    bad = sorted({k for k in kinds if k not in SUPPORTED_KINDS})
    if bad:
        first = kinds.index(bad[0])
        raise HybridError(f"{where}: layer type {bad[0]!r} (layer {first} of {_text(cfg).model_type}) is not supported: "
                          f"dflash separates packed conversations exactly in {', '.join(SUPPORTED_KINDS)} layers only")
    if "sliding_attention" in kinds and not sliding_window(cfg):
        raise HybridError(f"{where}: sliding_attention layers but no sliding_window in the config")
    return kinds


def is_hybrid(cfg) -> bool:
    """Whether any layer is not plain full attention (the forward then takes a mask per kind)."""
    return any(k != "full_attention" for k in layer_kinds(cfg))


# ------------------------------------------------------------------------------------------------ documents


@dataclass
class DocLayout:
    """Where a batch's conversations are. doc_ids [R, T] (0 = padding, each padding run its own segment).

    same_prev[j - 1][r, t]: token t - j of row r is in t's conversation (j = 1 .. taps - 1), for the convolution.
    segments: (row, start, stop) per maximal run of one doc id, in row-major order; cu_seqlens [S + 1] (int64, on
    the device; cu_seqlens_cpu its host copy) over the R*T tokens flattened, for a varlen kernel; chunk_indices
    [chunks, 2] (segment, chunk within it) of CHUNK tokens, what flash-linear-attention derives from cu_seqlens
    (given, it needs no host sync); real[s]: segment s is a conversation.

    `host` is doc_ids' host copy where the caller has one (extraction builds the rows on the host): with it the
    layout never waits for the GPU (a device-to-host copy of doc_ids would make the host idle until the previous
    forward ended, extract/run.py _rows_to_device); the device tensors go up through pinned memory, non-blocking."""

    doc_ids: torch.Tensor
    same_prev: list[torch.Tensor]
    segments: list[tuple[int, int, int]]
    real: list[bool]
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    chunk_indices: torch.Tensor

    CHUNK = 64  # flash-linear-attention's chunk of the gated delta rule

    @classmethod
    def of(cls, doc_ids: torch.Tensor, taps: int = 4, host: torch.Tensor | None = None) -> "DocLayout":
        R, T = doc_ids.shape
        same = []
        for j in range(1, taps):
            m = torch.zeros_like(doc_ids, dtype=torch.bool)
            m[:, j:] = doc_ids[:, j:] == doc_ids[:, :-j]
            same.append(m)
        host = torch.as_tensor(host) if host is not None else doc_ids.detach().to("cpu")
        change = torch.ones(R, T, dtype=torch.bool)
        change[:, 1:] = host[:, 1:] != host[:, :-1]
        starts = change.reshape(-1).nonzero().flatten()
        bounds = torch.cat([starts, torch.tensor([R * T])]).to(torch.int64)
        rows = (starts // T).tolist()
        segments = [(r, a - r * T, b - r * T) for r, a, b in zip(rows, starts.tolist(), bounds[1:].tolist())]
        real = (host.reshape(-1)[starts] != 0).tolist()
        lens = bounds[1:] - bounds[:-1]
        counts = (lens + cls.CHUNK - 1) // cls.CHUNK
        seg = torch.repeat_interleave(torch.arange(len(counts)), counts)
        within = torch.arange(len(seg)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        chunks = torch.stack([seg, within], 1).to(torch.int64)
        return cls(doc_ids, same, segments, real, _up(bounds, doc_ids.device), bounds, _up(chunks, doc_ids.device))


def _up(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, through pinned memory without blocking on a GPU."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def doc_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, docs: DocLayout) -> torch.Tensor:
    """A causal depthwise convolution of x [R, T, C] (weight [C, K]) whose taps stay in each token's conversation:
    out[t] = sum_j weight[:, K-1-j] * x[t-j] over the j with t - j in t's conversation (+ bias)."""
    K = weight.shape[-1]
    x = x.to(weight.dtype)
    out = x * weight[:, K - 1]
    for j in range(1, K):
        shifted = torch.zeros_like(x)
        shifted[:, j:] = x[:, :-j]
        out = out + shifted * docs.same_prev[j - 1][..., None] * weight[:, K - 1 - j]
    return out if bias is None else out + bias


def _fla_chunk_rule():
    """flash-linear-attention's varlen chunked gated delta rule, or None where it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001  (not installed, or no Triton on this machine)
        return None
    return chunk_gated_delta_rule


@functools.lru_cache(maxsize=None)
def _fla_takes(fla) -> frozenset:
    import inspect

    return frozenset(inspect.signature(fla).parameters)


def _fla_host_indices(fla, docs: DocLayout) -> dict:
    """The layout's host-built indices, for a flash-linear-attention version that takes them (0.6 does): without
    them it derives them from cu_seqlens with a device-to-host copy in every layer."""
    params = _fla_takes(fla)
    out = {}
    if "cu_seqlens_cpu" in params:
        out["cu_seqlens_cpu"] = docs.cu_seqlens_cpu
    if "chunk_indices" in params:
        out["chunk_indices"] = docs.chunk_indices
    return out


@torch.compiler.disable
def varlen_delta_rule(module, q, k, v, g, beta, docs: DocLayout) -> torch.Tensor:
    """The gated delta rule per conversation: [R, T, heads, d] in, [R, T, value heads, dv] out (padding: zeros)."""
    R, T = q.shape[:2]
    fla = _fla_chunk_rule() if q.is_cuda else None
    if fla is not None:
        flat = [t.reshape(1, R * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
        out, _ = fla(*flat[:3], g=flat[3], beta=flat[4], cu_seqlens=docs.cu_seqlens, use_qk_l2norm_in_kernel=True,
                     **_fla_host_indices(fla, docs))
        return out.reshape(R, T, *out.shape[2:])
    rule = getattr(sys.modules[type(module).__module__], "torch_chunk_gated_delta_rule")
    out = torch.zeros(*v.shape, dtype=q.dtype, device=q.device)
    for (r, a, b), real in zip(docs.segments, docs.real):
        if real:
            o, _ = rule(q[r:r + 1, a:b], k[r:r + 1, a:b], v[r:r + 1, a:b], g=g[r:r + 1, a:b], beta=beta[r:r + 1, a:b],
                        initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
            out[r, a:b] = o[0]
    return out


def gdn_heads(m, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
    """A Gated DeltaNet's delta-rule inputs, as Qwen3_5GatedDeltaNet.forward makes them after its convolution: the
    activated, convolved projections mixed [R, T, 2*key_dim + value_dim] split into q, k [R, T, Hk, Dk] and
    v [R, T, Hv, Dv], and from b, a [R, T, Hv] the write strength beta = sigmoid(b) and the log decay
    g = -exp(A_log) * softplus(a + dt_bias) (float32). Returns (q, k, v, g, beta)."""
    R, T, _ = mixed.shape
    q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.reshape(R, T, -1, m.head_k_dim)
    k = k.reshape(R, T, -1, m.head_k_dim)
    v = v.reshape(R, T, -1, m.head_v_dim)
    return q, k, v, -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias), b.sigmoid()


def varlen_gated_delta_net(module, hidden_states: torch.Tensor, docs: DocLayout) -> torch.Tensor:
    """Qwen3_5GatedDeltaNet.forward without a cache, each conversation of a packed row on its own (module docstring)."""
    R, T, _ = hidden_states.shape
    m = module
    mixed = m.in_proj_qkv(hidden_states)
    z = m.in_proj_z(hidden_states).reshape(R, T, -1, m.head_v_dim)
    b = m.in_proj_b(hidden_states)
    a = m.in_proj_a(hidden_states)
    conv = m.conv1d
    mixed = doc_conv(mixed, conv.weight.squeeze(1), conv.bias, docs)
    mixed = F.silu(mixed) if m.activation in ("silu", "swish") else _act(m.activation)(mixed)
    q, k, v, g, beta = gdn_heads(m, mixed.to(hidden_states.dtype), b, a)
    core = varlen_delta_rule(m, q, k, v, g, beta, docs)
    core = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(R, T, -1)
    return m.out_proj(core)


def _act(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@torch.compiler.disable
def per_conversation(forward: Callable, hidden_states: torch.Tensor, docs: DocLayout, **kwargs):
    """A mixer's own forward once per conversation ([1, n, D] each, no cache): exact for any layer whose output
    depends on its own conversation only. Outside any compiled graph: the conversations are data."""
    out = torch.zeros_like(hidden_states)
    for (r, a, b), real in zip(docs.segments, docs.real):
        if real:
            o = forward(hidden_states[r:r + 1, a:b], **kwargs)
            out[r, a:b] = (o[0] if isinstance(o, tuple) else o)[0]
    return out


def linear_mixers(model) -> list[torch.nn.Module]:
    """The linear-attention modules of a model's decoder layers (their `linear_attn`)."""
    from dflash.core.target import decoder_layers

    return [layer.linear_attn for layer in decoder_layers(model) if getattr(layer, "linear_attn", None) is not None]


def with_documents(model, get_docs: Callable[[], DocLayout | None]) -> int:
    """Makes each linear-attention layer of `model` keep packed conversations apart: while get_docs() returns a
    layout, the layer runs per conversation (varlen_gated_delta_net for the Qwen3.5 form, its own forward per
    conversation otherwise); with None it runs its own forward. Returns how many layers it wrapped."""
    mixers = linear_mixers(model)
    for mod in mixers:
        if getattr(mod, "_dflash_documents", False):
            continue
        own = mod.forward
        gdn = all(hasattr(mod, part) for part in GDN_PARTS)

        def forward(hidden_states, *args, _own=own, _mod=mod, _gdn=gdn, **kwargs):
            docs = get_docs()
            if docs is None or kwargs.get("cache", kwargs.get("cache_params")) is not None:
                return _own(hidden_states, *args, **kwargs)
            if _gdn:
                return varlen_gated_delta_net(_mod, hidden_states, docs)
            return per_conversation(_own, hidden_states, docs)

        mod.forward = forward
        mod._dflash_documents = True
    return len(mixers)


# ------------------------------------------------------------------------------------------------ attention masks


def document_mask(doc_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """bool [R, T, T], True = attend: causal within each document (padding attends to padding), and with a window
    only the last `window` positions (kv > q - window)."""
    T = doc_ids.shape[1]
    idx = torch.arange(T, device=doc_ids.device)
    allowed = idx[None, :] <= idx[:, None]
    if window:
        allowed = allowed & (idx[None, :] > idx[:, None] - window)
    return (doc_ids[:, :, None] == doc_ids[:, None, :]) & allowed


def document_block_mask(doc_ids: torch.Tensor, window: int | None = None):
    """The flex_attention BlockMask of document_mask (cross-document blocks skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    R, T = doc_ids.shape

    if window:
        def mask_mod(b, h, q, kv):
            return (kv <= q) & (kv > q - window) & (doc_ids[b, q] == doc_ids[b, kv])
    else:
        def mask_mod(b, h, q, kv):
            return (kv <= q) & (doc_ids[b, q] == doc_ids[b, kv])

    return create_block_mask(mask_mod, R, None, T, T, device=doc_ids.device)


def attention_masks(cfg, doc_ids: torch.Tensor, impl: str, dtype=torch.float32):
    """The attention_mask a packed forward passes: one tensor for a target of plain full attention (as before), else
    {kind: mask} for each attention kind of its layers (transformers' per-kind masks; linear layers take None).
    impl: "flex" (BlockMask), "eager" (additive float [R, 1, T, T]: 0 or dtype's min) or "sdpa" (bool)."""
    kinds = set(layer_kinds(cfg))
    window = sliding_window(cfg)

    def make(w):
        if impl == "flex":
            return document_block_mask(doc_ids, w)
        m = document_mask(doc_ids, w)[:, None]
        if impl == "eager":
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
        return m

    if kinds == {"full_attention"}:
        return make(None)
    if not getattr(_text(cfg), "layer_types", None):  # one kind for every layer, and a model that takes one mask
        return make(window if kinds == {"sliding_attention"} else None)
    masks: dict = {}
    if "full_attention" in kinds:
        masks["full_attention"] = make(None)
    if "sliding_attention" in kinds:
        masks["sliding_attention"] = make(window)
    if "linear_attention" in kinds:
        masks["linear_attention"] = None
    return masks
