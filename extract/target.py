"""The frozen target in extraction: packed forwards of fixed-length rows with a document mask.

Extraction needs only the first `max(layer_ids) + 1` decoder layers: PackedTarget loads exactly those (no
later layers, no LM head) through dflash.core.target, hooks the K captured layers so they write straight
into one preallocated [rows, T, K*H] buffer, and never builds HF's full `output_hidden_states` tuple.
"""

from __future__ import annotations

import torch

from dflash.core.hybrid import (DocLayout, attention_masks, check_layer_kinds, document_block_mask, document_mask,
                                 with_documents)
from dflash.core.target import (LayerCapture, attention_implementation, load_causal_lm, load_config, text_config,
                                validate_layer_ids)


def packed_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool [R, T, T], True = attend: causal within each document (padding attends to padding)."""
    return document_mask(doc_ids)


def packed_block_mask(doc_ids: torch.Tensor):
    """The flex_attention BlockMask of packed_causal_mask."""
    return document_block_mask(doc_ids)


class PackedTarget:
    """The truncated frozen target plus capture: run(ids, pos, docs, out) fills out [R, T, K*H].

    Every layer kind keeps the row's conversations apart (dflash.core.hybrid): attention layers through a document
    mask per kind (sliding windows within their window), linear-attention layers per conversation. A kind that
    cannot be separated exactly is refused here, naming it, before anything loads."""

    def __init__(self, path: str, layer_ids: list[int], *, device="cpu", dtype=torch.float32, attn: str = "sdpa"):
        self.cfg = load_config(path)
        c = text_config(self.cfg)
        self.num_layers = c.num_hidden_layers
        self.layer_ids = validate_layer_ids(layer_ids, self.num_layers, path)
        self.hidden_size = c.hidden_size
        need = max(self.layer_ids) + 1
        self.kinds = check_layer_kinds(self.cfg, f"--target {path}", need)
        impl = attention_implementation(self.cfg, "flex_attention" if attn == "flex" else "sdpa")
        self.attn = "flex" if impl == "flex_attention" else "sdpa"  # what runs: Qwen3.5 has no flex attention
        self.impl = "flex" if impl == "flex_attention" else impl  # the masks' form (attention_masks)
        self.model = load_causal_lm(path, device=device, dtype=dtype, attn_impl=impl, num_layers=need,
                                    with_head=False)
        self.docs: DocLayout | None = None
        self.linear_layers = with_documents(self.model, lambda: self.docs)
        last = self.num_layers - 1
        self.capture = LayerCapture(self.model, self.layer_ids, final_norm_for=last if last in self.layer_ids else None)
        self.device = torch.device(device)

    def masks(self, doc_ids: torch.Tensor):
        dtype = next(self.model.parameters()).dtype
        return attention_masks(self.cfg, doc_ids, self.impl, dtype)

    @torch.inference_mode()
    def forward(self, model, input_ids, position_ids, doc_ids, buf: torch.Tensor, doc_host=None) -> None:
        """`model` (this target's model, or a compiled form of it) over the rows, the K layers into buf. doc_host:
        doc_ids' host copy, where the caller has one (a linear-attention target's layout then needs no sync)."""
        mask = self.masks(doc_ids)
        self.docs = DocLayout.of(doc_ids, host=doc_host) if self.linear_layers else None
        self.capture.out = buf
        try:
            model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
        finally:
            self.capture.out = None
            self.docs = None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor, out: torch.Tensor,
            doc_host: torch.Tensor | None = None):
        """One packed forward of [R, T] rows; padding positions of `out` are set to exact zeros."""
        self.forward(self.model, input_ids, position_ids, doc_ids, out, doc_host)
        out.masked_fill_((doc_ids == 0)[..., None], 0)  # true zeros, not -0.0: padding costs nothing compressed
        return out
