"""The GPU recipe's data stage: conversations -> training samples, eval prompts and validation samples.

Each source's conversations are split by conversation (is_heldout: a hash of its id, heldout_percent held out) and
cut into samples by the recipe's `history` (training_sample: one multi-turn sample per conversation; turn_samples:
one per answered user turn, the data's own history before it); the eval prompts are held-out histories up to a user
turn at varied turn positions (eval_prompts); the held-out conversations, cut the same way, are the validation set.
Several sources are mixed by fixed shares (mix_sources), a held-out source giving the out-of-source prompts
(out_of_source_prompts) and each eval source (the recipe's eval_sources, e.g. HumanEval) a set of its own. prepare_data writes WORKDIR/data/{train,heldout,valid}.jsonl and data/split.json (the
counts); it is deterministic: a rerun writes the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from typing import Any

from dflash.core.io import atomic_jsonl
from dflash.recipes.gpu_config import GpuRecipe
from dflash.recipes.self_prompts import NAME as SELF
from dflash.recipes.sources import Conversation, as_messages, dialogues, load_source


def is_heldout(key: str, percent: float) -> bool:
    """Deterministic, by conversation: the first 8 hex digits of sha1(id), as a fraction, below percent/100."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 0x100000000 < percent / 100


def training_sample(turns: list[str], max_turns: int) -> list[dict[str, str]] | None:
    """One multi-turn sample: the first max_turns turns (0 = all), ending on an assistant turn; None if
    the conversation has no assistant turn."""
    kept = turns[:max_turns] if max_turns else list(turns)
    if len(kept) % 2:
        kept = kept[:-1]
    return as_messages(kept) if kept else None


def turn_samples(turns: list[str], max_turns: int, history_messages: int = 0) -> list[list[dict[str, str]]]:
    """One sample per answered user turn within the first max_turns turns (0 = all): the conversation as the data
    has it up to that user turn (its last history_messages messages before it; 0 = all, even: the sample still
    starts on a user turn), then its answer (the one `regenerate --turns last` rewrites)."""
    kept = turns[:max_turns] if max_turns else list(turns)
    return [as_messages(kept[max(0, j - history_messages) if history_messages else 0: j + 2])
            for j in range(0, len(kept) - 1, 2)]


def eval_prompts(held: list[tuple[str, list[str]]], n: int, max_turns: int) -> list[list[dict[str, str]]]:
    """n prompts from held-out conversations: a history up to (and including) a user turn. Conversations
    are taken in the order of their id's hash; round r takes from conversation i its ((i + r) mod u)-th
    user turn (u = its user turns within max_turns), so turn positions vary; no prompt repeats."""
    convs = sorted(held, key=lambda kv: hashlib.sha1(kv[0].encode()).hexdigest())
    out: list[list[dict[str, str]]] = []
    seen: set[tuple[str, int]] = set()
    for rnd in range(max(1, max_turns or 64)):
        progressed = False
        for i, (key, turns) in enumerate(convs):
            limit = min(len(turns), max_turns) if max_turns else len(turns)
            users = [j for j in range(0, limit, 2) if j + 1 < len(turns)]  # a user turn that got an answer
            if not users:
                continue
            j = users[(i + rnd) % len(users)]
            if (key, j) in seen:
                continue
            seen.add((key, j))
            progressed = True
            out.append(as_messages(turns[: j + 1]))
            if len(out) == n:
                return out
        if not progressed:
            break
    return out


def split_data(raw: dict[str, Any], recipe: GpuRecipe) -> tuple[list[list[dict]], list[list[dict]], dict,
                                                                 list[list[dict]]]:
    """(training samples, eval prompts, counts, held-out samples) from the chitchat file's dict. The held-out
    samples (held-out conversations cut like the training ones) are for the validation cache only."""
    return split_turns(dialogues(raw), recipe, recipe.eval_prompts)


def split_turns(convs: list[tuple[str, list[str]]], recipe: GpuRecipe, n_eval: int, name: str = "") -> tuple[
        list[list[dict]], list[list[dict]], dict, list[list[dict]]]:
    """split_data on one source's (conversation id, turn texts), with n_eval eval prompts (name: the source, for
    the error)."""
    train, held = [], []
    for key, turns in convs:
        (held if is_heldout(key, recipe.heldout_percent) else train).append((key, turns))
    pairs = [(t, s) for t, s in ((t, training_sample(t, recipe.max_turns)) for _, t in train) if s]
    without_answer = len(train) - len(pairs)
    dropped = max(0, len(pairs) - recipe.max_conversations) if recipe.max_conversations else 0
    pairs = pairs[: len(pairs) - dropped]
    used = len(pairs)
    prompts = eval_prompts(held, n_eval, recipe.eval_max_turns or recipe.max_turns) if n_eval else []
    held_convs = [t for _, t in held if training_sample(t, recipe.max_turns)]
    if recipe.validation_conversations:
        held_convs = held_convs[: recipe.validation_conversations]
    if recipe.history == "dataset":  # one sample per user turn, the data's own history
        samples = [s for t, _ in pairs for s in turn_samples(t, recipe.max_turns, recipe.history_messages)]
        held_samples = [s for t in held_convs for s in turn_samples(t, recipe.max_turns, recipe.history_messages)]
    else:
        samples = [s for _, s in pairs]
        held_samples = [training_sample(t, recipe.max_turns) for t in held_convs]
    kept_turns = sum(len(s) // 2 for s in samples) if recipe.history == "target" else len(samples)
    counts = {
        "conversations": len(convs), "train_conversations": len(train), "heldout_conversations": len(held),
        "history": recipe.history, "train_conversations_used": used,
        "train_samples": len(samples), "train_without_assistant_turn": without_answer,
        "train_dropped_by_max_conversations": dropped,
        "assistant_turns": kept_turns,
        "assistant_turns_cut_by_max_turns": sum(len(t) // 2 for t, _ in pairs) - kept_turns,
        "eval_prompts": len(prompts),
        "validation_samples": len(held_samples), "validation_conversations": len(held_convs),
        "eval_prompt_user_turns": sorted({sum(m["role"] == "user" for m in p) for p in prompts}),
    }
    if len(prompts) < n_eval:
        raise ValueError(f"eval_prompts: the held-out conversations{' of ' + name if name else ''} give only "
                         f"{len(prompts)} prompts, {n_eval} asked")
    return samples, prompts, counts, held_samples


def shares_of(n: int, shares: dict[str, float]) -> dict[str, int]:
    """n split by shares (normalised), largest remainder first, ties to the earlier name: the counts sum to n."""
    total = sum(shares.values())
    exact = {k: n * v / total for k, v in shares.items()}
    out = {k: int(x) for k, x in exact.items()}
    order = sorted(shares, key=lambda k: (-(exact[k] - out[k]), list(shares).index(k)))
    for k in order[: n - sum(out.values())]:
        out[k] += 1
    return out


def interleave(groups: list[list]) -> list:
    """Round-robin over the groups (one from each in turn, the exhausted ones skipped): any prefix holds every
    group in near-equal numbers."""
    out, i = [], 0
    while any(i < len(g) for g in groups):
        out.extend(g[i] for g in groups if i < len(g))
        i += 1
    return out


def repeat_to(samples: list, n: int) -> list:
    """n samples from a pool: all of it as many whole times as fit, then a part of it in the order of a hash of
    each sample's text (a spread over the pool, not its first rows). Deterministic."""
    if not samples:
        return []
    order = sorted(range(len(samples)), key=lambda i: hashlib.sha1(
        json.dumps(samples[i], ensure_ascii=False, sort_keys=True).encode()).hexdigest())
    whole, part = divmod(n, len(samples))
    return list(samples) * whole + [samples[i] for i in sorted(order[:part])]


def out_of_source_prompts(convs: list[Conversation], n: int) -> list[Conversation]:
    """n prompts (0 = all) of the held-out source, round-robin over its categories in the data's order."""
    by_cat: dict[Any, list[Conversation]] = {}
    for c in convs:
        by_cat.setdefault(c.category, []).append(c)
    mixed = interleave(list(by_cat.values()))
    return mixed[:n] if n else mixed


def prompt_of(c: Conversation) -> list[dict[str, str]]:
    """An eval prompt from a held-out source's conversation: its messages up to its user turn."""
    return c.messages[:-1] if c.messages[-1]["role"] == "assistant" else c.messages


def mix_sources(pools: dict[str, list[tuple[str, list[str]]]], recipe: GpuRecipe,
                heldout: list[Conversation] | None = None,
                eval_sets: dict[str, list[Conversation]] | None = None) -> tuple[list[list[dict]], list[dict], dict,
                                                                                 list[list[dict]]]:
    """The recipe's training mix and eval sets from the training sources' (conversation id, turn texts), in
    recipe.sources' order, and the held-out source's conversations.

    Each source is split like chitchat (split_turns: by a hash of the conversation id). Its training samples are
    mixed in by share: the first source gives all of its own, N = that count / its share; every other source gives
    round(N * share), its pool repeated whole (then in part) when smaller, a hash-spread part when larger. Returns
    (training samples, eval rows, counts, validation samples). Eval rows: {"messages", "set", "category",
    "source"}; the in-source set is eval_prompts held-out prompts split among the sources by share (category =
    the source), the out-of-source set the held-out source's (category = its own), and each of eval_sets
    ({source: its conversations}, recipe.eval_sources' prompts of each) a set named by its source; the rows
    alternate between the sets, and within a set between its sources or categories, so that any prefix (the
    float32 run's later_dtype_prompts) samples every part."""
    names = list(recipe.sources)
    n_eval = shares_of(recipe.eval_prompts, recipe.sources)
    parts = {k: split_turns(pools[k], recipe, n_eval[k], k) for k in names}
    total = sum(recipe.sources.values())
    base = len(parts[names[0]][0]) / (recipe.sources[names[0]] / total)
    samples, held_samples, per = [], [], {}
    for k in names:
        pool, _, c, val = parts[k]
        want = len(pool) if k == names[0] else round(base * recipe.sources[k] / total)
        mixed = repeat_to(pool, want)
        samples += mixed
        held_samples += val
        per[k] = dict(c, share=recipe.sources[k] / total, pool_samples=len(pool), train_samples=len(mixed),
                      passes=round(len(mixed) / len(pool), 2) if pool else 0.0)
    in_rows = interleave([[{"messages": p, "set": "in-source", "category": k, "source": k} for p in parts[k][1]]
                          for k in names])
    out = out_of_source_prompts(heldout or [], recipe.heldout_source_prompts)
    out_rows = [{"messages": prompt_of(c), "set": "out-of-source", "category": c.category,
                 "source": recipe.heldout_source} for c in out]
    more = {k: out_of_source_prompts(convs, recipe.eval_sources.get(k, 0)) for k, convs in (eval_sets or {}).items()}
    more_rows = [[{"messages": prompt_of(c), "set": k, "category": c.category, "source": k} for c in cs]
                 for k, cs in more.items()]
    rows = interleave([in_rows, out_rows, *more_rows])
    summed = ("conversations", "train_conversations", "heldout_conversations", "train_conversations_used",
              "train_without_assistant_turn", "train_dropped_by_max_conversations", "assistant_turns_cut_by_max_turns",
              "validation_samples", "validation_conversations")
    counts = {k: sum(per[n][k] for n in names) for k in summed}
    kept_turns = sum(len(s) // 2 for s in samples) if recipe.history == "target" else len(samples)
    counts.update({
        "history": recipe.history, "train_samples": len(samples), "assistant_turns": kept_turns,
        "eval_prompts": len(in_rows), "out_of_source_prompts": len(out_rows),
        "eval_prompt_user_turns": sorted({sum(m["role"] == "user" for m in r["messages"]) for r in in_rows}),
        "sources": per,
        "heldout_source": ({"name": recipe.heldout_source, "conversations": len(heldout or []),
                            "prompts": len(out_rows),
                            "categories": {str(c.category): sum(o.category == c.category for o in out) for c in out}}
                           if recipe.heldout_source else None),
        "eval_sources": {k: {"conversations": len((eval_sets or {})[k]), "prompts": len(cs),
                             "categories": {str(c.category): sum(o.category == c.category for o in cs) for c in cs}}
                         for k, cs in more.items()},
    })
    return samples, rows, counts, held_samples


def write_jsonl(path: str, rows: list[dict]) -> None:
    atomic_jsonl(path, rows, ensure_ascii=False)


def prepare_data(workdir: str, recipe: GpuRecipe, self_convs: list[Conversation] | None = None,
                 self_record: dict | None = None) -> tuple[str, str, dict, str]:
    """data/train.jsonl (the training sources' samples mixed by share (mix_sources), the data's answers to be
    regenerated), data/heldout.jsonl (the eval prompts: in-source and out-of-source rows, with `set` and `category`
    for `dflash eval`'s table), data/valid.jsonl (the held-out conversations as samples, for the validation cache),
    data/split.json (counts, per source too). self_convs: the `self` source's conversations when it is one of the
    sources (dflash/recipes/self_prompts.py; its turns equal to a prompt of the held-out source or of an eval source
    are dropped: those stay never trained on), self_record its record. Deterministic: a rerun writes the same files."""
    d = os.path.join(workdir, "data")
    os.makedirs(d, exist_ok=True)
    heldout = load_source(recipe.heldout_source) if recipe.heldout_source else None
    eval_sets = {k: load_source(k) for k in recipe.eval_sources}
    if SELF in recipe.sources and self_convs is None:
        raise ValueError("the recipe's sources name `self`: sample its prompts first (dflash/recipes/self_prompts.py)")
    self_dropped = 0
    if SELF in recipe.sources:
        banned = {" ".join(m["content"].split()).lower() for c in [*(heldout or []), *sum(eval_sets.values(), [])]
                  for m in c.messages if m["role"] == "user"}
        kept = [c for c in self_convs if " ".join(c.messages[0]["content"].split()).lower() not in banned]
        self_dropped, self_convs = len(self_convs) - len(kept), kept
    pools = {k: [(c.key, [m["content"] for m in c.messages]) for c in (self_convs if k == SELF else load_source(k))]
             for k in recipe.sources}
    samples, rows, counts, held_samples = mix_sources(pools, recipe, heldout, eval_sets)
    if SELF in recipe.sources:
        rec = self_record or {}
        counts["self_prompts"] = {"sampled": rec.get("sampled"), "kept": rec.get("kept"),
                                  "dropped": dict(rec.get("dropped") or {}, equal_to_heldout_source=self_dropped),
                                  "mean_tokens_kept": rec.get("mean_tokens_kept"), "seconds": rec.get("seconds")}
    train, held = os.path.join(d, "train.jsonl"), os.path.join(d, "heldout.jsonl")
    valid = os.path.join(d, "valid.jsonl")
    write_jsonl(train, [{"messages": s} for s in samples])
    write_jsonl(held, rows)
    write_jsonl(valid, [{"messages": s} for s in held_samples])
    with open(os.path.join(d, "split.json"), "w") as f:
        json.dump(dict(counts, recipe=asdict(recipe)), f, indent=2)
    return train, held, counts, valid
