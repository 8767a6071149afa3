"""`dflash eval`: what a drafter is worth, measured by real greedy speculative decoding.

For every prompt, three decodes of the same target with KV caches:
  * target-only greedy decoding (the reference output and the baseline speed);
  * DFlash: the target's prefill captures the K layers; each step the drafter proposes B-1 tokens
    after the last confirmed token in ONE forward, the target verifies the block in ONE forward,
    the longest matching prefix plus the target's own next token (the bonus) is accepted, both
    caches are cropped to the accepted length;
  * n-gram prompt lookup (no training): the B-1 tokens that followed the latest earlier occurrence
    of the sequence's last n-gram, verified the same way - what users get for free.
tau = mean over steps of (accepted + 1). Greedy speculative decoding is lossless, so each output
must equal the target-only output: exact in float32; in bf16 on GPU the match rate is reported.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dflash.config import check

from .model import DFlashDrafter, load_drafter


@dataclass
class EvalConfig:
    target: str = ""
    drafter: str = ""
    data: str = ""
    split: str = "train"
    max_prompts: int | None = None
    skip_prompts: int = 0
    max_new_tokens: int = 128
    ngram_max: int = 3
    device: str = "auto"
    dtype: str = "auto"  # bfloat16 on GPU, float32 on CPU
    chat_template_kwargs: dict = field(default_factory=dict)
    json_out: str | None = None
    plot: str | None = None
    stop_at_eos: bool = True
    progress: bool = True

    def __post_init__(self):
        check(bool(self.target), "target", "is required")
        check(bool(self.drafter), "drafter", "is required (a checkpoint directory, e.g. RUN/final)")
        check(bool(self.data), "data", "is required (prompts: a chat dataset; the turns before the first assistant turn)")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.max_prompts is None or self.max_prompts >= 1, "max_prompts", "must be >= 1")
        check(self.ngram_max >= 1, "ngram_max", "must be >= 1")
        check(self.dtype in ("auto", "bfloat16", "float32"), "dtype", "must be auto, bfloat16 or float32")


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
        from extract.target import LayerCapture, decoder_layers

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
# Proposers
# --------------------------------------------------------------------------------------------


class DFlashProposer:
    """Drafts B-1 tokens after the last confirmed token in one drafter forward."""

    name = "dflash"
    needs_hidden = True

    def __init__(self, drafter: DFlashDrafter, max_len: int):
        self.d = drafter
        self.block_size = drafter.cfg.block_size
        self.max_len = max_len

    def start(self, prompt_hidden: torch.Tensor) -> None:
        self.cache = self.d.new_cache(1, self.max_len)
        self.observe(prompt_hidden, 0)

    @torch.inference_mode()
    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """Target hidden states of confirmed tokens at positions start..start+L-1."""
        L = hidden.shape[1]
        pos = torch.arange(start, start + L, device=hidden.device)[None]
        self.d.extend_context(self.cache, hidden, pos)

    @torch.inference_mode()
    def propose(self, seq: list[int], last: int, pos: int) -> list[int]:
        B = self.block_size
        dev = self.d.fc.weight.device
        block = torch.full((1, B), self.d.cfg.mask_token_id, dtype=torch.long, device=dev)
        block[0, 0] = last
        positions = torch.arange(pos, pos + B, device=dev)[None]
        return self.d.draft_block(self.cache, block, positions).argmax(-1)[0].tolist()


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
# Decoding
# --------------------------------------------------------------------------------------------


@dataclass
class Decode:
    tokens: list[int]
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted + 1 per step
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _finish(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


@torch.inference_mode()
def greedy(target: Target, prompt: list[int], max_new: int, eos: set[int]) -> Decode:
    dev = target.device
    _sync(dev)
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(torch.tensor([prompt], device=dev), 0, hidden=False)
    tok = int(logits[0, -1].argmax())
    out = [tok]
    pos = len(prompt)
    while len(out) < max_new and tok not in eos:
        logits, _ = target.forward(torch.tensor([[tok]], device=dev), pos, hidden=False)
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        pos += 1
    _sync(dev)
    return Decode(out, steps=len(out), seconds=time.perf_counter() - t0)


@torch.inference_mode()
def speculative(target: Target, proposer, prompt: list[int], max_new: int, eos: set[int]) -> Decode:
    """Greedy speculative decoding: propose, verify in one target forward, accept prefix + bonus."""
    dev = target.device
    _sync(dev)
    t0 = time.perf_counter()
    target.reset()
    logits, hidden = target.forward(torch.tensor([prompt], device=dev), 0, hidden=proposer.needs_hidden)
    last = int(logits[0, -1].argmax())
    proposer.start(hidden)
    seq = list(prompt) + [last]
    out = [last]
    pos = len(prompt)  # position of `last` (not yet seen by the target)
    res = Decode(out)
    while len(out) < max_new and last not in eos:
        draft = list(proposer.propose(seq, last, pos))[: proposer.block_size - 1]
        block = torch.tensor([[last] + draft], device=dev)
        logits, hidden = target.forward(block, pos, hidden=proposer.needs_hidden)
        post = logits[0].argmax(-1).tolist()
        acc = 0
        while acc < len(draft) and draft[acc] == post[acc]:
            acc += 1
        new = draft[:acc] + [post[acc]]
        crop_cache(target.cache, pos + acc + 1)  # keep `last` and the accepted drafts
        if proposer.needs_hidden:
            proposer.observe(hidden[:, : acc + 1], pos)
        res.accept_lengths.append(acc + 1)
        res.steps += 1
        out.extend(new)
        seq.extend(new)
        pos += acc + 1
        last = new[-1]
        if any(t in eos for t in new):
            break
    _sync(dev)
    res.tokens = _finish(out, max_new, eos)
    res.seconds = time.perf_counter() - t0
    return res


# --------------------------------------------------------------------------------------------
# Prompts, the run, the report
# --------------------------------------------------------------------------------------------


def load_prompts(cfg: EvalConfig, tokenizer) -> list[list[int]]:
    """Token ids of each row's turns before its first assistant turn, with the generation prompt."""
    from extract.data import DataError, load_chat_dataset, to_messages

    ds = load_chat_dataset(cfg.data, split=cfg.split)
    n = len(ds)
    lo = min(cfg.skip_prompts, n)
    hi = n if cfg.max_prompts is None else min(n, lo + cfg.max_prompts)
    prompts = []
    for row in range(lo, hi):
        ex = ds[row]
        if "prompt" in ex and "messages" not in ex and "conversations" not in ex:
            msgs = [{"role": "user", "content": str(ex["prompt"])}]
        else:
            msgs = to_messages(ex, row, cfg.data)
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        msgs = msgs[:first]
        if not msgs or msgs[-1]["role"] != "user":
            raise DataError(f"{cfg.data}, row {row}: no user turn before the first assistant turn to use as a prompt")
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            **cfg.chat_template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        prompts.append([int(t) for t in ids])
    if not prompts:
        raise DataError(f"{cfg.data}: no prompts selected (rows {lo}..{hi})")
    return prompts


def summarize(name: str, decodes: list[Decode], block_size: int) -> dict[str, Any]:
    lens = [a for d in decodes for a in d.accept_lengths]
    toks = sum(len(d.tokens) for d in decodes)
    secs = sum(d.seconds for d in decodes)
    hist = [0] * (block_size + 1)
    for a in lens:
        hist[min(a, block_size)] += 1
    steps = max(1, len(lens))
    # slot k (1..B-1) accepted in a step <=> accept length >= k + 1
    by_slot = [sum(c for a, c in enumerate(hist) if a >= k + 1) / steps for k in range(1, block_size)]
    return {
        "name": name,
        "tau": sum(lens) / steps if lens else 1.0,
        "tau_per_prompt": [d.tau for d in decodes],
        "steps": len(lens),
        "tokens": toks,
        "seconds": secs,
        "tokens_per_s": toks / secs if secs > 0 else 0.0,
        "accept_length_hist": hist[1:],  # counts of accept length 1..B
        "slot_accept_rate": by_slot,
    }


def plot_acceptance(path: str, results: list[dict], block_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    k = list(range(1, block_size))
    w = 0.8 / len(results)
    for i, r in enumerate(results):
        ax.bar([x + (i - (len(results) - 1) / 2) * w for x in k], r["slot_accept_rate"], width=w,
               label=f"{r['name']} (tau {r['tau']:.2f})")
    ax.set_xlabel("draft slot k (token at anchor + k)")
    ax.set_ylabel("fraction of steps accepting slot k")
    ax.set_xticks(k)
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("Acceptance by slot (greedy verification)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    from dflash import progress
    from dflash.dist import compute_init, resolve_dtype
    from extract.target import load_causal_lm, load_tokenizer

    dev = compute_init(cfg.device).device
    dtype = resolve_dtype(cfg.dtype, dev)
    tok = load_tokenizer(cfg.target)
    model = load_causal_lm(cfg.target, device=dev, dtype=dtype)
    drafter = load_drafter(cfg.drafter, dtype=dtype, device=dev)
    drafter.set_target_head(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    drafter.eval()
    target = Target(model, drafter.cfg.target_layer_ids)
    prompts = load_prompts(cfg, tok)
    eos = set()
    if cfg.stop_at_eos:
        ids = tok.eos_token_id if isinstance(tok.eos_token_id, list) else [tok.eos_token_id]
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos = {int(i) for i in ids if i is not None}
    B = drafter.cfg.block_size
    max_len = max(len(p) for p in prompts) + cfg.max_new_tokens + B + 1
    props = [DFlashProposer(drafter, max_len), NgramProposer(B, cfg.ngram_max)]
    runs: dict[str, list[Decode]] = {"target": [], "dflash": [], "ngram": []}
    matches = {"dflash": 0, "ngram": 0}
    token_match = {"dflash": [0, 0], "ngram": [0, 0]}
    bar = progress.bar(cfg.progress, total=len(prompts), desc="eval", unit="prompt")
    # warm-up (allocations, kernels) outside the timings
    greedy(target, prompts[0], min(4, cfg.max_new_tokens), eos)
    for p in prompts:
        ref = greedy(target, p, cfg.max_new_tokens, eos)
        runs["target"].append(ref)
        for prop in props:
            d = speculative(target, prop, p, cfg.max_new_tokens, eos)
            runs[prop.name].append(d)
            matches[prop.name] += int(d.tokens == ref.tokens)
            n = min(len(d.tokens), len(ref.tokens))
            first_diff = next((i for i in range(n) if d.tokens[i] != ref.tokens[i]), n)
            token_match[prop.name][0] += first_diff
            token_match[prop.name][1] += len(ref.tokens)
        bar.update(1)
    bar.close()
    base = summarize("target", runs["target"], B)
    res = {"dflash": summarize("dflash", runs["dflash"], B), "ngram": summarize("ngram", runs["ngram"], B)}
    for name, r in res.items():
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
        r["outputs_identical"] = matches[name]
        r["output_match_rate"] = matches[name] / len(prompts)
        r["token_match_rate"] = token_match[name][0] / max(1, token_match[name][1])
    report = {
        "config": asdict(cfg), "device": str(dev), "dtype": str(dtype).replace("torch.", ""), "prompts": len(prompts),
        "block_size": B, "target_tokens_per_s": base["tokens_per_s"], "target_tokens": base["tokens"],
        "dflash": res["dflash"], "ngram": res["ngram"],
        "tau_gain_over_ngram": res["dflash"]["tau"] / res["ngram"]["tau"] if res["ngram"]["tau"] else None,
    }
    if cfg.plot:
        plot_acceptance(cfg.plot, [res["dflash"], res["ngram"]], B)
        report["plot"] = cfg.plot
    if cfg.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.json_out)), exist_ok=True)
        with open(cfg.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def format_report(r: dict[str, Any]) -> str:
    d, n = r["dflash"], r["ngram"]
    rows = [
        ("", "tau", "tokens/s", "speed-up", "identical outputs"),
        ("target greedy", "1.00", f"{r['target_tokens_per_s']:.1f}", "1.00x", "-"),
        ("dflash drafter", f"{d['tau']:.2f}", f"{d['tokens_per_s']:.1f}", f"{d['speedup']:.2f}x",
         f"{d['outputs_identical']}/{r['prompts']}"),
        ("n-gram lookup", f"{n['tau']:.2f}", f"{n['tokens_per_s']:.1f}", f"{n['speedup']:.2f}x",
         f"{n['outputs_identical']}/{r['prompts']}"),
    ]
    w = [max(len(x[i]) for x in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(row)) for row in rows]
    lines.append(f"{r['prompts']} prompts, {r['target_tokens']} tokens, block {r['block_size']}, {r['dtype']} on {r['device']}")
    return "\n".join(lines)
