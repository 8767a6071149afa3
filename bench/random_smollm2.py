"""A random-weights model of SmolLM2-135M-Instruct's shape (Llama: 30 layers, hidden 576, intermediate 1536,
9 heads / 3 KV heads, vocab 49152, tied embeddings), saved with a given tokenizer: for measuring the GPU
recipe's stages (regeneration, extraction, training, eval step times) where the real GGUF is not at hand.
A random model never emits end-of-sequence, so every generation runs to max-new-tokens (an upper bound on
the regeneration's cost); its tau is meaningless.

    python bench/random_smollm2.py --tokenizer TOKDIR --out /root/work/random-smollm2 [--layers 30 --hidden 576]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="A tokenizer folder (save_pretrained layout, with a chat template).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(a.out, "config.json")):
        print(f"{a.out} exists")
        return
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    cfg = LlamaConfig(vocab_size=max(a.vocab, len(tok)), hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"random {a.layers}-layer Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M) -> {a.out}")


if __name__ == "__main__":
    main()
