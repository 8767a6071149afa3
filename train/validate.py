"""Held-out validation for `dflash train --val-cache`: the training objective on rows the drafter never trains on.

A drafter learns its training rows by heart long before it stops improving on new text (the GPU recipe's drafter
expects tau 9.3 on its own rows and 6.5 on held-out ones). What users need to watch is the held-out figure, and
real speculative decoding (`dflash eval`) is too slow to run during training. The figure predicts eval's tau when
the held-out text is like the eval's: speculative decoding accepts what the teacher-forced draft accepts
(bench/tau_gap.py), but the GPU recipe's held-out conversations, regenerated after the target's own answers, are
mostly the target repeating itself, and its eval gets 2.2 on fresh answers (BENCHMARKS, GPU recipe, fourth run). The validation reads a
second cache, extracted from held-out conversations by the same target and layers, and computes on it what the
training step computes: the weighted block loss, the per-slot accuracy and the expected acceptance length tau
(1 + the mean over blocks of the longest correct prefix, what greedy verification accepts).

It runs at every checkpoint and at the end (rank 0; the other ranks wait), eager and without gradients. On a GPU
the drafter's flex attention is swapped for the exact split attention for the duration (train/attention.py: the
same masks, no compilation and no dense score matrix). The anchors are fixed (a seed per batch), so every
validation of a run, and of every run, measures the same blocks.
"""

from __future__ import annotations

import time

import torch

import dflash_cache

from .config import TrainError

VAL_SEED = 20_261_201  # fixed: every validation of every run draws the same anchors


class Validator:
    def __init__(self, path: str, train_cache, expect: dict, rows: int, batch_rows: int, num_anchors: int,
                 gamma: float, device: torch.device, threads: int = 4):
        try:
            self.cache = dflash_cache.open(path, expect=expect, threads=threads)
        except dflash_cache.CacheMismatchError as e:
            raise TrainError(f"--val-cache {path}: does not belong to --target: {e}") from e
        except dflash_cache.CacheError as e:
            raise TrainError(f"--val-cache {path}: {e}") from e
        c = self.cache
        if list(c.layer_ids) != list(train_cache.layer_ids):
            raise TrainError(f"--val-cache {path}: layers {list(c.layer_ids)}, but --cache has "
                             f"{list(train_cache.layer_ids)}: extract both with the same --num-context-layers/--layers")
        if num_anchors >= c.seq_len:
            raise TrainError(f"--val-cache {path}: rows of {c.seq_len} tokens cannot hold --num-anchors {num_anchors}")
        if len(c) == 0:
            raise TrainError(f"--val-cache {path}: has no rows")
        self.path = path
        self.rows = min(rows, len(c)) if rows else len(c)
        self.batch_rows = max(1, min(batch_rows, self.rows))
        self.num_anchors, self.gamma, self.dev = num_anchors, gamma, device

    def __call__(self, model) -> dict:
        """Loss, expected tau and per-slot accuracy over the first `rows` rows (weighted by blocks and labels)."""
        t0 = time.perf_counter()
        impl = model.attn_impl
        if impl == "flex":
            model.attn_impl = "split"
        gen = torch.Generator(device=self.dev)
        loss_w = w_sum = tau_b = blocks = 0.0
        hits = count = None
        try:
            with torch.no_grad():
                for b, lo in enumerate(range(0, self.rows, self.batch_rows)):
                    idx = list(range(lo, min(lo + self.batch_rows, self.rows)))
                    x = {k: v.to(self.dev) for k, v in self.cache.read_rows(idx, check=True, raw=True).items()}
                    gen.manual_seed(VAL_SEED + b)
                    scores = torch.rand(len(idx), self.cache.seq_len, generator=gen, device=self.dev)
                    _, met = model.forward_train(x["hidden"], x["input_ids"], x["loss_mask"], x["doc_ids"], scores,
                                                 self.num_anchors, self.gamma, x.get("hidden_scales"))
                    w, nb = float(met["weight"]), float(met["blocks"])
                    loss_w += float(met["loss"]) * w
                    w_sum += w
                    tau_b += (float(met["tau"]) - 1.0) * nb
                    blocks += nb
                    h = (met["slot_acc"] * met["slot_count"]).double().cpu()
                    n = met["slot_count"].double().cpu()
                    hits, count = (h, n) if hits is None else (hits + h, count + n)
        finally:
            model.attn_impl = impl
        return {"val_loss": loss_w / w_sum if w_sum else float("nan"),
                "val_tau_expected": 1.0 + tau_b / blocks if blocks else 1.0,
                "val_slot_acc": (hits / count.clamp(min=1)).tolist() if hits is not None else [],
                "val_rows": self.rows, "val_blocks": int(blocks), "val_s": time.perf_counter() - t0}
