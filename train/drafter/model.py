"""The DFlash drafter: a block-diffusion draft model conditioned on the target's hidden states.

Method (DFlash, arXiv 2602.06036), in the order the code below follows it:

1. Context. The frozen target runs over the text; K of its layers (ids spread from layer 1 to L-3)
   are concatenated per token, `h_t in R^{K*H}`. The drafter fuses them once:
   `c_t = RMSNorm(fc(h_t))`, `fc: K*H -> H` without bias.
2. Block. To draft after an anchor token x_a (the last token the target has confirmed), the drafter
   reads a block of B tokens `[x_a, MASK, ..., MASK]` at absolute positions a, a+1, ..., a+B-1 and
   predicts, in one forward, the token at a+k from slot k (k = 1..B-1). MASK is an unused id of the
   target vocabulary; block tokens are embedded with the target's frozen embedding table.
3. Layers. A few Qwen3-style decoder layers (RMSNorm, attention with q/k RMSNorm and RoPE, SwiGLU).
   In every layer the block's queries attend to keys/values made from the context features
   (c_t, t < a, projected by that layer's own k_proj/v_proj) followed by the block's own
   keys/values: context strictly before the anchor, the own block bidirectionally, nothing else.
4. Output. A final RMSNorm and the target's frozen LM head give logits for slots 1..B-1.

Training packs many blocks per row. For a row of T tokens (several documents, `doc_ids`, 0 = pad)
we draw N anchors among positions t where t and t+1 are supervised and in the same document, run
all N blocks in one forward (queries [N*B], keys [T context + N*B block]) under the mask of step 3,
and minimise cross-entropy on slots 1..B-1 weighted by exp(-(k-1)/gamma), masked where the label
is outside the anchor's document or not supervised. Positions restart per document, as in the
target forward that produced the context.

Shapes (R rows, T tokens, K layers, H hidden, N anchors, B block, V vocab):
    hidden [R, T, K*H] bf16    input_ids/loss_mask/doc_ids [R, T]    anchor_scores [R, T] in [0, 1)
    (or, from a cache on a basis of rank R', z = P x [R, T, R']: fc is then fc' [H, R'], and final/ holds fc' P)
    (or, from an fp8/fp4 cache, hidden as stored + hidden_scales: dequantised in fuse_context, in the step)
    -> block tokens [R, N*B], logits [R, N, B-1, V], loss scalar, metrics (all tensors, no host sync)

Checkpoints use the layout DFlash drafters are served from (HF `save_pretrained`: a Qwen3 config
with `block_size`, `num_target_layers`, `dflash_config {target_layer_ids, mask_token_id}` and
weights `layers.N.*`, `norm`, `fc`, `hidden_norm`); the embedding and LM head stay the target's.
The config fields train/drafter/checkpoint.py writes beyond those (what an exporter carries to the engines):
  * sliding-window layers (`dflash train --draft-window W`): `layer_types` (per layer `sliding_attention` or
    `full_attention`), `sliding_window` W, `use_sliding_window` true, and `sliding_window_non_causal` true (top
    level and in dflash_config): a sliding layer's block sees the W context positions before its anchor
    (anchor - W <= j < anchor, the same for every slot) and its own block bidirectionally, as speculators trains it
    (its `sliding_window_non_causal`). SGLang and vLLM run a `sliding_attention` draft layer causally with its window
    instead: an engine must be told, or it drafts with another mask than the one trained.
  * DFlash2 (`--arch dflash2`, train/drafter/dflash2.py): `architectures` ["DFlash2DraftModel"], `conv_kernel_size`,
    `conv_group_size`, `selector_rank`, `selector_top_k` (top level, as speculators' DFlash2 config, and in
    dflash_config with `arch: dflash2`), weights `layers.N.attention_conv.{base_kernel, kernel_projection.weight}`,
    `layers.N.mlp_conv.*` and `candidate_selector.{predecessor_codebook, successor_codebook,
    hidden_projection.weight}`.

This file is the model: its config, its layers and the drafter's two forwards (training over packed blocks,
drafting one block after a cached context), both through one decoder-layer forward. Around it:
train/drafter/blocks.py (anchors, blocks, attention masks), train/drafter/attention.py (the split attention kernel), train/drafter/rope.py,
train/drafter/loss.py (the objective and its metrics), train/drafter/checkpoint.py (save/load in the servable layout).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.core.layers import default_layer_ids
from dflash.train.drafter.attention import split_block_attention, split_mask
from dflash.train.drafter.blocks import Blocks, attend, dense_block_mask, flex_block_mask, make_blocks_opaque
from dflash.train.drafter.loss import chunked_block_loss
from dflash.train.drafter.errors import DrafterError  # noqa: F401  (re-exported)
from dflash.train.drafter.rope import (_rope_of, apply_rope, rope_attention_factor, rope_cos_sin, rope_inv_freq,  # noqa: F401
                               rotate_half)

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


# RoPE settings of a target that describe its own attention, not a Qwen3 drafter's (DrafterConfig.from_target)
TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None  # None / {"rope_type": "default"} / llama3 / linear
    max_position_embeddings: int = 40960
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention"
    attention_bias: bool = False
    # a sliding layer's block sees the `sliding_window` positions before its anchor and its own block bidirectionally
    # (speculators' sliding_window_non_causal; the only kind dflash trains, recorded in the checkpoint for engines)
    sliding_window_non_causal: bool = True
    # "dflash", or "dflash2": every layer wraps its attention and MLP in grouped causal convolutions over the block,
    # and a candidate selector reranks the top-k of each slot (train/drafter/dflash2.py); the fields below are dflash2's
    arch: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # R > 0: the drafter reads context features stored on a cache's basis (z = P x, dflash_cache/basis.py): fc takes R
    # inputs. Only training checkpoints hold such a drafter; final/ holds fc' P (K*H inputs) and basis_rank 0
    basis_rank: int = 0

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_layers
        checks = [
            (self.num_layers >= 1, "num_layers", "must be >= 1"),
            (self.block_size >= 2, "block_size", "must be >= 2"),
            (self.num_heads % self.num_kv_heads == 0, "num_kv_heads", f"must divide num_heads={self.num_heads}"),
            (len(self.layer_types) == self.num_layers, "layer_types", f"needs {self.num_layers} entries"),
            (all(t in ("full_attention", "sliding_attention") for t in self.layer_types), "layer_types",
             "entries must be full_attention or sliding_attention"),
            ("sliding_attention" not in self.layer_types or (self.sliding_window or 0) > 0, "sliding_window",
             "must be set when a layer is sliding_attention"),
            (len(self.target_layer_ids) >= 1, "target_layer_ids", "is empty"),
            (all(0 <= i < self.num_target_layers for i in self.target_layer_ids), "target_layer_ids",
             f"must lie in [0, {self.num_target_layers - 1}]"),
            (0 <= self.mask_token_id < self.vocab_size, "mask_token_id", f"must lie in [0, {self.vocab_size - 1}]"),
            (self.sliding_window_non_causal, "sliding_window_non_causal",
             "must be true (a sliding layer's block is bidirectional, as speculators trains DFlash2)"),
            (self.arch in ("dflash", "dflash2"), "arch", "must be dflash or dflash2"),
            (self.basis_rank >= 0, "basis_rank", "must be >= 0 (0: fc reads the K*H features as they are)"),
        ]
        if self.arch == "dflash2":
            checks += [
                (1 <= self.conv_kernel_size <= self.block_size, "conv_kernel_size",
                 f"must lie in [1, {self.block_size}]"),
                (self.conv_group_size >= 1 and self.hidden_size % self.conv_group_size == 0, "conv_group_size",
                 f"must divide hidden_size={self.hidden_size}"),
                (self.selector_rank >= 1, "selector_rank", "must be >= 1"),
                (1 <= self.selector_top_k <= self.vocab_size, "selector_top_k", f"must lie in [1, {self.vocab_size}]"),
            ]
        for ok, name, msg in checks:
            if not ok:
                raise DrafterError(f"drafter config: {name} {msg} (got {getattr(self, name)!r})")

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def context_width(self) -> int:
        """fc's inputs: the K*H features, or R of them on a cache's basis (basis_rank)."""
        return self.basis_rank or self.num_context_layers * self.hidden_size

    @classmethod
    def from_target(cls, hf_config, num_layers: int = 5, layer_ids: list[int] | None = None, block_size: int = 16,
                    mask_token_id: int = 0, **overrides) -> "DrafterConfig":
        """A drafter of the target's width (its heads, MLP size, RoPE) with `num_layers` layers."""
        c = getattr(hf_config, "text_config", hf_config)
        L = c.num_hidden_layers
        heads = c.num_attention_heads
        # the drafter is a Qwen3 decoder with full rotary embeddings: a target's partial rotary or multimodal RoPE
        # sections (Qwen3.5/3.6) are its own and not carried over (the drafter's config would claim them)
        rope = {k: v for k, v in _rope_of(c).items() if k not in TARGET_ONLY_ROPE_KEYS}
        kw = dict(
            hidden_size=c.hidden_size,
            # an experts target (Qwen3.5-MoE) has no dense MLP size: the dense-equivalent 3 x hidden
            intermediate_size=getattr(c, "intermediate_size", None) or 3 * c.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab_size=c.vocab_size,
            target_layer_ids=list(layer_ids) if layer_ids is not None else default_layer_ids(L),
            num_target_layers=L,
            num_layers=num_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"} or None,
            max_position_embeddings=getattr(c, "max_position_embeddings", 40960),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def named(cls, name: str, **overrides) -> "DrafterConfig":
        """Named sizes. `tiny` is for CPU tests; `qwen3-8b` is the released 8B drafter's shape."""
        sizes = {
            "tiny": dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                         vocab_size=512, target_layer_ids=[1, 3], num_target_layers=6, num_layers=2,
                         block_size=4, mask_token_id=511, rope_theta=10000.0),
            "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128,
                             vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36,
                             num_layers=5, block_size=16, mask_token_id=151669, rope_theta=1_000_000.0,
                             max_position_embeddings=40960),
        }
        if name not in sizes:
            raise DrafterError(f"unknown drafter size {name!r} (known: {sorted(sizes)})")
        return cls(**{**sizes[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------------------------------
# Building blocks (Qwen3 numerics: norms in float32; RoPE with rotate-half in train/drafter/rope.py)
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, sliding: bool):
        super().__init__()
        self.cfg = cfg
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=b)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.window = cfg.sliding_window if sliding else None

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of x [b, L, H] at the positions of cos/sin -> [b, nkv, L, hd] each."""
        b, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, L, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, L, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def q(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        b, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, L, self.nh, self.hd)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, L, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, L, self.nh * self.hd))


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig, sliding: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, sliding)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask, impl: str = "sdpa") -> torch.Tensor:
        """Step 3, for training and drafting alike: block tokens x [b, L, H] at the positions of
        cos/sin [b, L, hd] attend to the context's keys/values k_ctx/v_ctx [b, nkv, Tc, hd] (made by this
        layer's k_proj/v_proj, see Attention.kv) followed by their own, under mask: a bool [b, 1, L, Tc + L]
        or None (impl "sdpa"), a BlockMask ("flex"), or split_mask's masks ("split", train/drafter/attention.py)."""
        x = x + self.attention(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask, impl)
        return x + self.mlp(self.post_attention_layernorm(x))

    def attention(self, h, cos, sin, k_ctx, v_ctx, mask, impl: str) -> torch.Tensor:
        """The attention sublayer on normalised block states h [b, L, H] (forward's arguments), projected out."""
        att = self.self_attn
        k_blk, v_blk = att.kv(h, cos, sin)
        q = att.q(h, cos, sin)
        if impl == "split":  # context and own block apart, merged exactly (train/drafter/attention.py)
            o = split_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask)
        else:
            o = attend(q, torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2), mask, impl)
        return att.out(o)


# --------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    """Steps 1-4 of the method (module docstring): fuse_context (1), embed (2), the layers (3), logits / the
    chunked loss (4); forward_train over packed blocks, extend_context + draft_block to draft after a context."""

    layer_class = Layer  # DFlash2Drafter's layers add the block convolutions (train/drafter/dflash2.py)

    def __init__(self, cfg: DrafterConfig, attn_impl: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.attn_impl = attn_impl
        self.layers = nn.ModuleList(self.layer_class(cfg, t == "sliding_attention") for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.context_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope_scale = rope_attention_factor(cfg)  # YaRN's cos/sin factor (1.0 otherwise)
        # The target's embedding and LM head: frozen, never saved with the drafter.
        self.register_buffer("embed_weight", torch.zeros(cfg.vocab_size, cfg.hidden_size), persistent=False)
        self.register_buffer("lm_head_weight", torch.zeros(cfg.vocab_size, cfg.hidden_size), persistent=False)
        self.add_modules()
        self.reset_parameters()

    def add_modules(self) -> None:
        """Modules a variant adds before the parameters are initialised (DFlash2Drafter's candidate selector)."""

    def _apply(self, fn, recurse=True):
        # .to(bfloat16) and friends convert floating buffers too; the RoPE frequencies stay float32, as the
        # serving stacks compute them (bf16 frequencies turn position 3000 by up to ~0.5 rad the wrong way)
        out = super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.cfg).to(self.inv_freq.device)
        return out

    def reset_parameters(self, std: float = 0.02, seed: int | None = None):
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        for m in self.modules():
            if isinstance(m, nn.Linear):
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
                    if m.bias is not None:
                        m.bias.zero_()
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def set_target_head(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Install the target's (frozen) embedding table and LM head."""
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        for name, w in (("embed", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != (V, H):
                raise DrafterError(f"target {name} weight has shape {tuple(w.shape)}, the drafter expects {(V, H)}")
        dtype = self.fc.weight.dtype
        self.embed_weight = embed_weight.detach().to(self.fc.weight.device, dtype).clone()
        self.lm_head_weight = lm_head_weight.detach().to(self.fc.weight.device, dtype).clone()

    def fuse_context(self, hidden: torch.Tensor, hidden_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Step 1: [*, K*H] target hidden states -> [*, H] context features. With hidden_scales, hidden is a quantised
        cache's stored form (fp8 bytes or packed fp4, dflash_cache.quant), dequantised here on the device."""
        if hidden_scales is not None:
            from dflash_cache.quant import dequantize  # lazy: the cache package only for fp8/fp4

            hidden = dequantize(hidden, hidden_scales, self.fc.weight.dtype)
        width = self.cfg.context_width  # a cache with the target's last hidden state holds it after the features
        return self.hidden_norm(self.fc(hidden[..., :width].to(self.fc.weight.dtype)))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.lm_head_weight)

    # -- training: many blocks per packed row ----------------------------------------------------
    def forward_train(self, hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors: int,
                      gamma: float = 7.0, hidden_scales=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss and metrics of a packed batch: forward_slots, then the chunked loss (step 4)."""
        h, blocks = self.forward_slots(hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, hidden_scales)
        return chunked_block_loss(h, self.lm_head_weight, blocks, gamma)

    def forward_slots(self, hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors: int,
                      hidden_scales=None) -> tuple[torch.Tensor, Blocks]:
        """Steps 1-3 over a packed batch: its blocks and their normalised slot outputs h [R, N, B-1, H] (what the
        loss reads). The compiled step compiles this part as one graph and the loss's chunk apart
        (train/fit/compile_step.py)."""
        blocks, masks = self.prepare(input_ids, loss_mask, doc_ids, anchor_scores, num_anchors)
        return self.slot_outputs(hidden, blocks, masks, hidden_scales), blocks

    def prepare(self, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors: int):
        """A batch's blocks (anchors, block tokens, labels, positions) and attention masks, one per window."""
        input_ids, doc_ids = input_ids.long(), doc_ids.long()
        blocks = make_blocks_opaque(input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, self.cfg.block_size,
                                    self.cfg.mask_token_id)
        make = {"flex": flex_block_mask, "split": split_mask}.get(self.attn_impl, dense_block_mask)
        masks = {}
        for layer in self.layers:
            w = layer.self_attn.window
            if w not in masks:
                masks[w] = make(blocks, doc_ids, w)
        return blocks, masks

    def forward_blocks(self, hidden, blocks: Blocks, masks: dict, gamma: float = 7.0, hidden_scales=None):
        """Loss and metrics of the drafter over prepared blocks (see prepare) and the context's hidden states."""
        h = self.slot_outputs(hidden, blocks, masks, hidden_scales)
        return chunked_block_loss(h, self.lm_head_weight, blocks, gamma)

    def slot_outputs(self, hidden, blocks: Blocks, masks: dict, hidden_scales=None) -> torch.Tensor:
        """The normalised outputs h [R, N, B-1, H] of slots 1..B-1 over prepared blocks."""
        R, N, B = blocks.tokens.shape
        ctx = self.fuse_context(hidden, hidden_scales)  # [R, T, H]
        x = self.embed(blocks.tokens.view(R, N * B))  # [R, NB, H]
        dtype = x.dtype
        ctx_cos, ctx_sin = rope_cos_sin(self.inv_freq, blocks.ctx_positions, dtype, self.rope_scale)
        q_cos, q_sin = rope_cos_sin(self.inv_freq, blocks.positions.view(R, N * B), dtype, self.rope_scale)
        for layer in self.layers:
            x = self._layer(layer, x, ctx, q_cos, q_sin, ctx_cos, ctx_sin, masks[layer.self_attn.window])
        return self.norm(x.view(R, N, B, -1)[:, :, 1:])  # slots 1..B-1: [R, N, B-1, H]

    def _layer(self, layer: Layer, x, ctx, q_cos, q_sin, ctx_cos, ctx_sin, mask):
        """One layer in training: the context features' keys/values [R, nkv, T, hd], then the layer."""
        k_ctx, v_ctx = layer.self_attn.kv(ctx, ctx_cos, ctx_sin)
        return layer(x, q_cos, q_sin, k_ctx, v_ctx, mask, self.attn_impl)

    # -- inference: one block after a growing context ---------------------------------------------
    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> "ContextCache":
        device = device or self.fc.weight.device
        dtype = dtype or self.fc.weight.dtype
        return ContextCache(len(self.layers), batch, self.cfg.num_kv_heads, max_len, self.cfg.head_dim, device, dtype)

    def extend_context(self, cache: "ContextCache", hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Append target hidden states [b, L, K*H] at positions [b, L] to the context cache."""
        ctx = self.fuse_context(hidden)
        cos, sin = rope_cos_sin(self.inv_freq, positions, ctx.dtype, self.rope_scale)
        ks, vs = [], []
        for layer in self.layers:
            k, v = layer.self_attn.kv(ctx, cos, sin)
            ks.append(k)
            vs.append(v)
        cache.append(ks, vs, positions)

    def draft_block(self, cache: "ContextCache", block_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [b, B-1, V] for slots 1..B-1 of the block [b, B] at positions [b, B]."""
        return F.linear(self.draft_states(cache, block_ids, positions), self.lm_head_weight)

    def draft_states(self, cache: "ContextCache", block_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The normalised outputs [b, B-1, H] of slots 1..B-1 (what the LM head and DFlash2's selector read)."""
        x = self.embed(block_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype, self.rope_scale)
        n = cache.length
        for i, layer in enumerate(self.layers):
            mask = None
            if layer.self_attn.window is not None:  # the window positions before the anchor, and the own block
                kpos = torch.cat([cache.pos[:, :n], positions], 1)
                mask = window_mask(positions, kpos, layer.self_attn.window)
            x = layer(x, cos, sin, cache.k[i][:, :, :n], cache.v[i][:, :, :n], mask)
        return self.norm(x[:, 1:])


def window_mask(positions: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """bool [b, 1, B, len]: which keys at positions kpos [b, len] a block at positions [b, B] sees in a sliding layer:
    those no more than `window` positions before its anchor (positions[:, 0]), for every query of the block (the
    training mask, train/drafter/blocks.py); the block's own keys always."""
    return (positions[:, :1, None] - kpos[:, None, :] <= window)[:, None].expand(-1, -1, positions.shape[1], -1)


class ContextCache:
    """Per-layer keys/values of the context features (never of draft blocks), preallocated."""

    def __init__(self, layers, batch, nkv, max_len, hd, device, dtype):
        self.k = [torch.zeros(batch, nkv, max_len, hd, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(batch, nkv, max_len, hd, device=device, dtype=dtype) for _ in range(layers)]
        self.pos = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.length = 0
        self.max_len = max_len

    def append(self, ks, vs, positions):
        L = ks[0].shape[2]
        if self.length + L > self.max_len:
            raise DrafterError(f"drafter context cache is full ({self.max_len} positions)")
        s = slice(self.length, self.length + L)
        for i in range(len(ks)):
            self.k[i][:, :, s] = ks[i]
            self.v[i][:, :, s] = vs[i]
        self.pos[:, s] = positions
        self.length += L
