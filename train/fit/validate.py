"""Held-out validation for `dflash train --val-cache`: the drafter on rows it never trains on, as decoding sees it.

A drafter learns its training rows by heart long before it stops improving on new text, and real speculative
decoding (`dflash eval`) is too slow to run during training. The validation reads a second cache, extracted from
held-out conversations by the same target and layers, drafts a block at EVERY position that can anchor one (each
block sees the context before its anchor and itself, never another block: so drafting them all at once is
drafting them one by one), and reports:
  * val_tau_decode: greedy speculative decoding simulated along each held-out answer: the answer's first token
    comes from the prompt's forward, then every step drafts after the last token, accepts the longest correct
    prefix of the draft and adds the target's bonus token (decode_walk). Speculative decoding accepts exactly
    what the teacher-forced draft accepts at the same anchor (71 of 71 steps where the two were compared), so on
    answers the target itself wrote (regenerated, greedy) this is what `dflash eval` would measure on them;
  * val_tau_expected: the training step's figure, 1 + the mean over ALL anchors of the longest correct prefix.
    It weighs every position alike, where decoding passes through easy stretches in a few long steps and spends
    many short steps on hard ones, so it overstates tau wherever a text mixes the two (the GPU recipe's drafter:
    8.51 here against eval's 3.53; BENCHMARKS.md, "Decoding and quality");
  * the weighted block loss and the per-slot accuracy, as the training step computes them.
A DFlash2 drafter (train/drafter/dflash2.py) is scored against the target's argmax, read from the last hidden state the
held-out cache must then hold (`dflash extract --last-hidden`, as the training cache): its loss is the training
objective (teacher forced), its drafts those of the selector's greedy path (DFlash2Drafter.forward_blocks), so a
block's accepted prefix is what `dflash eval` drafting it with greedy_selector_path and verifying it accepts.

It runs at every checkpoint and at the end (rank 0; the other ranks wait), eager and without gradients, with as
many blocks per forward as a training step has. On a GPU the drafter's flex attention is swapped for the exact
split attention for the duration (train/drafter/attention.py: the same masks, no compilation and no dense score matrix).
Nothing is random: every validation of a run, and of every run, measures the same blocks.
"""

from __future__ import annotations

import time

import numpy as np
import torch

import dflash_cache

from dflash.train.drafter.blocks import anchor_positions
from dflash.train.fit.config import TrainError


class Validator:
    def __init__(self, path: str, train_cache, expect: dict, rows: int, batch_rows: int, num_anchors: int,
                 gamma: float, device: torch.device, threads: int = 4, max_new_tokens: int = 0,
                 keep_accepted: bool = False, last_hidden: bool = False):
        try:
            self.cache = dflash_cache.open(path, expect=expect, threads=threads)
        except dflash_cache.CacheMismatchError as e:
            raise TrainError(f"--val-cache {path}: does not belong to --target: {e}") from e
        except dflash_cache.CacheError as e:
            raise TrainError(f"--val-cache {path}: {e}") from e
        c = self.cache
        if last_hidden and not c.last_hidden:
            raise TrainError(f"--val-cache {path}: does not hold the target's last hidden state, which --arch dflash2 "
                             "validates against: extract it with `dflash extract ... --last-hidden`")
        if list(c.context_layer_ids) != list(train_cache.context_layer_ids):
            raise TrainError(f"--val-cache {path}: layers {list(c.context_layer_ids)}, but --cache has "
                             f"{list(train_cache.context_layer_ids)}: extract both with the same "
                             "--num-context-layers/--layers")
        mine, theirs = (x.spec.basis.get("digest") if x.spec.basis else None for x in (c, train_cache))
        if mine != theirs:  # a drafter on one basis reads features on that basis only (dflash_cache/basis.py)
            raise TrainError(f"--val-cache {path}: field 'basis.digest' is {mine!r}, but --cache has {theirs!r}: its "
                             "features are on another basis; extract it with `dflash extract ... --basis-from "
                             f"{getattr(train_cache, 'path', 'CACHE')}`")
        if len(c) == 0:
            raise TrainError(f"--val-cache {path}: has no rows")
        self.path = path
        self.rows = min(rows, len(c)) if rows else len(c)
        self.batch_rows = max(1, min(batch_rows, self.rows))
        self.num_anchors, self.gamma, self.dev = num_anchors, gamma, device
        self.max_new_tokens = max_new_tokens
        self.keep_accepted = keep_accepted  # keep (accepted, loss_mask, doc_ids) per row of the last call: walks
        self.accepted: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # at other max_new_tokens (benchmarks)

    def __call__(self, model) -> dict:
        """Loss, expected and decoding tau and per-slot accuracy over the first `rows` rows, a block at every
        position that can anchor one (weighted by blocks and labels)."""
        t0 = time.perf_counter()
        impl = model.attn_impl
        if impl == "flex":
            model.attn_impl = "split"
        budget = self.batch_rows * self.num_anchors  # blocks per forward: the training step's
        loss_w = w_sum = tau_b = blocks = 0.0
        walk = [0, 0]  # tokens, steps of the simulated decoding
        self.accepted = []
        hits = count = None
        try:
            with torch.no_grad():
                for lo in range(0, self.rows, self.batch_rows):
                    idx = list(range(lo, min(lo + self.batch_rows, self.rows)))
                    host = self.cache.read_rows(idx, check=True, raw=True)
                    x = {k: v.to(self.dev) for k, v in host.items()}
                    lm_host, doc_host = host["loss_mask"].numpy(), host["doc_ids"].numpy()
                    valid = anchor_positions(x["loss_mask"], x["doc_ids"])
                    n = int(valid.sum(1).max())
                    if n == 0:
                        continue
                    per = max(1, budget // n)  # rows per forward
                    for a in range(0, len(idx), per):
                        part = {k: v[a:a + per] for k, v in x.items()}
                        bl, masks = model.prepare(part["input_ids"], part["loss_mask"], part["doc_ids"],
                                                  valid[a:a + per].float(), n)
                        _, met = model.forward_blocks(part["hidden"], bl, masks, self.gamma, part.get("hidden_scales"))
                        w, nb = float(met["weight"]), float(met["blocks"])
                        loss_w += float(met["loss"]) * w
                        w_sum += w
                        tau_b += (float(met["tau"]) - 1.0) * nb
                        blocks += nb
                        h = (met["slot_acc"] * met["slot_count"]).double().cpu()
                        c = met["slot_count"].double().cpu()
                        hits, count = (h, c) if hits is None else (hits + h, count + c)
                        acc = torch.zeros_like(part["doc_ids"], dtype=torch.long)
                        acc.scatter_(1, bl.anchors, met["accepted"].round().long() * bl.anchor_valid)
                        acc_host = acc.cpu().numpy()
                        for r in range(acc_host.shape[0]):
                            row = (acc_host[r], lm_host[a + r], doc_host[a + r])
                            if self.keep_accepted:
                                self.accepted.append(row)
                            t, st = decode_walk(*row, self.max_new_tokens)
                            walk[0] += t
                            walk[1] += st
        finally:
            model.attn_impl = impl
        return {"val_loss": loss_w / w_sum if w_sum else float("nan"),
                "val_tau_expected": 1.0 + tau_b / blocks if blocks else 1.0,
                "val_tau_decode": walk[0] / walk[1] if walk[1] else 1.0,
                "val_slot_acc": (hits / count.clamp(min=1)).tolist() if hits is not None else [],
                "val_rows": self.rows, "val_blocks": int(blocks), "val_s": time.perf_counter() - t0}


def answer_spans(loss_mask: np.ndarray, doc_ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of supervised tokens of one real document in a row: an answer each."""
    sup = (loss_mask > 0) & (doc_ids > 0)
    spans, s, T = [], 0, len(sup)
    while s < T:
        if not sup[s]:
            s += 1
            continue
        e = s
        while e < T and sup[e] and doc_ids[e] == doc_ids[s]:
            e += 1
        spans.append((s, e))
        s = e
    return spans


def decode_walk(accepted: np.ndarray, loss_mask: np.ndarray, doc_ids: np.ndarray,
                max_new_tokens: int = 0) -> tuple[int, int]:
    """Greedy speculative decoding simulated along one row's supervised spans (each a run of supervised tokens
    of one document: an answer): its first token comes from the prompt's forward, then every step drafts after
    the last token p, accepts accepted[p] drafts and adds the target's bonus token, until the span's last
    token, or until max_new_tokens tokens of the answer are out (0: no limit; the last step counts in full, as
    in `dflash eval`). Returns (tokens produced by the steps, steps); tokens / steps is what `dflash eval` calls
    tau."""
    tokens = steps = 0
    for s, e in answer_spans(loss_mask, doc_ids):
        p = s
        while p < e - 1 and (not max_new_tokens or p - s + 1 < max_new_tokens):
            n = int(accepted[p]) + 1
            tokens += n
            steps += 1
            p += n
    return tokens, steps
