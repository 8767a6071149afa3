"""`dflash eval`: what a drafter is worth, measured by real greedy speculative decoding.

For every prompt, three decodes of the same target with KV caches:
  * target-only greedy decoding (the reference output and the baseline speed);
  * DFlash: the target's prefill captures the K layers; each step the drafter proposes B-1 tokens
    after the last confirmed token in ONE forward, the target verifies the block in ONE forward,
    the longest matching prefix plus the target's own next token (the bonus) is accepted, both
    caches are cropped to the accepted length (on a hybrid target the linear-attention layers' recurrent and
    conv states too: dflash/core/static_hybrid.py's accept in CUDA graphs, dflash/core/decode_state.py eagerly);
  * n-gram prompt lookup (no training): the B-1 tokens that followed the latest earlier occurrence
    of the sequence's last n-gram, verified the same way - what users get for free.
tau = mean over steps of (accepted + 1). Greedy speculative decoding is lossless, so each output
must equal the target-only output: exact in float32; in bf16 on GPU the match rate is reported.
The decoding loop lives in train/evaluate/decode.py, the target in train/evaluate/verify.py, the DFlash proposer in
train/evaluate/drafting.py; this module loads, runs and reports.

Prompt rows may carry a `set` (e.g. "in-source" / "out-of-source": prompts like the training data's, and from
elsewhere) and a `category` (e.g. MT-Bench's writing, coding, ...): the report then has the figures of every set
and category too, and the printed report a table with one line per set and per category within it.

The JSON report (--json; schema SCHEMA, the same keys on every run):
  schema, config, device, dtype, prompts, block_size, drafter_layers, draft_graph, target_attention,
  target_graph             true when the target's steps ran as CUDA graphs over a static KV cache (StaticTarget):
                           the speed-ups are then those of both models graph-captured, as serving engines run them
  target_fused             true when, in those graphs, each target layer ran as two compiled functions (the
                           pointwise work fused: dflash/core/static_decode.py fused_layers)
  draft_compiled           true when the drafter's step went through torch.compile before its capture (its
                           pointwise work fused: train/evaluate/drafting.py StaticDraft)
  harness                  the settings that make one harness's tau comparable with another's (serving engines'
                           benchmarks differ on them): decoding ("greedy"), temperature (0.0), block_size,
                           max_new_tokens, stop_at_eos, chat_template_kwargs (as rendered; {} = the template's own
                           defaults, e.g. thinking on or off), enable_thinking (that kwarg, or null when not given)
  target, dflash, ngram    one METHOD object each over all prompts (ngram when EvalConfig.ngram, the default;
                           target: the target alone, speedup 1 and identical = prompts by definition)
  tau_gain_over_ngram      dflash tau / n-gram tau (with ngram)
  sets                     {set: GROUP} in the order of the data; {} when no row has a `set`
  categories               {category: GROUP} over all prompts; {} when no row has a `category`
  target_tokens_per_s, target_tokens, plot    (as in earlier reports)
METHOD: name, tau, speedup (tokens/s over the target's), tokens_per_s, identical (outputs equal to the target's
  own), prompts, tokens, steps, seconds, tau_per_prompt, accept_length_hist, slot_accept_rate, time_s,
  ms_per_step; dflash and ngram also outputs_identical (= identical), output_match_rate, token_match_rate and
  differences (classify_differences).
GROUP: prompts, target, dflash, ngram (when run): each {tau, speedup, tokens_per_s, identical, prompts, tokens,
  steps, seconds} over the group's prompts (tau: its accepted tokens over its steps; speedup: against the target
  on the same prompts); tau_over_ngram; a set's GROUP has `categories` too: {category: GROUP} within the set.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dflash.core import progress
from dflash.core.chat import DataError, eos_ids_of, iter_row_batches, load_chat_dataset, row_messages
from dflash.core.config import check, finite
from dflash.core.decode_state import eager_reason
from dflash.core.threads import check_threads, decode_threads
from dflash.core.dist import compute_init, resolve_dtype
from dflash.core.hybrid import check_layer_kinds
from dflash.core.target import load_causal_lm, load_config, load_tokenizer, text_config

from dflash.train.drafter.checkpoint import check_fits_target, load_drafter, read_drafter_config
from dflash.train.evaluate.decode import Decode, NgramProposer, NoDraft, speculative
from dflash.train.drafter.dflash2 import DFlash2Drafter
from dflash.train.evaluate.dflash2_drafting import DFlash2Proposer
from dflash.train.evaluate.drafting import DFlashProposer
from dflash.train.drafter.model import DrafterError
from dflash.train.evaluate.verify import StaticTarget, Target


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
    ngram: bool = True  # also run n-gram prompt lookup (the free baseline)
    warmup_prompts: int = 2  # decoded by every method before the timed runs (kernels, allocator, caches)
    tie_margin: float = 0.5  # a differing output whose first differing token had a top-2 logit gap below this is a near tie
    # the drafter's step (context + draft) as one CUDA graph (checked against the eager step once); None: on a GPU
    # (bench/spec_step.py --draft-only on the H200: 0.61 vs 2.33 ms a step in bf16), off on a CPU (no graphs there)
    draft_graph: bool | None = None
    # the target's steps (alone, and the verify of a block) as CUDA graphs over a static KV cache (train/evaluate/verify.py
    # StaticTarget), as serving engines run it; None: on a GPU where the model allows it, else the HF forward
    target_graph: bool | None = None
    threads: int = 0  # intra-op CPU threads; 0: 1 on a CPU (or $OMP_NUM_THREADS), untouched on CUDA (core/threads.py)
    progress: bool = True

    def __post_init__(self):
        check(bool(self.target), "target", "is required")
        check(bool(self.drafter), "drafter", "is required (a checkpoint directory, e.g. RUN/final)")
        check(bool(self.data), "data", "is required (prompts: a chat dataset; the turns before the first assistant turn)")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.max_prompts is None or self.max_prompts >= 1, "max_prompts", "must be >= 1")
        check(self.skip_prompts >= 0, "skip_prompts", f"must be >= 0, got {self.skip_prompts}")
        check(self.ngram_max >= 1, "ngram_max", "must be >= 1")
        check(self.dtype in ("auto", "bfloat16", "float32"), "dtype", "must be auto, bfloat16 or float32")
        check(self.warmup_prompts >= 0, "warmup_prompts", "must be >= 0")
        check(finite(self.tie_margin) and self.tie_margin >= 0, "tie_margin", "must be a finite number >= 0")
        check_threads(self.threads)


# --------------------------------------------------------------------------------------------
# Prompts, the run, the report
# --------------------------------------------------------------------------------------------


def prompt_messages(msgs: list[dict], row: int, source: str) -> list[dict]:
    """The prompt of a row: the whole row when it ends with a user turn (a conversation's history up to
    the turn to answer), else the turns before its first assistant turn."""
    if not (msgs and msgs[-1]["role"] == "user"):
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        msgs = msgs[:first]
    if not msgs or msgs[-1]["role"] != "user":
        raise DataError(f"{source}, row {row}: no user turn before the first assistant turn to use as a prompt")
    return msgs


def load_prompts(cfg: EvalConfig, tokenizer) -> list[list[int]]:
    """Token ids of each row's prompt (see prompt_messages), with the generation prompt."""
    ds = load_chat_dataset(cfg.data, split=cfg.split)
    n = len(ds)
    lo = min(cfg.skip_prompts, n)
    hi = n if cfg.max_prompts is None else min(n, lo + cfg.max_prompts)
    prompts = []
    rows = itertools.chain.from_iterable(iter_row_batches(ds, cfg.data, prompt=True, lo=lo, hi=hi))
    for row, ex in zip(range(lo, hi), rows):
        msgs = prompt_messages(row_messages(ex, row, cfg.data, prompt=True), row, cfg.data)
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            **cfg.chat_template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        prompts.append([int(t) for t in ids])
    if not prompts:
        raise DataError(f"{cfg.data}: no prompts selected (rows {lo}..{hi})")
    return prompts


SCHEMA = "dflash.eval/1"
LABELS = ("set", "category")  # the optional prompt-row fields the report groups by


def prompt_labels(cfg: EvalConfig, n: int) -> list[dict[str, str | None]]:
    """{"set", "category"} of each of the n prompts load_prompts selected (None where the row has none)."""
    ds = load_chat_dataset(cfg.data, split=cfg.split)
    lo = min(cfg.skip_prompts, len(ds))
    names = getattr(ds, "column_names", None) or []
    sub = ds.select(range(lo, lo + n)) if hasattr(ds, "select") else None
    cols = {k: (sub[k] if sub is not None and k in names else [None] * n) for k in LABELS}
    return [{k: (None if cols[k][i] is None else str(cols[k][i])) for k in LABELS} for i in range(n)]


def group_method(decodes: list[Decode], refs: list[Decode], target_tps: float | None) -> dict[str, Any]:
    """{tau, speedup, tokens_per_s, identical, prompts, tokens, steps, seconds} of one method on some prompts;
    refs: the target's own decodes of the same prompts; target_tps: its tokens/s there (None: this is it)."""
    lens = [a for d in decodes for a in d.accept_lengths]
    toks = sum(len(d.tokens) for d in decodes)
    secs = sum(d.seconds for d in decodes)
    tps = toks / secs if secs > 0 else 0.0
    base = tps if target_tps is None else target_tps
    return {"tau": sum(lens) / len(lens) if lens else 1.0, "speedup": tps / base if base else 0.0,
            "tokens_per_s": tps, "identical": sum(int(d.tokens == r.tokens) for d, r in zip(decodes, refs)),
            "prompts": len(decodes), "tokens": toks, "steps": len(lens), "seconds": secs}


def group(runs: dict[str, list[Decode]], idx: list[int]) -> dict[str, Any]:
    """The GROUP of the prompts idx: every method's group_method, and dflash's tau over n-gram's."""
    ref = [runs["target"][i] for i in idx]
    out: dict[str, Any] = {"prompts": len(idx), "target": group_method(ref, ref, None)}
    for name, ds in runs.items():
        if name != "target":
            out[name] = group_method([ds[i] for i in idx], ref, out["target"]["tokens_per_s"])
    n = out.get("ngram")
    out["tau_over_ngram"] = out["dflash"]["tau"] / n["tau"] if n and n["tau"] else None
    return out


def groups(runs: dict[str, list[Decode]], labels: list[dict[str, str | None]]) -> tuple[dict, dict]:
    """(sets, categories): {set: GROUP with its categories} and {category: GROUP}, keys in the order the data
    first has them; a row without the field is in no group ({} when no row has it)."""
    def by(key, idx):
        out: dict[str, list[int]] = {}
        for i in idx:
            if labels[i][key] is not None:
                out.setdefault(labels[i][key], []).append(i)
        return out

    every = list(range(len(labels)))
    sets = {s: dict(group(runs, idx), categories={c: group(runs, j) for c, j in by("category", idx).items()})
            for s, idx in by("set", every).items()}
    return sets, {c: group(runs, idx) for c, idx in by("category", every).items()}


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
    draft, verify, prefill = (sum(getattr(d, k) for d in decodes) for k in ("draft_s", "verify_s", "prefill_s"))
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
        # where the time goes: prefill, then per decoding step the draft (drafter / lookup) and the
        # verify forward; host = the rest (acceptance bookkeeping, cache crops, the per-step sync)
        "time_s": {"prefill": prefill, "draft": draft, "verify": verify,
                   "host": max(0.0, secs - prefill - draft - verify)},
        "ms_per_step": {"draft": 1e3 * draft / steps, "verify": 1e3 * verify / steps,
                        "total": 1e3 * (secs - prefill) / steps},
    }


def classify_differences(refs: list[Decode], outs: list[Decode], tie_margin: float) -> dict[str, Any]:
    """Prompts whose output differs from the target's own: where, and the logit margin (top-1 minus top-2)
    of the target-alone run and of the speculative run at the first differing token. A difference whose
    smaller margin is below tie_margin is a near tie (an argmax flip between a 1-token and a block forward,
    expected in bf16); anything else is suspect (a bug, unless the margins explain it)."""
    cases = []
    for i, (ref, out) in enumerate(zip(refs, outs)):
        if out.tokens == ref.tokens:
            continue
        n = min(len(out.tokens), len(ref.tokens))
        j = next((k for k in range(n) if out.tokens[k] != ref.tokens[k]), n)
        m_ref = ref.margins[j] if j < len(ref.margins) else None
        m_out = out.margins[j] if j < len(out.margins) else None
        known = [m for m in (m_ref, m_out) if m is not None]
        kind = "near_tie" if known and min(known) < tie_margin else "suspect"
        cases.append({"prompt": i, "first_diff": j, "margin_target": m_ref, "margin_spec": m_out, "kind": kind})
    return {"differing": len(cases), "near_tie": sum(c["kind"] == "near_tie" for c in cases),
            "suspect": sum(c["kind"] == "suspect" for c in cases), "tie_margin": tie_margin, "cases": cases}


def acceptance_label(r: dict, sets: dict[str, dict] | None = None) -> str:
    """A method's legend entry: its tau over the prompts the bars are of (all of them), and each set's tau beside it,
    so that the figure a summary quotes for one set (the CPU demo's in-source tau) reads off the plot too."""
    label = f"{r['name']}: tau {r['tau']:.2f} over all {r['prompts']} prompts"
    per_set = [f"{name} ({g['prompts']}) {g[r['name']]['tau']:.2f}" for name, g in (sets or {}).items()
               if r["name"] in g]
    return label + (f"; {', '.join(per_set)}" if len(per_set) > 1 else "")


def plot_acceptance(path: str, results: list[dict], block_size: int, sets: dict[str, dict] | None = None) -> None:
    """Bars of each slot's acceptance rate over all the prompts, one colour per method; the legend names the prompts
    (acceptance_label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    k = list(range(1, block_size))
    w = 0.8 / len(results)
    for i, r in enumerate(results):
        ax.bar([x + (i - (len(results) - 1) / 2) * w for x in k], r["slot_accept_rate"], width=w,
               label=acceptance_label(r, sets))
    ax.set_xlabel("draft slot k (token at anchor + k)")
    ax.set_ylabel("fraction of steps accepting slot k")
    ax.set_xticks(k)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title(f"Acceptance by slot over all {results[0]['prompts']} prompts (greedy verification)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def load_for_decoding(target_path: str, drafter_path: str, dtype: torch.dtype, dev: torch.device):
    """(tokenizer, HF model, drafter on the target's embedding and LM head, Target capturing the drafter's layers):
    what speculative decoding needs (run_eval). A drafter that is no checkpoint, or one made for another target, is a
    DrafterError naming --drafter before the target loads."""
    check_layer_kinds(load_config(target_path), f"--target {target_path}")  # one error line naming the kind
    try:
        check_fits_target(read_drafter_config(drafter_path), drafter_path, text_config(load_config(target_path)),
                          target_path)
        tok = load_tokenizer(target_path)
        model = load_causal_lm(target_path, device=dev, dtype=dtype)
        drafter = load_drafter(drafter_path, dtype=dtype, device=dev)
    except DrafterError as e:
        raise DrafterError(f"--drafter {e}") from None
    drafter.set_target_head(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    drafter.eval()
    return tok, model, drafter, Target(model, drafter.cfg.target_layer_ids)


def static_target(cfg: EvalConfig, model, layer_ids: list[int], max_len: int, block_size: int):
    """StaticTarget (the target's steps in CUDA graphs) when cfg.target_graph allows it and the device and the
    model can; None for the HF forward. --target-graph on where it cannot is an error naming why."""
    from dflash.core.static import graphs_unsupported

    why = graphs_unsupported(model, cfg.target_graph)
    if cfg.target_graph and why is not None:
        raise DrafterError(f"--target-graph: the target cannot decode in CUDA graphs here ({why})")
    if why is not None:
        return None
    return StaticTarget(model, layer_ids, max_len=max_len, block_size=block_size)


def decode_order(labels: list[dict[str, str | None]]) -> list[int]:
    """The order the prompts are decoded in: round-robin over their (set, category) groups in the order the data
    first has them, each group's prompts in the data's order. The bar's rate is then measured on a mix from the first
    prompts on: with 16 short chitchat prompts before 4 long MT-Bench ones, its first ETA was 12.7x too low. The report
    keeps the data's order."""
    groups: dict[tuple, list[int]] = {}
    for i, lab in enumerate(labels):
        groups.setdefault((lab.get("set"), lab.get("category")), []).append(i)
    queues = list(groups.values())
    order: list[int] = []
    while len(order) < len(labels):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return order


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    with decode_threads(cfg.threads, cfg.device):
        return _run_eval(cfg)


def _run_eval(cfg: EvalConfig) -> dict[str, Any]:

    dev = compute_init(cfg.device).device
    dtype = resolve_dtype(cfg.dtype, dev)
    tok, model, drafter, target = load_for_decoding(cfg.target, cfg.drafter, dtype, dev)
    prompts = load_prompts(cfg, tok)
    labels = prompt_labels(cfg, len(prompts))
    eos = eos_ids_of(model, tok) if cfg.stop_at_eos else set()
    B = drafter.cfg.block_size
    max_len = max(len(p) for p in prompts) + cfg.max_new_tokens + B + 1
    graph = dev.type == "cuda" if cfg.draft_graph is None else cfg.draft_graph
    target = static_target(cfg, model, drafter.cfg.target_layer_ids, max_len, B) or target
    if not isinstance(target, StaticTarget) and target.by_kind:  # decode_state's cache, rolled back per layer kind
        from dflash.core.static import graphs_unsupported

        print(f"eval: {eager_reason(model)}: the eager decoder (no CUDA graphs: "
              f"{graphs_unsupported(model, cfg.target_graph)})", flush=True)
    dflash = (DFlash2Proposer if isinstance(drafter, DFlash2Drafter) else DFlashProposer)(drafter, max_len, graph=graph)
    props = [NoDraft(), dflash] + ([NgramProposer(B, cfg.ngram_max)] if cfg.ngram else [])
    names = [p.name for p in props]
    # warm-up outside the timings: every step shape of the graph-captured target (else the first method to reach a
    # longer span pays its capture and compile inside its timing), then every method on the first prompts
    # (kernels, allocator, lazy inits)
    if isinstance(target, StaticTarget):
        target.prepare()
    for p in prompts[: cfg.warmup_prompts]:
        for prop in props:
            speculative(target, prop, p, cfg.max_new_tokens, eos, margins=True)
    bar = progress.bar(cfg.progress, total=len(prompts), desc="eval", unit="prompt")
    done: dict[str, list] = {n: [None] * len(prompts) for n in names}
    for i in decode_order(labels):  # the methods interleaved per prompt: drifts of clock or load hit all alike
        for prop in props:
            done[prop.name][i] = speculative(target, prop, prompts[i], cfg.max_new_tokens, eos, margins=True)
        bar.update(1)
    bar.close()
    runs = {n: list(d) for n, d in done.items()}  # in the data's order
    base = summarize("target", runs["target"], B)
    ref = runs["target"]
    res = {n: summarize(n, runs[n], B) for n in names[1:]}
    for name, r in res.items():
        outs = runs[name]
        same = sum(int(d.tokens == t.tokens) for d, t in zip(outs, ref))
        agree = total = 0
        for d, t in zip(outs, ref):
            n = min(len(d.tokens), len(t.tokens))
            agree += next((i for i in range(n) if d.tokens[i] != t.tokens[i]), n)
            total += len(t.tokens)
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
        r["identical"] = r["outputs_identical"] = same
        r["prompts"] = len(prompts)
        r["output_match_rate"] = same / len(prompts)
        r["token_match_rate"] = agree / max(1, total)
        r["differences"] = classify_differences(ref, outs, cfg.tie_margin)
    base.update(speedup=1.0, identical=len(prompts), prompts=len(prompts))
    sets, categories = groups(runs, labels)
    report = {
        "schema": SCHEMA,
        "config": asdict(cfg), "device": str(dev), "dtype": str(dtype).replace("torch.", ""), "prompts": len(prompts),
        "block_size": B, "drafter_layers": len(drafter.layers), "draft_graph": dflash.graph_status,
        "target_attention": target.attention, "target_graph": isinstance(target, StaticTarget),
        "target_fused": isinstance(target, StaticTarget) and target.dec.fused,
        "draft_compiled": bool(dflash.static is not None and dflash.static.compiled and dflash.graph_status == "graph"),
        "harness": harness_settings(cfg, B),
        "target_tokens_per_s": base["tokens_per_s"], "target_tokens": base["tokens"], "target": base,
        "dflash": res["dflash"],
    }
    if "ngram" in res:
        report["ngram"] = res["ngram"]
        report["tau_gain_over_ngram"] = res["dflash"]["tau"] / res["ngram"]["tau"] if res["ngram"]["tau"] else None
    report["sets"], report["categories"] = sets, categories
    if cfg.plot:
        plot_acceptance(cfg.plot, list(res.values()), B, sets)
        report["plot"] = cfg.plot
    if cfg.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.json_out)), exist_ok=True)
        with open(cfg.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def harness_settings(cfg: EvalConfig, block_size: int) -> dict[str, Any]:
    """The report's `harness`: what a serving benchmark must match for its tau to compare with this one."""
    kwargs = dict(cfg.chat_template_kwargs or {})
    return {"decoding": "greedy", "temperature": 0.0, "block_size": block_size, "max_new_tokens": cfg.max_new_tokens,
            "stop_at_eos": cfg.stop_at_eos, "chat_template_kwargs": kwargs,
            "enable_thinking": kwargs.get("enable_thinking")}


def format_report(r: dict[str, Any]) -> str:
    def ms(x):
        s = x["ms_per_step"]
        return f"{s['draft']:.2f} + {s['verify']:.2f}"

    t = r.get("target")
    rows = [("", "tau", "tokens/s", "speed-up", "identical outputs", "ms/step draft+verify"),
            ("target greedy", "1.00", f"{r['target_tokens_per_s']:.1f}", "1.00x", "-", ms(t) if t else "-")]
    for key, label in (("dflash", "dflash drafter"), ("ngram", "n-gram lookup")):
        if key in r:
            d = r[key]
            rows.append((label, f"{d['tau']:.2f}", f"{d['tokens_per_s']:.1f}", f"{d['speedup']:.2f}x",
                         f"{d['outputs_identical']}/{r['prompts']}", ms(d) if "ms_per_step" in d else "-"))
    w = [max(len(x[i]) for x in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(row)) for row in rows]
    lines.append(f"{r['prompts']} prompts, {r['target_tokens']} tokens, block {r['block_size']}, {r['dtype']} on {r['device']}")
    graphs = [name for name, on in (("target", r.get("target_graph")), ("drafter", r.get("draft_graph") == "graph"))
              if on]
    fused = [what for what, on in (("the target's layers fused", r.get("target_fused")),
                                   ("the drafter's step compiled", r.get("draft_compiled"))) if on]
    lines.append("speed-ups with " + (" and ".join(graphs) + " in CUDA graphs" if graphs else "both models eager")
                 + (f" ({' and '.join(fused)})" if fused else "")
                 + ("" if len(graphs) == 2 else " (serving engines run both in CUDA graphs)"))
    h = r.get("harness")
    if h:
        lines.append(f"harness: {h['decoding']} (temperature {h['temperature']:g}), block {h['block_size']}, at most "
                     f"{h['max_new_tokens']} new tokens{', stop at EOS' if h['stop_at_eos'] else ''}, chat template "
                     f"kwargs {json.dumps(h['chat_template_kwargs']) if h['chat_template_kwargs'] else 'none (the template defaults)'}")
    diff = r["dflash"].get("differences")
    if diff and diff["differing"]:
        lines.append(f"dflash outputs differing from the target's: {diff['differing']} ({diff['near_tie']} near-tie "
                     f"argmax flips with a top-2 logit gap < {diff['tie_margin']}, {diff['suspect']} other)")
    table = format_groups(r)
    return "\n".join(lines) + ("\n\n" + table if table else "")


def format_groups(r: dict[str, Any]) -> str:
    """The table of the sets and categories (each set, then its categories indented, then all prompts): tau,
    n-gram tau, speed-ups and identical outputs; "" when the prompts have fewer than two sets and categories."""
    sets, cats = r.get("sets") or {}, r.get("categories") or {}
    if len(sets) < 2 and len(cats) < 2:
        return ""
    ng = "ngram" in r
    head = ("", "prompts", "dflash tau") + (("n-gram tau", "dflash/n-gram") if ng else ()) + (
        "dflash speed-up",) + (("n-gram speed-up",) if ng else ()) + ("identical dflash",) + (
        ("identical n-gram",) if ng else ())

    def row(label, g):
        d, n = g["dflash"], g.get("ngram")
        cells = [label, str(g["prompts"]), f"{d['tau']:.2f}"]
        if ng:
            cells += [f"{n['tau']:.2f}", f"{g['tau_over_ngram']:.2f}x" if g.get("tau_over_ngram") else "-"]
        cells.append(f"{d['speedup']:.2f}x")
        if ng:
            cells.append(f"{n['speedup']:.2f}x")
        cells.append(f"{d['identical']}/{g['prompts']}")
        if ng:
            cells.append(f"{n['identical']}/{g['prompts']}")
        return tuple(cells)

    rows = [head]
    if sets:
        for name, g in sets.items():
            rows.append(row(name, g))
            rows += [row("  " + c, cg) for c, cg in g["categories"].items()]
    else:
        rows += [row(c, g) for c, g in cats.items()]
    everything = {"prompts": r["prompts"], "dflash": r["dflash"], "ngram": r.get("ngram"),
                  "tau_over_ngram": r.get("tau_gain_over_ngram")}
    rows.append(row("all prompts", everything))
    w = [max(len(x[i]) for x in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(x)) for x in rows)
