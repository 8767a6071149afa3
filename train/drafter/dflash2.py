"""The DFlash2 drafter: DFlash (train/drafter/model.py) plus convolutions inside the block and a candidate selector.

Method (DFlash2, z-lab with inco.ai; the reference is speculators 0.9.0's `speculators.models.dflash2`, whose tensor
names these are), on top of the DFlash drafter's steps 1-4:

* Block convolution. In every draft layer the attention sublayer and the MLP sublayer are each wrapped in a
  token-conditioned grouped causal convolution over the slots of the block (`attention_conv`, `mlp_conv`). For
  the sublayer's normalised input u [B, H] (one block) the convolution makes a kernel per slot from u itself,
  `kernel_projection(u_s) -> [2, k, G]` (k taps, G = H / group channel groups; the first half for the input side,
  the second for the output side), and
      in_s  = sum_{t < k, t <= s} u_{s-t} * (base_kernel[0, t] + delta_in[s, t, group(c)])    (channel c)
      out_s = sum_{t < k, t <= s} y_{s-t} * (base_kernel[1, t] + delta_out[s, t, group(c)])
  where y = sublayer(in). A slot only reads itself and the slots before it, never another block. Initialised as
  the identity (base tap 0 = 1, others 0, kernel_projection 0): a fresh DFlash2 layer is a DFlash layer.
* Candidate selector (`candidate_selector`). The unary logits of slot s (the LM head on its final state h_s)
  give its top-k candidates; each candidate c is rescored with a low-rank bilinear term in the slot's
  predecessor token p (the token before it: the anchor for slot 1, the previous slot's token after it):
      score(c) = logit_s(c) + < P[p] * (A h_s), S[c] >,   P, S: [V, rank] codebooks, A: Linear(H, rank)
  In training p is the true previous token (teacher forcing); when drafting it is the token the selector chose
  for the slot before (train/evaluate/dflash2_drafting.py).

Objective (speculators' default for DFlash2, `forward_train`): the target's own distribution, not its token, is
the label. For slot k >= 1 of an anchor a, the target's logits at position a+k-1 (its LM head on the final
hidden state that `dflash extract --last-hidden` records) give p; the unary loss is KL(p || softmax(logits)), the
selector loss the cross-entropy of the reranked top-k against the target's argmax (put in place of the weakest
candidate when the top-k misses it), both weighted per slot by exp(-(k-1)/gamma) and summed over supervised
slots / their count:
    loss = sum w_k KL_k / n + selector_loss_alpha * sum w_k CE_k / n      (n = supervised slots, + 1e-5)
A slot is supervised where the DFlash objective counts its label (train/drafter/blocks.py: supervised and in the anchor's
document; the reference asks only the first, which is the same on rows whose documents open with a prompt).
The training metrics (slot accuracy, expected tau) score the selector's teacher-forced choice against the target's
argmax, wrong where the unary top-k misses it (as served).
No [slots, vocab] tensor is ever held whole: `_LinearKL` works chunk by chunk (`kl_chunk`) like the DFlash loss.

Shapes: as DFlashDrafter, with hidden [R, T, (K+1)*H]: the K context layers, then the target's last hidden state
(after its final norm); candidates [R, N, B-1, top_k]. The checkpoint adds `layers.N.attention_conv.{base_kernel,
kernel_projection.weight}`, `layers.N.mlp_conv.*` and `candidate_selector.{predecessor_codebook,
successor_codebook, hidden_projection.weight}` to the DFlash layout (train/drafter/checkpoint.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from dflash.train.drafter.blocks import Blocks
from dflash.train.drafter.loss import block_metrics, ce_chunk, even_chunk, slot_weights
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig, DrafterError, Layer

LOSS_EPS = 1e-5  # the reference's: loss sums are divided by the supervised slots + this
# a KL chunk holds ~5 float32 [slots, vocab] tensors (the cross-entropy's 2): a quarter of its budget per tensor
KL_CHUNK_BYTES = 1 << 28


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """The grouped causal convolution over each block's slots. x [..., L, H] with L a multiple of block_size (the
    slots of L / block_size consecutive blocks); delta [..., L, k, G] the token-conditioned part of each slot's
    kernel; base [k, H] the shared part -> [..., L, H]: out_s = sum_t x_{s-t} * (base[t] + delta[s, t]) over the taps
    t <= s of s's own block (a group's channels share its delta)."""
    k, H = base.shape
    G = delta.shape[-1]
    B = block_size
    xs = x.reshape(-1, B, G, H // G)  # [blocks, B, G, channels per group]
    ds = delta.reshape(-1, B, k, G)
    out = None
    for t in range(k):
        shifted = xs if t == 0 else F.pad(xs[:, :B - t], (0, 0, 0, 0, t, 0))  # slot s reads slot s - t (0 before 0)
        term = shifted * (base[t].to(x.dtype).view(G, H // G) + ds[:, :, t, :, None])
        out = term if out is None else out + term
    return out.reshape(x.shape)


class GroupedCausalConv(nn.Module):
    """The pair of convolutions around one sublayer: `prepare` convolves its input and returns the output side's
    kernel (both made from the input), `finish` convolves its output with it."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.kernel_size, self.groups = block_size, kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [input/output side, tap, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 = 1, the others 0, no token-conditioned part."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = self.kernel_projection(u).view(*u.shape[:-1], 2, self.kernel_size, self.groups)
        return block_conv(u, kernels[..., 0, :, :], self.base_kernel[0], self.block_size), kernels[..., 1, :, :]

    def finish(self, y: torch.Tensor, out_kernel: torch.Tensor) -> torch.Tensor:
        return block_conv(y, out_kernel, self.base_kernel[1], self.block_size)


class DFlash2Layer(Layer):
    """A DFlash decoder layer whose attention and MLP sublayers are each wrapped in a GroupedCausalConv."""

    def __init__(self, cfg: DrafterConfig, sliding: bool):
        super().__init__(cfg, sliding)
        conv = dict(block_size=cfg.block_size, kernel_size=cfg.conv_kernel_size, group_size=cfg.conv_group_size)
        self.attention_conv = GroupedCausalConv(cfg.hidden_size, **conv)
        self.mlp_conv = GroupedCausalConv(cfg.hidden_size, **conv)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask, impl: str = "sdpa") -> torch.Tensor:
        u, out_kernel = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.attention(u, cos, sin, k_ctx, v_ctx, mask, impl), out_kernel)
        u, out_kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), out_kernel)


class CandidateSelector(nn.Module):
    """score(c) = unary logit of c + < predecessor_codebook[p] * hidden_projection(h), successor_codebook[c] >."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def transition(self, h: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """h [..., H], predecessor ids [...], candidate ids [..., k] -> the bilinear term [..., k]."""
        context = self.predecessor_codebook[predecessor] * self.hidden_projection(h).to(self.predecessor_codebook.dtype)
        return (context.unsqueeze(-2) * self.successor_codebook[candidates]).sum(-1)


class DFlash2Drafter(DFlashDrafter):
    """The DFlash drafter with DFlash2Layer layers and a CandidateSelector (module docstring)."""

    layer_class = DFlash2Layer

    def __init__(self, cfg: DrafterConfig, attn_impl: str = "sdpa"):
        if cfg.arch != "dflash2":
            raise DrafterError(f"DFlash2Drafter needs a dflash2 config, got arch {cfg.arch!r}")
        super().__init__(cfg, attn_impl)

    def add_modules(self) -> None:
        c = self.cfg
        self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k)

    def reset_parameters(self, std: float = 0.02, seed: int | None = None):
        super().reset_parameters(std, seed)  # every Linear normal(std), every RMSNorm 1
        g = torch.Generator().manual_seed(seed + 1) if seed is not None else None
        with torch.no_grad():
            for layer in self.layers:
                layer.attention_conv.reset_parameters()
                layer.mlp_conv.reset_parameters()
            for book in (self.candidate_selector.predecessor_codebook, self.candidate_selector.successor_codebook):
                book.copy_(torch.randn(book.shape, generator=g) * std)

    # -- training ---------------------------------------------------------------------------------
    def target_hidden(self, hidden: torch.Tensor, hidden_scales: torch.Tensor | None = None) -> torch.Tensor:
        """The target's last hidden state [R, T, H] (after its final norm): the last H channels of a cache row."""
        c = self.cfg
        width = c.context_width + c.hidden_size
        if hidden_scales is None and hidden.shape[-1] != width:
            raise DrafterError(f"a DFlash2 drafter trains on rows of {width} channels (the {c.num_context_layers} "
                               f"context layers and the target's last hidden state), got {hidden.shape[-1]}")
        if hidden_scales is not None:
            from dflash_cache.quant import dequantize

            hidden = dequantize(hidden, hidden_scales, self.fc.weight.dtype)
        return hidden[..., width - c.hidden_size:].to(self.fc.weight.dtype)

    selector_loss_alpha = 1.0  # the selector loss's weight in the objective (`dflash train` sets its setting's)

    def forward_train(self, hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors: int,
                      gamma: float = 7.0, hidden_scales=None):
        """Loss and metrics of a packed batch (module docstring's objective)."""
        h, blocks = self.forward_slots(hidden, input_ids, loss_mask, doc_ids, anchor_scores, num_anchors, hidden_scales)
        return self.slot_loss(h, blocks, self.target_hidden(hidden, hidden_scales), gamma, self.selector_loss_alpha)

    def forward_blocks(self, hidden, blocks: Blocks, masks: dict, gamma: float = 7.0, hidden_scales=None):
        """Held-out validation's forward (train/fit/validate.py) over prepared blocks: the training objective (teacher
        forced), with the metrics (slot accuracy, accepted drafts, tau) of the selector's greedy path as drafting
        follows it (slot_loss's `greedy`)."""
        h = self.slot_outputs(hidden, blocks, masks, hidden_scales)
        return self.slot_loss(h, blocks, self.target_hidden(hidden, hidden_scales), gamma, self.selector_loss_alpha,
                              greedy=True)

    def slot_loss(self, h: torch.Tensor, blocks: Blocks, target_hidden: torch.Tensor, gamma: float,
                  selector_loss_alpha: float = 1.0, chunk_fn=None, greedy: bool = False):
        """The objective from the slot outputs h [R, N, B-1, H] and the target's last hidden states [R, T, H].

        The metrics score, per slot, the selector's choice among the unary top-k against the target's argmax. By
        default with the true previous token as predecessor (teacher forcing, as the loss). greedy=True: with the
        anchor before slot 1 and the target's argmax of the slot before after it, which is the draft before it
        wherever the drafts so far were accepted; so each block's accepted prefix is exactly that of drafting it
        with greedy_selector_path (train/evaluate/dflash2_drafting.py) and verifying against the target's argmax."""
        R, N, Bm1, H = h.shape
        n = R * N * Bm1
        valid = blocks.label_valid[..., 1:]
        w = slot_weights(Bm1 + 1, gamma, h.device)[1:] * valid.float()  # [R, N, B-1]
        kl, unary, cands, target_pos, hit, target_id, pred = self.unary_terms(h, blocks, target_hidden, w, chunk_fn)
        scores = unary + self.candidate_selector.transition(h.reshape(n, H), self.predecessor_ids(blocks),
                                                            cands).to(unary.dtype)
        sel_ce = F.cross_entropy(scores.float(), target_pos, reduction="none")
        count = valid.float().sum() + LOSS_EPS
        unary_loss = kl / count
        selector_loss = (sel_ce * w.reshape(n)).sum() / count
        loss = unary_loss + selector_loss_alpha * selector_loss
        with torch.no_grad():  # metrics against the target's argmax: the selector's choice, when the served top-k
            if greedy:  # holds the argmax
                prev = torch.cat([blocks.labels[..., :1], target_id.view(R, N, Bm1)[..., :-1]], -1).reshape(n)
                scores = unary + self.candidate_selector.transition(h.reshape(n, H), prev, cands).to(unary.dtype)
            chosen = cands.gather(1, scores.argmax(-1, keepdim=True))[:, 0]
            chosen = torch.where(hit, chosen, torch.full_like(chosen, -1))
            labels = torch.cat([blocks.labels[..., :1], target_id.view(R, N, Bm1)], -1)
            met = block_metrics(chosen.view(R, N, Bm1), dataclasses.replace(blocks, labels=labels), loss, count)
            met.update(unary_loss=unary_loss.detach(), selector_loss=selector_loss.detach(),
                       unary_acc=((pred == target_id) & valid.reshape(n)).float().sum() / count,
                       recall=(hit & valid.reshape(n)).float().sum() / count)
        return loss, met

    def slot_terms(self, h: torch.Tensor, blocks: Blocks, target_hidden: torch.Tensor, w: torch.Tensor, chunk_fn=None):
        """Per slot (flattened, n = R*N*(B-1)): the weighted unary KL sum, the reranked scores of the training
        candidates [n, k] (teacher forced), the candidates, the target argmax's place among them, whether the unary
        top-k held it, the target's argmax and the unary argmax. w [R, N, B-1]: the slots' weights."""
        kl, unary, cands, target_pos, hit, target_id, pred = self.unary_terms(h, blocks, target_hidden, w, chunk_fn)
        transition = self.candidate_selector.transition(h.reshape(-1, h.shape[-1]), self.predecessor_ids(blocks), cands)
        return kl, unary + transition.to(unary.dtype), cands, target_pos, hit, target_id, pred

    def unary_terms(self, h: torch.Tensor, blocks: Blocks, target_hidden: torch.Tensor, w: torch.Tensor,
                    chunk_fn=None):
        """slot_terms without the selector: the unary logits at the candidates [n, k] in place of the scores."""
        R, N, Bm1, H = h.shape
        T = target_hidden.shape[1]
        n = R * N * Bm1
        # slot k's label distribution: the target's logits at a+k-1, k = 1..B-1 (the anchor's own for slot 1)
        at = (blocks.anchors[..., None] + torch.arange(Bm1, device=h.device)).clamp(max=T - 1).view(R, -1)
        t_states = target_hidden.gather(1, at[..., None].expand(-1, -1, H))  # [R, N*(B-1), H]
        return _LinearKL.apply(
            h.reshape(n, H), t_states.reshape(n, H), self.lm_head_weight, w.reshape(n), self.cfg.selector_top_k,
            even_chunk(n, ce_chunk(self.lm_head_weight.shape[0], KL_CHUNK_BYTES)), chunk_fn or kl_chunk)

    @staticmethod
    def predecessor_ids(blocks: Blocks) -> torch.Tensor:
        """[R*N*(B-1)]: the true token before each slot 1..B-1 (the anchor before slot 1): teacher forcing."""
        return blocks.labels[..., :-1].reshape(-1)

    def selector_scores(self, h: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Reranked scores [..., k] of candidate ids [..., k] for slot outputs h [..., H] after predecessor ids [...]
        (the unary logits gathered at the candidates, plus the selector's term)."""
        unary = torch.einsum("...h,...kh->...k", h, self.lm_head_weight[candidates])
        return unary + self.candidate_selector.transition(h, predecessor, candidates).to(unary.dtype)


def kl_chunk(x: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, top_k: int):
    """One chunk of _LinearKL. x [c, H] slot outputs, t [c, H] the target's final states, weight [V, H] the frozen
    LM head, w [c] slot weights -> (sum_i w_i KL(p_i || q_i), its gradient w.r.t. x, the training candidates [c, k]
    (the unary top-k, the target's argmax in place of the last when missing), the argmax's place among them, whether
    the top-k held it, the target's argmax, the unary argmax, the unary logits at the candidates [c, k])."""
    raw = x @ weight.t()
    # the top-k of the logits in their own dtype: the same values as after the cast to float32 (bf16 -> float32 is
    # exact), half the bytes to sort (on the H200 the float32 top-k was ~9% of the Qwen3-8B-shaped step)
    top = raw.topk(top_k, dim=-1).indices
    logits = raw.float()
    t_logits = (t @ weight.t()).float()
    logq = torch.log_softmax(logits, -1)
    logp = torch.log_softmax(t_logits, -1)
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1)
    grad = ((logq.exp() - p) * w[:, None]).to(x.dtype) @ weight  # d KL / d logits = q - p
    target_id = t_logits.argmax(-1)
    match = top == target_id[:, None]
    hit = match.any(-1)
    target_pos = torch.where(hit, match.int().argmax(-1), torch.full_like(target_id, top_k - 1))
    cands = torch.cat([top[:, :-1], torch.where(hit, top[:, -1], target_id)[:, None]], -1)
    return (kl * w).sum(), grad.to(x.dtype), cands, target_pos, hit, target_id, logits.argmax(-1), \
        logits.gather(1, cands).to(x.dtype)


class _LinearKL(torch.autograd.Function):
    """The unary KL and the unary logits at the selector's candidates, chunk by chunk (the [slots, vocab] logits never
    exist at once). Gradients w.r.t. x only: the KL's formed on the fly, the candidates' logits' (d logit_c / dx =
    W[c]) in the backward from the candidates' rows of W."""

    @staticmethod
    def forward(ctx, x, t, weight, w, top_k: int, chunk: int, chunk_fn):
        n = x.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad = torch.empty_like(x)
        parts = []
        for s in range(0, n, chunk):
            kl, g, *rest = chunk_fn(x[s:s + chunk], t[s:s + chunk], weight, w[s:s + chunk], top_k)
            total = total + kl
            grad[s:s + chunk] = g
            parts.append(rest)
        cands, target_pos, hit, target_id, pred, unary = (torch.cat(c) for c in zip(*parts))
        ctx.save_for_backward(grad, weight, cands)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(cands, target_pos, hit, target_id, pred)
        return total, unary, cands, target_pos, hit, target_id, pred

    @staticmethod
    def backward(ctx, g_total, g_unary, *_):
        grad, weight, cands = ctx.saved_tensors
        dx = grad * g_total.to(grad.dtype)
        if g_unary is not None:  # chunk by chunk: the candidates' rows of W are [slots, k, H]
            g_unary = g_unary.to(weight.dtype)
            for s in range(0, dx.shape[0], ctx.chunk):
                dx[s:s + ctx.chunk] += torch.einsum("nk,nkh->nh", g_unary[s:s + ctx.chunk],
                                                    weight[cands[s:s + ctx.chunk]]).to(dx.dtype)
        return dx, None, None, None, None, None, None


def make_drafter(cfg: DrafterConfig, attn_impl: str = "sdpa") -> DFlashDrafter:
    """The drafter of cfg.arch: a DFlashDrafter or a DFlash2Drafter."""
    return (DFlash2Drafter if cfg.arch == "dflash2" else DFlashDrafter)(cfg, attn_impl=attn_impl)
