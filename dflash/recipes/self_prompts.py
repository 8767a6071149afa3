"""The `self` data source of the GPU recipe: user turns written by the target itself.

No dataset that ships in a package covers the range of prompts a chat model is served (the recipe's four sources
are chit-chat plus ~1,200 distinct instructions; MT-Bench's writing, reasoning, math, coding, extraction, STEM and
humanities questions are out of their reach). An instruction-tuned target, given its chat template up to where a
user's words begin and sampled, writes a user turn of the kind it was tuned on: the "pre-query template" of Magpie
(Xu et al. 2024). The recipe samples such turns once, after the target is prepared and before the data stage; the
target then answers them (greedy, `regenerate`) like every other source's prompts. In the GPU recipe half the samples
are such turns: MT-Bench tau 1.83 against 1.48 without them (BENCHMARKS.md, "GPU recipe").

    convs, record = self_prompts(workdir, target, recipe, device)   # [Conversation("self:00042", [user, ""]), ...]

Sampling is `dflash prompts`' (extract/generation/prompts.py: prefix_of, sample, keep; SmolLM2's prefix carries its default
system prompt): row i's text depends on neither the batch nor the device count. Kept: turns that ended on their own
(an end-of-sequence id within self_prompt_tokens), not empty once stripped, the first of equal ones. A kept turn's
key is its row ("self:00042"): the recipe's split by a hash of the key holds some out as in-source eval prompts, like
any source's.

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
from dflash.recipes.sources import Conversation, as_messages

NAME = "self"  # the source's name in the recipe's `sources`
RECORD, PROMPTS = "self-prompts.json", "self-prompts.jsonl"


def settings_of(recipe) -> dict[str, Any]:
    """What makes the sampled turns: the recipe's self_* fields."""
    return {"prompts": recipe.self_prompts, "max_new_tokens": recipe.self_prompt_tokens,
            "temperature": recipe.self_temperature, "top_p": recipe.self_top_p, "seed": recipe.self_seed}


def self_prompts(workdir: str, target: str, recipe, device: str = "auto",
                 progress: bool = True) -> tuple[list[Conversation], dict[str, Any]]:
    """The self source's conversations (one user turn each, an empty answer for `regenerate` to write) and its
    record: read from WORKDIR/data when sampled before with the same settings and target, else sampled and
    written there (module docstring)."""
    from dflash.extract.generation.prompts import keep, sample, target_identity  # (the stage, when the recipe samples)

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
