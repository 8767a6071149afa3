"""The frozen target in extraction: packed forwards of fixed-length rows with a document mask.

Extraction needs only the first `max(layer_ids) + 1` decoder layers: PackedTarget loads exactly those (no
later layers, no LM head) through dflash.core.target, hooks the K captured layers so they write straight
into one preallocated [rows, T, K*H] buffer, and never builds HF's full `output_hidden_states` tuple.
"""

from __future__ import annotations

import torch

from dflash.core.target import LayerCapture, load_causal_lm, load_config, text_config, validate_layer_ids


def packed_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool [R, 1, T, T], True = attend: causal within each document (padding attends to padding)."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal



def packed_block_mask(doc_ids: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    R, T = doc_ids.shape

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (doc_ids[b, q] == doc_ids[b, kv])

    return create_block_mask(mask_mod, R, None, T, T, device=doc_ids.device)



class PackedTarget:
    """The truncated frozen target plus capture: run(ids, pos, docs, out) fills out [R, T, K*H]."""

    def __init__(self, path: str, layer_ids: list[int], *, device="cpu", dtype=torch.float32, attn: str = "sdpa"):
        self.cfg = load_config(path)
        c = text_config(self.cfg)
        self.num_layers = c.num_hidden_layers
        self.layer_ids = validate_layer_ids(layer_ids, self.num_layers, path)
        self.hidden_size = c.hidden_size
        self.attn = attn
        need = max(self.layer_ids) + 1
        impl = "flex_attention" if attn == "flex" else "sdpa"
        self.model = load_causal_lm(path, device=device, dtype=dtype, attn_impl=impl, num_layers=need, with_head=False)
        last = self.num_layers - 1
        self.capture = LayerCapture(self.model, self.layer_ids, final_norm_for=last if last in self.layer_ids else None)
        self.device = torch.device(device)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor, out: torch.Tensor):
        """One packed forward of [R, T] rows; padding positions of `out` are set to exact zeros."""
        mask = packed_block_mask(doc_ids) if self.attn == "flex" else packed_causal_mask(doc_ids)[:, None]
        self.capture.out = out
        try:
            self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
        finally:
            self.capture.out = None
        out.masked_fill_((doc_ids == 0)[..., None], 0)  # true zeros, not -0.0: padding costs nothing compressed
        return out
