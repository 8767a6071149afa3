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
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from dflash.core.target import LayerCapture, decode_sdpa, decoder_layers

from .model import DFlashDrafter, rope_cos_sin

# --------------------------------------------------------------------------------------------
# The target with KV cache and (optionally) the captured layers
# --------------------------------------------------------------------------------------------


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions (a negative count removes from the end in every transformers version)."""
    cur = cache.get_seq_length()
    if length < cur:
        cache.crop(length - cur)


class Target:
    def __init__(self, model, layer_ids: list[int] | None):
        self.model = model
        self.device = next(model.parameters()).device
        self.capture = None
        if layer_ids:
            L = len(decoder_layers(model))
            self.capture = LayerCapture(model, layer_ids, final_norm_for=L - 1 if L - 1 in layer_ids else None)
        self.cache = None
        import inspect  # transformers >= 5.2x renamed past_key_values to cache

        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def reset(self):
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [1, L, V] (and captured hidden [1, L, K*H]) for ids [1, L] at positions start..start+L-1."""
        L = ids.shape[1]
        pos = torch.arange(start, start + L, device=self.device)[None]
        out_h = None
        if hidden and self.capture is not None:
            K, H = len(self.capture.layer_ids), self.model.config.get_text_config().hidden_size
            out_h = torch.empty(1, L, K * H, device=self.device, dtype=next(self.model.parameters()).dtype)
            self.capture.out = out_h
        try:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self._cache_kw: self.cache})
        finally:
            if self.capture is not None:
                self.capture.out = None
        return out.logits, out_h


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

    def observe(self, hidden, start) -> None:
        pass

    def propose(self, seq: list[int], last: int, pos: int) -> list[int]:
        return []


class StaticDraft:
    """The drafter's block forward at fixed shapes: attention over the whole preallocated context cache with a
    mask of its filled positions, so nothing depends on the context length and the forward can be captured as
    one CUDA graph (captured on the first call on a GPU, replayed after; run eagerly on a CPU, where it is
    tested against DFlashDrafter.draft_block). Inputs are copied into static buffers: no host sync."""

    def __init__(self, drafter: DFlashDrafter, cache, capture: bool):
        self.d, self.cache = drafter, cache
        B, dev = drafter.cfg.block_size, cache.k[0].device
        self.block = torch.full((1, B), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
        self.positions = torch.zeros(1, B, dtype=torch.long, device=dev)
        self.offsets = torch.arange(B, device=dev)[None]
        self.n = torch.zeros((), dtype=torch.long, device=dev)
        self.kidx = torch.arange(cache.max_len, device=dev)
        self.capture = capture and dev.type == "cuda"
        self.graph = None
        self.out = None

    def forward(self) -> torch.Tensor:
        d, c = self.d, self.cache
        B = self.block.shape[1]
        x = d.embed(self.block)
        cos, sin = rope_cos_sin(d.inv_freq, self.positions, x.dtype)
        visible = torch.cat([self.kidx < self.n, self.kidx.new_ones(B, dtype=torch.bool)])  # [max_len + B]
        mask = visible[None, None, None, :].expand(1, 1, B, visible.shape[0])
        for i, layer in enumerate(d.layers):
            m = mask
            if layer.self_attn.window is not None:
                kpos = torch.cat([c.pos, self.positions], 1)
                m = mask & (self.positions[:, :, None] - kpos[:, None, :] < layer.self_attn.window)[:, None]
            x = layer(x, cos, sin, c.k[i], c.v[i], m)
        return d.logits(x[:, 1:]).argmax(-1)[0]

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.forward()
        self.graph = graph

    @torch.inference_mode()
    def __call__(self, last, pos: int) -> torch.Tensor:
        self.block[0, 0] = last
        self.positions.copy_(self.offsets + pos)
        self.n.fill_(self.cache.length)
        if not self.capture:
            return self.forward()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites self.out


class DFlashProposer:
    """Drafts B-1 tokens after the last confirmed token in one drafter forward (returned on the device).

    graph=True: the block forward runs at fixed shapes (StaticDraft), as one CUDA graph on a GPU. The first
    draft of the first prompt is checked against the eager forward; on a mismatch (or a failed capture) the
    proposer says so and stays eager."""

    name = "dflash"
    needs_hidden = True

    def __init__(self, drafter: DFlashDrafter, max_len: int, graph: bool = False):
        self.d = drafter
        self.block_size = drafter.cfg.block_size
        self.max_len = max_len
        dev = drafter.fc.weight.device
        self._block = torch.full((1, self.block_size), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
        self._offsets = torch.arange(self.block_size, device=dev)[None]
        self.graph = graph
        self.cache = None
        self.static: StaticDraft | None = None
        self.graph_status = "off" if not graph else "unchecked"

    def start(self, prompt_hidden: torch.Tensor) -> None:
        if self.cache is None or not self.graph:
            self.cache = self.d.new_cache(1, self.max_len)
        else:
            self.cache.length = 0  # the same buffers for every prompt: a captured graph reads them
        self.observe(prompt_hidden, 0)

    @torch.inference_mode()
    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """Target hidden states of confirmed tokens at positions start..start+L-1."""
        L = hidden.shape[1]
        pos = torch.arange(start, start + L, device=hidden.device)[None]
        self.d.extend_context(self.cache, hidden, pos)

    @torch.inference_mode()
    def _eager(self, last, pos: int) -> torch.Tensor:
        block = self._block.clone()
        block[0, 0] = last  # a device scalar (the verify step's bonus token) or an int: no host sync either way
        return self.d.draft_block(self.cache, block, self._offsets + pos).argmax(-1)[0]

    def propose(self, seq: list[int], last: int | torch.Tensor, pos: int) -> torch.Tensor:
        if self.graph_status in ("off", "eager"):
            return self._eager(last, pos)
        if self.graph_status == "unchecked":
            want = self._eager(last, pos)
            try:
                self.static = StaticDraft(self.d, self.cache, capture=True)
                got = self.static(last, pos)
                why = None if bool((got == want).all()) else "its draft differs from the eager forward's"
            except Exception as e:  # noqa: BLE001 - a failed capture leaves the eager forward, and says why
                why = f"{type(e).__name__}: {e}"
            if why:
                print(f"eval: the drafter's static forward is not used ({why}); drafting eagerly", flush=True)
            self.graph_status = "eager" if why else ("graph" if self.static.capture else "static")
            return want
        return self.static(last, pos)


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last n-gram."""

    name = "ngram"
    needs_hidden = False

    def __init__(self, block_size: int, ngram_max: int = 3):
        self.block_size = block_size
        self.n = ngram_max

    def start(self, prompt_hidden) -> None:
        pass

    def observe(self, hidden, start) -> None:
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
        crop_cache(target.cache, pos + acc + 1)  # keep `last` and the accepted drafts
        if proposer.needs_hidden:
            proposer.observe(hidden[:, : acc + 1], pos)
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
