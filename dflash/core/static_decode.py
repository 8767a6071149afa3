"""The target's decode over a static KV cache, replayable as CUDA graphs: what `regenerate`, `prompts` and `eval` run
on a GPU (the HF model's own forward stays the CPU path and the reference).

A decode step of a small target is bound by kernel launches, not by the GPU: SmolLM2-135M's eager step took ~20 ms
on an H200 at batch 1 for well under a millisecond of memory traffic. Here every shape of a step is fixed, so the
step is captured once as a CUDA graph and replayed as one launch:

  * the cache: per layer, keys and values of `slots` rows x `max_len` positions, [slots, Hkv, max_len, D]. Row r's
    token at position p lives at column p of slot r (no padding before a row: its prompt starts at column 0);
  * a step feeds q tokens to each of the first n slots at each slot's own start position (a [n] tensor): their keys
    and values are written at columns start..start+q-1, and query j of a row sees the columns <= start + j of its
    own slot. Columns past that are never read, so nothing needs cropping: a rejected draft is simply overwritten;
  * the step attends over the first S columns only, S a multiple of `bucket`: one graph per (n, q, S), captured on
    first use (or all beforehand: prepare) and replayed after. Its attention is a plain softmax(q k^T) v with
    grouped query heads folded onto their KV head ([n, Hkv, G*q, D] against [n, Hkv, S, D]), so the cache is read
    in place, never repeated per head (SDPA's masked kernels took ~45 us a layer for a one-token query on the H200);
  * a batched one-token step on a GPU (regenerate's and prompts' decode: at least VARLEN_MIN_ROWS rows, bf16 or
    fp16) can read each row's own columns only (_varlen_attend), with dflash.core.decode_attention's Triton kernel
    (a tile of the G query heads of a (row, KV head), the columns split when the rows are few) or flash
    attention's variable-length kernel (every (row, KV head) a sequence of its own, its cache row a segment of the
    flat buffer): each checked against _attend once per process, the faster of the two on this GPU taken
    (varlen_kernel). Rows of unequal lengths then cost their own columns, not the longest row's bucket (the span);
  * a step is bound by its kernel count, not by bytes: q, k and v come from one matmul (the three projections
    stacked once, a copy of those weights), the rotary embedding of q and k is applied at once (rotate_half's sign
    folded into the sin table) and the norms use torch's rms_norm (bench/decode.py, BENCHMARKS.md "Decoding at
    serving speed");
  * on a GPU each layer of a step runs as two compiled functions (fused_layers: everything before the cache write,
    everything after), the norms, rotary, softmax, residuals and gated MLP's pointwise work fused by inductor: ~10
    kernels a layer instead of ~33 (1.41 against 2.52 ms a recipe step at batch 1); the weights are arguments and
    the shapes symbolic, so one compiled pair serves every layer, bucket and decoder of a process (a handful of
    variants: one row or several, one token or several, the dtype; FUSED_RECOMPILE_LIMIT bounds them);
  * prefill (a new row's prompt, any length) runs the same layers eagerly, causal within the prompt, and writes the
    prompt's keys and values into the row's slot.

The layers are the HF model's own modules (norms, projections, MLP, embedding, LM head, rotary frequencies); only
the attention and its cache are this module's. Supported: the Llama family of decoder layers (Llama, Qwen2,
Qwen3 with its q/k norms, Mistral without a sliding window) with full attention and a static rotary embedding, and
Qwen3.5 / 3.6 hybrids (Gated DeltaNet + gated full attention, dflash.core.static_hybrid's HybridDecoder, whose
linear states a verify records and accept() rolls back); dflash.core.static's static_decoder(model) builds the one a
model needs and its unsupported(model) names what stops any other model (experts, sliding windows), whose callers
keep the HF forward.
"""

from __future__ import annotations

import torch

from .target import decoder_layers

SUPPORTED_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer")
HYBRID_LAYERS = ("Qwen3_5DecoderLayer",)  # Gated DeltaNet + gated full attention: dflash.core.static_hybrid


def unsupported(model) -> str | None:
    """None when StaticDecoder can run `model`, else why not (in words). Callers ask dflash.core.static, which also
    knows the hybrid decoder."""
    try:
        layers = decoder_layers(model)
    except Exception as e:  # noqa: BLE001 - any model without a layer list is simply not supported
        return str(e)
    kinds = {type(layer).__name__ for layer in layers}
    if kinds <= set(HYBRID_LAYERS):
        return "linear-attention layers (dflash.core.static_hybrid's HybridDecoder runs them)"
    if not kinds <= set(SUPPORTED_LAYERS):
        return f"decoder layers of type {sorted(kinds - set(SUPPORTED_LAYERS))[0]}"
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if set(getattr(cfg, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        from dflash.core.decode_state import eager_reason

        return eager_reason(model) or "sliding-window layers"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and \
            type(layers[0]).__name__ == "MistralDecoderLayer":
        return "a sliding window"
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding module"
    if str(getattr(rotary, "rope_type", "default")) in ("dynamic", "longrope"):
        return f"a {rotary.rope_type} rotary embedding (its frequencies depend on the length)"
    if getattr(model, "lm_head", None) is None or getattr(base, "embed_tokens", None) is None:
        return "no embed_tokens / lm_head"
    return None


def fusable(layers, cfg) -> str | None:
    """None when every layer is of the plain kind fused_layers computes (RMS norms, SiLU gated MLP without biases),
    else what is not."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"the activation {cfg.hidden_act}"
    for layer in layers:
        mlp = layer.mlp
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP without gate/up/down projections"
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP biases"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if hasattr(layer.self_attn, "q_norm"):
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        if any(getattr(m, "variance_epsilon", None) is None or getattr(m, "weight", None) is None for m in norms):
            return "norms other than RMSNorm"
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: weight * (x in float32 / rms).to(x's dtype)."""
    return weight * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _project(h, qkv_w, qkv_b, qk_norm, cos, sin, heads: int, kv_heads: int):
    """The attention inputs of normed h [n, q, H]: q, k and v in one matmul (the projections stacked), the q/k norms
    (Qwen3; qk_norm = (q weight, k weight, eps) or None), the rotary embedding of q and k at once (rotate_half(t) =
    roll(t, D/2) * [-1]*D/2 + [1]*D/2, the sign folded into sin). Returns q [n, q, Hq, D], k and v [n, q, Hkv, D]."""
    n, q, _ = h.shape
    t = torch.nn.functional.linear(h, qkv_w, qkv_b)
    D = t.shape[-1] // (heads + 2 * kv_heads)
    t = t.view(n, q, heads + 2 * kv_heads, D)
    qk = t[:, :, :heads + kv_heads]
    if qk_norm is not None:
        qw, kw, qk_eps = qk_norm
        qk = torch.cat([_rms(qk[:, :, :heads], qw, qk_eps), _rms(qk[:, :, heads:], kw, qk_eps)], 2)
    qk = qk * cos[:, :, None] + qk.roll(D // 2, -1) * sin[:, :, None]
    return qk[:, :, :heads], qk[:, :, heads:], t[:, :, heads + kv_heads:]


def _fold(qs, kv_heads: int):
    """Queries [n, q, Hq, D] folded onto their KV head: [n, Hkv, G*q, D], row g*q + j = head kv*G + g, token j."""
    n, q, heads, D = qs.shape
    return qs.transpose(1, 2).reshape(n, kv_heads, (heads // kv_heads) * q, D)


def _attend(g, kc, vc, mask, scaling: float, q: int):
    """A plain softmax(q k^T) v of the folded queries g over the cache's first columns kc, vc [n, Hkv, S, D]
    (float32 scores; mask [n, 1, G*q, S]: what each query row sees): SDPA's masked kernels spend ~45 us on a
    one-token query (the H200). Returns [n, q, Hq * D]."""
    n, Hk, _, D = g.shape
    scores = torch.matmul(g, kc.transpose(-1, -2)).float().mul_(scaling).masked_fill_(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(g.dtype), vc)  # [n, Hk, G*q, D]
    heads = out.shape[2] // q * Hk
    return out.view(n, heads, q, D).transpose(1, 2).reshape(n, q, heads * D)


def _layer_pre(x, ln_w, eps: float, qkv_w, qkv_b, qk_norm, cos, sin, heads: int, kv_heads: int):
    """A step's layer up to its cache write: the norm, then _project. Returns (the queries folded, keys, values)."""
    qs, ks, vs = _project(_rms(x, ln_w, eps), qkv_w, qkv_b, qk_norm, cos, sin, heads, kv_heads)
    return _fold(qs, kv_heads).clone(memory_format=torch.contiguous_format), ks, vs


def _layer_post(x, g, k, v, mask, scaling: float, o_w, o_b, ln_w, eps: float, gate_w, up_w, down_w):
    """A step's layer after its cache write: _attend over the first mask.shape[-1] columns of the rows' caches k, v
    (the layer's whole buffers [slots, Hkv, max_len + 1, D]: sliced here, so that a step's inputs have the same layout
    whatever its span), the output projection, the residual, the gated MLP and its residual."""
    n, span = x.shape[0], mask.shape[-1]
    return _layer_out(x, _attend(g, k[:n, :, :span], v[:n, :, :span], mask, scaling, x.shape[1]), o_w, o_b, ln_w,
                      eps, gate_w, up_w, down_w)


def _layer_out(x, att, o_w, o_b, ln_w, eps: float, gate_w, up_w, down_w):
    """A step's layer after its attention att [n, q, Hq * D]: the output projection, the residual, the gated MLP and
    its residual."""
    x = x + torch.nn.functional.linear(att, o_w, o_b)
    h = _rms(x, ln_w, eps)
    act = torch.nn.functional.silu(torch.nn.functional.linear(h, gate_w)) * torch.nn.functional.linear(h, up_w)
    return x + torch.nn.functional.linear(act, down_w)


# A one-token step over at least this many rows reads each row's own columns (_varlen_attend); fewer rows (eval's
# batch 1) keep _attend, whose span is then the row's own length rounded up to a bucket anyway.
VARLEN_MIN_ROWS = 8


VARLEN_KERNELS = ("triton", "flash")  # the kernels of a varlen step, in the order tried (decode_attention, flash's)


def _varlen_lengths(kernel: str, start: torch.Tensor, n: int, kv_heads: int, groups: int, columns: int, span: int):
    """What `kernel` needs to read each row's own columns in a one-token step over rows 0..n-1 at positions start [n]:
    used[r] = start[r] + 1 columns of row r (at most span: a row past the step's `end` is not one the step serves,
    e.g. a free slot with a stale position), int32. triton: (kernel, used). flash: sequence b = row * kv_heads +
    head, its G queries from q offset b*G (cu_q), its keys at offset b * columns of the layer's flat buffer (cu_k:
    row r's slot, head h's plane): (kernel, cu_q, cu_k, used per sequence). Computed once per step, on the device
    (inside a captured graph)."""
    used = (start[:n] + 1).clamp(max=span).to(torch.int32)
    if kernel == "triton":
        return kernel, used
    b = torch.arange(n * kv_heads + 1, dtype=torch.int32, device=start.device)
    return kernel, b * groups, b * columns, used.repeat_interleave(kv_heads)


def _varlen_attend(g, k, v, lengths, span: int, scaling: float):
    """The attention of folded one-token queries g [n, Hkv, G, D] over each row's own first `used` columns of the
    layer's whole buffers k, v [slots, Hkv, C, D] (read in place), with `lengths` = _varlen_lengths(kernel, ..):
    triton, dflash.core.decode_attention's kernel; flash, flash attention's variable-length kernel over the
    buffers viewed flat as slots*Hkv sequences of C columns, one head each. span bounds every row's length.
    Returns [n, 1, Hq * D], head kv*G + g, as _attend."""
    n, Hk, G, D = g.shape
    if lengths[0] == "triton":
        from . import decode_attention

        return decode_attention.attend(g, k, v, lengths[1], span, scaling).view(n, 1, Hk * G * D)
    _, cu_q, cu_k, used = lengths
    out = _flash_varlen(g.reshape(n * Hk * G, 1, D), k.view(-1, 1, D), v.view(-1, 1, D), cu_q, cu_k, G, span, 0.0,
                        False, False, scale=scaling, seqused_k=used)[0]
    return out.view(n, 1, Hk * G * D)


def _flash_varlen(*args, **kwargs):
    """torch's flash-attention forward (variable lengths: cu_seqlens, seqused_k), CUDA only."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


_VARLEN: dict[tuple, str | None] = {}  # (device, dtype, head dim, G, KV heads) -> the varlen kernel (None: none)


def varlen_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, groups: int, kv_heads: int) -> str | None:
    """The kernel this process's batched one-token steps read each row's own columns with, or None (they attend
    over the span): on a CUDA device in bf16 or fp16, each of VARLEN_KERNELS that runs here and gives _attend's
    output (checked once per process and shape); of two, the faster on a step of this shape (512 rows of 1-1,024
    columns, timed once). A kernel that errs or differs is left out, with a note."""
    key = (str(device), dtype, int(head_dim), int(groups), int(kv_heads))
    if key not in _VARLEN:
        ok = []
        if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0 \
                and head_dim <= 256:
            for kernel in VARLEN_KERNELS:
                why = _varlen_unsupported(kernel, head_dim, groups)
                if why is None:
                    try:
                        why = None if _varlen_check(kernel, device, dtype, head_dim, groups, kv_heads) else \
                            "its output differs from the plain attention's"
                    except Exception as e:  # noqa: BLE001  (a torch or Triton that refuses these inputs)
                        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                if why is None:
                    ok.append(kernel)
                elif kernel == "flash" or why != "no Triton in this install":
                    print(f"static decoder: note: the {kernel} variable-length attention is off ({why[:200]})",
                          flush=True)
        if len(ok) > 1:
            secs = {}
            for kernel in ok:
                try:
                    secs[kernel] = _varlen_time(kernel, device, dtype, head_dim, groups, kv_heads)
                except Exception:  # noqa: BLE001  (it ran in the check: a failure here leaves the other)
                    secs[kernel] = float("inf")
            ok.sort(key=secs.get)
        _VARLEN[key] = ok[0] if ok else None
        if not ok and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
            print("static decoder: note: no variable-length attention runs here; batched steps attend over the "
                  "longest row's columns", flush=True)
    return _VARLEN[key]


def _varlen_unsupported(kernel: str, head_dim: int, groups: int) -> str | None:
    if kernel == "triton":
        from . import decode_attention

        return decode_attention.supported(head_dim, groups)
    return None


def _varlen_inputs(device, dtype, D: int, G: int, Hk: int, n: int, C: int, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    g = torch.randn(n, Hk, G, D, generator=gen).to(device, dtype)
    k, v = (torch.randn(n + 2, Hk, C, D, generator=gen).to(device, dtype) for _ in range(2))
    start = torch.randint(0, C - 1, (n,), generator=gen).to(device)
    return g, k, v, start


@torch.inference_mode()
def _varlen_check(kernel: str, device, dtype, D: int, G: int, Hk: int) -> bool:
    """_varlen_attend with `kernel` against _attend on random rows of unequal lengths (with one of a single column
    and one of the whole span), few rows (the Triton kernel's columns split) and many."""
    for n, C in ((5, 1100), (300, 200)):
        g, k, v, start = _varlen_inputs(device, dtype, D, G, Hk, n, C)
        start[0], start[1] = 0, C - 2
        span = C - 1
        mask = (torch.arange(span, device=device)[None] <= start[:, None])[:, None, None].expand(n, 1, G, span)
        want = _attend(g, k[:n, :, :span], v[:n, :, :span], mask, 0.125, 1)
        got = _varlen_attend(g, k, v, _varlen_lengths(kernel, start, n, Hk, G, C, span), span, 0.125)
        if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
            return False
    return True


@torch.inference_mode()
def _varlen_time(kernel: str, device, dtype, D: int, G: int, Hk: int) -> float:
    """Seconds a call of _varlen_attend with `kernel` takes on 512 rows of 1-1,024 columns (after a warm-up)."""
    g, k, v, start = _varlen_inputs(device, dtype, D, G, Hk, 512, 1025, seed=1)
    lengths = _varlen_lengths(kernel, start, 512, Hk, G, 1025, 1024)
    for _ in range(3):
        _varlen_attend(g, k, v, lengths, 1024, 0.125)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        _varlen_attend(g, k, v, lengths, 1024, 0.125)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 10e3


_FUSED = None
# The compiled variants fused_layers may hold per function in one process. Its shapes are symbolic from the first
# call, so a variant is one of: one row or several, one token or several, one slot or several, per dtype (and per
# kind of model: q/k norms, biases): a process that regenerates, then evaluates in bf16 and float32 (the GPU recipe)
# needs ~12, past torch's default of 8 (which stopped the recipe's eval). A variant compiles once, before the
# steps that use it are captured.
FUSED_RECOMPILE_LIMIT = 64


def _limited(fn):
    """fn called with torch's recompile limit raised to FUSED_RECOMPILE_LIMIT for its own compilations only (the
    rest of the process keeps its limit). The patch runs where fn is called eagerly; a captured step replays
    without it."""
    import torch._dynamo

    def call(*args):
        with torch._dynamo.config.patch(recompile_limit=FUSED_RECOMPILE_LIMIT):
            return fn(*args)
    return call


_FUSED_FAILED: str | None = None  # why fused_layers failed to compile in this process (its decoders then do not fuse)


def _fused_failed(e: Exception) -> None:
    global _FUSED_FAILED
    if _FUSED_FAILED is None:
        _FUSED_FAILED = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        print(f"static decoder: note: the fused layers failed to compile ({_FUSED_FAILED}); this process decodes "
              "with the HF modules' layers instead (the same results, slower)", flush=True)


def fused_layers():
    """(pre, post, out): _layer_pre, _layer_post and _layer_out (post without its attention) through torch.compile,
    built once per process. The weights are arguments, so one compiled graph serves every layer. Its first call
    compiles for static shapes; a size that then changes (rows, tokens, columns) becomes symbolic in a second compile
    (torch's automatic dynamic shapes), so no later bucket or batch size compiles again (FUSED_RECOMPILE_LIMIT) while
    the model's own sizes (heads, head and hidden widths) stay constants. Marking every size dynamic instead made the
    pre-attention kernels index with symbolic widths: at the coder shape (830 rows), a regeneration step took 4.83 ms
    against 3.88 ms (BENCHMARKS.md "Coder recipe")."""
    global _FUSED
    if _FUSED is None:
        _FUSED = tuple(_limited(torch.compile(f, fullgraph=True, dynamic=None))
                       for f in (_layer_pre, _layer_post, _layer_out))
    return _FUSED


class StaticDecoder:
    """The target over a static KV cache (module docstring). Inputs and outputs of graphed steps live in static
    buffers: the tensors step() returns are valid until the next step.

    layer_ids: the layers whose outputs step()/prefill() also return, concatenated ([.., K*H]; layer id i = the
    output of decoder layer i, the last layer after the final norm, as dflash.core.target.LayerCapture does)."""

    def __init__(self, model, slots: int, max_len: int, layer_ids: list[int] | None = None, bucket: int = 256,
                 graphs: bool = True, max_q: int = 16, fused: bool | None = None, varlen: bool | str | None = None):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the static decoder cannot run this model: {why}")
        self.layers = decoder_layers(model)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._init_cache(model, getattr(model, "model", model), cfg, self.layers[0].self_attn, slots, max_len, bucket,
                         layer_ids)
        self._qkv = []  # per layer: q, k and v projections stacked (one matmul; a copy of those weights)
        for layer in self.layers:
            a = layer.self_attn
            w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
            b = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
            self._qkv.append((w, b))
        # a step's layers as two compiled functions each (fused_layers): the pointwise work fused, one set of kernels
        # for every layer and every shape; the HF modules' eager path where the layers are not the plain kind
        # (None: on a GPU; on a CPU compiling costs more than it saves, and the HF modules are the reference)
        fused = self.device.type == "cuda" if fused is None else fused
        self.fused = bool(fused) and fusable(self.layers, cfg) is None and _FUSED_FAILED is None
        self._init_steps(graphs, max_q, varlen)

    def _init_cache(self, model, base, cfg, attn, slots: int, max_len: int, bucket: int,
                    layer_ids: list[int] | None) -> None:
        """The set-up every static decoder shares, once self.layers is set: the model and its decoder stack (base:
        embed_tokens, norm, rotary_emb), the attention's shape (attn: an attention module), the slots and their
        positions, the key and value buffers (_buffers), the captured layers and the rotary tables."""
        self.model, self.base = model, base
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.hidden_size = cfg.hidden_size
        self.head_dim = attn.head_dim
        self.kv_heads = cfg.num_key_value_heads
        self.heads = cfg.num_attention_heads
        self.groups = self.heads // self.kv_heads
        self.slots, self.bucket = int(slots), int(bucket)
        self.max_len = -(-int(max_len) // self.bucket) * self.bucket
        self.k, self.v = self._buffers(), self._buffers()
        L = len(self.layers)
        self.layer_ids = list(layer_ids or [])
        self._final_norm_for = L - 1 if (L - 1) in self.layer_ids else None
        self._tables()

    def _init_steps(self, graphs: bool, max_q: int, varlen: bool | str | None) -> None:
        """The step machinery every static decoder shares: graphs on or off, the varlen kernel, the graph table and
        the step's static inputs."""
        self.graphs_on = graphs and self.device.type == "cuda"
        # batched one-token steps read each row's own columns (_varlen_attend) with the kernel varlen_kernel picks
        # (None), none (False), or the one named (tests: "flash" with a CPU stand-in for _flash_varlen, "triton"
        # in Triton's interpreter)
        if varlen is None:  # (a decoder of fewer slots never takes a varlen step: eval's)
            varlen = varlen_kernel(self.device, self.dtype, self.head_dim, self.groups, self.kv_heads) \
                if self.slots >= VARLEN_MIN_ROWS else False
        self.varlen_kernel = varlen if varlen in VARLEN_KERNELS else None
        if varlen not in (None, False) and self.varlen_kernel is None:
            raise ValueError(f"varlen={varlen!r}: one of {VARLEN_KERNELS}, None or False")
        self.varlen = self.varlen_kernel is not None
        # (n, q, span, all logits, varlen, record) -> (graph, logits, hidden)
        self._graphs: dict[tuple[int, int, int, bool, bool, bool], tuple] = {}
        self._pool = None
        self._ids = torch.zeros((self.slots, max_q), dtype=torch.long, device=self.device)  # step inputs (static)
        self._start = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self.captures = 0
        self.shapes: set[tuple[int, int, int, bool]] = set()  # the (n, q, span, all logits) steps run so far

    def _buffers(self) -> list[torch.Tensor]:
        """Per layer, a cache buffer [slots, Hkv, max_len + 1, D]. The column past max_len is never written nor
        read: a step's span is then always a strict slice of the buffer, so the compiled layers see one layout
        whether or not the span reaches max_len (else each case is a variant of its own)."""
        shape = (self.slots, self.kv_heads, self.max_len + 1, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    def _tables(self) -> None:
        """cos/sin of every position [max_len, D], as the HF rotary module computes them, and the column ids."""
        rot = self.base.rotary_emb
        pos = torch.arange(self.max_len, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * rot.inv_freq.to(device=self.device, dtype=torch.float32)[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(getattr(rot, "attention_scaling", 1.0))
        self.cos = (emb.cos() * scale).to(self.dtype)
        half = emb.shape[-1] // 2
        sign = torch.cat([-torch.ones(half, device=self.device), torch.ones(half, device=self.device)])
        self.sin = (emb.sin() * scale).to(self.dtype) * sign.to(self.dtype)  # rotate_half's sign folded in
        self.cols = torch.arange(self.max_len, device=self.device)

    @torch.inference_mode()
    def grow(self, max_len: int) -> None:
        """At least max_len positions per slot (rounded up to a bucket): the cache is copied into larger buffers and
        the captured graphs, which read the old ones, are dropped (the next steps capture again)."""
        new = -(-int(max_len) // self.bucket) * self.bucket
        if new <= self.max_len:
            return
        for buf in (self.k, self.v):
            for i, old in enumerate(buf):  # one layer at a time: the old buffer goes before the next one grows
                t = old.new_zeros(old.shape[:2] + (new + 1, old.shape[3]))  # _buffers' layout
                t[:, :, :self.max_len] = old[:, :, :self.max_len]
                buf[i] = t
        self.max_len = new
        self._tables()
        self._graphs.clear()
        self._pool = None

    # -- the layers ------------------------------------------------------------------------------------------------
    def _norm(self, module, x: torch.Tensor) -> torch.Tensor:
        """The HF RMSNorm `module` on x (_rms: fewer kernels than the module's six elementwise ones, a decode step
        being bound by launches); any other norm module as it is."""
        eps = getattr(module, "variance_epsilon", None)
        return module(x) if eps is None else _rms(x, module.weight, eps)

    @staticmethod
    def _qk_norm(a):
        """_project's qk_norm of attention module a: (q weight, k weight, eps) for Qwen3's q/k norms, else None."""
        return (a.q_norm.weight, a.k_norm.weight, a.q_norm.variance_epsilon) if hasattr(a, "q_norm") else None

    def _write_step(self, i: int, ks: torch.Tensor, vs: torch.Tensor, cols: torch.Tensor) -> None:
        """A step's keys and values [n, q, Hkv, D] into layer i's cache, row r's at its columns cols[r]."""
        n, q = cols.shape
        r = torch.arange(n, device=cols.device)[:, None].expand(n, q)
        self.k[i][r, :, cols] = ks  # advanced indices first: [n, q, Hk, D]
        self.v[i][r, :, cols] = vs

    def varlen_step(self, n: int, q: int) -> bool:
        """Whether a step of n rows of q tokens reads each row's own columns (_varlen_attend) rather than span."""
        return self.varlen and q == 1 and n >= VARLEN_MIN_ROWS

    def _attention(self, i: int, layer, x: torch.Tensor, cos, sin, rows, start, span: int | None, cols, mask):
        """Self-attention of layer i for x [n, q, H] at positions start[r]+j. span=None: a prefill (rows' columns
        0..q-1, causal within x); else a step over the first `span` columns of the cache (cols [n, q]: the columns
        the step writes; mask [n, 1, G*q, span]: what each folded query row sees, or a varlen step's lengths
        (_varlen_lengths) in its place)."""
        a = layer.self_attn
        n, q, _ = x.shape
        w, b = self._qkv[i]
        qs, ks, vs = _project(x, w, b, self._qk_norm(a), cos, sin, self.heads, self.kv_heads)
        if span is None:
            self.k[i][rows, :, :q] = ks.transpose(1, 2)
            self.v[i][rows, :, :q] = vs.transpose(1, 2)
            out = torch.nn.functional.scaled_dot_product_attention(
                qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), is_causal=True, scale=a.scaling,
                enable_gqa=self.heads != self.kv_heads)
            out = out.transpose(1, 2).reshape(n, q, -1)
        else:
            self._write_step(i, ks, vs, cols)
            if isinstance(mask, tuple):
                out = _varlen_attend(_fold(qs, self.kv_heads), self.k[i], self.v[i], mask, span, a.scaling)
            else:
                out = _attend(_fold(qs, self.kv_heads), self.k[i][:n, :, :span], self.v[i][:n, :, :span], mask,
                              a.scaling, q)
        return a.o_proj(out)

    def _fused_layer(self, i: int, layer, x: torch.Tensor, cos, sin, span: int, cols, mask) -> torch.Tensor:
        """Decoder layer i of a step through the compiled functions (fused_layers): what _attention and the HF MLP
        compute, the cache written between the two halves."""
        a, mlp = layer.self_attn, layer.mlp
        pre, post, out = fused_layers()
        w, b = self._qkv[i]
        g, ks, vs = pre(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, w, b,
                        self._qk_norm(a), cos, sin, self.heads, self.kv_heads)
        self._write_step(i, ks, vs, cols)
        rest = (a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.variance_epsilon, mlp.gate_proj.weight, mlp.up_proj.weight,
                mlp.down_proj.weight)
        if isinstance(mask, tuple):  # a varlen step: the kernel between the compiled halves
            return out(x, _varlen_attend(g, self.k[i], self.v[i], mask, span, a.scaling), *rest)
        return post(x, g, self.k[i], self.v[i], mask, a.scaling, *rest)

    def _forward(self, ids, rows, start, span, keep, varlen: bool = False, record: bool = False):
        """(logits, hidden) for ids [n, q]; keep: the position per row whose logits to return ([n] tensor), or
        None for all positions; varlen: a step that reads each row's own columns (step() decides); record: unused
        (a dense target has no state to record)."""
        n, q = ids.shape
        pos = start[:, None] + torch.arange(q, device=ids.device)[None]
        cos, sin = self.cos[pos], self.sin[pos]
        cols = mask = None
        if span is not None:
            cols = pos  # a row's tokens go to the columns of their positions
            if varlen:
                mask = _varlen_lengths(self.varlen_kernel, start, n, self.kv_heads, self.groups, self.k[0].shape[2],
                                       span)
            else:
                seen = self.cols[:span][None, None, :] <= cols[:, :, None]  # [n, q, span]
                mask = seen[:, None].expand(n, self.groups, q, span).reshape(n, 1, self.groups * q, span)
        x = self.base.embed_tokens(ids)
        H = self.hidden_size
        hidden = torch.empty(n, q, len(self.layer_ids) * H, dtype=self.dtype, device=ids.device) \
            if self.layer_ids else None
        for i, layer in enumerate(self.layers):
            if self.fused and span is not None:
                x = self._fused_layer(i, layer, x, cos, sin, span, cols, mask)
            else:
                x = x + self._attention(i, layer, self._norm(layer.input_layernorm, x), cos, sin, rows, start, span,
                                        cols, mask)
                x = x + layer.mlp(self._norm(layer.post_attention_layernorm, x))
            if hidden is not None and i in self.layer_ids:
                k = self.layer_ids.index(i)
                hidden[..., k * H:(k + 1) * H] = self._norm(self.base.norm, x) if i == self._final_norm_for else x
        x = self._norm(self.base.norm, x)
        if keep is not None:
            x = x[torch.arange(n, device=ids.device), keep][:, None]
        return self.model.lm_head(x), hidden

    # -- the entry points ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor | None = None,
                all_logits: bool = False):
        """Prompts ids [k, w] (right-padded; lengths [k], None: all w) into slots `rows` [k] at columns 0..w-1
        (eager). Returns (logits, hidden): logits [k, 1, V] at each prompt's last token (all_logits: [k, w, V]);
        hidden [k, w, K*H] or None. Padding past a prompt's length is written but never attended to (a later
        step writes its own tokens over it)."""
        k, w = ids.shape
        if w > self.max_len:
            raise ValueError(f"a prompt of {w} tokens does not fit the decoder's {self.max_len} positions")
        start = torch.zeros(k, dtype=torch.long, device=ids.device)
        keep = None if all_logits else (lengths.to(ids.device) - 1 if lengths is not None
                                         else torch.full((k,), w - 1, dtype=torch.long, device=ids.device))
        return self._forward(ids, rows.to(ids.device), start, None, keep)

    def span_for(self, end: int) -> int:
        """The columns a step whose last token sits at position end-1 attends over: end rounded up to a bucket."""
        return min(self.max_len, -(-end // self.bucket) * self.bucket)

    # A dense target's state is its keys and values only: a step past a rejected draft simply writes over them, so
    # there is nothing to record and nothing to accept (dflash.core.static_hybrid's decoder has recurrent states).
    recurrent = False

    def _records(self, q: int, record: bool | None) -> bool:
        """Whether a step of q tokens keeps the state after each of them for accept()."""
        return False

    def accept(self, keep, n: int = 1) -> None:
        """After a recorded step of rows 0..n-1: keep its first `keep` tokens per row (an int or a [n] tensor on the
        device). A dense target's keys past them are never read: nothing to do."""

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, start: torch.Tensor, end: int, all_logits: bool = True,
             varlen: bool | None = None, record: bool | None = None):
        """Tokens ids [n, q] for slots 0..n-1 at positions start[r].. (start: [n] long tensor on the device);
        `end` bounds every row's start + q (it picks the bucket). varlen: whether a step that can read each row's own
        columns does (varlen_step; None: it does; False: the caller knows the rows' lengths are close to the span's,
        where the spanned attention is faster). record: whether the step keeps the state after each of its tokens
        so that accept() can take the rows back to any of them (None: a step of several tokens does; a target
        without recurrent state ignores it). Returns (logits [n, q, V] or, with all_logits=False, [n, 1, V] of
        each row's last token, hidden [n, q, K*H] or None): static buffers on a GPU, valid until the next step."""
        n, q = ids.shape
        if end > self.max_len:
            raise ValueError(f"a step up to position {end} does not fit the decoder's {self.max_len} positions")
        span = self.span_for(end)
        varlen = self.varlen_step(n, q) and varlen is not False
        record = self._records(q, record)
        self.shapes.add((n, q, span, all_logits))
        if not self.graphs_on:
            return self._forward_or_fall_back(ids, start, span, None if all_logits else start.new_full((n,), q - 1),
                                              varlen, record)
        if q > self._ids.shape[1]:
            raise ValueError(f"a step of {q} tokens per row is more than the decoder's max_q ({self._ids.shape[1]})")
        self._ids[:n, :q].copy_(ids)
        self._start[:n].copy_(start)
        g = self._graphs.get((n, q, span, all_logits, varlen, record))
        if g is None:
            g = self._capture(n, q, span, all_logits, varlen, record)
        g[0].replay()
        return g[1], g[2]

    @torch.inference_mode()
    def prepare(self, n: int, qs: list[int], all_logits: bool = True) -> int:
        """Run once every step shape that n rows of q tokens (each q in qs) can take, one per span bucket up to
        max_len: on a GPU each is captured (and the fused layers compiled) now, not on first use, so a timed
        decode after it captures and compiles nothing (eval: else the first method to reach a longer span pays its
        capture). The steps write their keys and values into columns of rows 0..n-1: call it before those rows
        hold anything. Returns the number of shapes run."""
        count = 0
        for span in range(self.bucket, self.max_len + 1, self.bucket):
            for q in qs:
                if q > span or (n, q, span, all_logits) in self.shapes:
                    continue
                ids = torch.zeros((n, q), dtype=torch.long, device=self.device)
                self.step(ids, torch.full((n,), span - q, dtype=torch.long, device=self.device), span, all_logits)
                count += 1
        return count

    def _forward_or_fall_back(self, ids, start, span, keep, varlen: bool = False, record: bool = False):
        """_forward of a step, run where the fused layers may compile (never inside a capture). Should their compilation
        fail (a torch or compiler error, not ours), this process decodes with the HF modules' layers from then on,
        slower but the same arithmetic, and says so once: a decode that runs beats one that stops. The step's keys
        and values are written again, the same at the same columns."""
        try:
            return self._forward(ids, None, start, span, keep, varlen, record)
        except Exception as e:  # noqa: BLE001  (only the compiler's own errors are caught: below)
            if not self.fused or not type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            _fused_failed(e)
            self.fused = False
            return self._forward(ids, None, start, span, keep, varlen, record)

    def _warm_up(self, ids, start, span, keep, varlen: bool, record: bool) -> None:
        """The eager run before a capture (on a side stream): it compiles what the step compiles and writes the keys
        and values this very step writes (the same values at the same places), so no slot's cache needs saving
        around it."""
        self._forward_or_fall_back(ids, start, span, keep, varlen, record)

    def _capture(self, n: int, q: int, span: int, all_logits: bool, varlen: bool, record: bool = False):
        """Capture the step of shape (n, q, span) with the step's own inputs already in the static buffers, after
        one eager run of it (_warm_up)."""
        ids, start = self._ids[:n, :q], self._start[:n]
        keep = None if all_logits else torch.full((n,), q - 1, dtype=torch.long, device=self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._warm_up(ids, start, span, keep, varlen, record)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, hidden = self._forward(ids, None, start, span, keep, varlen, record)
        self.captures += 1
        entry = (graph, logits, hidden)
        self._graphs[(n, q, span, all_logits, varlen, record)] = entry
        return entry

    @torch.inference_mode()
    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the cache of slots src [m] into slots dst [m] (every column)."""
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]
