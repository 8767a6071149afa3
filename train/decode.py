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

from .model import DFlashDrafter, DrafterError, rope_cos_sin

# --------------------------------------------------------------------------------------------
# The target with KV cache and (optionally) the captured layers
# --------------------------------------------------------------------------------------------


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions (a negative count removes from the end in every transformers version)."""
    cur = cache.get_seq_length()
    if length < cur:
        cache.crop(length - cur)


def _lower_right_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """HF attention function (registered as "dflash_decode") for ONE sequence decoded with a KV cache: query
    position i sees every cached key and the block's keys up to i (causal, aligned to the bottom right of the
    [q, kv] square), with no mask tensor at all. Grouped KV heads are read in place (enable_gqa). HF's own sdpa
    path builds a 4D mask for every multi-token forward and then repeats the whole KV cache per query head
    (repeat_kv: two copies per layer): on a launch-bound verify forward that is ~200 more host operations than a
    one-token step (SmolLM2, 30 layers)."""
    q, n = query.shape[2], key.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=None if q == 1 else _lower_right(q, n), scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=4)
def _lower_right(q: int, n: int):
    """torch's lower-right causal bias for a [q, n] attention (no tensor behind it): made once per forward, not
    once per layer."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(q, n)


DECODE_ATTENTION = "dflash_decode"


def decode_attention_ok(model, require_flash: bool = False) -> str | None:
    """None when the target can decode with _lower_right_sdpa, else why not (sliding windows, soft-capped
    logits or attention sinks need HF's own masks; another attention implementation than sdpa is kept).
    require_flash: also only where SDPA's flash kernel takes the bottom-right causal block with grouped KV heads
    in place (CUDA, 16-bit weights, head dim <= 256). Elsewhere torch materialises the mask and runs its math
    kernel: float32 on the H200 measured slower than HF's path (verify 27.5 vs 20.2 ms for the target's step)."""
    cfg = model.config
    if require_flash:
        p = next(model.parameters())
        hd = getattr(cfg.get_text_config(), "head_dim", None) or 0
        if p.device.type != "cuda" or p.dtype not in (torch.bfloat16, torch.float16) or hd > 256:
            return f"no flash attention for {p.dtype} on {p.device.type}"
    tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", DECODE_ATTENTION):
        return f"the model uses {getattr(cfg, '_attn_implementation', None)} attention"
    kinds = set(getattr(tc, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)}"
    if getattr(tc, "sliding_window", None) and getattr(tc, "use_sliding_window", True):
        return "a sliding window"
    if getattr(tc, "attn_logit_softcapping", None):
        return "soft-capped attention logits"
    if any(hasattr(m, "sinks") for m in model.modules()):
        return "attention sinks"
    return None


class Target:
    """The target model with a KV cache (DynamicCache) and, given layer_ids, the captured layers.

    attention="auto": the target decodes with _lower_right_sdpa where it runs on SDPA's flash kernel (a CUDA
    GPU in bf16/fp16) and decode_attention_ok(model) (both the target-only baseline and the verify forwards: the
    same code path); "decode" wherever the model allows it (the CPU tests); "model" keeps the model's own."""

    def __init__(self, model, layer_ids: list[int] | None, attention: str = "auto"):
        if attention not in ("auto", "decode", "model"):
            raise ValueError(f"attention must be auto, decode or model, got {attention!r}")
        self.model = model
        self.device = next(model.parameters()).device
        why = (decode_attention_ok(model, require_flash=attention == "auto") if attention != "model"
               else "asked for the model's own")
        if why is None:
            from transformers import AttentionInterface

            AttentionInterface.register(DECODE_ATTENTION, _lower_right_sdpa)
            model.config._attn_implementation = DECODE_ATTENTION
        elif getattr(model.config, "_attn_implementation", None) == DECODE_ATTENTION:
            model.config._attn_implementation = "sdpa"
        self.attention = model.config._attn_implementation
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

    def observe(self, hidden, start, count=None) -> None:
        pass

    def propose(self, seq: list[int], last: int, pos: int) -> list[int]:
        return []


class StaticDraft:
    """One decoding step of the drafter at fixed shapes, so it can be captured as one CUDA graph (captured on
    the first call on a GPU, replayed after; run eagerly on a CPU, where it is tested against the eager path):

      1. the context features of the last verified block (the target's hidden states of all B block
         positions, [1, B, K*H]) go into the context cache at positions start..start+B-1, although only the
         first `count` are confirmed: the rest lie beyond the confirmed length, are never attended to, and the
         next step overwrites them (the cache has B positions of slack);
      2. the block after the last confirmed token attends to the whole preallocated cache under a mask of its
         confirmed positions, so nothing depends on the context length.

    The eager path does the same as DFlashDrafter.extend_context of the confirmed rows then draft_block: ~75 host
    operations of the extension and ~175 of the draft that a graph replays as one launch. Inputs are copied
    into static buffers: no host sync."""

    def __init__(self, drafter: DFlashDrafter, cache, capture: bool):
        self.d, self.cache = drafter, cache
        B, dev = drafter.cfg.block_size, cache.k[0].device
        if cache.k[0].shape[2] < cache.max_len + B:
            raise ValueError("StaticDraft needs a context cache with block_size positions of slack")
        self.block = torch.full((1, B), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
        self.offsets = torch.arange(B, device=dev)[None]
        self.start = torch.zeros((), dtype=torch.long, device=dev)  # where the pending block's features go
        self.n = torch.zeros((), dtype=torch.long, device=dev)  # confirmed context length = position of `last`
        self.hidden: torch.Tensor | None = None  # [1, B, K*H], allocated on the first block
        self.kidx = torch.arange(cache.k[0].shape[2], device=dev)
        self.capture = capture and dev.type == "cuda"
        self.graph = None
        self.out = None

    def forward(self) -> torch.Tensor:
        d, c = self.d, self.cache
        B = self.block.shape[1]
        cpos = self.start + self.offsets  # [1, B]
        ctx = d.fuse_context(self.hidden)
        ccos, csin = rope_cos_sin(d.inv_freq, cpos, ctx.dtype)
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.kv(ctx, ccos, csin)
            c.k[i].index_copy_(2, cpos[0], k)
            c.v[i].index_copy_(2, cpos[0], v)
        c.pos.index_copy_(1, cpos[0], cpos)
        positions = self.n + self.offsets
        x = d.embed(self.block)
        cos, sin = rope_cos_sin(d.inv_freq, positions, x.dtype)
        visible = torch.cat([self.kidx < self.n, self.kidx.new_ones(B, dtype=torch.bool)])  # [len + B]
        mask = visible[None, None, None, :].expand(1, 1, B, visible.shape[0])
        for i, layer in enumerate(d.layers):
            m = mask
            if layer.self_attn.window is not None:
                kpos = torch.cat([c.pos, positions], 1)
                m = mask & (positions[:, :, None] - kpos[:, None, :] < layer.self_attn.window)[:, None]
            x = layer(x, cos, sin, c.k[i], c.v[i], m)
        return d.logits(x[:, 1:]).argmax(-1)[0]

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # the warm-up runs write what the step writes: the same values at the same places
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.forward()
        self.graph = graph

    @torch.inference_mode()
    def __call__(self, last, pos: int, hidden: torch.Tensor | None = None, start: int | None = None) -> torch.Tensor:
        """The draft after `last` at position `pos` (= the confirmed length once the block is in). hidden
        [1, B, K*H]: the verified block's features at positions start..start+B-1, confirmed up to pos; None:
        nothing new (the block is written at pos, past the confirmed length, and overwritten later)."""
        if pos + self.block.shape[1] > self.kidx.shape[0]:
            raise DrafterError(f"drafter context cache is full ({self.cache.max_len} positions)")
        if self.hidden is None:
            if hidden is None:
                raise ValueError("the first StaticDraft step needs a verified block's hidden states")
            self.hidden = torch.zeros_like(hidden)
        if hidden is not None:
            self.hidden.copy_(hidden)
        self.start.fill_(pos if start is None else start)
        self.n.fill_(pos)
        self.block[0, 0] = last
        self.cache.length = pos
        if not self.capture:
            return self.forward()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites self.out


def draft_disagreement(got: torch.Tensor, logits: torch.Tensor, rel: float = 0.03) -> str | None:
    """None when the draft `got` [B-1] is what the eager logits [B-1, V] choose, up to near ties: a slot may
    hold another token only if its eager logit is within rel * |top logit| (+0.01) of the top one. The two paths
    add in different orders (the static one attends over the whole buffer under a mask), and a bf16 logit of
    20 has a resolution of 0.125: the late slots of a block are often that close (block 16 on the H200, where
    an exact comparison failed). A wrong context or position moves logits by whole units."""
    top = logits.max(-1).values.float()
    mine = logits.gather(-1, got.view(-1, 1)).squeeze(-1).float()
    gap = top - mine
    bad = gap > rel * top.abs() + 0.01
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        return (f"its draft differs from the eager forward's at slot {k + 1} by a logit gap of {float(gap[k]):.3f} "
                f"(more than a near tie)")
    return None


class DFlashProposer:
    """Drafts B-1 tokens after the last confirmed token in one drafter forward (returned on the device).

    graph=True: the step (the last verified block into the context cache, then the draft) runs at fixed shapes
    (StaticDraft), as one CUDA graph on a GPU. The first step with a verified block (the second draft of the
    first prompt) is checked against the eager path (extend_context + draft_block); on a mismatch (or a failed
    capture) the proposer says so and stays eager."""

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
        self.pending: tuple[torch.Tensor, int, int] | None = None  # (hidden [1, L, K*H], start, count) not yet in
        self.graph_status = "off" if not graph else "unchecked"

    def start(self, prompt_hidden: torch.Tensor) -> None:
        if self.cache is None or not self.graph:
            self.cache = self.d.new_cache(1, self.max_len)
            if self.graph:  # B positions of slack: StaticDraft writes whole blocks
                self.cache = self.d.new_cache(1, self.max_len + self.block_size)
                self.cache.max_len = self.max_len
        else:
            self.cache.length = 0  # the same buffers for every prompt: a captured graph reads them
        self.pending = None
        self._extend(prompt_hidden, 0)

    @torch.inference_mode()
    def _extend(self, hidden: torch.Tensor, start: int) -> None:
        pos = torch.arange(start, start + hidden.shape[1], device=hidden.device)[None]
        self.d.extend_context(self.cache, hidden, pos)

    def observe(self, hidden: torch.Tensor, start: int, count: int | None = None) -> None:
        """Target hidden states of the tokens at positions start..start+L-1, of which the first `count` (all
        when None) are confirmed; they enter the context cache in the next propose()."""
        count = hidden.shape[1] if count is None else count
        if self.pending is not None:
            self._flush()
        self.pending = (hidden, start, count)

    def _flush(self) -> None:
        hidden, start, count = self.pending
        self.pending = None
        self._extend(hidden[:, :count], start)

    @torch.inference_mode()
    def _eager_logits(self, last, pos: int) -> torch.Tensor:
        if self.pending is not None:
            self._flush()
        block = self._block.clone()
        block[0, 0] = last  # a device scalar (the verify step's bonus token) or an int: no host sync either way
        return self.d.draft_block(self.cache, block, self._offsets + pos)[0]

    def _eager(self, last, pos: int) -> torch.Tensor:
        return self._eager_logits(last, pos).argmax(-1)

    def _static(self, last, pos: int) -> torch.Tensor:
        hidden = start = None
        if self.pending is not None:
            hidden, start, count = self.pending
            if hidden.shape[1] != self.block_size or start + count != pos:  # not a whole verified block
                self._flush()
                hidden = start = None
            self.pending = None
        return self.static(last, pos, hidden, start)

    def propose(self, seq: list[int], last: int | torch.Tensor, pos: int) -> torch.Tensor:
        if self.graph_status in ("off", "eager"):
            return self._eager(last, pos)
        if self.graph_status in ("graph", "static"):
            return self._static(last, pos)
        # unchecked: the first step with a whole verified block pending runs both ways, the static one first
        pending = self.pending
        if pending is None or pending[0].shape[1] != self.block_size:
            return self._eager(last, pos)
        try:
            self.static = StaticDraft(self.d, self.cache, capture=True)
            got = self._static(last, pos)
        except Exception as e:  # noqa: BLE001 - a failed capture leaves the eager forward, and says why
            got, why = None, f"{type(e).__name__}: {e}"
        self.pending = pending  # the eager path rewrites the same cache positions
        self.cache.length = pending[1]
        logits = self._eager_logits(last, pos)
        want = logits.argmax(-1)
        if got is not None:
            why = draft_disagreement(got, logits)
        if why:
            print(f"eval: the drafter's static step is not used ({why}); drafting eagerly", flush=True)
        self.graph_status = "eager" if why else ("graph" if self.static.capture else "static")
        return want


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
        crop_cache(target.cache, pos + acc + 1)  # keep `last` and the accepted drafts
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
