"""The DFlash2 drafter as a proposer of train/decode.py's loop: one drafter forward per step, then the candidate
selector's greedy pass over the block.

After the forward (DFlashDrafter.draft_states: the slots' normalised outputs h_1..h_{B-1}), each slot's unary top-k
(`selector_top_k`) is reranked left to right: slot 1's predecessor is the last confirmed token, and each later slot's
is the candidate chosen for the slot before it; a slot's draft is its candidate of the highest score (unary logit +
the selector's bilinear term, train/dflash2.py). This is the greedy path speculators' DFlash2 metrics follow (its
`eal`); the drafted block is then verified as any other, so decoding stays lossless.

Eager only: DFlashProposer's fixed-shape CUDA-graph step (train/drafting.StaticDraft) drafts by argmax, and a DFlash2
drafter with graph=True drafts eagerly and says so (graph_status "eager").
"""

from __future__ import annotations

import torch

from .dflash2 import DFlash2Drafter
from .drafting import DFlashProposer


def greedy_selector_path(drafter: DFlash2Drafter, h: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The draft [B-1] from slot outputs h [B-1, H] after the confirmed token `last` (a 0-d tensor): per slot, the
    unary top-k reranked with the previous slot's choice as predecessor. No host sync."""
    candidates = (h @ drafter.lm_head_weight.t()).topk(drafter.cfg.selector_top_k, dim=-1).indices  # [B-1, k]
    prev = last.reshape(())
    out = []
    for s in range(h.shape[0]):
        scores = drafter.selector_scores(h[s], prev, candidates[s])
        prev = candidates[s][scores.argmax()]
        out.append(prev)
    return torch.stack(out)


class DFlash2Proposer(DFlashProposer):
    """DFlashProposer for a DFlash2Drafter: the same context cache and forward, the selector's greedy pass after."""

    def __init__(self, drafter: DFlash2Drafter, max_len: int, graph: bool = False):
        super().__init__(drafter, max_len, graph=False)
        if graph:
            self.graph_status = "eager"  # asked for, not available for DFlash2 (module docstring)

    @torch.inference_mode()
    def _eager(self, last, pos: int) -> torch.Tensor:
        if self.pending is not None:
            self._flush()
        block = self._block.clone()
        block[0, 0] = last
        h = self.d.draft_states(self.cache, block, self._offsets + pos)[0]
        return greedy_selector_path(self.d, h, block[0, 0])

    def propose(self, seq: list[int], last, pos: int) -> torch.Tensor:
        return self._eager(last, pos)
