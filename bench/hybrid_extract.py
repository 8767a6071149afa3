"""Extraction from a hybrid target (Qwen3.6-27B-shaped: Gated DeltaNet + full attention), against its pure forward.

Feeds BENCHMARKS.md, "Hybrid targets". On one GPU, random bf16 weights of the real shape (hidden 5120, MLP 17408,
linear attention 16 key / 48 value heads of 128, full attention 24 / 4 heads of 256, vocab 248,320), the first
--layers of its 64 layers (3 linear to 1 full), packed rows of --seq-len tokens of synthetic chats:

  pure       the model's plain forward over the rows (transformers' own kernels: flash-linear-attention's where
             installed; conversations NOT separated, no capture): the bar's reference
  packed     PackedTarget.run as `dflash extract` runs it eagerly: flex document masks, the varlen delta rule over
             each conversation (dflash/core/hybrid.py), K layers captured
  compiled   the compiled forward extract/compiled.py builds, after its check against eager
  e2e        `dflash extract` end to end into /dev/shm (fp8, the preset's layers scaled to --layers), tok/s of real
             tokens less the compile (the command's own report)
and on the first rows, per conversation, the packed features against the conversation run alone through the same
model (bf16; first conversations of a row vs later ones: equal error levels mean the state does not carry over).

    python bench/hybrid_extract.py --layers 8 --rows 4 --json hybrid.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from bench.common import hardware, synthetic_chats, write_jsonl  # noqa: E402

QWEN36_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                  num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  max_position_embeddings=262144, tie_word_embeddings=False)


def hybrid_dir(path: str, layers: int) -> str:
    import transformers as tf
    from tiny import make_tiny_tokenizer

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    cfg = tf.Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=kinds, **QWEN36_27B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def batches(target_dir: str, data: str, seq_len: int, rows: int, n: int, from_end: bool = False):
    from dflash.core.chat import load_chat_dataset
    from dflash.core.target import load_tokenizer
    from dflash.extract.data import ChatTokenizer, tokenize_dataset
    from dflash.extract.pack import materialize, pack

    tok = load_tokenizer(target_dir)
    d = tokenize_dataset(load_chat_dataset(data), ChatTokenizer(tok), seq_len, data, progress=False)
    plan = pack(d.lengths, seq_len)
    out = []
    first = (len(plan) // rows - n) * rows if from_end else 0  # the packer places the longest conversations first
    for b in range(n):
        arr = materialize(plan, d.docs, seq_len, 0, first + b * rows, first + (b + 1) * rows)
        b = {k: torch.from_numpy(arr[k]).long().cuda() for k in ("input_ids", "position_ids", "doc_ids")}
        b["doc_host"] = torch.from_numpy(arr["doc_ids"]).long()  # as `dflash extract` has it: no device-to-host sync
        out.append(b)
    return out, plan


def rate(fn, bs, real_tokens) -> float:
    fn(bs[0])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in bs[1:]:
        fn(b)
    torch.cuda.synchronize()
    return real_tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--chats", type=int, default=600)
    ap.add_argument("--from-end", action="store_true", help="the plan's last rows (the most conversations a row)")
    ap.add_argument("--skip", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--work", default="/root/bench-hybrid")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    res: dict = {"hardware": hardware(), "layers": a.layers, "rows": a.rows, "seq_len": a.seq_len,
                 "from_end": a.from_end}

    def save():
        print(json.dumps(res, indent=1), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)

    try:
        import fla  # noqa: F401
        res["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        res["fla"] = f"not importable: {e}"
    os.makedirs(a.work, exist_ok=True)
    target = hybrid_dir(os.path.join(a.work, f"qwen3.6-27b-{a.layers}l"), a.layers)
    data = write_jsonl(os.path.join(a.work, "chats.jsonl"), synthetic_chats(a.chats, mean_tokens=900))
    bs, plan = batches(target, data, a.seq_len, a.rows, a.batches, a.from_end)
    real = sum(int((b["doc_ids"] != 0).sum()) for b in bs[1:])
    res["conversations_per_row"] = round(sum(int((b["doc_ids"].diff(dim=1) > 0).sum()) + int((b["doc_ids"][:, 0] > 0)
                                             .sum()) for b in bs) / (a.rows * a.batches), 2)
    layer_ids = sorted({1, a.layers // 4, a.layers // 2, (3 * a.layers) // 4, a.layers - 2})

    from dflash.core.target import load_causal_lm
    from dflash.extract.compiled import compiled_or_eager
    from dflash.extract.target import PackedTarget

    if "pure" not in skip:
        model = load_causal_lm(target, device="cuda", dtype=torch.bfloat16, attn_impl="sdpa", with_head=False)
        with torch.inference_mode():
            res["pure_tok_s"] = round(rate(lambda b: model(input_ids=b["input_ids"], use_cache=False), bs, real))
        del model
        torch.cuda.empty_cache()
        save()
    pt = PackedTarget(target, layer_ids, device="cuda", dtype=torch.bfloat16, attn="flex")
    R, T = bs[0]["input_ids"].shape
    out = torch.empty(R, T, len(layer_ids) * 5120, dtype=torch.bfloat16, device="cuda")
    if "packed" not in skip:
        res["packed_tok_s"] = round(rate(lambda b: pt.run(b["input_ids"], b["position_ids"], b["doc_ids"], out,
                                                          doc_host=b["doc_host"]),
                                         bs, real))
        save()
    if "errors" not in skip:
        most = max(bs, key=lambda b: int((b["doc_ids"].diff(dim=1) != 0).sum()))  # the most conversations
        res["per_conversation"] = conversation_errors(pt, most, layer_ids)
        save()
    if "compiled" not in skip:
        first = (bs[0]["input_ids"], bs[0]["position_ids"], bs[0]["doc_ids"])
        runner, report = compiled_or_eager(pt, first)
        res["compile_report"] = {k: v for k, v in report.items() if k in ("passed", "compiled", "why", "seconds",
                                                                         "err_compiled_vs_ref", "err_eager_vs_ref")}
        if report.get("compiled"):
            res["compiled_tok_s"] = round(rate(lambda b: runner.run(b["input_ids"], b["position_ids"], b["doc_ids"],
                                                                     out, doc_host=b["doc_host"]), bs, real))
        save()
    del pt
    torch.cuda.empty_cache()
    if "e2e" not in skip:
        cache = "/dev/shm/hybrid-cache"
        cmd = [sys.executable, "-m", "dflash", "extract", "--target", target, "--data", data, "--out", cache,
               "--seq-len", str(a.seq_len), "--layers", ",".join(map(str, layer_ids)), "--hidden-dtype", "fp8",
               "--no-progress", "--overwrite", "--tokenize-cache", "off"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        res["e2e"] = {"seconds": round(time.perf_counter() - t0, 1), "rc": p.returncode,
                      "tail": (p.stdout + p.stderr)[-1500:], "command": " ".join(cmd[1:])}
        save()


def conversation_errors(pt, batch: dict, layer_ids: list[int]) -> dict:
    """Relative error of each conversation's packed features against it run alone (bf16, same GPU), split into the
    first conversation of each row and the later ones; and the same for the rows without separation."""
    from dflash.core.hybrid import DocLayout

    model = pt.model
    ids, doc = batch["input_ids"], batch["doc_ids"]
    R, T = ids.shape
    K = len(layer_ids)
    out = torch.zeros(R, T, K * 5120, dtype=torch.bfloat16, device="cuda")
    pt.run(ids, batch["position_ids"], doc, out)
    plain = torch.zeros_like(out)  # no separation: one causal sequence per row (what a plain forward computes)
    pt.capture.out = plain
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    pt.capture.out = None
    first, later, plain_later = [], [], []
    lay = DocLayout.of(doc)
    prev_row = -1
    for (r, s, e), real in zip(lay.segments, lay.real):
        is_first, prev_row = r != prev_row, r
        if not real:
            continue
        alone = torch.zeros(1, e - s, K * 5120, dtype=torch.bfloat16, device="cuda")
        pt.capture.out = alone
        with torch.inference_mode():
            model(input_ids=ids[r:r + 1, s:e], use_cache=False)
        pt.capture.out = None
        a = alone[0].float()
        err = float((out[r, s:e].float() - a).norm() / a.norm())
        (first if is_first else later).append(err)
        if not is_first:
            plain_later.append(float((plain[r, s:e].float() - a).norm() / a.norm()))
    mx = lambda x: round(max(x), 5) if x else None  # noqa: E731
    return {"first_max": mx(first), "later_max": mx(later), "later_n": len(later),
            "unseparated_later_max": mx(plain_later)}


if __name__ == "__main__":
    main()
