"""`dflash prompts`: user turns written by the target itself, the prompts of a training set that reaches past the
data at hand.

A drafter drafts well where it was trained: trained on one chat corpus it falls back towards n-gram lookup on
everything else. An instruction-tuned target, given its chat template up to where a user's words begin and
sampled, writes a user turn of the kind it was tuned on (the "pre-query template" of Magpie, Xu et al. 2024): a
free source of prompts as varied as the target's own tuning data. `dflash prompts` samples --num such turns and
keeps those that ended on their own within --max-new-tokens, are not empty and are distinct; `dflash regenerate
--data OUT` then answers them with the target. In the GPU recipe half the samples are such turns
(dflash/recipes/self_prompts.py uses this module): MT-Bench tau 1.76 against 1.48 without them (BENCHMARKS.md,
"GPU recipe").

    dflash prompts --target T --out P --num 50000 && dflash regenerate --target T --data P --out A

Sampling: the template up to the user's words (prefix_of) is the prompt of every row; row i draws its own
counter-based stream (rng_key(seed, i): extract/generation/sampling.py), so its text depends on neither the batch nor the part
it is sampled in, and a rerun on the same hardware and software writes the same turns.

OUT: prompts.jsonl (the kept turns in row order, each a conversation of one user turn: {"messages": [{"role":
"user", "content": ...}]}, the plain form, so that the file mixes with other prompt files), dflash_prompts.json (the
record: settings, the target's identity, counts; written first with "complete": false, last with true) and, while sampling, .parts/part-00003.jsonl (every sampled row of a part of --part-size:
its text, whether it ended, its tokens; each written whole), removed once prompts.jsonl is written. A rerun of the
same command samples only the parts not yet written; another setting or target is an error unless --overwrite.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from dflash.core.chat import PROMPTS_META, DataError
from dflash.core.config import ConfigError, check
from dflash.core.io import atomic_json, atomic_jsonl
from dflash.core.paths import output_lock
from dflash.extract.data import chat_template_fingerprint, template_text
from dflash_cache.lock import LOCK_NAME

FORMAT = "dflash.prompts"
PROMPTS_FILE = "prompts.jsonl"
PARTS_DIR = ".parts"
MARKER = "\x00dflash-user-words\x00"


def prefix_of(tokenizer, chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> str:
    """The chat template's text up to where a user's words begin (a one-turn conversation rendered with MARKER as
    the user's words, cut at it). DataError without a template, or if it drops or rewrites the user's words."""
    kw = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kw["chat_template"] = chat_template
    elif not getattr(tokenizer, "chat_template", None):
        raise DataError("the target's tokenizer has no chat template, so there is no user header to sample after: "
                        "pass --chat-template FILE (the template the target was tuned with)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False, **kw)
    if MARKER not in text:
        raise DataError("the target's chat template does not render a user's words as given, so no text ends where "
                        "a user's words begin: self-written prompts need a template that does (--chat-template FILE)")
    return text[: text.index(MARKER)]


def keep(texts: list[str], stopped: list[bool]) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(row, text) of the turns kept, in row order, and the counts of those dropped by reason."""
    seen: set[str] = set()
    kept, dropped = [], {"not_ended": 0, "empty": 0, "repeated": 0}
    for i, (text, ended) in enumerate(zip(texts, stopped)):
        text = text.strip()
        why = "not_ended" if not ended else "empty" if not text else "repeated" if text in seen else None
        if why:
            dropped[why] += 1
            continue
        seen.add(text)
        kept.append((i, text))
    return kept, dropped


class Sampler:
    """The target loaded once, sampling rows [first, last) after its prefix (settings: max_new_tokens,
    temperature, top_p, seed). `tokenizer` and `prefix`: the caller's, when it has them (else the target's own
    tokenizer and its template's prefix)."""

    def __init__(self, target: str, device: str = "auto", dtype: str = "auto", batch_size: int = 0,
                 tokenizer=None, prefix: str | None = None, target_graph: bool | None = None):
        from dflash.core.chat import eos_ids_of
        from dflash.core.dist import parse_device, resolve_dtype
        from dflash.core.target import load_causal_lm, load_config, load_tokenizer
        from dflash.extract.generation.slab import plan_engine

        self.device = parse_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target)
        self.prefix = prefix if prefix is not None else prefix_of(self.tokenizer)
        self.ids = self.tokenizer(self.prefix, add_special_tokens=False)["input_ids"]
        self.model = load_causal_lm(target, device=self.device, dtype=self.dtype, attn_impl="sdpa")
        self.eos = eos_ids_of(self.model, self.tokenizer)
        self.engine = plan_engine(load_config(target), self.dtype, self.device, batch_size)
        from dflash.core.static import graphs_unsupported
        from dflash.core.target import TargetError

        why = graphs_unsupported(self.model, target_graph)
        if target_graph and why is not None:
            raise TargetError(f"--target-graph: the target cannot decode in CUDA graphs here ({why})")
        self.graphs = why is None  # False: the eager engine
        from dflash.core.decode_state import eager_reason

        if not self.graphs and eager_reason(self.model):  # transformers' cache per layer kind (extract/generation/kind_engine.py)
            print(f"prompts: {eager_reason(self.model)}: the eager decoder (no CUDA graphs: {why})", flush=True)
        self.decoder = None

    def rows(self, first: int, last: int, settings: dict[str, Any], on_row=None) -> list[dict[str, Any]]:
        """[{"text", "ended", "tokens"}] of rows first..last-1."""
        import torch

        from dflash.extract.generation.generate import generate

        batch, max_tokens, prefill = self.engine
        if self.graphs and self.decoder is None:  # one static decoder (and its CUDA graphs) for every part
            from dflash.core.static import static_decoder

            self.decoder = static_decoder(self.model, slots=batch, max_len=len(self.ids) + settings["max_new_tokens"],
                                          max_q=1)
        with torch.inference_mode():
            res = generate(self.model, [self.ids] * (last - first), eos_ids=self.eos, decoder=self.decoder,
                           engine="static" if self.graphs else "eager",
                           max_new_tokens=settings["max_new_tokens"], batch_size=batch, max_batch_tokens=max_tokens,
                           prefill_tokens=prefill, temperature=settings["temperature"], top_p=settings["top_p"],
                           seed=settings["seed"], pad_id=min(self.eos) if self.eos else 0, first_row=first,
                           on_result=(lambda r: on_row()) if on_row is not None else None)
        return [{"text": self.tokenizer.decode(r.tokens, skip_special_tokens=True), "ended": bool(r.stopped),
                 "tokens": len(r.tokens)} for r in res]

    def close(self) -> None:
        """Give the model's and its KV cache's memory back (a caller may load the target again next)."""
        import torch

        del self.model
        self.decoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def sample(target: str, settings: dict[str, Any], device: str = "auto", batch_size: int = 0,
           progress: bool = True) -> tuple[list[str], list[bool], list[int], str]:
    """(texts, ended, tokens, prefix): settings["prompts"] user turns sampled from the target after prefix_of."""
    s = Sampler(target, device, batch_size=batch_size)
    bar = _bar(settings["prompts"], progress)
    rows = s.rows(0, settings["prompts"], settings, on_row=(lambda: bar.update(1)) if bar is not None else None)
    if bar is not None:
        bar.close()
    s.close()
    return [r["text"] for r in rows], [r["ended"] for r in rows], [r["tokens"] for r in rows], s.prefix


def _bar(total: int, progress: bool, done: int = 0):
    if not progress:
        return None
    from dflash.core.progress import bar

    return bar(total=total, initial=done, desc="prompts", unit="prompt")


# ----------------------------------------------------------------------------------------------------------------
# the command


@dataclass
class PromptsConfig:
    target: str = ""
    out: str = ""
    num: int = 10000  # user turns sampled (those kept are fewer: see keep)
    max_new_tokens: int = 64  # a turn longer than this is dropped (not_ended)
    temperature: float = 1.0
    top_p: float = 0.99
    seed: int = 0
    chat_template: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    part_size: int = 8192  # rows per written part (the unit of resume)
    batch_size: int = 0  # 0: 256 on GPU, 32 on CPU
    dtype: str = "auto"  # bfloat16 on GPU, float32 on CPU
    overwrite: bool = False
    device: str = "auto"
    target_graph: bool | None = None  # None: the target decodes in CUDA graphs on a GPU where it can (slot_engine)
    threads: int = 0  # intra-op CPU threads; 0: 1 on a CPU (or $OMP_NUM_THREADS), untouched on CUDA (core/threads.py)
    progress: bool = True

    def __post_init__(self):
        check(bool(self.target), "target", "is required (a local HF model directory or .gguf file)")
        check(bool(self.out), "out", "is required (a directory for the prompts)")
        from dflash.core.threads import check_threads  # (torch: this module loads it only when it runs)

        check_threads(self.threads)
        check(self.num >= 1, "num", f"must be >= 1, got {self.num}")
        check(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        check(math.isfinite(self.temperature) and self.temperature > 0, "temperature",
              f"must be a finite number > 0 (greedy would write one turn {self.num} times), got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        check(self.part_size >= 1, "part_size", f"must be >= 1, got {self.part_size}")
        check(self.batch_size >= 0, "batch_size", f"must be >= 1 (or 0 for the default), got {self.batch_size}")
        check(self.dtype in ("auto", "bfloat16", "float32"), "dtype",
              f"must be auto, bfloat16 or float32, got {self.dtype!r}")

    def settings(self, dtype) -> dict[str, Any]:
        """What the sampled text depends on (a rerun into the same --out must match); a --chat-template by its
        content (a file's path may be reused for another template)."""
        template = template_text(self.chat_template)
        return {"num": self.num, "max_new_tokens": self.max_new_tokens, "temperature": float(self.temperature),
                "top_p": float(self.top_p), "seed": self.seed,
                "chat_template": None if template is None else chat_template_fingerprint(template, None),
                "chat_template_kwargs": dict(self.chat_template_kwargs or {}), "part_size": self.part_size,
                "dtype": str(dtype).replace("torch.", "")}


def target_identity(target: str) -> dict[str, str]:
    """The target's configuration and weight files (names and sizes): another target is another sample."""
    from dflash.core.target import config_fingerprint, load_config, weights_fingerprint

    return {"config": config_fingerprint(load_config(target)), "weights": weights_fingerprint(target)}


def part_path(out: str, p: int) -> str:
    return os.path.join(out, PARTS_DIR, f"part-{p:05d}.jsonl")


def read_record(out: str) -> dict | None:
    """OUT's record; None when OUT has none. DataError when it cannot be read."""
    path = os.path.join(out, PROMPTS_META)
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(f"--out: {path} cannot be read ({e}); rerun with --overwrite to start over") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise DataError(f"--out: {path} is not a {FORMAT} record; choose another directory")
    return rec


def _ours(name: str) -> bool:
    return name in (PROMPTS_META, PROMPTS_FILE, PARTS_DIR) or name.startswith(LOCK_NAME)


def check_out(out: str, overwrite: bool) -> None:
    """OUT must be new, empty, or a `dflash prompts` output (never written into otherwise)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out: {out} is a file; give a directory")
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
    foreign = [n for n in entries if not _ours(n)]
    if foreign:
        raise ConfigError(f"--out: {out} holds files `dflash prompts` did not write ({', '.join(foreign[:5])}); "
                          "choose an empty or new directory")
    if not overwrite:
        read_record(out)


def _committed(out: str, n_parts: int) -> set[int]:
    d = os.path.join(out, PARTS_DIR)
    names = set(os.listdir(d)) if os.path.isdir(d) else set()
    return {p for p in range(n_parts) if os.path.basename(part_path(out, p)) in names}


def _read_part(out: str, p: int, expect: int) -> list[dict[str, Any]]:
    path = part_path(out, p)
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read ({e}); delete it and rerun to sample its rows again") from None
    if len(rows) != expect:
        raise DataError(f"{path} holds {len(rows)} rows, not {expect}; delete it and rerun to sample its rows again")
    return rows


def run_prompts(cfg: PromptsConfig) -> dict[str, Any]:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("dflash prompts runs as one process: start it without torchrun (sampling a few "
                          "thousand turns is short next to answering them)")
    from dflash.core.hybrid import check_layer_kinds
    from dflash.core.target import load_config

    check_layer_kinds(load_config(cfg.target), f"--target {cfg.target}")  # one error line, before OUT is touched
    from dflash.core.threads import decode_threads

    with output_lock(cfg.out, "prompts", True, precheck=lambda out: check_out(out, cfg.overwrite)):
        with decode_threads(cfg.threads, cfg.device):
            return _run(cfg)


def _run(cfg: PromptsConfig) -> dict[str, Any]:
    from dflash.core.dist import parse_device, resolve_dtype
    from dflash.core.target import load_tokenizer

    t0 = time.perf_counter()
    dtype = resolve_dtype(cfg.dtype, parse_device(cfg.device))
    tokenizer = load_tokenizer(cfg.target)
    prefix = prefix_of(tokenizer, template_text(cfg.chat_template), cfg.chat_template_kwargs)
    # (before anything is written: a template that cannot be used is one error line and leaves OUT as it was)
    want = {"format": FORMAT, "settings": cfg.settings(dtype), "target": target_identity(cfg.target)}
    old = None if cfg.overwrite else read_record(cfg.out)
    if old is not None:
        for key in ("target", "settings"):
            was, now = old.get(key) or {}, want[key]
            if was != now:
                diff = [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
                what = "another target" if key == "target" else "other settings"
                changes = ", ".join(f"{k}: {was.get(k)!r} there, {now.get(k)!r} now" for k in diff[:3])
                raise ConfigError(f"--out: {cfg.out} holds prompts sampled with {what} ({changes}); rerun with the "
                                  "same settings, choose another --out, or pass --overwrite")
        if old.get("complete"):
            print(f"prompts: nothing to do: {cfg.out} holds {old['kept']:,} turns kept of {old['sampled']:,} sampled "
                  f"-> {os.path.join(cfg.out, PROMPTS_FILE)}", flush=True)
            return old
    if cfg.overwrite:  # only what this command writes
        for name in (PROMPTS_FILE, PROMPTS_META):
            if os.path.exists(os.path.join(cfg.out, name)):
                os.remove(os.path.join(cfg.out, name))
        shutil.rmtree(os.path.join(cfg.out, PARTS_DIR), ignore_errors=True)
    os.makedirs(os.path.join(cfg.out, PARTS_DIR), exist_ok=True)
    n_parts = -(-cfg.num // cfg.part_size)
    atomic_json(os.path.join(cfg.out, PROMPTS_META), dict(want, complete=False, parts=n_parts))
    done = _committed(cfg.out, n_parts)
    todo = [p for p in range(n_parts) if p not in done]
    rows_of = {p: (p * cfg.part_size, min(cfg.num, (p + 1) * cfg.part_size)) for p in range(n_parts)}
    if done:
        print(f"prompts: resuming: {len(done)} of {n_parts} parts already sampled in {cfg.out}", flush=True)
    sampled_s, todo_rows = 0.0, sum(rows_of[p][1] - rows_of[p][0] for p in todo)
    if todo:
        sampler = Sampler(cfg.target, cfg.device, cfg.dtype, cfg.batch_size, tokenizer=tokenizer, prefix=prefix,
                          target_graph=cfg.target_graph)
        print(f"prompts: sampling {todo_rows:,} user turns from {cfg.target} after {prefix!r} (temperature "
              f"{cfg.temperature:g}, top-p {cfg.top_p:g}, seed {cfg.seed}, at most {cfg.max_new_tokens} tokens each) "
              f"on {sampler.device}", flush=True)
        bar = _bar(cfg.num, cfg.progress, done=cfg.num - todo_rows)
        ts = time.perf_counter()
        for p in todo:
            a, b = rows_of[p]
            rows = sampler.rows(a, b, want["settings"], on_row=(lambda: bar.update(1)) if bar is not None else None)
            atomic_jsonl(part_path(cfg.out, p), rows, ensure_ascii=False)
        sampled_s = time.perf_counter() - ts
        if bar is not None:
            bar.close()
        sampler.close()
    rows = [r for p in range(n_parts) for r in _read_part(cfg.out, p, rows_of[p][1] - rows_of[p][0])]
    kept, dropped = keep([r["text"] for r in rows], [r["ended"] for r in rows])
    if not kept:
        raise DataError(f"none of the {len(rows)} user turns sampled from {cfg.target} ended within --max-new-tokens "
                        f"{cfg.max_new_tokens}: is it a chat model? Raise --max-new-tokens")
    atomic_jsonl(os.path.join(cfg.out, PROMPTS_FILE), [{"messages": [{"role": "user", "content": t}]} for _, t in kept],
                 ensure_ascii=False)
    record = dict(want, complete=True, parts=n_parts, sampled=len(rows), kept=len(kept), dropped=dropped,
                  mean_tokens_kept=round(sum(rows[i]["tokens"] for i, _ in kept) / len(kept), 1),
                  sampling_seconds=round(sampled_s, 1), seconds=round(time.perf_counter() - t0, 1), prefix=prefix)
    atomic_json(os.path.join(cfg.out, PROMPTS_META), record)  # last: complete names a whole prompts.jsonl
    shutil.rmtree(os.path.join(cfg.out, PARTS_DIR), ignore_errors=True)
    rate = f" ({todo_rows / sampled_s:,.0f}/s this run)" if todo and sampled_s > 0 else ""
    print(f"prompts: {len(rows):,} user turns sampled{rate}: {len(kept):,} kept -> "
          f"{os.path.join(cfg.out, PROMPTS_FILE)}; dropped {dropped['not_ended']:,} that did not end within "
          f"{cfg.max_new_tokens} tokens, {dropped['empty']:,} empty, {dropped['repeated']:,} repeated", flush=True)
    print(f"prompts: then: dflash regenerate --target {cfg.target} --data {cfg.out} --out ANSWERS", flush=True)
    return record
