"""The static decoder of a hybrid target (Qwen3.5 / 3.6: Gated DeltaNet linear attention, gated full attention every
4th layer, a dense MLP), replayable as CUDA graphs like dflash.core.static_decode's StaticDecoder, whose interface it
keeps (prefill, step, prepare, move, grow, layer_ids, shapes, captures) and whose step machinery it shares.

Per slot it holds:

  * full-attention layers: keys and values [slots, Hkv, max_len + 1, D], as StaticDecoder (a rejected draft's keys
    lie past the confirmed length, never read, written over by the next step);
  * linear-attention layers, stacked over those layers so that a row's state moves or rolls back in one op:
      conv  [Llin, slots, C, K - 1]           the causal convolution's last K - 1 inputs (the model's dtype)
      rec   [Llin, slots, Hv, Dk, Dv]         the gated delta rule's state (float32, as transformers keeps it)
    A step of q tokens runs the convolution over [window, the q inputs] and the recurrence token by token (q <= 16:
    an unrolled loop of fixed-shape ops, no host sync, so it captures as one graph). Unlike keys, these states have
    no positions: a rejected draft's tokens have already changed them.

Rollback (speculative verify): a recorded step (record=True; by default every step of several tokens) also writes
    win   [Llin, slots, C, K - 1 + max_q]     the convolution's whole input window of the step
    hist  [Llin, slots, max_q, Hv, Dk, Dv]    the recurrent state after each of its tokens
and accept(keep) copies the state after token `keep` of each row back into conv and rec (a gather over the stacked
layers, keep a device tensor: no host sync). The alternative, re-running the accepted tokens from a saved state,
costs a second target forward on every partially accepted step; the record costs one state write per token.

Prefill (eager, right-padded prompts of any length): the layers' own math through transformers' chunked delta rule
in torch (torch_chunk_gated_delta_rule, whatever kernels are installed), with beta = 0 and g = 0 past each prompt's
length: a token with no update and no decay leaves the state as it was, so each row's final state is its prompt's own
(the same arithmetic transformers' own padding of a chunk does); the conv window is each prompt's last K - 1 inputs.

The arithmetic is transformers' Qwen3_5 modeling, module by module: the norms are the model's (1 + weight) RMSNorm
modules, the attention's query comes with a gate (output * sigmoid(gate)) and q/k norms, the rotary embedding is
partial (the first rotary_dim channels; mRoPE of text positions is the plain one) and the recurrence is
torch_recurrent_gated_delta_rule's (l2-normed q and k, q scaled by Dk^-0.5, g = -exp(A_log) softplus(a + dt_bias),
beta = sigmoid(b), the gated RMSNorm with z, out_proj). Equal to the HF forward in float32 (tests/test_hybrid_static.py).
Qwen3.5-MoE (routed experts), Qwen3-Next and gpt-oss stay on the eager path (decode_state.py): unsupported() names why.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .hybrid import gdn_heads
from .static_decode import StaticDecoder, _attend, _fold, _varlen_attend, _varlen_lengths
from .target import decoder_layers

KINDS = ("full_attention", "linear_attention")
GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


def _text_model(model):
    """The decoder stack with embed_tokens, norm and rotary_emb (the language model of a multimodal wrapper)."""
    base = getattr(model, "model", model)
    return getattr(base, "language_model", base)


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def hybrid_unsupported(model) -> str | None:
    """None when HybridDecoder can run `model` (its layers are Qwen3_5DecoderLayer), else why not."""
    cfg = _text_config(model)
    layers = decoder_layers(model)
    kinds = [str(k) for k in (getattr(cfg, "layer_types", None) or [])][:len(layers)]
    if len(kinds) != len(layers) or not set(kinds) <= set(KINDS):
        return f"layer types {sorted(set(kinds) - set(KINDS)) or 'missing'}"
    text = _text_model(model)
    if any(getattr(text, a, None) is None for a in ("embed_tokens", "norm", "rotary_emb")) or \
            model.get_output_embeddings() is None:
        return "no embed_tokens / norm / rotary embedding / lm_head"
    rotary = text.rotary_emb
    if str(getattr(rotary, "rope_type", "default")) in ("dynamic", "longrope"):
        return f"a {rotary.rope_type} rotary embedding (its frequencies depend on the length)"
    for layer, kind in zip(layers, kinds):
        if kind == "linear_attention":
            m = getattr(layer, "linear_attn", None)
            if m is None or not all(hasattr(m, p) for p in GDN_PARTS):
                return "a linear-attention module other than Qwen3.5's Gated DeltaNet"
            if m.activation not in ("silu", "swish"):
                return f"the convolution's activation {m.activation}"
        elif not all(hasattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm")):
            return "an attention module other than Qwen3.5's gated one"
    return None


def linear_state_bytes(cfg, dtype: torch.dtype) -> int:
    """A slot's linear-attention state in HybridDecoder (conv windows in `dtype`, float32 recurrent states) for a
    text config; 0 for a target without linear-attention layers. The slot engine plans its slots with it."""
    n = sum(1 for k in (getattr(cfg, "layer_types", None) or []) if k == "linear_attention")
    if not n:
        return 0
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = (2 * hk * dk + hv * dv) * (cfg.linear_conv_kernel_dim - 1) * torch.finfo(dtype).bits // 8
    return n * (conv + hv * dk * dv * 4)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' l2norm (eps 1e-6), as its delta rules apply it to q and k."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The partial rotary embedding of t [n, q, heads, D] at cos, sin [n, q, R] (rotate_half's sign folded into sin,
    as StaticDecoder's tables): the first R channels rotated, the rest passed through."""
    R = cos.shape[-1]
    r = t[..., :R]
    r = r * cos[:, :, None] + r.roll(R // 2, -1) * sin[:, :, None]
    return r if R == t.shape[-1] else torch.cat([r, t[..., R:]], -1)


class HybridDecoder(StaticDecoder):
    """StaticDecoder's interface over a Qwen3.5 hybrid target (module docstring). step() of several tokens records
    by default; accept(keep) then rolls the linear layers back to the state after the first `keep` of them."""

    recurrent = True

    def __init__(self, model, slots: int, max_len: int, layer_ids: list[int] | None = None, bucket: int = 256,
                 graphs: bool = True, max_q: int = 16, fused: bool | None = None, varlen: bool | str | None = None):
        why = hybrid_unsupported(model)
        if why is not None:
            raise ValueError(f"the static decoder cannot run this model: {why}")
        self.layers = decoder_layers(model)
        cfg = _text_config(model)
        kinds = list(cfg.layer_types)[:len(self.layers)]
        self.linear = [k == "linear_attention" for k in kinds]  # (before _init_cache: _buffers reads it)
        # each layer's index among the layers of its kind (its buffers)
        self._index = [sum(1 for k in kinds[:i] if k == kind) for i, kind in enumerate(kinds)]
        attn = next(layer.self_attn for layer, lin in zip(self.layers, self.linear) if not lin)
        self._init_cache(model, _text_model(model), cfg, attn, slots, max_len, bucket, layer_ids)
        gdn = next(layer.linear_attn for layer, lin in zip(self.layers, self.linear) if lin)
        n_lin = sum(self.linear)
        self.conv_dim, self.taps = gdn.conv_dim, gdn.conv_kernel_size
        shape = (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
        dev = self.device
        self.conv = torch.zeros(n_lin, self.slots, self.conv_dim, self.taps - 1, dtype=self.dtype, device=dev)
        self.rec = torch.zeros(n_lin, self.slots, *shape, dtype=torch.float32, device=dev)
        self.max_q = int(max_q)
        recording = self.max_q > 1  # a decoder of one-token steps (regenerate's) never rolls back
        self.win = torch.zeros(n_lin, self.slots, self.conv_dim, self.taps - 1 + self.max_q, dtype=self.dtype,
                               device=dev) if recording else None
        self.hist = torch.zeros(n_lin, self.slots, self.max_q, *shape, dtype=torch.float32, device=dev) \
            if recording else None
        self._keep = torch.zeros(self.slots, dtype=torch.long, device=dev)
        self._dry = False  # a capture's warm-up: compute every state, write none (_warm_up)
        self.fused = False  # fused_layers computes the plain Llama layer only
        self._init_steps(graphs, max_q, varlen)

    def _buffers(self) -> list[torch.Tensor]:
        """StaticDecoder's key or value buffers, for the full-attention layers only."""
        shape = (self.slots, self.kv_heads, self.max_len + 1, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for lin in self.linear if not lin]

    def state_bytes_per_slot(self) -> int:
        """The linear layers' state of one slot (conv windows and recurrent states), recording buffers included."""
        per = self.conv[:, 0].numel() * self.conv.element_size() + self.rec[:, 0].numel() * 4
        if self.hist is not None:
            per += self.win[:, 0].numel() * self.win.element_size() + self.hist[:, 0].numel() * 4
        return per

    # -- rollback ----------------------------------------------------------------------------------------------------
    def _records(self, q: int, record: bool | None) -> bool:
        record = q > 1 if record is None else bool(record)
        if record and (self.hist is None or q > self.max_q):
            raise ValueError(f"a recorded step of {q} tokens needs a decoder of max_q >= {q} (this one: {self.max_q})")
        return record

    @torch.inference_mode()
    def accept(self, keep, n: int = 1) -> None:
        """After a recorded step of rows 0..n-1: each row's linear states become those after its first keep[r] tokens
        of the step (keep: an int, or a [n] long tensor on the device, 1 <= keep <= the step's q). Device ops only (a
        gather over the stacked layers): capturable, no host sync. Attention needs nothing (StaticDecoder.accept)."""
        if self.hist is None:
            raise ValueError("accept() after a recorded step: this decoder records none (max_q = 1)")
        if isinstance(keep, torch.Tensor):
            keep = keep.to(self.device).view(-1).expand(n)
        else:
            keep = self._keep[:n].fill_(int(keep))
        rows = torch.arange(n, device=self.device)
        self.rec[:, :n] = self.hist[:, rows, keep - 1]
        cols = keep[:, None] + torch.arange(self.taps - 1, device=self.device)  # the window's last K-1 inputs
        L, C = self.conv.shape[0], self.conv_dim
        self.conv[:, :n] = self.win[:, :n].gather(-1, cols[None, :, None, :].expand(L, n, C, self.taps - 1))

    def _warm_up(self, ids, start, span, keep, varlen: bool, record: bool) -> None:
        """The eager run before a capture writes no conv or recurrent state: those are updated in place (new = f(old)),
        so the warm-up and the replay that follows would otherwise advance them twice (keys and values are only
        written, the same twice)."""
        self._dry = True
        try:
            super()._warm_up(ids, start, span, keep, varlen, record)
        finally:
            self._dry = False

    @torch.inference_mode()
    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the cache of slots src [m] into slots dst [m]: keys and values, conv windows and recurrent states."""
        super().move(src, dst)
        self.conv[:, dst] = self.conv[:, src]
        self.rec[:, dst] = self.rec[:, src]

    # -- the layers ----------------------------------------------------------------------------------------------
    def _attention(self, i: int, layer, x: torch.Tensor, cos, sin, rows, start, span: int | None, cols, mask):
        """Qwen3.5's gated full attention of layer i (its j-th attention layer) on normed x [n, q, H]: the query
        and its gate from q_proj, q/k norms, the partial rotary embedding, then StaticDecoder's cache and attention
        (span None: a prefill, causal within x), output * sigmoid(gate), o_proj."""
        a, j = layer.self_attn, self._index[i]
        n, q, _ = x.shape
        D = self.head_dim
        query, gate = a.q_proj(x).view(n, q, -1, 2 * D).chunk(2, dim=-1)
        gate = gate.reshape(n, q, -1)
        query = _rotate(a.q_norm(query), cos, sin)
        key = _rotate(a.k_norm(a.k_proj(x).view(n, q, -1, D)), cos, sin)
        value = a.v_proj(x).view(n, q, -1, D)
        if span is None:
            self.k[j][rows, :, :q] = key.transpose(1, 2)
            self.v[j][rows, :, :q] = value.transpose(1, 2)
            out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                                 is_causal=True, scale=a.scaling,
                                                 enable_gqa=self.heads != self.kv_heads)
            out = out.transpose(1, 2).reshape(n, q, -1)
        else:
            self._write_step(j, key, value, cols)
            if isinstance(mask, tuple):
                out = _varlen_attend(_fold(query, self.kv_heads), self.k[j], self.v[j], mask, span, a.scaling)
            else:
                out = _attend(_fold(query, self.kv_heads), self.k[j][:n, :, :span], self.v[j][:n, :, :span], mask,
                              a.scaling, q)
        return a.o_proj(out * torch.sigmoid(gate))

    def _linear(self, i: int, m, x: torch.Tensor, rows, span: int | None, record: bool, lengths):
        """The Gated DeltaNet of layer i on normed x [n, q, H]: a prefill from a zero state (span None; lengths [n]
        the prompts' own) or a step from each row's state (module docstring)."""
        j = self._index[i]
        n, q, _ = x.shape
        C, K = self.conv_dim, self.taps
        mixed = m.in_proj_qkv(x).transpose(1, 2)  # [n, C, q]
        z = m.in_proj_z(x).reshape(n, q, -1, m.head_v_dim)
        b, a = m.in_proj_b(x), m.in_proj_a(x)
        w = m.conv1d.weight  # [C, 1, K]
        if span is None:
            conv = F.conv1d(mixed.to(w.dtype), w, m.conv1d.bias, padding=K - 1, groups=C)[..., :q]
            last = lengths[:, None] + torch.arange(K - 1, device=x.device)  # a prompt's last K-1 inputs, zeros before
            padded = F.pad(mixed, (K - 1, 0))
            self.conv[j][rows] = padded.gather(-1, last[:, None, :].expand(n, C, K - 1)).to(self.dtype)
        else:
            win = torch.cat([self.conv[j][:n], mixed.to(self.dtype)], -1)  # [n, C, K-1+q]
            conv = F.conv1d(win.to(w.dtype), w, m.conv1d.bias, groups=C)
            if record:
                self.win[j][:n, :, :K - 1 + q].copy_(win)
            if not self._dry:
                self.conv[j][:n].copy_(win[..., q:])
        query, key, value, g, beta = gdn_heads(m, F.silu(conv).to(x.dtype).transpose(1, 2), b, a)
        if span is None:
            real = (torch.arange(q, device=x.device)[None] < lengths[:, None])[..., None]  # [n, q, 1]
            rule = getattr(sys.modules[type(m).__module__], "torch_chunk_gated_delta_rule")
            core, state = rule(query, key, value, g=g * real, beta=beta * real, initial_state=None,
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
            self.rec[j][rows] = state.float()
        else:
            core = self._recurrence(j, query, key, value, g, beta, record)
        core = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(n, q, -1)
        return m.out_proj(core)

    def _recurrence(self, j: int, query, key, value, g, beta, record: bool) -> torch.Tensor:
        """transformers' torch_recurrent_gated_delta_rule over the step's q tokens from rows 0..n-1's state of linear
        layer j, updated in place (a copy in a capture's warm-up); with record, the state after each token into
        hist. [n, q, heads, d] in; [n, q, Hv, Dv] out, in query's dtype."""
        n, q, hk, dk = key.shape
        hv, dv = value.shape[2:]
        if hk != hv:  # each key head serves hv // hk consecutive value heads
            query = query.repeat_interleave(hv // hk, dim=2)
            key = key.repeat_interleave(hv // hk, dim=2)
        qf, kf, vf, bf, gf = (t.transpose(1, 2).float() for t in (query, key, value, beta, g))  # [n, Hv, q, ..]
        qf = _l2norm(qf) / dk ** 0.5
        kf = _l2norm(kf)
        state = self.rec[j][:n]
        if self._dry:
            state = state.clone()
        flat = state.view(n * hv, dk, dv)
        outs = []
        for t in range(q):
            state.mul_(gf[:, :, t].exp()[..., None, None])
            k_t = kf[:, :, t].reshape(n * hv, 1, dk)
            kv_mem = torch.bmm(k_t, flat).view(n, hv, dv)  # what the state predicts for this key
            delta = (vf[:, :, t] - kv_mem) * bf[:, :, t, None]
            flat.baddbmm_(k_t.transpose(1, 2), delta.view(n * hv, 1, dv))  # state += k delta^T
            outs.append(torch.bmm(qf[:, :, t].reshape(n * hv, 1, dk), flat).view(n, hv, dv))
            if record:
                self.hist[j][:n, t].copy_(state)
        return torch.stack(outs, 1).to(query.dtype)

    def _forward(self, ids, rows, start, span, keep, varlen: bool = False, record: bool = False, lengths=None):
        """(logits, hidden) for ids [n, q] (StaticDecoder._forward's contract); lengths: a prefill's prompt lengths."""
        n, q = ids.shape
        pos = start[:, None] + torch.arange(q, device=ids.device)[None]
        cos, sin = self.cos[pos], self.sin[pos]
        cols = mask = None
        if span is not None:
            cols = pos
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
            h = layer.input_layernorm(x)
            if self.linear[i]:
                x = x + self._linear(i, layer.linear_attn, h, rows, span, record, lengths)
            else:
                x = x + self._attention(i, layer, h, cos, sin, rows, start, span, cols, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if hidden is not None and i in self.layer_ids:
                k = self.layer_ids.index(i)
                hidden[..., k * H:(k + 1) * H] = self.base.norm(x) if i == self._final_norm_for else x
        x = self.base.norm(x)
        if keep is not None:
            x = x[torch.arange(n, device=ids.device), keep][:, None]
        return self.model.get_output_embeddings()(x), hidden

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor | None = None,
                all_logits: bool = False):
        """StaticDecoder.prefill: prompts ids [k, w] (right-padded; lengths [k], None: all w) into slots `rows`, their
        keys and values at columns 0..w-1 and their linear layers' states after each prompt's own last token."""
        k, w = ids.shape
        if w > self.max_len:
            raise ValueError(f"a prompt of {w} tokens does not fit the decoder's {self.max_len} positions")
        lengths = torch.full((k,), w, dtype=torch.long, device=ids.device) if lengths is None \
            else lengths.to(ids.device)
        start = torch.zeros(k, dtype=torch.long, device=ids.device)
        keep = None if all_logits else lengths - 1
        return self._forward(ids, rows.to(ids.device), start, None, keep, lengths=lengths)
