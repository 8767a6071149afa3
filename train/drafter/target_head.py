"""The target's pieces the drafter borrows: its frozen embedding and LM head, and the mask token id."""

from __future__ import annotations

import json
import os

import torch

from dflash.core.config import ConfigError
from dflash.core.target import load_causal_lm, load_config, resolve_target, text_config


def load_target_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding weight, LM head weight) of the target, reading only those tensors when possible."""
    d, gguf = resolve_target(path)
    cfg = text_config(load_config(path))
    if gguf is None:
        from safetensors import safe_open

        index = os.path.join(d, "model.safetensors.index.json")
        files = {}
        if os.path.exists(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(d, "model.safetensors")):
            with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
                files = {k: "model.safetensors" for k in f.keys()}

        def get(names):
            for n in names:
                if n in files:
                    with safe_open(os.path.join(d, files[n]), "pt") as f:
                        return f.get_tensor(n)
            return None

        emb = get(["model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight"])
        head = get(["lm_head.weight", "model.lm_head.weight"])
        if emb is not None and (head is not None or cfg.tie_word_embeddings):
            return emb, head if head is not None else emb
    model = load_causal_lm(path, dtype=torch.float32)
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()


def resolve_mask_token_id(tokenizer, vocab_size: int, override: int | None) -> int:
    """An id the target never produces: the first embedding row beyond the tokenizer (Qwen3: 151669),
    else a reserved special token that the chat template does not use; --mask-token-id overrides."""
    if override is not None:
        if not 0 <= override < vocab_size:
            raise ConfigError(f"--mask-token-id {override} is outside the target vocabulary [0, {vocab_size})")
        return override
    n = len(tokenizer)
    if vocab_size > n:
        return n
    template = str(getattr(tokenizer, "chat_template", "") or "")
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    special = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    special.update({i: tokenizer.convert_ids_to_tokens(i) for i in tokenizer.all_special_ids})
    cands = [i for i, tok in sorted(special.items()) if i not in used and tok and tok not in template and i < vocab_size]
    if not cands:
        raise ConfigError(f"the target's vocabulary ({vocab_size}) has no unused id for the mask token; pass --mask-token-id")
    return cands[-1]
