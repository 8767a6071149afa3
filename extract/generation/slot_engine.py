"""The generation engine of `regenerate` and `prompts` on a GPU: extract/generation/generate.py's Engine (the same add/step
interface, Requests, Results, Continuations and counter-based sampling) over a static KV cache whose decode step is
one CUDA-graph replay (dflash/core/static_decode.py). The eager Engine stays the CPU path and the reference.

  * the batch is `slots` fixed rows of `max_len` positions each. A prompt is prefilled (eagerly, in chunks of at
    most prefill_tokens padded tokens) into a free slot, right-padded from column 0; a finished row frees its slot
    at once, so there is no compaction of a running batch and no copy of a cache per refill;
  * a decode step feeds every row of the first n slots its newest token at its own position; n is the highest
    busy slot + 1 rounded up to a power of two (>= 8), and the step attends over the busy rows' longest length
    rounded up to the decoder's bucket: one graph per (n, bucket), captured on first use. On a GPU a step whose
    rows' own columns are under VARLEN_MAX_SHARE (the kernel's) of that span reads only those (the decoder's
    variable-length attention; a graph per (n, bucket) of that kind too). When the queue is empty
    and the busy rows fit half of n, the highest busy rows move down into free slots (one copy of those rows)
    so the tail of a run decodes a smaller batch;
  * the slots start with start_len positions and grow (doubling, one copy of the cache, the graphs captured
    again) when a request needs more, up to max_len: memory follows the longest request seen, not the budget;
  * a request longer than a slot can grow (prompt + max_new_tokens > max_len) is decoded by an eager Engine beside it
    (`overflow`), and a continuation that would outgrow its slot is refused (the caller submits the next turn
    as a new prompt), as Engine does with its token budget: no request is ever dropped;
  * sampling is Engine's: one uniform per (row's rng key, step), so the text of a row depends on neither the
    engine, nor the batch, nor the slot it ran in;
  * the host reads a step's tokens one step late (`pipeline`, on unless turns go on in their slots): each step's
    tokens stay on the device as the next step's inputs, so step k+1 is launched before step k's tokens are copied
    back and booked (appended, end ids found, slots freed), and that work runs while the device computes. A row
    that ended at step k is decoded once more at step k+1 and that token dropped. The in-flight step is booked
    first whenever slots change hands (a prefill, a compaction), so no token reaches another row. Turns that go on
    in their slot (follow) need each token before the next step's input is chosen, so they book every step at once.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from dflash.core.decode_state import needs_kind_cache
from dflash.core.static import static_decoder
from dflash.core.static_decode import StaticDecoder
from dflash.core.target import decode_sdpa, text_config

from dflash.extract.generation.engine import Continuation, Engine, Request, Result, _Row, continue_row, end_of_turn
from dflash.extract.generation.sampling import sample, uniforms

MIN_BATCH = 8
# A decode step reads each row's own columns (StaticDecoder's variable-length attention) when they are fewer than
# this share of the span's, by kernel. flash's: rows of 64-2,048 tokens (~50% of the span) took 15.3 against 17.1 ms
# a step at 1,024 rows, rows of 512 each (100%) 10.4 against 8.9. dflash's Triton kernel: 9.1 and 6.0 ms there,
# faster than the spanned step even when every column is real, so always (bench/decode.py --modes
# fused,triton,flash --batches 1024 --mixed 64-2048, H200, 2026-12-04).
VARLEN_MAX_SHARE = {"flash": 0.7, "triton": math.inf}


def padded(prompts: list[list[int]], width: int, pad: int) -> tuple[torch.Tensor, np.ndarray]:
    """The prompts right-padded with `pad` to `width` columns ([k, width] long) and their lengths ([k] int64): one
    flat array scattered under a mask, 4.2 against 26.6 ms for 1,024 prompts of 20-300 tokens row by row (2 CPU
    cores; bench/prefill_ids.py), a prefill's host time while the GPU waits."""
    lens = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    flat = np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=int(lens.sum()))
    ids = np.full((len(prompts), width), pad, dtype=np.int64)
    ids[np.arange(width)[None, :] < lens[:, None]] = flat
    return torch.from_numpy(ids), lens


@dataclass
class SlotPlan:
    slots: int
    max_len: int
    overflow_tokens: int  # KV budget (tokens) of the eager engine beside it


def plan_slots(cfg_hf, dtype, batch_size: int, max_batch_tokens: int, bucket: int = 256) -> SlotPlan | None:
    """Slots and positions per slot that fit a KV budget of max_batch_tokens (the eager engine's budget, which
    plans for a 2.5x peak; a static cache has none): 90% to the slots, 10% to the overflow engine. None when a
    slot would hold fewer than two buckets. A hybrid target's slot also holds its linear layers' states, of fixed size
    whatever its length: they take the budget of that many tokens first (dflash.core.static_hybrid)."""
    from dflash.core.static_hybrid import linear_state_bytes
    from dflash.extract.generation.slab import kv_bytes_per_token

    budget = max_batch_tokens * 5 // 2
    c = text_config(cfg_hf)
    ctx = int(getattr(c, "max_position_embeddings", 0) or 1 << 20)
    state = linear_state_bytes(c, dtype or torch.bfloat16)
    state = -(-state // kv_bytes_per_token(c, dtype or torch.bfloat16)) if state else 0  # in tokens of the budget
    slots = int(batch_size)
    max_len = min(ctx, int(budget * 0.9) // slots - state) // bucket * bucket
    while max_len < 2 * bucket and slots > MIN_BATCH:
        slots //= 2
        max_len = min(ctx, int(budget * 0.9) // slots - state) // bucket * bucket
    if max_len < 2 * bucket:
        return None
    return SlotPlan(slots, max_len, max(4096, budget // 10 * 2 // 5))


class SlotEngine:
    """Engine's interface over a static KV cache of `slots` rows (module docstring)."""

    def __init__(self, model, *, eos_ids: Iterable[int], slots: int, max_len: int, prefill_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, pad_id: int = 0, refill: int | None = None,
                 follow: Callable[[Result], Continuation | None] | None = None, overflow_tokens: int = 1 << 16,
                 graphs: bool = True, bucket: int = 256, decoder: StaticDecoder | None = None,
                 start_len: int | None = None, pipeline: bool | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.limit = -(-int(max_len) // bucket) * bucket  # positions a slot may grow to
        if decoder is None or decoder.slots < slots:
            first = self.limit if start_len is None else min(self.limit, max(2 * bucket, int(start_len)))
            decoder = static_decoder(model, slots=slots, max_len=first, graphs=graphs, max_q=1, bucket=bucket)
        self.dec = decoder  # a caller's decoder is reused (its graphs too): sampling in parts captures once
        self.eos = frozenset(int(i) for i in eos_ids)
        self.batch_size = int(slots)
        self.max_batch_tokens = self.batch_size * self.limit
        self.prefill_tokens = int(prefill_tokens)
        self.temperature, self.top_p, self.pad_id = float(temperature), float(top_p), int(pad_id)
        self.refill = max(1, int(refill if refill is not None else self.batch_size // 4))
        self.follow = follow
        self.pending: list[tuple[tuple, int, Request]] = []
        self._seq = 0
        self.slot_rows: list[_Row | None] = [None] * self.batch_size
        # per slot, as arrays (a step's bookkeeping over ~1,000 rows in a few numpy calls, not Python loops: the GPU
        # waits for it): the position of its newest token (= tokens in its cache), busy, and the tokens its turn may
        # still generate (end_of_turn ends it at 1)
        self.pos = np.zeros(self.batch_size, dtype=np.int64)
        self._busy = np.zeros(self.batch_size, dtype=bool)
        self._left = np.zeros(self.batch_size, dtype=np.int64)
        self._eos = np.array(sorted(self.eos), dtype=np.int64)
        self._forcing: set[int] = set()  # slots whose row may still have continuation ids to feed
        self.last = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        # the step launched but not yet booked: (its live slots, their rows, its tokens on the host, their event)
        self.pipeline = follow is None if pipeline is None else bool(pipeline)
        if self.pipeline and follow is not None:
            raise ValueError("pipeline: turns that go on in their slot (follow) need each step's tokens at once")
        self._inflight: tuple | None = None
        cuda = self.device.type == "cuda"
        # host buffers, two of each (one for the step in flight, one for the step being launched or booked),
        # page-locked on a GPU so that both copies run asynchronously: the steps' tokens, and their rows' positions
        self._host = [torch.zeros(self.batch_size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._host_start = [torch.zeros(self.batch_size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._flip = 0
        self._start = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        # the eager engine of the target's kind (a hybrid's: transformers' cache per layer kind)
        if needs_kind_cache(model):
            from dflash.extract.generation.kind_engine import KindEngine as eager
        else:
            eager = Engine
        self.overflow = eager(model, eos_ids=self.eos, batch_size=MIN_BATCH, max_batch_tokens=overflow_tokens,
                              prefill_tokens=prefill_tokens, temperature=temperature, top_p=top_p, pad_id=pad_id,
                              follow=follow)
        self.steps = self.prefills = self.generated = self.prompt_tokens = 0
        # the slots' own counts; the properties add the overflow engine's (decode_real_columns always did, so a
        # run with overflowed requests read "100%+ of the columns real")
        self._prefill_columns = self._copied_columns = self._decode_columns = self.varlen_steps = 0
        self._decode_real = 0
        self.seconds = {"prefill": 0.0, "decode": 0.0, "batch_edit": 0.0}
        self.dead = 0
        self.compactions = 0
        self.continued = self.forced_tokens = self.refused = 0
        self.overflowed = 0  # requests decoded by the eager engine (longer than a slot)
        self.grows = 0  # times the slots grew to hold a longer request

    # -- Engine's interface -----------------------------------------------------------------------------------------
    @property
    def rows(self) -> list[_Row]:
        return [r for r in self.slot_rows if r is not None] + self.overflow.rows

    @property
    def decode_real_columns(self) -> int:
        return int(self._decode_real) + self.overflow.decode_real_columns

    @property
    def decode_columns(self) -> int:
        return self._decode_columns + self.overflow.decode_columns

    @property
    def prefill_columns(self) -> int:
        return self._prefill_columns + self.overflow.prefill_columns

    @property
    def copied_columns(self) -> int:
        return self._copied_columns + self.overflow.copied_columns

    @property
    def busy(self) -> bool:
        return bool(self.pending or self._busy.any() or self._inflight is not None or self.overflow.busy)

    @property
    def graphs(self) -> int:
        return len(self.dec._graphs)

    def add(self, req: Request) -> None:
        if len(req.prompt) < 1:
            raise ValueError("empty prompt")
        if req.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        need = len(req.prompt) + req.max_new_tokens
        if need > self.limit:
            self.overflowed += 1
            self.overflow.add(req)
            return
        self._fit(need)
        heapq.heappush(self.pending, (req.priority, self._seq, req))
        self._seq += 1

    def step(self) -> list[Result]:
        done: list[Result] = []
        free = np.flatnonzero(~self._busy).tolist()
        busy = self.batch_size - len(free)
        if self.pending and free and (busy == 0 or len(free) >= self.refill):
            t = time.perf_counter()
            done += self._book()  # the rows that ended in the step in flight free their slots first (decode time)
            u = time.perf_counter()
            self.seconds["decode"] += u - t
            done += self._admit(np.flatnonzero(~self._busy).tolist())
            self.seconds["prefill"] += time.perf_counter() - u
        if self._busy.any():
            t = time.perf_counter()
            done += self._decode()
            self.seconds["decode"] += time.perf_counter() - t
        elif self._inflight is not None:
            done += self._book()
        if self.overflow.busy:
            done += self.overflow.step()
        return done

    # -- internals ----------------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: list[_Row | None]) -> torch.Tensor:
        u = None
        if self.temperature > 0:
            # a row's step counter is its tokens so far: with a step in flight, one more than its booked tokens
            # (every busy row was in it: a prefill books it first)
            late = int(self._inflight is not None)
            u = torch.from_numpy(uniforms([r.req.rng_key if r else 0 for r in rows],
                                          [len(r.out) + late if r else 0 for r in rows]))
        return sample(logits, self.temperature, self.top_p, u)

    @torch.inference_mode()
    def _admit(self, free: list[int]) -> list[Result]:
        """Prefill waiting prompts into the free slots, in chunks of at most prefill_tokens padded tokens."""
        done: list[Result] = []
        while self.pending and free:
            chosen: list[Request] = []
            width = 0
            while self.pending and len(chosen) < len(free):
                req = self.pending[0][2]
                w = max(width, len(req.prompt))
                if chosen and (len(chosen) + 1) * w > self.prefill_tokens:
                    break
                heapq.heappop(self.pending)
                chosen.append(req)
                width = w
            slots, free = free[:len(chosen)], free[len(chosen):]
            ids, lens = padded([r.prompt for r in chosen], width, self.pad_id)
            lengths = torch.from_numpy(lens).to(self.device)
            slot_idx = torch.tensor(slots, device=self.device)
            with decode_sdpa():
                logits, _ = self.dec.prefill(ids.to(self.device), slot_idx, lengths)
            rows = [_Row(r) for r in chosen]
            first = self._sample(logits[:, 0].float(), rows)
            self.last[slot_idx] = first
            for s, row in zip(slots, rows):
                self.slot_rows[s] = row
            self.pos[slots] = lens
            self._left[slots] = [r.max_new_tokens for r in chosen]
            self._busy[slots] = True
            self.prefills += 1
            self.prompt_tokens += int(lens.sum())
            self._prefill_columns += len(chosen) * width
            done += self._emit(slots, first.tolist(), fed=set())
        return done

    def _width(self) -> int:
        top = int(np.flatnonzero(self._busy)[-1]) + 1
        n = MIN_BATCH
        while n < top:
            n *= 2
        return min(n, self.batch_size)

    @torch.inference_mode()
    def _decode(self) -> list[Result]:
        early = self._compact() if not self.pending else []  # with a step in flight booked first: rows it ended
        if not self._busy.any():
            return early
        n = self._width()
        live = np.flatnonzero(self._busy[:n])
        end = int(self.pos[live].max()) + 1
        start = self.pos[:n]  # a free slot's position is 0: its step writes and reads that column only
        staged = self._host_start[self._flip][:n]  # free again: the step that last read it has been booked
        staged.numpy()[:] = start
        self._start[:n].copy_(staged, non_blocking=True)
        # each row's own columns (the decoder's variable-length attention) where they are few enough of the span's
        own, spanned = int(start.sum()) + n, n * self.dec.span_for(end)
        varlen = self.dec.varlen_step(n, 1) and own < VARLEN_MAX_SHARE[self.dec.varlen_kernel] * spanned
        with decode_sdpa():
            logits, _ = self.dec.step(self.last[:n, None], self._start[:n], end, varlen=varlen)
        self._decode_columns += own if varlen else spanned  # the columns the step reads
        self.varlen_steps += varlen
        self._decode_real += int(self.pos[live].sum()) + len(live)
        self.last[:n] = self._sample(logits[:, 0].float(), self.slot_rows[:n])
        self.steps += 1
        self.pos[live] += 1
        fed = set()
        for i in sorted(self._forcing):
            row = self.slot_rows[i]
            if row is None or not row.forced:
                self._forcing.discard(i)
            elif i < n and not row.done:
                fed.add(i)
        if fed:
            idx = sorted(fed)
            self.last[idx] = torch.tensor([self.slot_rows[i].forced.popleft() for i in idx], device=self.device)
        if not self.pipeline:
            tokens = self.last[:n].tolist()
            return early + self._emit(live.tolist(), [tokens[i] for i in live.tolist()], fed)
        host = self._host[self._flip][:n]
        self._flip ^= 1
        host.copy_(self.last[:n], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        slots = live.tolist()
        prev, self._inflight = self._inflight, (slots, [self.slot_rows[i] for i in slots], host, event)
        return early + (self._book(prev) if prev is not None else [])

    def _book(self, step: tuple | None = None) -> list[Result]:
        """Book a launched step's tokens (the one in flight by default): each row still in its slot gets its token
        (a row that ended in the step before was decoded once more, its token dropped)."""
        if step is None:
            step, self._inflight = self._inflight, None
            if step is None:
                return []
        live, rows, host, event = step
        if event is not None:
            event.synchronize()
        tokens = host.tolist()
        keep = [s for s, row in zip(live, rows) if self.slot_rows[s] is row]
        return self._emit(keep, [tokens[s] for s in keep], set())

    def _emit(self, slots: list[int], tokens: list[int], fed: set[int]) -> list[Result]:
        """Append each busy slot's token (slots[j] gets tokens[j], slots ascending; but those fed a continuation id)
        and return the finished rows' Results; a finished row's slot is freed at once unless follow() continues it
        there. A token that ends no turn is only appended (the arrays say which do: an end id, or the turn's last)."""
        done = []
        inputs: dict[int, int] = {}
        idx = np.asarray(slots, dtype=np.int64)
        ends = self._left[idx] <= 1
        if len(self._eos):
            ends |= np.isin(np.asarray(tokens, dtype=np.int64), self._eos)
        rows = self.slot_rows
        if fed:
            keep = np.array([s not in fed for s in slots], dtype=bool)
            ends &= keep
            going = np.flatnonzero(keep & ~ends)
        else:
            going = np.flatnonzero(~ends)
        for j in going.tolist():
            rows[slots[j]].out.append(tokens[j])
        self._left[idx[going]] -= 1
        self.generated += len(going)
        for j in np.flatnonzero(ends).tolist():
            s, row = slots[j], rows[slots[j]]
            self.generated += 1
            res = end_of_turn(row, tokens[j], self.eos)
            assert res is not None, "end_of_turn and the slot arrays disagree"
            done.append(res)
            cont = self.follow(res) if self.follow is not None else None
            if cont is not None and self._goes_on(s, row, res, cont, inputs):
                continue
            self.slot_rows[s] = None
            self.pos[s] = 0
            self._busy[s] = False
        if inputs:
            idx = list(inputs)
            self.last[idx] = torch.tensor([inputs[i] for i in idx], device=self.device)
        return done

    def _goes_on(self, s: int, row: _Row, res: Result, cont: Continuation, inputs: dict) -> bool:
        """Continue slot s's row with `cont` (continue_row) if its slot can grow to hold it; True if it does."""
        if not cont.forced or cont.max_new_tokens < 1:
            return False
        need = self.pos[s] + len(cont.forced) + cont.max_new_tokens + 1
        if need > self.limit:
            self.refused += 1
            return False
        self._fit(need)
        first = continue_row(row, res, cont)
        self._left[s] = row.req.max_new_tokens
        self._forcing.add(s)
        if first is not None:
            inputs[s] = first
        self.continued += 1
        self.forced_tokens += len(cont.forced)
        return True

    def _fit(self, need: int) -> None:
        """Grow every slot (doubling, up to the limit) until it holds `need` positions: the memory follows the
        longest request seen, not the budget."""
        if need > self.dec.max_len:
            t = time.perf_counter()
            self.dec.grow(min(self.limit, max(need, 2 * self.dec.max_len)))
            self.grows += 1
            self.seconds["batch_edit"] += time.perf_counter() - t

    @property
    def max_len(self) -> int:
        return self.dec.max_len

    def _compact(self) -> list[Result]:
        """With no prompt waiting: move the highest busy rows into the lowest free slots while the busy rows fit
        half of the current step's batch, so the tail of a run decodes fewer rows. Returns the rows the step in
        flight ended (it is booked first)."""
        n = self._width()
        busy = np.flatnonzero(self._busy).tolist()
        if n <= MIN_BATCH or len(busy) > n // 2:
            return []
        if self._inflight is not None:  # rows move to other slots: the step in flight is booked by the old ones
            done = self._book()
            if self._busy.any():
                done += self._compact()
            return done
        target = n // 2
        while target // 2 >= max(MIN_BATCH, len(busy)):
            target //= 2
        src = [i for i in busy if i >= target]
        dst = [i for i in range(target) if self.slot_rows[i] is None][:len(src)]
        t = time.perf_counter()
        si, di = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        self.dec.move(si, di)
        self.last[di] = self.last[si]
        for a, b in zip(src, dst):
            self.slot_rows[b], self.slot_rows[a] = self.slot_rows[a], None
            self.pos[b], self.pos[a] = self.pos[a], 0
            self._left[b], self._left[a] = self._left[a], 0
            self._busy[b], self._busy[a] = True, False
            if a in self._forcing:
                self._forcing.discard(a)
                self._forcing.add(b)
        self.compactions += 1
        self._copied_columns += len(src) * self.dec.max_len
        self.seconds["batch_edit"] += time.perf_counter() - t
        return []
