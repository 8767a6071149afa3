"""The DFlash drafter as a proposer of train/evaluate/decode.py's loop: it drafts B-1 tokens after the last confirmed
token in ONE forward, from the target's captured hidden states of the confirmed tokens.

  * DFlashProposer: eager (DFlashDrafter.extend_context of the confirmed rows, then draft_block) or, with
    graph=True, StaticDraft's fixed-shape step, checked once against the eager one (draft_disagreement);
  * StaticDraft: the verified block into the context cache, then the next draft, at fixed shapes: one CUDA
    graph replay per step on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.train.drafter.model import DFlashDrafter, DrafterError, rope_cos_sin, window_mask


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
    into static buffers: no host sync.

    compiled (None: where the step is captured, on a GPU): the step goes through torch.compile first (fixed
    shapes, one graph), so inductor fuses its pointwise work: a captured graph replays a few dozen kernels instead
    of ~250 small ones (a 4-layer step took 1.04 ms against 1.64 for the recipe's whole fused target step). Should
    it fail to compile, the step runs uncompiled, said once."""

    def __init__(self, drafter: DFlashDrafter, cache, capture: bool, compiled: bool | None = None):
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
        self.compiled = self.capture if compiled is None else bool(compiled)
        self._fwd = _compiled(self.forward) if self.compiled else self.forward

    def _run(self) -> torch.Tensor:
        """The step through _fwd; a compiler error (torch's, not ours) turns the compiled step off, says so once,
        and runs it uncompiled (nothing was written: the step fails while it compiles, before it runs)."""
        try:
            return self._fwd()
        except Exception as e:  # noqa: BLE001  (only the compiler's own errors are caught: below)
            if not self.compiled or not type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"eval: note: the drafter's step failed to compile ({type(e).__name__}: {first[:200]}); it runs "
                  "uncompiled", flush=True)
            self.compiled, self._fwd = False, self.forward
            return self.forward()

    def forward(self) -> torch.Tensor:
        d, c = self.d, self.cache
        B = self.block.shape[1]
        cpos = self.start + self.offsets  # [1, B]
        ctx = d.fuse_context(self.hidden)
        ccos, csin = rope_cos_sin(d.inv_freq, cpos, ctx.dtype, d.rope_scale)
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.kv(ctx, ccos, csin)
            c.k[i].index_copy_(2, cpos[0], k)
            c.v[i].index_copy_(2, cpos[0], v)
        c.pos.index_copy_(1, cpos[0], cpos)
        positions = self.n + self.offsets
        x = d.embed(self.block)
        cos, sin = rope_cos_sin(d.inv_freq, positions, x.dtype, d.rope_scale)
        visible = torch.cat([self.kidx < self.n, self.kidx.new_ones(B, dtype=torch.bool)])  # [len + B]
        mask = visible[None, None, None, :].expand(1, 1, B, visible.shape[0])
        for i, layer in enumerate(d.layers):
            m = mask
            if layer.self_attn.window is not None:
                kpos = torch.cat([c.pos, positions], 1)
                m = mask & window_mask(positions, kpos, layer.self_attn.window)
            x = layer(x, cos, sin, c.k[i], c.v[i], m)
        return self.select(d.norm(x[:, 1:]))

    def select(self, h: torch.Tensor) -> torch.Tensor:
        """The draft [B-1] from the slots' normalised outputs h [1, B-1, H]: the LM head's argmax (a DFlash2
        drafter's step reranks with its selector instead, train/evaluate/dflash2_drafting.py)."""
        return F.linear(h, self.d.lm_head_weight).argmax(-1)[0]

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # the warm-up runs write what the step writes: the same values at the same places
                self._run()  # (and compile it, outside the capture)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._fwd()
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
            return self._run()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites self.out


# The compiled variants of StaticDraft.forward one process may hold: one per drafter kind, dtype and cache size
# (a demo's evals: DFlash and DFlash2, bf16 and float32), past torch's default of 8 in a process that evaluates many.
DRAFT_RECOMPILE_LIMIT = 64


def _compiled(fn):
    """fn through torch.compile (fixed shapes, one graph), its compilations under DRAFT_RECOMPILE_LIMIT."""
    import torch._dynamo

    step = torch.compile(fn, fullgraph=True, dynamic=False)

    def call():
        with torch._dynamo.config.patch(recompile_limit=DRAFT_RECOMPILE_LIMIT):
            return step()
    return call


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
    capture) the proposer says so and stays eager. On a GPU the step is compiled before its capture
    (StaticDraft, compiled)."""

    name = "dflash"
    needs_hidden = True
    static_class = StaticDraft  # the fixed-shape step (DFlash2Proposer's reranks with the selector)

    def __init__(self, drafter: DFlashDrafter, max_len: int, graph: bool = False, compiled: bool | None = None):
        self.d = drafter
        self.compiled = compiled  # StaticDraft's (None: where it is captured)
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
            slack = self.block_size if self.graph else 0  # StaticDraft writes whole blocks past the confirmed length
            self.cache = self.d.new_cache(1, self.max_len + slack)
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

    def _checked_eager(self, last, pos: int, got: torch.Tensor | None) -> tuple[torch.Tensor, str | None]:
        """The eager draft, and how the static step's draft `got` differs from it beyond near ties (None: it does
        not, or there is none)."""
        logits = self._eager_logits(last, pos)
        return logits.argmax(-1), (draft_disagreement(got, logits) if got is not None else None)

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
            self.static = self.static_class(self.d, self.cache, capture=True, compiled=self.compiled)
            got = self._static(last, pos)
        except Exception as e:  # noqa: BLE001 - a failed capture leaves the eager forward, and says why
            got, why = None, f"{type(e).__name__}: {e}"
        self.pending = pending  # the eager path rewrites the same cache positions
        self.cache.length = pending[1]
        want, disagreement = self._checked_eager(last, pos, got)
        if got is not None:
            why = disagreement
        if why:
            print(f"eval: the drafter's static step is not used ({why}); drafting eagerly", flush=True)
        self.graph_status = "eager" if why else ("graph" if self.static.capture else "static")
        return want
