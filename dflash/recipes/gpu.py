"""The GPU recipe of `dflash demo`: SmolLM2-135M-Instruct + user turns it writes itself and the user turns of
chitchat and three other packaged datasets (configs/demo-gpu.yaml's `sources`), on one CUDA GPU.

Sizes and hyper-parameters live in the preset configs/demo-gpu.yaml (one section per stage, read with
dflash.core.config like every preset; flags of `dflash demo` override a few). Stages, each resumed when rerun
into the same workdir:

    prepare target (bundled GGUF -> bf16 folder)
    -> self prompts (only when `self` is one of the sources: user turns sampled from the target,
    dflash/recipes/self_prompts.py)
    -> data: chitchat conversations split by conversation (a hash of its id: heldout_percent held out);
       history "target": each training conversation becomes ONE multi-turn `messages` sample (turns alternate
       user / assistant, the first turn is the user's), cut to max_turns messages, ending on an assistant turn,
       every answer regenerated after the target's own earlier ones; history "dataset": one sample per answered
       user turn, the history as chitchat has it, only its answer regenerated (`regenerate --turns last`, the
       kept answers marked weight 0: context, not trained on). The eval prompts are held-out histories up to a
       user turn, at varied turn positions; the held-out conversations, cut the same way, make the validation set.
       With several `sources` (dflash/recipes/sources.py: chat and instruction datasets shipped in packages), each is
       split so and their samples mixed by fixed shares (mix_sources); the in-source eval prompts come from every
       source's held-out conversations, and a `heldout_source` kept whole out of training (MT-Bench) gives the
       out-of-source prompts, beside them in the same eval (rows labelled `set` and `category`). The source `self`
       (dflash/recipes/self_prompts.py) is user turns the target writes itself, sampled in a stage of its own before
       this one
    -> regenerate the answers with the target (large batch)
    -> extract the hidden states (and the validation set's, for train's --val-cache) -> train (compiled CUDA-graph
       step, held-out loss and decoding tau at every checkpoint)
    -> eval in bf16 (target alone, DFlash, n-gram lookup) and float32 (target alone, DFlash: the lossless check)

Workdir layout: target/, data/{train,heldout,valid}.jsonl + data/split.json (and data/self-prompts.json{,l}),
regenerated/, regenerated-valid/, cache/, cache-valid/, run/ (with eval-bfloat16.json, eval-float32.json),
summary.json (the JSON summary, with the bars checked), time.json (the wall time of every run on the workdir: the
time from nothing across resumes), caches/ (the tokenise, datasets and matplotlib caches: nothing is written outside
the workdir). Each stage prints its line with its expected share of the time as it starts; a rerun of a finished demo
prints the stored result and changes nothing (dflash/recipes/stages.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash.core.config import ConfigError, build, check, coerce_all, read_preset
from dflash.core.io import atomic_json, atomic_jsonl
from dflash.recipes.assets import smollm2_gguf
from dflash.recipes.stages import StagePlan, caches_under, now_stamp, show_stored, stored_result, train_rates
from dflash.recipes.self_prompts import NAME as SELF
from dflash.recipes.sources import SOURCES, Conversation, as_messages, dialogues, load_source  # noqa: F401

PRESET = "demo-gpu"

# The bars (DESIGN.md section 5), checked in the summary: tau on the in-source prompts, tau over n-gram lookup's on
# the same out-of-source prompts, the speed-up over the target alone on the in-source prompts (first eval dtype).
BARS = {"tau": 3.5, "out_of_source_tau_over_ngram": 2.0, "speedup": 2.0}


@dataclass
class GpuRecipe:
    """The `recipe` section of configs/demo-gpu.yaml."""

    heldout_percent: float = 5.0  # of conversations, chosen by a hash of the conversation id
    max_turns: int = 16  # messages kept per training conversation (user + assistant); 0 = all
    eval_max_turns: int = 0  # eval prompts end on a user turn within the first eval_max_turns messages; 0 = max_turns
    max_conversations: int = 0  # training conversations kept (the first ones after the split); 0 = all
    eval_prompts: int = 64
    eval_max_new_tokens: int = 96
    eval_dtypes: list = field(default_factory=lambda: ["bfloat16", "float32"])  # the first one gets n-gram lookup too
    later_dtype_prompts: int = 16  # prompts of the dtypes after the first (the float32 lossless check); 0 = eval_prompts
    # "dataset": one sample per user turn, its history as chitchat has it and only its answer regenerated (regenerate
    # --turns last): the target answering real conversations, as in the eval prompts; "target": one sample per
    # conversation, every answer regenerated after the target's own earlier ones (SmolLM2-135M then repeats its
    # first answer in 77-100% of the 4-grams of every later turn: BENCHMARKS.md, "GPU recipe")
    history: str = "dataset"
    # history "dataset": the messages of the data's history kept before each user turn (the last ones; 0 = all).
    # Bounds a sample's tokens, so that late turns of long conversations can be trained on (max_turns 0)
    history_messages: int = 0
    validation: bool = True  # regenerate + extract the held-out conversations too: train's --val-cache
    validation_conversations: int = 64  # held-out conversations of each source in the validation cache; 0 = all
    # the training mix, {source: share of the training samples} (dflash/recipes/sources.py names the sources): the
    # first source gives all its samples, the others as many as their share asks for (their pool repeated whole
    # when it is smaller); eval_prompts are split among them by share (the in-source set)
    sources: dict = field(default_factory=lambda: {"chitchat": 1.0})
    # the `self` source (dflash/recipes/self_prompts.py): user turns the target writes itself after its chat template's
    # user
    # header, sampled once (seeded) before the data stage; kept: those that ended within self_prompt_tokens, distinct
    self_prompts: int = 8192  # turns sampled (when `self` is in sources)
    self_prompt_tokens: int = 64
    self_temperature: float = 1.0
    self_top_p: float = 0.99
    self_seed: int = 0
    self_batch_size: int = 0  # rows sampled together; 0: regenerate's default (256 on GPU, 32 on CPU)
    heldout_source: str = ""  # a source kept whole out of training: the out-of-source eval set ("" = none)
    heldout_source_prompts: int = 0  # its prompts, taken round-robin over its categories; 0 = all
    # train while extracting: the validation data first, then `dflash train --follow` as a child process on the same
    # device beside the main extraction (dflash/pipeline.py says what sharing one GPU costs); false: one after the other
    follow: bool = False

    def __post_init__(self):
        check(0 < self.heldout_percent < 100, "heldout_percent", f"must be in (0, 100), got {self.heldout_percent}")
        check(self.max_turns == 0 or self.max_turns >= 2, "max_turns", f"must be 0 (all) or >= 2, got {self.max_turns}")
        check(self.eval_max_turns == 0 or self.eval_max_turns >= 1, "eval_max_turns",
              f"must be 0 (= max_turns) or >= 1, got {self.eval_max_turns}")
        check(self.max_conversations >= 0, "max_conversations", f"must be >= 0 (0 = all), got {self.max_conversations}")
        check(self.eval_prompts >= 1, "eval_prompts", f"must be >= 1, got {self.eval_prompts}")
        check(self.eval_max_new_tokens >= 1, "eval_max_new_tokens", "must be >= 1")
        check(self.history in ("dataset", "target"), "history", f"must be dataset or target, got {self.history!r}")
        check(self.history_messages >= 0 and self.history_messages % 2 == 0, "history_messages",
              f"must be an even number >= 0 (0 = the whole history; even: a sample starts on a user turn), "
              f"got {self.history_messages}")
        check(not self.history_messages or self.history == "dataset", "history_messages",
              "applies to history: dataset only (history: target regenerates every answer of a conversation)")
        check(self.validation_conversations >= 0, "validation_conversations", "must be >= 0 (0 = all)")
        check(self.later_dtype_prompts >= 0, "later_dtype_prompts", "must be >= 0 (0 = eval_prompts)")
        check(bool(self.eval_dtypes) and all(d in ("bfloat16", "float32") for d in self.eval_dtypes), "eval_dtypes",
              f"must be a non-empty list of bfloat16 / float32, got {self.eval_dtypes}")
        check(isinstance(self.sources, dict) and bool(self.sources), "sources",
              f"must map data sources to their shares, e.g. {{chitchat: 0.9, humaneval: 0.1}}, got {self.sources!r}")
        for name, share in self.sources.items():
            check(name in SOURCES or name == SELF, "sources",
                  f"{name!r} is not a data source (known: {', '.join([*SOURCES, SELF])})")
            check(isinstance(share, (int, float)) and not isinstance(share, bool) and share > 0, "sources",
                  f"the share of {name} must be a number > 0, got {share!r}")
        check(self.heldout_source == "" or self.heldout_source in SOURCES, "heldout_source",
              f"{self.heldout_source!r} is not a data source (known: {', '.join(SOURCES)})")
        check(self.heldout_source not in self.sources, "heldout_source",
              f"{self.heldout_source} is also a training source: an out-of-source set must be kept out of training")
        check(self.heldout_source_prompts >= 0, "heldout_source_prompts", "must be >= 0 (0 = all)")
        check(self.self_prompts >= 1, "self_prompts", f"must be >= 1, got {self.self_prompts}")
        check(self.self_prompt_tokens >= 1, "self_prompt_tokens", f"must be >= 1, got {self.self_prompt_tokens}")
        check(self.self_temperature > 0, "self_temperature",
              f"must be > 0 (greedy would write one turn {self.self_prompts} times), got {self.self_temperature}")
        check(0 < self.self_top_p <= 1, "self_top_p", f"must be in (0, 1], got {self.self_top_p}")
        check(self.self_batch_size >= 0, "self_batch_size", "must be >= 0 (0 = the default)")


# --------------------------------------------------------------------------------------------
# Data: conversations -> (train samples, held-out prompts), split by conversation
# --------------------------------------------------------------------------------------------


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


def mix_sources(pools: dict[str, list[tuple[str, list[str]]]], recipe: GpuRecipe,
                heldout: list[Conversation] | None = None) -> tuple[list[list[dict]], list[dict], dict,
                                                                      list[list[dict]]]:
    """The recipe's training mix and eval sets from the training sources' (conversation id, turn texts), in
    recipe.sources' order, and the held-out source's conversations.

    Each source is split like chitchat (split_turns: by a hash of the conversation id). Its training samples are
    mixed in by share: the first source gives all of its own, N = that count / its share; every other source gives
    round(N * share), its pool repeated whole (then in part) when smaller, a hash-spread part when larger. Returns
    (training samples, eval rows, counts, validation samples). Eval rows: {"messages", "set", "category",
    "source"}; the in-source set is eval_prompts held-out prompts split among the sources by share (category =
    the source), the out-of-source set the held-out source's (category = its own); the rows alternate between
    the sets, and within a set between its sources or categories, so that any prefix (the float32 run's
    later_dtype_prompts) samples every part."""
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
    out_rows = [{"messages": c.messages[:-1] if c.messages[-1]["role"] == "assistant" else c.messages,
                 "set": "out-of-source", "category": c.category, "source": recipe.heldout_source} for c in out]
    rows = interleave([in_rows, out_rows])
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
    sources (dflash/recipes/self_prompts.py; its turns equal to a held-out source's prompt are dropped: that source
    stays never
    trained on), self_record its record. Deterministic: a rerun writes the same files."""
    d = os.path.join(workdir, "data")
    os.makedirs(d, exist_ok=True)
    heldout = load_source(recipe.heldout_source) if recipe.heldout_source else None
    if SELF in recipe.sources and self_convs is None:
        raise ValueError("the recipe's sources name `self`: sample its prompts first (dflash/recipes/self_prompts.py)")
    self_dropped = 0
    if SELF in recipe.sources:
        banned = {" ".join(m["content"].split()).lower() for c in heldout or [] for m in c.messages
                  if m["role"] == "user"}
        kept = [c for c in self_convs if " ".join(c.messages[0]["content"].split()).lower() not in banned]
        self_dropped, self_convs = len(self_convs) - len(kept), kept
    pools = {k: [(c.key, [m["content"] for m in c.messages]) for c in (self_convs if k == SELF else load_source(k))]
             for k in recipe.sources}
    samples, rows, counts, held_samples = mix_sources(pools, recipe, heldout)
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


# --------------------------------------------------------------------------------------------
# The stages
# --------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """What the training runs share: the target, the held-out prompts, the cache (and the validation cache)."""

    target: str
    heldout: str
    cache: str
    counts: dict
    timings: dict
    regen: dict | None = None
    extract: dict | None = None
    val_cache: str | None = None  # the held-out conversations' cache (train --val-cache), or None
    follower: "FollowingTrainer | None" = None  # the recipe's follow: the trainer started beside the extraction


class FollowingTrainer:
    """`dflash train --follow` as a child process: it trains from the cache while this process extracts it (one
    process per job, each single-threaded for CUDA; they share only the cache). Its lines are forwarded behind
    `[train] `; wait() returns once it has finished (a failure is one error line: rerunning the demo resumes both)."""

    def __init__(self, args: list[str]):
        import subprocess
        import sys
        import threading

        from dflash.pipeline import forward_lines

        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.thread = threading.Thread(target=forward_lines, args=("train", self.proc.stdout, threading.Lock()),
                                       daemon=True)  # file I/O only
        self.thread.start()
        self.wall_s: float | None = None

    def wait(self) -> float:
        """Wait for the trainer; its wall time from start to end (seconds)."""
        rc = self.proc.wait()
        self.thread.join()
        if rc != 0:
            raise ConfigError(f"the trainer following the extraction failed (exit {rc}, its lines above start with "
                              "[train]); rerun the same `dflash demo` command to resume it")
        self.wall_s = time.perf_counter() - self.t0
        return self.wall_s

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()


def follower_args(target: str, cache: str, val_cache: str | None, run: str, preset: str, device: str,
                  train_overrides: dict | None) -> list[str]:
    """The command line of the trainer that follows the extraction: what train_and_eval's run_train gets."""
    args = ["--config", str(preset), "--target", target, "--cache", cache, "--out", run, "--follow", "--no-progress"]
    if device != "auto":
        args += ["--device", device]
    if val_cache:
        args += ["--val-cache", val_cache]
    for k, v in (train_overrides or {}).items():
        args += ["--" + k.replace("_", "-"), str(v)]
    return args


def load_recipe(preset: str = PRESET) -> GpuRecipe:
    fields = read_preset(preset, "recipe")
    known = set(GpuRecipe.__dataclass_fields__)
    bad = sorted(set(fields) - known)
    if bad:
        raise ConfigError(f"--config: unknown key {bad[0]!r} in the recipe section of {preset} "
                          f"(known: {', '.join(sorted(known))})")
    return GpuRecipe(**coerce_all(GpuRecipe, fields, preset))  # typed as the stages' presets are


def prepare(workdir: str, preset: str = PRESET, device: str = "auto", progress: bool = True,
            target: str | None = None, timings: dict | None = None, stages: StagePlan | None = None,
            tokenize_cache: str | None = None, before_extract=None) -> Prepared:
    """Target, data, regenerated responses and the cache (each skipped or resumed when already there).
    target: an HF folder to use instead of the bundled SmolLM2 (e.g. a random model of its shape); timings: the
    dict each stage's seconds go into as it ends (a new one by default); stages: prints each stage's line as it
    starts; tokenize_cache: extract's --tokenize-cache (None: its default); before_extract(target, cache,
    val_cache): called just before the main extraction starts, the validation data being made first (the recipe's
    `follow`: it starts the trainer that follows the extraction)."""
    from dflash.extract.regenerate import RegenerateConfig, run_regenerate
    from dflash.extract.run import ExtractConfig, run_extract

    recipe = load_recipe(preset)
    os.makedirs(workdir, exist_ok=True)
    timings = timings if timings is not None else {}
    start = stages.start if stages is not None else (lambda name: None)
    tok = {"tokenize_cache": tokenize_cache} if tokenize_cache else {}
    start("prepare target")
    t = time.perf_counter()
    if target is None:
        target = os.path.join(workdir, "target")
        if not (os.path.exists(os.path.join(target, "config.json"))
                and os.path.exists(os.path.join(target, "tokenizer_config.json"))):  # converted once, then reused
            from dflash.core.target import convert_gguf

            target = convert_gguf(smollm2_gguf(), target)
    timings["prepare target"] = time.perf_counter() - t
    self_convs = self_record = None
    if SELF in recipe.sources:
        from dflash.recipes.self_prompts import self_prompts

        start("self prompts")
        t = time.perf_counter()
        self_convs, self_record = self_prompts(workdir, target, recipe, device, progress)
        timings["self prompts"] = time.perf_counter() - t
        dropped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in self_record["dropped"].items())
        print(f"demo-gpu: self prompts: {self_record['kept']} of {self_record['sampled']} user turns sampled from the "
              f"target kept ({self_record['mean_tokens_kept']} tokens on average; dropped: {dropped})", flush=True)
    start("data")
    t = time.perf_counter()
    train_jsonl, held, counts, valid_jsonl = prepare_data(workdir, recipe, self_convs, self_record)
    timings["data"] = time.perf_counter() - t
    print(f"demo-gpu: {counts['train_conversations_used']} training conversations ({counts['assistant_turns']} "
          f"assistant turns to regenerate, {counts['assistant_turns_cut_by_max_turns']} more cut by max_turns="
          f"{recipe.max_turns}; history: {recipe.history}) in {counts['train_samples']} samples, "
          f"{counts['eval_prompts']} eval prompts from {counts['heldout_conversations']} held-out conversations",
          flush=True)

    regen_out = os.path.join(workdir, "regenerated")
    start("regenerate")
    t = time.perf_counter()
    turns = {"turns": "last"} if recipe.history == "dataset" else {}
    regen = run_regenerate(build(RegenerateConfig, preset, "regenerate",
                                 {"target": target, "data": train_jsonl, "out": regen_out, "device": device,
                                  "progress": progress, **turns}))
    timings["regenerate"] = time.perf_counter() - t

    cache = os.path.join(workdir, "cache")

    def main_extract():
        start("extract")
        t = time.perf_counter()
        if before_extract is not None:
            before_extract(target, cache, val_cache)
        out = run_extract(build(ExtractConfig, preset, "extract",
                                {"target": target, "data": regen_out, "out": cache, "device": device,
                                 "progress": progress, **tok}))
        timings["extract"] = time.perf_counter() - t
        return out

    val_cache = None
    ex = None if recipe.validation and before_extract is not None else main_extract()
    if recipe.validation:  # the held-out conversations through the same two stages: the trainer's --val-cache
        start("validation data")
        t = time.perf_counter()
        regen_val = os.path.join(workdir, "regenerated-valid")
        run_regenerate(build(RegenerateConfig, preset, "regenerate",
                             {"target": target, "data": valid_jsonl, "out": regen_val, "device": device,
                              "progress": progress, **turns}))
        val_cache = os.path.join(workdir, "cache-valid")
        run_extract(build(ExtractConfig, preset, "extract", {"target": target, "data": regen_val, "out": val_cache,
                                                             "device": device, "progress": progress, **tok}))
        timings["validation data"] = time.perf_counter() - t
    if ex is None:  # follow: the trainer needs the validation cache when it starts
        ex = main_extract()
    return Prepared(target, held, cache, counts, timings, regen, ex, val_cache)


def train_and_eval(prep: Prepared, run: str, preset: str = PRESET, device: str = "auto", progress: bool = True,
                   train_overrides: dict | None = None, eval_prompts: int | None = None,
                   eval_dtypes: list[str] | None = None, timings: dict | None = None,
                   ngram: bool = True, eval_overrides: dict | None = None, eval_tag: str = "",
                   stages: StagePlan | None = None) -> dict[str, Any]:
    """Train a drafter into `run` (resumed when rerun) and evaluate RUN/final once per dtype (RUN/eval-DTYPE.json,
    reused when newer than RUN/final; eval_tag names variants, e.g. eval-bfloat16-graph.json); n-gram lookup runs
    in the first dtype when ngram is True; eval_overrides are EvalConfig fields (e.g. draft_graph); stages: prints
    each stage's line as it starts. Returns {"train": summary, "eval": {dtype: report}}."""
    from dflash.train.eval import EvalConfig, run_eval
    from dflash.train.trainer import TrainConfig, run_train

    recipe = load_recipe(preset)
    timings = timings if timings is not None else {}
    start = stages.start if stages is not None else (lambda name: None)
    start("train")
    t = time.perf_counter()
    base = {"cache": prep.cache, "target": prep.target, "out": run, "device": device, "progress": progress}
    if prep.val_cache:
        base["val_cache"] = prep.val_cache
    if prep.follower is not None:  # it trained beside the extraction: wait for it; run_train then finds it finished
        prep.follower.wait()
    tr = run_train(build(TrainConfig, preset, "train", dict(base, **(train_overrides or {}))))
    timings["train"] = time.perf_counter() - t  # with follow: only what was left after the extraction
    evals = {}
    # the in-source and out-of-source prompts (heldout.jsonl alternates them: a prefix samples both)
    n_eval = eval_prompts or recipe.eval_prompts + int(prep.counts.get("out_of_source_prompts") or 0)
    for i, dtype in enumerate(recipe.eval_dtypes if eval_dtypes is None else eval_dtypes):
        path = os.path.join(run, f"eval-{dtype}{'-' + eval_tag if eval_tag else ''}.json")
        if os.path.exists(path) and os.path.getmtime(path) > os.path.getmtime(os.path.join(run, "final")):
            with open(path) as f:
                evals[dtype] = json.load(f)
            continue
        start(f"eval {dtype}")
        t = time.perf_counter()
        evals[dtype] = run_eval(build(EvalConfig, preset, "eval", {
            "target": prep.target, "drafter": os.path.join(run, "final"), "data": prep.heldout,
            "max_prompts": n_eval if i == 0 or not recipe.later_dtype_prompts
            else min(recipe.later_dtype_prompts, n_eval),
            "max_new_tokens": recipe.eval_max_new_tokens,
            "dtype": dtype, "ngram": ngram and i == 0, "device": device, "json_out": path, "progress": progress,
            "plot": os.path.join(run, f"acceptance-{dtype}.png") if i == 0 else None} | (eval_overrides or {})))
        timings[f"eval {dtype}"] = time.perf_counter() - t
    return {"train": tr, "eval": evals}


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class WorkTime:
    """The wall time of every run of the demo on a workdir, the killed ones too: WORKDIR/time.json holds one
    record per run ({"wall_s", "stages_s": the stages it finished}), rewritten every `every` seconds by a thread
    (file I/O only) and at the end, so a run killed by a time limit counts up to its last write. Their sum is
    the time from nothing of a demo that took several runs to finish."""

    def __init__(self, workdir: str, stages: dict[str, float], every: float = 5.0):
        import threading

        self.path = os.path.join(workdir, "time.json")
        os.makedirs(workdir, exist_ok=True)
        runs = (_read_json(self.path) or {}).get("runs")
        self.runs = list(runs) if isinstance(runs, list) else []
        self.runs.append({"wall_s": 0.0, "stages_s": {}})
        self.stages, self.t0, self.every = stages, time.perf_counter(), every
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._beat, name="demo-time", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self.runs[-1] = {"wall_s": round(time.perf_counter() - self.t0, 1),
                         "stages_s": {k: round(v, 1) for k, v in dict(self.stages).items()}}
        atomic_json(self.path, {"runs": self.runs})

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self._write()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._write()


def bars(ev: dict[str, Any]) -> dict[str, Any]:
    """The bars on one eval report: on its in-source prompts (all of them when its prompts have no sets) and, when
    it has them, its out-of-source ones (keys out_of_source_*)."""
    sets = ev.get("sets") or {}
    ins = sets.get("in-source") or {"dflash": ev["dflash"], "ngram": ev.get("ngram")}
    d, n = ins["dflash"], ins.get("ngram")
    out = {"tau": d["tau"], "tau_ok": d["tau"] >= BARS["tau"], "speedup": d["speedup"],
           "speedup_ok": d["speedup"] >= BARS["speedup"]}
    if n:
        out["tau_ngram"] = n["tau"]
        out["tau_over_ngram"] = d["tau"] / n["tau"] if n["tau"] else None
    oos = sets.get("out-of-source")
    if oos:
        od, on = oos["dflash"], oos.get("ngram")
        out.update(out_of_source_tau=od["tau"], out_of_source_speedup=od["speedup"])
        if on:
            ratio = od["tau"] / on["tau"] if on["tau"] else None
            out.update(out_of_source_tau_ngram=on["tau"], out_of_source_tau_over_ngram=ratio,
                       out_of_source_tau_over_ngram_ok=ratio is not None
                       and ratio >= BARS["out_of_source_tau_over_ngram"])
    return out


def set_summary(g: dict[str, Any]) -> dict[str, Any]:
    """A set's (or category's) figures in the summary: prompts, tau and speed-up of dflash and n-gram, identical."""
    n = g.get("ngram") or {}
    out = {"prompts": g["prompts"], "tau_dflash": g["dflash"]["tau"], "tau_ngram": n.get("tau"),
           "speedup_dflash": g["dflash"]["speedup"], "speedup_ngram": n.get("speedup"),
           "identical": f"{g['dflash']['identical']}/{g['prompts']}"}
    if "categories" in g:
        out["categories"] = {c: set_summary(cg) for c, cg in g["categories"].items()}
    return out


# Seconds of each stage of the GPU recipe on one H200 from nothing (2026-12-03, the preset with 192-token self prompts
# and follow: 18 min 45 s with both evals; "train" is what training took after the extraction it ran beside).
# BENCHMARKS.md, "GPU recipe". What is shown is each stage's share of the whole.
GPU_STAGE_SECONDS = {"prepare target": 13.0, "self prompts": 61.0, "data": 4.0, "regenerate": 211.0, "extract": 54.0,
                     "validation data": 29.0, "train": 465.0, "eval bfloat16": 249.0, "eval float32": 38.0}


def gpu_stage_plan(preset: str = PRESET, train_overrides: dict | None = None) -> StagePlan:
    """The GPU recipe's stages for the preset, with GPU_STAGE_SECONDS (training's scaled by a max_steps override)."""
    recipe = load_recipe(preset)
    ref = GPU_STAGE_SECONDS
    secs = {k: ref[k] for k in ("prepare target", "self prompts", "data", "regenerate")
            if k != "self prompts" or SELF in recipe.sources}
    if recipe.validation and recipe.follow:  # the trainer that follows the extraction needs the validation cache
        secs["validation data"] = ref["validation data"]
    secs["extract"] = ref["extract"]
    if recipe.validation and not recipe.follow:
        secs["validation data"] = ref["validation data"]
    steps, preset_steps = (train_overrides or {}).get("max_steps"), read_preset(preset, "train").get("max_steps")
    secs["train"] = ref["train"] * (steps / preset_steps if steps and preset_steps else 1.0)
    for i, dtype in enumerate(recipe.eval_dtypes):
        secs[f"eval {dtype}"] = ref.get(f"eval {dtype}", ref["eval bfloat16"] if i == 0 else ref["eval float32"])
    return StagePlan(secs)


def gpu_request(preset: str, device: str, target: str | None, train_overrides: dict | None,
                eval_prompts: int | None) -> dict[str, Any]:
    """What makes a GPU demo's result (the preset by name and content, and the arguments that change it): a rerun
    with the same finds it stored."""
    from dflash.core.config import resolve_preset

    path = resolve_preset(preset)
    data = open(path, "rb").read() if isinstance(path, str) else path.read_bytes()
    return {"preset": preset, "preset_sha256": hashlib.sha256(data).hexdigest(), "device": device, "target": target,
            "train_overrides": dict(train_overrides or {}), "eval_prompts": eval_prompts}


def run_gpu_demo(workdir: str, preset: str = PRESET, device: str = "auto", progress: bool = True,
                 target: str | None = None, train_overrides: dict | None = None,
                 eval_prompts: int | None = None) -> dict[str, Any]:
    """The whole GPU recipe; prints the eval tables and writes WORKDIR/summary.json. A rerun that finds the summary
    of a finished run with the same request (gpu_request) and its eval reports prints them and writes nothing."""
    from dflash.train.eval import format_report
    from dflash.train.run_dir import read_metrics

    workdir = os.path.abspath(workdir)  # every path the stages print is absolute
    recipe = load_recipe(preset)
    run, summary_path = os.path.join(workdir, "run"), os.path.join(workdir, "summary.json")
    request = gpu_request(preset, device, target, train_overrides, eval_prompts)
    stored = stored_result(summary_path, request, "request",
                           [os.path.join(run, f"eval-{dtype}.json") for dtype in recipe.eval_dtypes])
    if stored is not None:
        summary, reports = stored
        show_stored("demo", summary_path, summary, workdir,
                    again=f"delete that file and {run}/eval-*.json to measure again")
        print()
        for ev in reports:
            print(format_report(ev))
            print()
        print(format_summary(summary))
        return summary
    plan = gpu_stage_plan(preset, train_overrides)
    print(f"demo: the GPU recipe ({preset}) in {len(plan.seconds)} stages, about "
          f"{sum(plan.seconds.values()) / 60:.0f} min on one H200 (as measured for the shipped preset); the first "
          "training steps compile the step (~40 s)", flush=True)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    clock = WorkTime(workdir, timings)
    try:
        with caches_under(workdir) as tokenize_cache:
            followers: list[FollowingTrainer] = []

            def start_follower(target_dir: str, cache: str, val_cache: str | None) -> None:
                followers.append(FollowingTrainer(follower_args(target_dir, cache, val_cache, run, preset, device,
                                                                train_overrides)))

            try:
                prep = prepare(workdir, preset, device, progress, target, timings, stages=plan,
                               tokenize_cache=tokenize_cache, before_extract=start_follower if recipe.follow else None)
                prep.follower = followers[0] if followers else None
                out = train_and_eval(prep, run, preset, device, progress, train_overrides, eval_prompts,
                                     timings=timings, stages=plan)
            finally:
                for f in followers:
                    f.stop()
    finally:
        clock.close()
    tr, evals = out["train"], out["eval"]
    hist = tr.get("history") or []
    last = hist[-1] if hist else {}
    first = next(iter(evals.values()))
    # a resumed run's own figures cover only what it did: the earlier runs' come from the summary they left
    # (regeneration, extraction) and from RUN/metrics.jsonl (every logged window of the training, resumes cut it
    # back to the checkpoint they start from)
    old = _read_json(os.path.join(workdir, "summary.json")) or {}
    regen = {k: prep.regen.get(k) for k in ("tokens_per_s_this_rank", "generated_tokens_this_rank",
                                            "generation_s_this_rank", "engine_this_rank", "counts")} if prep.regen else None
    if regen and not regen["generated_tokens_this_rank"] and old.get("regenerate"):
        regen = old["regenerate"]
    ex_tps = (prep.extract or {}).get("tokens_per_s_this_rank") or old.get("extract_tokens_per_s")
    records = read_metrics(os.path.join(workdir, "run")) or hist
    rates = train_rates(records)
    summary = {
        "recipe": "gpu", "preset": preset, "request": request, "finished_at": now_stamp(),
        "target": prep.target, "data": prep.counts,
        "regenerate": regen,
        "extract_tokens_per_s": ex_tps,
        "train": {"steps": tr.get("steps"), "final_loss": last.get("loss"), "tau_expected": last.get("tau_expected"),
                  # the run mean after the first window (the warm-up) and the last window, with their steps
                  "ctx_tokens_per_s": rates["train_tokens_per_s"], "ctx_tokens_per_s_steps": rates[
                      "train_tokens_per_s_steps"], "ctx_tokens_per_s_last_window": rates[
                      "train_tokens_per_s_last_window"], "last_window_steps": rates["train_last_window_steps"],
                  "val_tau_decode": (tr.get("val") or {}).get("val_tau_decode"),
                  "val_tau_expected": (tr.get("val") or {}).get("val_tau_expected"),
                  "val_loss": (tr.get("val") or {}).get("val_loss"),
                  # [step, held-out decoding tau, held-out expected tau] at every checkpoint
                  "val_curve": [[h["step"], h.get("val_tau_decode"), h["val_tau_expected"]]
                                for h in records if "val_tau_expected" in h]},
        "eval": {dt: {"tau_dflash": ev["dflash"]["tau"], "tau_ngram": ev.get("ngram", {}).get("tau"),
                      "tokens_per_s": {"target": ev["target_tokens_per_s"], "dflash": ev["dflash"]["tokens_per_s"],
                                       "ngram": ev.get("ngram", {}).get("tokens_per_s")},
                      "speedup_dflash": ev["dflash"]["speedup"], "speedup_ngram": ev.get("ngram", {}).get("speedup"),
                      "ms_per_step": {"target": ev["target"]["ms_per_step"], "dflash": ev["dflash"]["ms_per_step"]},
                      "identical": f"{ev['dflash']['outputs_identical']}/{ev['prompts']}",
                      "differences": {k: ev["dflash"]["differences"][k] for k in ("differing", "near_tie", "suspect")},
                      "sets": {k: set_summary(g) for k, g in (ev.get("sets") or {}).items()}}
                 for dt, ev in evals.items()},
        "bars": bars(first),
        "lossless_float32": (evals["float32"]["dflash"]["outputs_identical"] == evals["float32"]["prompts"]
                             if "float32" in evals else None),
        "timings_s": timings,
        # the recipe's follow: the trainer's own wall time, from its start beside the extraction to its end
        "follow": ({"trainer_wall_s": prep.follower.wall_s, "extract_s": timings.get("extract"),
                    "train_after_extract_s": timings.get("train")} if prep.follower is not None else None),
        "wall_s": time.perf_counter() - t0,
        "all_runs": clock.runs,  # every run of the demo on this workdir, the killed ones too (WORKDIR/time.json)
        "wall_s_all_runs": sum(r["wall_s"] for r in clock.runs),
    }

    atomic_json(summary_path, summary)
    print()
    for ev in evals.values():
        print(format_report(ev))
        print()
    print(format_summary(summary))
    return summary


def format_summary(s: dict[str, Any]) -> str:
    b, d = s["bars"], s["data"]
    src = d.get("sources") or {}
    mix = ", ".join(f"{k} {v['train_samples']:,} ({v['share']:.0%}" + (f", {v['passes']:g} passes)" if v["passes"] > 1
                                                                    else ")") for k, v in src.items())
    held = d.get("heldout_source")
    rows = [
        ("training data", f"{d.get('train_conversations_used', d['train_samples']):,} conversations, "
                          f"{d['assistant_turns']:,} assistant turns regenerated by the target (history: "
                          f"{d.get('history', 'target')})"),
        *([("training mix", mix)] if len(src) > 1 else []),
        ("eval prompts", f"{d['eval_prompts']} from {d['heldout_conversations']} held-out conversations"
                         + (f" (in-source) + {held['prompts']} of {held['name']}, never trained on (out-of-source)"
                            if held else "")),
        ("train", f"{s['train']['steps']} steps, final loss {s['train']['final_loss']:.3f}"
         if s["train"]["final_loss"] is not None else "resumed"),
        ("expected tau, train / held-out rows", f"{s['train']['tau_expected']:.2f} / "
         + (f"{s['train']['val_tau_expected']:.2f}" if s["train"].get("val_tau_expected") is not None else "-")
         if s["train"].get("tau_expected") is not None else "resumed"),
        ("held-out decoding tau (--val-cache)", f"{s['train']['val_tau_decode']:.2f}"
         if s["train"].get("val_tau_decode") is not None else "-"),
        ("tau dflash / n-gram" + (", in-source" if held else ""),
         f"{b['tau']:.2f} / "
         + (f"{b['tau_ngram']:.2f} ({b['tau_over_ngram']:.2f}x)" if b.get("tau_over_ngram") else "-")),
        *([("tau dflash / n-gram, out-of-source", f"{b['out_of_source_tau']:.2f} / "
            + (f"{b['out_of_source_tau_ngram']:.2f} ({b['out_of_source_tau_over_ngram']:.2f}x)"
               if b.get("out_of_source_tau_over_ngram") else "-"))] if "out_of_source_tau" in b else []),
        ("speed-up vs target alone", f"{b['speedup']:.2f}x" + (f" in-source, {b['out_of_source_speedup']:.2f}x "
                                                               "out-of-source" if "out_of_source_tau" in b else "")),
        (f"bars (tau>={BARS['tau']:g}, out-of-source >={BARS['out_of_source_tau_over_ngram']:g}x n-gram, "
         f">={BARS['speedup']:g}x)", f"{b['tau_ok']}, {b.get('out_of_source_tau_over_ngram_ok')}, {b['speedup_ok']}"),
        ("lossless in float32", str(s["lossless_float32"])),
        ("time", ", ".join(f"{k} {v:.0f}s" for k, v in s["timings_s"].items())),
    ]
    if len(s.get("all_runs", [])) > 1:
        rows.append(("time from nothing", f"{s['wall_s_all_runs']:.0f}s in {len(s['all_runs'])} runs "
                                          "(" + ", ".join(f"{r['wall_s']:.0f}s" for r in s["all_runs"]) + ")"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
