"""Greedy speculative decoding with a KV-cached target: the loop `dflash eval` times and the demo, serve-parity
and decoding tests check.

One loop for every method (speculative(): propose, verify in one target forward, accept the longest matching
prefix plus the target's own next token, crop both caches):
  * NoDraft: a zero-length draft, so the target alone runs through the same code (greedy());
  * DFlashProposer: the drafter drafts B-1 tokens after the last confirmed token in ONE forward, from the
    target's captured hidden states of the confirmed tokens (eager, or StaticDraft: fixed shapes, one CUDA graph);
  * NgramProposer: prompt lookup, the tokens that followed the latest earlier occurrence of the last n-gram.
Decoding runs with dflash.core.target.decode_sdpa's kernel choice (no cuDNN attention: it plans every new sequence
length on the host).

The target side (KV cache, captured layers, decode attention) is train/evaluate/verify.py; the DFlash proposer is
train/evaluate/drafting.py. target.crop() after a partly accepted verify takes every layer back to the accepted prefix: keys
and values, and on hybrid targets the Gated DeltaNet's recurrent and conv states, captured at each verified token
(dflash/core/decode_state.py; dflash/core/static_hybrid.py's accept for the static target).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from dflash.core.target import decode_sdpa

from dflash.train.evaluate.verify import Target


# --------------------------------------------------------------------------------------------
# Proposers: propose(seq, last, pos) -> the draft after `last` (at most B-1 tokens): a list of ids,
# or a 1-D LongTensor on the target's device (kept there: no host round trip to build the block)
# --------------------------------------------------------------------------------------------


class NoDraft:
    """The target alone: a zero-length draft, so every step is one 1-token target forward through the
    same loop as speculative decoding (the baseline is timed by the same code)."""

    name = "target"
    needs_hidden = False
    block_size = 1

    def start(self, prompt_hidden) -> None:
        pass

    def observe(self, hidden, start, count=None) -> None:
        pass

    def propose(self, seq: list[int], last: int, pos: int) -> list[int]:
        return []


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last n-gram."""

    name = "ngram"
    needs_hidden = False

    def __init__(self, block_size: int, ngram_max: int = 3):
        self.block_size = block_size
        self.n = ngram_max

    def start(self, prompt_hidden) -> None:
        pass

    def observe(self, hidden, start, count=None) -> None:
        pass

    def propose(self, seq: list[int], last: int, pos: int) -> list[int]:
        k = self.block_size - 1
        for n in range(min(self.n, len(seq)), 0, -1):
            tail = seq[-n:]
            for i in range(len(seq) - n - 1, -1, -1):
                if seq[i:i + n] == tail:
                    return seq[i + n:i + n + k]
        return []


# --------------------------------------------------------------------------------------------
# Decoding: one loop for the target alone (NoDraft), DFlash and n-gram lookup
# --------------------------------------------------------------------------------------------


@dataclass
class Decode:
    tokens: list[int]
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted + 1 per step
    seconds: float = 0.0  # wall clock, prefill included, device-synchronised at both ends
    prefill_s: float = 0.0
    draft_s: float = 0.0  # per phase, summed over steps (CUDA events on a GPU, perf_counter on CPU)
    verify_s: float = 0.0
    margins: list[float] = field(default_factory=list)  # per output token: top-1 minus top-2 logit that chose it

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Marks:
    """Phase boundaries of every step: CUDA events on a GPU (read once, after the decode), else host clocks."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"
        self.marks: list = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def spans(self, every: int) -> list[list[float]]:
        """Seconds between consecutive marks within each group of `every` marks."""
        out = []
        for i in range(0, len(self.marks) - every + 1, every):
            g = self.marks[i:i + every]
            if self.cuda:
                out.append([g[j].elapsed_time(g[j + 1]) / 1e3 for j in range(every - 1)])
            else:
                out.append([g[j + 1] - g[j] for j in range(every - 1)])
        return out


def _finish(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


def _margin(logits: torch.Tensor) -> torch.Tensor:
    """top-1 minus top-2 logit per row of [L, V] (float32, on the device)."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def decode_attention(fn):
    """Run fn with the SDPA kernels decoding uses (dflash.core.target.decode_sdpa: no cuDNN, which plans every
    new sequence length on the host): the target's and the drafter's attention."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with decode_sdpa():
            return fn(*args, **kwargs)

    return wrapped


@decode_attention
@torch.inference_mode()
def speculative(target: Target, proposer, prompt: list[int], max_new: int, eos: set[int],
                margins: bool = False) -> Decode:
    """Greedy speculative decoding: propose, verify in one target forward, accept prefix + bonus.

    One host synchronisation per step (the accepted length and the new tokens, read together); the
    draft stays on the device; phase times come from events read after the decode. With NoDraft
    this is plain greedy decoding. margins=True records the logit margin behind every output token."""
    dev = target.device
    marks = _Marks(dev)
    _sync(dev)
    t0 = time.perf_counter()
    target.reset()
    logits, hidden = target.forward(torch.tensor([prompt], device=dev), 0, hidden=proposer.needs_hidden)
    last_dev = logits[0, -1].argmax()
    margin_parts = [_margin(logits[0, -1:])] if margins else []
    last = int(last_dev)
    prefill_s = time.perf_counter() - t0
    proposer.start(hidden)
    seq = list(prompt) + [last]
    out = [last]
    pos = len(prompt)  # position of `last` (not yet seen by the target)
    res = Decode(out)
    k_max = proposer.block_size - 1
    while len(out) < max_new and last not in eos:
        marks.mark()
        draft = proposer.propose(seq, last_dev, pos)
        if not isinstance(draft, torch.Tensor):
            draft = torch.tensor(list(draft)[:k_max], dtype=torch.long, device=dev)
        draft = draft[:k_max]
        n = draft.shape[0]
        block = torch.cat([last_dev.view(1), draft])[None]
        marks.mark()
        logits, hidden = target.forward(block, pos, hidden=proposer.needs_hidden)
        post = logits[0].argmax(-1)  # [n + 1]
        acc_dev = (draft == post[:n]).long().cumprod(0).sum() if n else post.new_zeros(())
        if margins:
            margin_parts.append(_margin(logits[0]))
        marks.mark()
        host = torch.cat([acc_dev.view(1), post]).tolist()  # the step's one synchronisation
        acc = host[0]
        new = host[1:acc + 2]  # accepted drafts (equal to the target's own choices) + the bonus token
        if margins:
            margin_parts[-1] = margin_parts[-1][:acc + 1]
        target.crop(pos + acc + 1)  # keep `last` and the accepted drafts
        if proposer.needs_hidden:
            proposer.observe(hidden, pos, acc + 1)
        last_dev = post[acc]
        res.accept_lengths.append(acc + 1)
        res.steps += 1
        out.extend(new)
        seq.extend(new)
        pos += acc + 1
        last = new[-1]
        if any(t in eos for t in new):
            break
    _sync(dev)
    res.seconds = time.perf_counter() - t0
    res.prefill_s = prefill_s
    spans = marks.spans(3)
    res.draft_s = sum(s[0] for s in spans)
    res.verify_s = sum(s[1] for s in spans)
    res.tokens = _finish(out, max_new, eos)
    if margins:
        res.margins = torch.cat(margin_parts).tolist()[: len(res.tokens)]
    return res


def greedy(target: Target, prompt: list[int], max_new: int, eos: set[int], margins: bool = False) -> Decode:
    """The target's own greedy decoding: speculative() with a zero-length draft."""
    return speculative(target, NoDraft(), prompt, max_new, eos, margins=margins)
