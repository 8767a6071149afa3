"""What a drafter's run recorded of its target, and what the target mixes tokens with (the serving notes of
`dflash export` and `dflash check`).

run_record(final) reads RUN/run.json and the cache it names: the target's path and the chat template kwargs.

A drafter reads hidden states only: it is the same for a hybrid target (Qwen3.5 / 3.6: Gated DeltaNet linear
attention beside full attention) or a sliding-window one (gpt-oss). What differs is the engine's verify: on a
partly accepted block it must roll the target's linear-attention state (recurrent state and convolution window)
back to the accepted prefix, not only its KV cache, and keep sliding-window layers within their window. dflash's
own `eval` does (dflash/core/decode_state.py). An export records the counts in `dflash_trained.target_layer_kinds`;
a RUN/final has them from the target its run recorded.

    counts = target_layer_kinds(target)        # {"linear_attention": 48, "full_attention": 16} or None
    note = serving_note(counts)                # one sentence for an engine, or None for plain attention
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

from dflash.core.hybrid import layer_kinds
from dflash.core.target import load_config

KEY = "target_layer_kinds"


def run_record(final: str) -> dict[str, Any]:
    """What RUN/run.json and the cache it names record of the run final/ came from: target path, chat kwargs."""
    out: dict[str, Any] = {}
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(final)), "run.json")) as f:
            run = json.load(f)
        cache = ((run.get("caches") or {}).get("cache") or {}).get("path")
        with open(os.path.join(cache, "zarr.json")) as f:
            info = (json.load(f).get("attributes") or {}).get("info") or {}
    except (OSError, ValueError, TypeError, AttributeError):
        return out
    target = (info.get("target") or {}).get("name_or_path")
    if target:
        out["target"] = target
    kwargs = info.get("chat_template_kwargs", (info.get("extraction") or {}).get("chat_template_kwargs"))
    if isinstance(kwargs, dict):
        out["chat_template_kwargs"] = kwargs
    return out


def target_layer_kinds(target: str | None) -> dict[str, int] | None:
    """Layer kinds of a target (path or directory) and how many layers of each, or None where it cannot be read."""
    if not target or not os.path.exists(target):
        return None
    try:
        return dict(Counter(layer_kinds(load_config(target))))
    except Exception:  # noqa: BLE001  (a target that moved or broke: the notes simply go without it)
        return None


def recorded_kinds(path: str) -> dict[str, int] | None:
    """The counts a drafter directory records (an export's dflash_trained), else those of the target its run
    recorded (RUN/final)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            rec = (json.load(f).get("dflash_trained") or {}).get(KEY)
        if isinstance(rec, dict) and all(isinstance(v, int) for v in rec.values()):
            return rec
    except (OSError, ValueError, AttributeError):
        pass
    return target_layer_kinds(run_record(path).get("target"))


def serving_note(counts: dict[str, int] | None) -> str | None:
    if not counts or set(counts) <= {"full_attention"}:
        return None
    parts = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    need = []
    if "linear_attention" in counts:
        need.append("roll the linear-attention layers' recurrent and convolution state back to the accepted prefix "
                    "on a partly accepted block (not only the KV cache)")
    if "sliding_attention" in counts:
        need.append("keep its sliding-window layers within their window")
    return (f"the target has {parts} layers: the drafter is the same, but the engine's verify must "
            + " and ".join(need) + " (dflash eval does)")
