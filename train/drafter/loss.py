"""The training objective and its metrics: slot-weighted cross-entropy over a block's slots 1..B-1.

Slot k (k >= 1) of a block predicts the token at anchor+k with weight exp(-(k-1)/gamma); labels outside the
anchor's document or not supervised weigh 0; the loss is the weighted sum over the normalised weights.
`chunked_block_loss` computes it from the drafter's normalised slot outputs without ever holding the
[slots, vocab] logits (`_LinearCrossEntropy`, chunk by chunk through `linear_ce_chunk`); `block_loss` is the
reference form from full logits.
Metrics (per-slot accuracy, expected acceptance length tau, block and weight counts, the drafts accepted at
each anchor) are tensors: no host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.train.drafter.blocks import Blocks

def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B] weights: 0 for slot 0, exp(-(k-1)/gamma) for slots k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def linear_ce_chunk(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor):
    """One chunk of _LinearCrossEntropy: for x [c, H] against the frozen head weight [V, H], the weighted cross-entropy
    sum_i w_i * CE(x_i @ W^T, y_i), the argmax per slot, and the gradient of that sum w.r.t. x. Pure tensor code: the
    compiled step compiles it once and calls it for every chunk (train/fit/compile_step.py)."""
    logits = (x @ weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    total = ((lse - logits.gather(1, labels[:, None])[:, 0]) * w).sum()
    pred = logits.argmax(-1)
    p = torch.exp(logits - lse[:, None])  # softmax; d CE / d logits = p - onehot(y)
    p = p.scatter_add(1, labels[:, None], -torch.ones_like(lse)[:, None]) * w[:, None]
    return total, pred, (p.to(x.dtype) @ weight).to(x.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(x_i @ W^T, y_i) and argmax_i, computed chunk by chunk (chunk_fn: linear_ce_chunk or a compiled
    copy of it) with the gradient w.r.t. x formed on the fly, so the [slots, vocab] logits never exist at once (W is
    frozen: no grad). A 4 x 512 x 15-slot batch over a 152k vocabulary would otherwise hold ~19 GB of float32
    logits."""

    @staticmethod
    def forward(ctx, x, weight, labels, w, chunk: int, chunk_fn):
        n = x.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad = torch.empty_like(x)
        preds = []
        for s in range(0, n, chunk):
            t, pred, g = chunk_fn(x[s:s + chunk], weight, labels[s:s + chunk], w[s:s + chunk])
            total = total + t
            preds.append(pred)
            grad[s:s + chunk] = g
        pred = torch.cat(preds)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(pred)
        return total, pred

    @staticmethod
    def backward(ctx, g_total, g_pred):
        (grad,) = ctx.saved_tensors
        return grad * g_total.to(grad.dtype), None, None, None, None, None


def ce_chunk(vocab: int, budget_bytes: int = 1 << 30) -> int:
    """Slots per chunk so that one chunk's float32 logits stay near budget_bytes."""
    return max(256, budget_bytes // (4 * vocab))


def even_chunk(n: int, most: int) -> int:
    """Slots per chunk for n slots, at most `most`: as few chunks as that allows, of one size when a count of chunks
    at most 3 above the fewest divides n (a compiled chunk then has one shape), else even with a shorter last one.
    4 x 512 x 15 slots over a 151,936 vocabulary: 20 chunks of 1,536 (1,766 allowed)."""
    fewest = -(-n // max(1, most))
    for k in range(fewest, fewest + 4):
        if n % k == 0:
            return n // k
    return -(-n // fewest)


def chunked_block_loss(h: torch.Tensor, lm_head: torch.Tensor, blocks: Blocks, gamma: float, chunk_fn=linear_ce_chunk):
    """The objective from the drafter's normalised slot outputs h [R, N, B-1, H] (no full logits)."""
    R, N, Bm1, H = h.shape
    labels = blocks.labels[..., 1:]
    valid = blocks.label_valid[..., 1:]
    w = slot_weights(Bm1 + 1, gamma, h.device)[1:]
    wv = w * valid.float()
    denom = wv.sum()
    n = R * N * Bm1
    total, pred = _LinearCrossEntropy.apply(h.reshape(-1, H), lm_head, labels.reshape(-1), wv.reshape(-1),
                                            even_chunk(n, ce_chunk(lm_head.shape[0])), chunk_fn)
    loss = total / denom.clamp(min=1e-6)
    return loss, block_metrics(pred.view(R, N, Bm1), blocks, loss, denom)


def block_loss(logits: torch.Tensor, blocks: Blocks, gamma: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reference form of the objective from full logits [R, N, B-1, V]: weighted CE over slots 1..B-1."""
    R, N, Bm1, V = logits.shape
    labels = blocks.labels[..., 1:]
    valid = blocks.label_valid[..., 1:]
    w = slot_weights(Bm1 + 1, gamma, logits.device)[1:]
    ce = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), reduction="none").view(R, N, Bm1)
    wv = w * valid.float()
    denom = wv.sum()
    loss = (ce * wv).sum() / denom.clamp(min=1e-6)
    return loss, block_metrics(logits.argmax(-1), blocks, loss, denom)


def block_metrics(pred: torch.Tensor, blocks: Blocks, loss: torch.Tensor, denom: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-slot accuracy and the expected acceptance length from argmax predictions [R, N, B-1]."""
    labels = blocks.labels[..., 1:]
    valid = blocks.label_valid[..., 1:]
    with torch.no_grad():
        correct = (pred == labels) & valid
        slot_valid = valid.float().sum((0, 1))
        slot_acc = correct.float().sum((0, 1)) / slot_valid.clamp(min=1)
        # verification accepts the longest correct prefix: tau = 1 + sum_k prod_{j<=k} correct_j
        accepted = torch.cumprod(correct.float(), dim=-1).sum(-1)
        av = blocks.anchor_valid.float()
        n_blocks = av.sum()
        accepted = accepted * av  # [R, N]: drafts accepted at each anchor (0 for an invalid anchor)
        tau = 1 + accepted.sum() / n_blocks.clamp(min=1)
    return {"loss": loss.detach(), "slot_acc": slot_acc, "slot_count": slot_valid, "tau": tau,
            "blocks": n_blocks, "weight": denom.detach(), "accepted": accepted}
