"""Real tau against the training objective's tau on the same text: where does a drafter lose acceptance?

For each prompt, speculative decoding (train/decode.py) records every step's anchor (the position of the token
the block starts from) and how many drafts the target accepted. Then the target runs once over prompt + output,
and the drafter drafts, teacher-forced, from every position of the output (the training objective's view: the
context is the target's hidden states strictly before the anchor, exactly what `dflash train` measures as the
expected tau). Three figures per prompt:

  real tau                 what decoding got (accepted + 1 per step)
  forced tau, same anchors the teacher-forced acceptance at decoding's own anchors: equal to the real tau when the
                           decoding path gives the drafter what training gave it (a mismatch here is a bug)
  forced tau, all anchors  the mean over every position of the output (uniform anchors, as in training)

    python bench/tau_gap.py --target W/target --drafter W/run/final --prompts W/data/heldout.jsonl --n 8

--conversations DATA (a regenerated dataset, e.g. `dflash regenerate`'s output) instead measures the training
text itself, per assistant turn of each conversation (tokenised as `dflash extract` does): the forced tau over
the turn's positions, and the share of its 4-grams that already occur earlier in the conversation (how much of
the answer repeats what came before).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def forced_accepts(drafter, ctx_hidden, full: list[int], anchors: list[int], limit: int) -> list[int]:
    """Accepted drafts at each anchor p: the drafter's block [full[p], MASK..] at positions p.. with the target's
    hidden states of positions < p as context, compared with full[p+1 : p+B] (at most limit - p - 1 tokens)."""
    import torch

    B = drafter.cfg.block_size
    dev = ctx_hidden.device
    cache = drafter.new_cache(1, ctx_hidden.shape[1] + 1)
    drafter.extend_context(cache, ctx_hidden, torch.arange(ctx_hidden.shape[1], device=dev)[None])
    out = []
    for p in anchors:
        cache.length = p
        block = torch.full((1, B), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
        block[0, 0] = full[p]
        draft = drafter.draft_block(cache, block, torch.arange(p, p + B, device=dev)[None])[0].argmax(-1).tolist()
        truth = full[p + 1: min(p + B, limit)]
        acc = 0
        for d, t in zip(draft, truth):
            if d != t:
                break
            acc += 1
        out.append(acc)
    cache.length = ctx_hidden.shape[1]
    return out


def per_turn(a, tok, drafter, target) -> None:
    """Forced tau and 4-gram repetition per assistant turn of the first --n conversations of --conversations."""
    import numpy as np
    import torch

    from dflash.core.chat import load_chat_dataset, row_messages
    from dflash.extract.data import ChatTokenizer
    from dflash.train.validate import answer_spans

    chat = ChatTokenizer(tok)
    ds = load_chat_dataset(a.conversations)
    turns: dict[int, list[tuple[float, float]]] = {}
    for r in range(min(a.n, len(ds))):
        ids, mask = chat.encode(row_messages(ds[r], r, a.conversations))
        ids, mask = ids[: a.max_len], mask[: a.max_len]
        runs = answer_spans(np.asarray(mask), np.ones(len(mask), np.int64))  # one assistant turn each
        with torch.inference_mode():
            target.reset()
            _, hidden = target.forward(torch.tensor([ids], device=target.device), 0, hidden=True)
            for k, (lo, hi) in enumerate(runs):
                if hi - lo < 2:
                    continue
                acc = forced_accepts(drafter, hidden, ids, list(range(lo, hi - 1)), hi)
                seen = {tuple(ids[j:j + 4]) for j in range(max(0, lo - 3))}
                grams = [tuple(ids[j:j + 4]) for j in range(lo, hi - 3)]
                rep = sum(g in seen for g in grams) / max(1, len(grams))
                turns.setdefault(k + 1, []).append((1 + sum(acc) / len(acc), rep))
    rows = {k: {"conversations": len(v), "forced_tau": sum(x[0] for x in v) / len(v),
                "repeated_4grams": sum(x[1] for x in v) / len(v)} for k, v in sorted(turns.items())}
    for k, v in rows.items():
        print(f"assistant turn {k}: {v['conversations']} conversations, forced tau {v['forced_tau']:.2f}, "
              f"4-grams already earlier in the conversation {v['repeated_4grams']:.0%}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"per_turn": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", help="jsonl of {messages} (the eval's prompt file)")
    ap.add_argument("--conversations", help="a regenerated dataset: measure its turns instead of decoding prompts")
    ap.add_argument("--max-len", type=int, default=2048, help="--conversations: tokens kept per conversation")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json")
    a = ap.parse_args()
    if bool(a.prompts) == bool(a.conversations):
        ap.error("give one of --prompts and --conversations")

    import torch

    from dflash.core.chat import eos_ids_of
    from dflash.train.decode import speculative
    from dflash.train.drafting import DFlashProposer
    from dflash.train.eval import EvalConfig, load_for_decoding, load_prompts

    tok, model, drafter, target = load_for_decoding(a.target, a.drafter, getattr(torch, a.dtype),
                                                    torch.device(a.device))
    dev = target.device
    if a.conversations:
        return per_turn(a, tok, drafter, target)
    cfg = EvalConfig(target=a.target, drafter=a.drafter, data=a.prompts, max_prompts=a.n, max_new_tokens=a.max_new)
    prompts = load_prompts(cfg, tok)
    eos = eos_ids_of(model, tok)
    rows = []
    for i, prompt in enumerate(prompts):
        prop = DFlashProposer(drafter, len(prompt) + a.max_new + drafter.cfg.block_size + 1, graph=False)
        res = speculative(target, prop, prompt, a.max_new, eos)
        gen = res.tokens
        full = list(prompt) + gen
        limit = len(full)
        anchors, p = [], len(prompt)
        for acc1 in res.accept_lengths:
            anchors.append(p)
            p += acc1
        with torch.inference_mode():
            target.reset()
            _, hidden = target.forward(torch.tensor([full], device=dev), 0, hidden=True)
            same = forced_accepts(drafter, hidden, full, anchors, limit)
            every = forced_accepts(drafter, hidden, full, list(range(len(prompt), limit - 1)), limit)
        real = [x - 1 for x in res.accept_lengths]
        # the last decoding step may be cut by max_new or end at EOS: compare the steps whose block lies inside
        agree = sum(int(r == s or (r >= s and anchors[k] + s + 1 >= limit - 1))
                    for k, (r, s) in enumerate(zip(real, same)))
        row = {"prompt": i, "prompt_tokens": len(prompt), "new_tokens": len(gen), "steps": len(real),
               "real_tau": 1 + sum(real) / len(real), "forced_tau_same_anchors": 1 + sum(same) / len(same),
               "forced_tau_all_anchors": 1 + sum(every) / max(1, len(every)), "steps_agreeing": agree,
               "real": real, "forced_same": same}
        rows.append(row)
        print(f"prompt {i}: {len(prompt)} + {len(gen)} tokens, {len(real)} steps: real tau {row['real_tau']:.2f}, "
              f"forced at the same anchors {row['forced_tau_same_anchors']:.2f} ({agree}/{len(real)} steps agree), "
              f"forced at every position {row['forced_tau_all_anchors']:.2f}", flush=True)
    tot = lambda k: sum(r[k] * r["steps"] for r in rows) / sum(r["steps"] for r in rows)  # noqa: E731
    summary = {"prompts": len(rows), "real_tau": tot("real_tau"),
               "forced_tau_same_anchors": tot("forced_tau_same_anchors"),
               "forced_tau_all_anchors": sum(r["forced_tau_all_anchors"] for r in rows) / len(rows),
               "steps_agreeing": sum(r["steps_agreeing"] for r in rows), "steps": sum(r["steps"] for r in rows)}
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
