"""The DFlash2 drafter as a proposer of train/evaluate/decode.py's loop: one drafter forward per step, then the candidate
selector's greedy pass over the block.

After the forward (the slots' normalised outputs h_1..h_{B-1}), each slot's unary top-k (`selector_top_k`) is
reranked left to right: slot 1's predecessor is the last confirmed token, and each later slot's is the candidate
chosen for the slot before it; a slot's draft is its candidate of the highest score (unary logit + the selector's
bilinear term, train/drafter/dflash2.py). This is the greedy path speculators' DFlash2 metrics follow (its `eal`); the
drafted block is then verified as any other, so decoding stays lossless.

The pass is B-1 steps of fixed-shape tensor ops (top-k, gathers, an argmax): nothing reads a value back to the host,
so it is part of the drafter's fixed-shape step. DFlash2Proposer drafts as DFlashProposer does (train/evaluate/drafting.py):
eagerly, or with graph=True through StaticDraft2, the same static step as StaticDraft's with the selector's pass in
place of the LM head's argmax, captured once as one CUDA graph on a GPU and replayed (run eagerly on a CPU, where
it is tested against the eager path), checked once against the eager step (selector_disagreement).
"""

from __future__ import annotations

import torch

from dflash.train.drafter.dflash2 import DFlash2Drafter
from dflash.train.evaluate.drafting import DFlashProposer, StaticDraft, draft_disagreement


def greedy_selector_path(drafter: DFlash2Drafter, h: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The draft [B-1] from slot outputs h [B-1, H] after the confirmed token `last` (a tensor of one element): per
    slot, the unary top-k reranked with the previous slot's choice as predecessor. Fixed shapes, no host sync."""
    candidates = (h @ drafter.lm_head_weight.t()).topk(drafter.cfg.selector_top_k, dim=-1).indices  # [B-1, k]
    prev = last.reshape(1)
    out = []
    for s in range(h.shape[0]):
        scores = drafter.selector_scores(h[s:s + 1], prev, candidates[s:s + 1])  # [1, k]
        prev = candidates[s:s + 1].gather(1, scores.argmax(-1, keepdim=True))[:, 0]  # [1]
        out.append(prev)
    return torch.cat(out)


def selector_disagreement(drafter: DFlash2Drafter, got: torch.Tensor, h: torch.Tensor,
                          last: torch.Tensor) -> str | None:
    """None when the draft `got` [B-1] is the greedy path's over the eager slot outputs h [B-1, H] up to near ties:
    with each slot's predecessor taken from `got` itself, its choice must score within draft_disagreement's
    tolerance of the best of the eager top-k."""
    prev = torch.cat([last.reshape(1), got[:-1]])
    candidates = (h @ drafter.lm_head_weight.t()).topk(drafter.cfg.selector_top_k, dim=-1).indices
    scores = drafter.selector_scores(h, prev, candidates)  # [B-1, k]
    mine = drafter.selector_scores(h, prev, got[:, None])  # [B-1, 1]
    k = scores.shape[-1]
    return draft_disagreement(torch.full_like(got, k), torch.cat([scores, mine], -1))


class StaticDraft2(StaticDraft):
    """StaticDraft for a DFlash2Drafter: the same fixed-shape step, the selector's greedy pass as its draft."""

    def select(self, h: torch.Tensor) -> torch.Tensor:
        return greedy_selector_path(self.d, h[0], self.block[0, :1])


class DFlash2Proposer(DFlashProposer):
    """DFlashProposer for a DFlash2Drafter: the same context cache and forward, the selector's greedy pass after;
    graph=True: StaticDraft2's step (one CUDA graph on a GPU), checked once against the eager one."""

    static_class = StaticDraft2

    @torch.inference_mode()
    def _eager_states(self, last, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is not None:
            self._flush()
        block = self._block.clone()
        block[0, 0] = last
        return self.d.draft_states(self.cache, block, self._offsets + pos)[0], block[0, :1]

    @torch.inference_mode()
    def _eager(self, last, pos: int) -> torch.Tensor:
        h, first = self._eager_states(last, pos)
        return greedy_selector_path(self.d, h, first)

    @torch.inference_mode()
    def _checked_eager(self, last, pos: int, got: torch.Tensor | None) -> tuple[torch.Tensor, str | None]:
        h, first = self._eager_states(last, pos)
        want = greedy_selector_path(self.d, h, first)
        return want, (selector_disagreement(self.d, got, h, first) if got is not None else None)
