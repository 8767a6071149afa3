"""The `self` data source of the GPU recipe: user turns written by the target itself.

No dataset that ships in a package covers the range of prompts a chat model is served (the recipe's four sources
are chit-chat plus ~1,200 distinct instructions; MT-Bench's writing, reasoning, math, coding, extraction, STEM and
humanities questions are out of their reach). An instruction-tuned target, given its chat template up to where a
user's words begin and sampled, writes a user turn of the kind it was tuned on: the "pre-query template" of Magpie
(Xu et al. 2024). The recipe samples such turns once, after the target is prepared and before the data stage; the
target then answers them (greedy, `regenerate`) like every other source's prompts. In the GPU recipe half the samples
are such turns: MT-Bench tau 1.76 against 1.48 without them (BENCHMARKS.md, "GPU recipe").

    convs, record = self_prompts(workdir, target, recipe, device)   # [Conversation("self:00042", [user, ""]), ...]

Sampling: the template up to the user's words (prefix_of; SmolLM2's carries its default system prompt) is the
prompt of every row; each row draws its own counter-based stream (rng_key(seed, row): extract/generate.py), so the
text of row i depends on neither the batch nor the device count, and a rerun on the same hardware and software
writes the same turns. Kept: turns that ended on their own (an end-of-sequence id within self_prompt_tokens), not
empty once stripped, the first of equal ones. A kept turn's key is its row ("self:00042"): the recipe's split by a
hash of the key holds some out as in-source eval prompts, like any source's.

Files: WORKDIR/data/self-prompts.jsonl (the kept turns: {"key", "prompt"}) and WORKDIR/data/self-prompts.json (the
settings, the target's identity, the counts, the prefix, the seconds). A rerun with the same settings and target reads
them; another setting or another target samples again (and says why).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from dflash.core.io import atomic_json, atomic_jsonl
from dflash.demo_sources import Conversation, as_messages

NAME = "self"  # the source's name in the recipe's `sources`
RECORD, PROMPTS = "self-prompts.json", "self-prompts.jsonl"
MARKER = "\x00dflash-user-words\x00"


def prefix_of(tokenizer) -> str:
    """The chat template's text up to where a user's words begin (a one-turn conversation rendered with MARKER as
    the user's words, cut at it). ValueError if the template drops or rewrites the user's words."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    if MARKER not in text:
        raise ValueError("the target's chat template does not render a user's words as given: the self source needs "
                         "it to (leave `self` out of the recipe's sources)")
    return text[: text.index(MARKER)]


def settings_of(recipe) -> dict[str, Any]:
    """What makes the sampled turns: the recipe's self_* fields."""
    return {"prompts": recipe.self_prompts, "max_new_tokens": recipe.self_prompt_tokens,
            "temperature": recipe.self_temperature, "top_p": recipe.self_top_p, "seed": recipe.self_seed}


def target_identity(target: str) -> dict[str, str]:
    """The target's configuration and weight files (names and sizes): another target samples again."""
    from dflash.core.target import config_fingerprint, load_config, weights_fingerprint

    return {"config": config_fingerprint(load_config(target)), "weights": weights_fingerprint(target)}


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


def sample(target: str, settings: dict[str, Any], device: str = "auto", batch_size: int = 0,
           progress: bool = True) -> tuple[list[str], list[bool], list[int], str]:
    """(texts, ended, tokens, prefix): settings["prompts"] user turns sampled from the target after prefix_of."""
    import torch

    from dflash.core.chat import eos_ids_of
    from dflash.core.dist import parse_device, resolve_dtype
    from dflash.core.target import load_causal_lm, load_config, load_tokenizer
    from dflash.extract.generate import generate
    from dflash.extract.slab import plan_engine

    dev = parse_device(device)
    dtype = resolve_dtype("auto", dev)
    tok = load_tokenizer(target)
    prefix = prefix_of(tok)
    ids = tok(prefix, add_special_tokens=False)["input_ids"]
    model = load_causal_lm(target, device=dev, dtype=dtype, attn_impl="sdpa")
    eos = eos_ids_of(model, tok)
    batch, max_tokens, prefill = plan_engine(load_config(target), dtype, dev, batch_size)
    n = settings["prompts"]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc="self prompts", unit="prompt", dynamic_ncols=True)
    with torch.inference_mode():
        res = generate(model, [ids] * n, eos_ids=eos, max_new_tokens=settings["max_new_tokens"], batch_size=batch,
                       max_batch_tokens=max_tokens, prefill_tokens=prefill, temperature=settings["temperature"],
                       top_p=settings["top_p"], seed=settings["seed"], pad_id=min(eos) if eos else 0,
                       on_result=(lambda r: bar.update(1)) if bar is not None else None)
    if bar is not None:
        bar.close()
    del model  # the next stages load the target again in this process: give its memory back
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    texts = [tok.decode(r.tokens, skip_special_tokens=True) for r in res]
    return texts, [r.stopped for r in res], [len(r.tokens) for r in res], prefix


def self_prompts(workdir: str, target: str, recipe, device: str = "auto",
                 progress: bool = True) -> tuple[list[Conversation], dict[str, Any]]:
    """The self source's conversations (one user turn each, an empty answer for `regenerate` to write) and its
    record: read from WORKDIR/data when sampled before with the same settings and target, else sampled and
    written there (module docstring)."""
    d = os.path.join(workdir, "data")
    record_path, prompts_path = os.path.join(d, RECORD), os.path.join(d, PROMPTS)
    want = {"settings": settings_of(recipe), "target": target_identity(target)}
    old = None
    try:
        with open(record_path) as f:
            old = json.load(f)
        with open(prompts_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not isinstance(old, dict) or len(rows) != old.get("kept"):
            old = None
    except (OSError, ValueError):
        old = None
    if old is not None and all(old.get(k) == v for k, v in want.items()):
        return [Conversation(r["key"], as_messages([r["prompt"], ""])) for r in rows], old
    if old is not None:
        changed = [k for k, v in want.items() if old.get(k) != v]
        print(f"demo-gpu: sampling the self prompts again: the {' and '.join(changed)} changed since "
              f"{record_path} was written", flush=True)
    t0 = time.perf_counter()
    texts, stopped, lengths, prefix = sample(target, want["settings"], device, recipe.self_batch_size, progress)
    kept, dropped = keep(texts, stopped)
    if not kept:
        raise ValueError(f"self_prompts: none of the {len(texts)} user turns sampled from {target} ended within "
                         f"self_prompt_tokens={recipe.self_prompt_tokens} tokens: is it a chat model? Raise "
                         "self_prompt_tokens or leave `self` out of the recipe's sources")
    width = len(str(len(texts) - 1))
    rows = [{"key": f"{NAME}:{i:0{width}d}", "prompt": t} for i, t in kept]
    record = dict(want, sampled=len(texts), kept=len(kept), dropped=dropped,
                  mean_tokens_kept=round(sum(lengths[i] for i, _ in kept) / len(kept), 1),
                  seconds=round(time.perf_counter() - t0, 1), prefix=prefix)
    os.makedirs(d, exist_ok=True)
    atomic_jsonl(prompts_path, rows, ensure_ascii=False)
    atomic_json(record_path, record)  # last: the record names a complete prompts file
    return [Conversation(r["key"], as_messages([r["prompt"], ""])) for r in rows], record
