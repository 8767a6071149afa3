"""The generation engine of `dflash regenerate`: batched greedy or sampled decoding with a KV cache, on the HF
causal LM (no `model.generate`). The engines built on it (extract/generation/slot_engine.py's SlotEngine, extract/generation/kind_engine.py's
KindEngine) import it from here; extract/generation/generate.py chooses one and runs prompts through it:

    Engine(model, ...).add(Request(...)); Engine.step() until idle  # the streaming form the command drives

The generator (Engine) is a plain decoding loop over the HF causal LM (no `model.generate`):
  * a batch of rows, left-padded: a 2D real-token mask over the KV-cache columns, explicit position ids that count
    real tokens only, and a 4D boolean attention mask built here (pads hidden; a pad query sees itself, so no row
    of the softmax is empty and no NaN can reach a real token);
  * a KV cache (`SlabCache`, extract/generation/slab.py: a transformers DynamicCache whose layers write into preallocated
    buffers that grow by amortised steps instead of a torch.cat of the whole cache at every token);
  * a row is done when it emits an end-of-sequence id or reaches its max-new-tokens; done rows stay in the batch
    (decoded, their tokens ignored) until they are a quarter of it (or of the refill threshold), then one
    compaction drops them from the cache and the running tensors (and cuts cache columns that became padding for
    every remaining row): one cache copy per quarter of the batch finished, not one per step in which a row ends
    (at batch 1024 a row ends nearly every step, and each copy moves the whole cache);
  * free slots are refilled from a queue of waiting prompts (longest first within a part): the newcomers are
    prefilled in chunks of at most prefill_tokens padded tokens (only the last position's logits are computed),
    and all the chunks of one refill are merged into the running batch at once, their caches right-aligned with
    it: one copy of the batch's cache per refill, not one per chunk (at batch 1024 a refill admits 256 prompts
    or more, in chunks of 16,384 tokens on a GPU, beside a cache the KV budget lets grow to tens of GB).
    A multi-turn conversation's next turn joins the queue as soon as its previous
    turn is done, so there is no barrier between turns, nor between parts;
  * a multi-turn conversation can continue in its row (Engine(follow=...)): when a turn ends, the caller hands
    the tokens between this answer and the next one (end of turn, the next user turn, the next assistant
    header); the row feeds them one per decode step (forced: nothing sampled is kept) and then generates the
    next answer, so the history is never prefilled again. A continuation that would break the batch's token
    budget is refused and the caller queues the next turn as a new prompt;
  * greedy or temperature/top-p sampling (extract/generation/sampling.py): one uniform per row and step from a counter-based
    hash of (seed, dataset row, turn, step): the text of a conversation depends on neither the batch it ran in,
    nor the part size, nor the number of GPUs, so a rerun reproduces it.
"""

from __future__ import annotations

import heapq
import inspect
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash.core.target import decode_sdpa

from dflash.extract.generation.sampling import rng_key, sample, uniforms  # noqa: F401  (rng_key: importable from here)
from dflash.extract.generation.slab import (  # noqa: F401  (kv_bytes_per_token, plan_engine: importable from here)
    attention_impl,
    cache_select,
    cache_stack,
    kv_bytes_per_token,
    plan_engine,
    slab_cache,
)


# ----------------------------------------------------------------------------------------------------------------
# the generator


@dataclass
class Request:
    prompt: list[int]  # token ids (the chat template already applied)
    max_new_tokens: int
    key: Any = None  # the caller's handle, returned in the Result
    rng_key: int = 0  # sampling stream of this request (rng_key(seed, row, turn)); unused when greedy
    priority: tuple = ()  # smaller first


@dataclass
class _Chunk:
    """Prompts prefilled together and not yet merged into the batch: their cache, real-token mask [k, width] and
    first tokens."""

    cache: Any
    real: torch.Tensor
    first: torch.Tensor
    rows: list
    width: int


@dataclass
class Result:
    key: Any
    tokens: list[int]  # the generated ids, without the end-of-sequence id that stopped it
    stopped: bool  # True: ended by an end-of-sequence id; False: cut at max_new_tokens (truncated)
    prompt_len: int
    generated: int  # tokens the model produced, the stop id included
    continued: bool = False  # the row goes on with the caller's continuation (Engine(follow=...)): do not resubmit

    @property
    def truncated(self) -> bool:
        return not self.stopped


@dataclass
class Continuation:
    """What Engine(follow=...) returns for a finished turn to go on in the same row: the token ids between the
    answer just generated (without its stop id) and the next answer (e.g. end of turn, the next user turn, the
    assistant header), then up to max_new_tokens generated with the sampling stream rng_key."""

    forced: list[int]
    max_new_tokens: int
    rng_key: int = 0


@dataclass
class _Row:
    req: Request
    out: list[int] = field(default_factory=list)
    done: bool = False  # finished, still in the batch until the next compaction (its tokens are ignored)
    forced: deque = field(default_factory=deque)  # continuation ids still to feed (each replaces a step's sample)


def end_of_turn(row: _Row, token: int, eos: frozenset) -> Result | None:
    """Append `token` to the row's answer; the turn's Result when it ends there (an end-of-sequence id, not part of
    the tokens, or the turn's max_new_tokens), else None. Both engines (Engine, slot_engine.SlotEngine) use it."""
    row.out.append(token)
    stop = token in eos
    if not (stop or len(row.out) >= row.req.max_new_tokens):
        return None
    return Result(row.req.key, row.out[:-1] if stop else row.out, stop, len(row.req.prompt), len(row.out))


def continue_row(row: _Row, res: Result, cont: Continuation) -> int | None:
    """Go on with the finished turn `res` in its row: the row's request becomes the whole context (prompt, answer,
    the continuation's ids) with the continuation's budget and sampling stream, and its ids are fed one per step.
    The cache holds the prompt and the answer but its newest token, so a turn that stopped at an end id has that id
    replaced by the first continuation id: returned, for the caller to make the row's next input (None otherwise:
    a truncated turn's last token is fed first, as usual). The caller has checked that cont.forced is not empty."""
    forced = list(map(int, cont.forced))
    first = forced[0] if res.stopped else None
    row.req = Request(row.req.prompt + res.tokens + forced, int(cont.max_new_tokens), key=row.req.key,
                      rng_key=int(cont.rng_key), priority=row.req.priority)
    row.out = []
    row.forced = deque(forced[1:] if res.stopped else forced)
    res.continued = True
    return first


class Engine:
    """Batched decoding with a KV cache: add() requests, step() until idle; step() returns finished Results.

    batch_size: rows decoded together. max_batch_tokens: bound on rows x cache columns, checked when rows are
    admitted against the columns the batch can reach (admitted rows may all still run to max_new_tokens).
    prefill_tokens: bound on padded prompt tokens per prefill forward. refill: admit waiting prompts once at least
    this many slots are free (default a quarter of the batch; always when the batch is empty). follow: called
    with each finished turn's Result; a Continuation keeps the row going (module docstring), None ends it.
    """

    def __init__(self, model, *, eos_ids: Iterable[int], batch_size: int, max_batch_tokens: int,
                 prefill_tokens: int, temperature: float = 0.0, top_p: float = 1.0, pad_id: int = 0,
                 refill: int | None = None, follow: Callable[[Result], Continuation | None] | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.eos = frozenset(int(i) for i in eos_ids)
        self.batch_size = int(batch_size)
        self.max_batch_tokens = int(max_batch_tokens)
        self.prefill_tokens = int(prefill_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.pad_id = int(pad_id)
        self.refill = max(1, int(refill if refill is not None else self.batch_size // 4))
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.pending: list[tuple[tuple, int, Request]] = []
        self._seq = 0
        self.rows: list[_Row] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # bool [B, n]: cache column holds a real token
        self.last: torch.Tensor | None = None  # long [B]: the newest token, not yet in the cache
        self.pos: torch.Tensor | None = None  # long [B]: its position (= real tokens in the cache)
        self.steps = 0
        self.prefills = 0
        self.generated = 0
        self.prompt_tokens = 0
        # where the work goes (the regenerate log line): prompt columns prefilled, padding included; token columns
        # copied when a prefill is stacked beside the batch or the batch is compacted; cache columns attended by
        # decode steps (every row attends the batch's full width) against the real tokens among them
        self.prefill_columns = 0
        self.copied_columns = 0
        self.decode_columns = 0
        self._decode_real = 0  # summed on the device (a tensor once decoding starts): no host sync per step
        self.seconds = {"prefill": 0.0, "decode": 0.0, "batch_edit": 0.0}  # wall time per phase (host-synced)
        self.dead = 0  # finished rows still in the batch
        self.compactions = 0
        self.follow = follow
        self.continued = 0  # turns that went on in their row
        self.forced_tokens = 0  # continuation ids fed (the history a new prompt would have prefilled is not counted)
        self.refused = 0  # continuations refused by the token budget (the caller resubmitted those turns)

    @property
    def decode_real_columns(self) -> int:
        return int(self._decode_real)

    # -- queue --------------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if len(req.prompt) < 1:
            raise ValueError("empty prompt")
        if req.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        heapq.heappush(self.pending, (req.priority, self._seq, req))
        self._seq += 1

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.pending)

    def step(self) -> list[Result]:
        """Fill the free slots with waiting prompts (once `refill` slots are free), then decode one token per row."""
        done: list[Result] = []
        if self.pending and (not self.rows or self.batch_size - len(self.rows) >= self.refill):
            t = time.perf_counter()
            chunks: list[_Chunk] = []  # fill every free slot the budgets allow, one prefill forward per chunk
            while self.pending and (chunk := self._admit(chunks)) is not None:
                chunks.append(chunk)
            if chunks:
                done += self._merge(chunks)
            self.seconds["prefill"] += time.perf_counter() - t
        if self.rows:
            t = time.perf_counter()
            done += self._decode()
            self.seconds["decode"] += time.perf_counter() - t
        return done

    # -- internals ----------------------------------------------------------------------------------------------
    def _forward(self, ids, pos, mask4, cache):
        kw = {"input_ids": ids, "position_ids": pos, "attention_mask": mask4, self._cache_kw: cache,
              "use_cache": True}
        if self._keep_kw:
            kw[self._keep_kw] = 1
        with decode_sdpa(), attention_impl(self.model):
            logits = self.model(**kw).logits
        return logits[:, -1].float()

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        u = None
        if self.temperature > 0:
            u = torch.from_numpy(uniforms([r.req.rng_key for r in rows], [len(r.out) for r in rows]))
        return sample(logits, self.temperature, self.top_p, u)

    def _admit(self, chunks: list[_Chunk]) -> _Chunk | None:
        """Prefill one chunk of waiting prompts that fits the budgets beside the batch and the chunks prefilled
        before it in this refill (not yet merged); None when none fits (or no slot is free)."""
        rows_now = len(self.rows) + sum(len(c.rows) for c in chunks)
        free = self.batch_size - rows_now
        n_now = max([0 if self.mask is None else self.mask.shape[1]] + [c.width for c in chunks])
        reach = max([r.req.max_new_tokens - len(r.out) + len(r.forced) for r in self.rows if not r.done]
                    + [r.req.max_new_tokens for c in chunks for r in c.rows], default=0)
        chosen: list[Request] = []
        width = 0
        while self.pending and len(chosen) < free:
            req = self.pending[0][2]
            w = max(width, len(req.prompt))
            r = max(reach, req.max_new_tokens)
            rows = rows_now + len(chosen) + 1
            if chosen and (len(chosen) + 1) * w > self.prefill_tokens:
                break
            if rows > 1 and rows * (max(n_now, w) + r) > self.max_batch_tokens:
                break
            heapq.heappop(self.pending)
            chosen.append(req)
            width, reach = w, r
        if not chosen:
            return None
        return self._prefill(chosen, width)

    @torch.inference_mode()
    def _prefill(self, reqs: list[Request], width: int) -> _Chunk:
        k, dev = len(reqs), self.device
        ids = torch.full((k, width), self.pad_id, dtype=torch.long)
        real = torch.zeros((k, width), dtype=torch.bool)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.long)
            real[i, width - len(r.prompt):] = True
        ids, real = ids.to(dev), real.to(dev)
        pos = (real.long().cumsum(-1) - 1).clamp_(min=0)
        logits, cache = self._prefill_forward(ids, pos, real)
        rows = [_Row(r) for r in reqs]
        self.prefills += 1
        self.prompt_tokens += sum(len(r.prompt) for r in reqs)
        self.prefill_columns += k * width
        return _Chunk(cache, real, self._sample(logits, rows), rows, width)

    # -- the cache and mask: what a per-kind engine (extract/generation/kind_engine.py) does otherwise ------------
    def _prefill_forward(self, ids, pos, real) -> tuple[torch.Tensor, Any]:
        """(last logits, new cache) of a left-padded prefill: a 4D boolean mask (a pad query sees only itself) over
        a SlabCache, whose padding columns are then zeroed."""
        width, dev = ids.shape[1], ids.device
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril_()
        eye = torch.eye(width, dtype=torch.bool, device=dev)
        mask4 = (causal & (real[:, None, :] | eye))[:, None]  # [k, 1, q, kv]
        cache = slab_cache()
        logits = self._forward(ids, pos, mask4, cache)
        if not bool(real.all()):
            for layer in cache.layers:
                layer.zero_columns(~real)
        return logits, cache

    def _decode_mask(self) -> torch.Tensor:
        """The attention mask of a decode step from the batch's real-token mask [B, columns]."""
        return self.mask[:, None, None, :]

    def _stack(self, caches: list, width: int):
        """The caches of a refill's parts as one, right-aligned at `width` columns."""
        return cache_stack(caches, width)

    def _select(self, cache, idx: torch.Tensor, trim: int) -> None:
        """Keep the rows idx of the cache, less its first `trim` columns (in place)."""
        cache_select(cache, idx, trim)

    def _merge(self, chunks: list[_Chunk]) -> list[Result]:
        """The refill's prefilled chunks into the running batch, right-aligned: ONE copy of the batch's cache per
        refill (not one per chunk), then their first tokens."""
        # (cache, real-token mask, newest token, its position) of the batch, then of each chunk
        parts = [(self.cache, self.mask, self.last, self.pos)] if self.rows else []
        parts += [(c.cache, c.real, c.first, c.real.sum(-1)) for c in chunks]
        if len(parts) == 1:
            self.cache, self.mask, self.last, self.pos = parts[0]
        else:
            w = max(p[1].shape[1] for p in parts)
            pad = torch.nn.functional.pad
            self.copied_columns += sum(p[1].shape[0] for p in parts) * w
            self.cache = self._stack([p[0] for p in parts], w)
            self.mask = torch.cat([pad(p[1], (w - p[1].shape[1], 0)) for p in parts], 0)
            self.last = torch.cat([p[2] for p in parts])
            self.pos = torch.cat([p[3] for p in parts])
        base = len(self.rows)
        for c in chunks:
            self.rows.extend(c.rows)
        return self._emit(torch.cat([c.first for c in chunks]).tolist(), start=base)

    @torch.inference_mode()
    def _decode(self) -> list[Result]:
        B = len(self.rows)
        self.mask = torch.cat([self.mask, torch.ones(B, 1, dtype=torch.bool, device=self.device)], 1)
        logits = self._forward(self.last[:, None], self.pos[:, None], self._decode_mask(), self.cache)
        self.decode_columns += B * self.mask.shape[1]
        self._decode_real = self._decode_real + (self.pos.sum() + B)
        self.pos = self.pos + 1
        self.last = self._sample(logits, self.rows)
        self.steps += 1
        fed = [i for i, r in enumerate(self.rows) if r.forced and not r.done] if self.follow is not None else []
        if fed:  # continuing rows: their next input is the caller's token, not the sample
            self.last[fed] = torch.tensor([self.rows[i].forced.popleft() for i in fed], device=self.device)
        return self._emit(self.last.tolist(), start=0, skip=set(fed))

    def _emit(self, tokens: list[int], start: int, skip: set[int] | None = None) -> list[Result]:
        """Append tokens to the live rows start.. (except those in skip: fed a continuation id this step) and return
        the rows that finished as Results. A finished row stays in the batch (decoded, its tokens ignored) until the
        finished rows are a quarter of the batch or of the refill threshold: then one compaction copies the cache
        once, instead of once per step in which a row ends. A finished row whose follow() gives a Continuation
        goes on instead (its Result says continued)."""
        done = []
        inputs: list[tuple[int, int]] = []  # (row, id): a stopped row's next input is its continuation's first id
        for i, t in enumerate(tokens, start):
            row = self.rows[i]
            if row.done or (skip and i in skip):
                continue
            self.generated += 1
            res = end_of_turn(row, t, self.eos)
            if res is not None:
                done.append(res)
                cont = self.follow(res) if self.follow is not None else None
                if cont is not None and self._goes_on(row, res, cont, inputs, i):
                    continue
                row.done = True
                self.dead += 1
        if inputs:
            idx = torch.tensor([i for i, _ in inputs], device=self.device)
            self.last[idx] = torch.tensor([v for _, v in inputs], device=self.device)
        if self.dead and self.dead >= max(1, min(self.refill, len(self.rows) // 4)):
            t = time.perf_counter()
            self._retain([i for i, r in enumerate(self.rows) if not r.done])
            self.seconds["batch_edit"] += time.perf_counter() - t
        return done

    def _goes_on(self, row: _Row, res: Result, cont: Continuation, inputs: list, i: int) -> bool:
        """Continue `row` with `cont` (continue_row) if the batch's token budget allows it; True if it does."""
        if not cont.forced or cont.max_new_tokens < 1:
            return False
        cols = self.mask.shape[1] if self.mask is not None else 0
        live = len(self.rows) - self.dead
        if live > 1 and live * (cols + len(cont.forced) + cont.max_new_tokens) > self.max_batch_tokens:
            self.refused += 1
            return False
        first = continue_row(row, res, cont)
        if first is not None:
            inputs.append((i, first))
        self.continued += 1
        self.forced_tokens += len(cont.forced)
        return True

    def _retain(self, keep: list[int]) -> None:
        self.dead = 0
        self.compactions += 1
        if not keep:
            self.rows, self.cache, self.mask, self.last, self.pos = [], None, None, None, None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self.mask[idx]
        trim = int(mask.any(0).long().argmax())  # leading columns that are padding for every kept row
        self.mask = mask[:, trim:]
        self.copied_columns += len(keep) * self.mask.shape[1]
        self.last, self.pos = self.last[idx], self.pos[idx]
        self._select(self.cache, idx, trim)
        self.rows = [self.rows[i] for i in keep]
