"""The output folder of `dflash regenerate`: its parts, its record and the checks that make a rerun resume.

OUT/data/part-00007.jsonl holds part 7's conversations; OUT/data/.part-00007.stats.json its counts, written first,
so a part exists whole (with its counts) or not at all. OUT/dflash_regenerate.json records the settings, the
target's identity and, once every part is committed, the totals; OUT/README.md is a dataset card whose `configs`
block lets `datasets.load_dataset(OUT)` find the parts. A folder holding anything else is never written into, and
--overwrite removes only what regenerate writes.

What a resume checks (so that no output mixes two inputs): every setting the text depends on, the target's
config and tokenizer, the content fingerprint of the target's weights (`weights`, dflash.core.weights: a resume
with other weights of the same shapes names the first tensor that differs) and the content fingerprint of the
data files (`identity.data_fingerprint`, dflash.core.chat.content_fingerprint: a file replaced in place, even
with the same rows, is refused). An output recorded before these fingerprints resumes with a note saying what
could not be checked.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

from dflash.core.chat import REGENERATE_META, DataError, committed_regenerate_parts
from dflash.core.config import ConfigError
from dflash.core.io import TEMPORARY_GLOB, atomic_write
from dflash.core.weights import WeightsFingerprint, compare_full
from dflash_cache.lock import LOCK_NAME

FORMAT = "dflash-regenerate"
FORMAT_VERSION = 1
META_NAME = REGENERATE_META  # the dataset loader skips this name when it scans a directory

# the record's settings and identity keys -> the flag a user changes to match them
SETTING_FLAGS = {"data": "data", "split": "split", "max_samples": "max_samples", "max_new_tokens": "max_new_tokens",
                 "temperature": "temperature", "top_p": "top_p", "seed": "seed",
                 "chat_template_kwargs": "chat_template_kwargs", "part_size": "part_size", "dtype": "dtype",
                 "stop_at_eos": "stop_at_eos", "continue_turns": "continue_turns", "rows": "data",
                 "chat_template_fingerprint": "chat_template",
                 "tokenizer_fingerprint": "target", "target": "target", "data_fingerprint": "data"}
# identity keys recorded since a later version: an older record without them resumes unchecked, with a note
ADDED_IDENTITY = {"data_fingerprint": "the content of --data"}


def part_name(p: int) -> str:
    return f"part-{p:05d}.jsonl"


def _paths(out: str, p: int) -> tuple[str, str]:
    d = os.path.join(out, "data")
    return os.path.join(d, part_name(p)), os.path.join(d, f".part-{p:05d}.stats.json")


def committed_parts(out: str) -> set[int]:
    """Parts whose file and counts are both on disk (the counts are written first)."""
    return committed_regenerate_parts(out)


def _atomic_write(path: str, text: str) -> None:
    atomic_write(path, text, durable=True)  # resume skips a committed part on its word: fsync before the rename


def read_meta(out: str) -> dict | None:
    path = os.path.join(out, META_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path}: {e}; pass --overwrite to start over") from e
    if not isinstance(doc, dict):
        raise DataError(f"{path} holds a {type(doc).__name__}, not a regenerate record; pass --overwrite to start over")
    return doc


def _fmt(v) -> str:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else repr(v)


def _same_data(old: dict, new: dict) -> bool:
    """Both records carry the data's content fingerprint and it is the same (the data moved, not changed)."""
    was = (old.get("identity") or {}).get("data_fingerprint") if isinstance(old.get("identity"), dict) else None
    return was is not None and was == new["identity"].get("data_fingerprint")


def _check_same(old: dict, new: dict, out: str) -> list[str]:
    """Settings and identity of the record against this run's: the first difference is a ConfigError naming its
    flag; returns notes for identity keys the record predates (not checked)."""
    diffs, notes = [], []
    for key in ("settings", "identity"):
        a, b = old.get(key, {}), new[key]
        for k in sorted(set(a) | set(b)):
            if key == "identity" and k in ADDED_IDENTITY and k not in a:
                notes.append(f"note: {out} records no fingerprint of {ADDED_IDENTITY[k]} (written by an older "
                             "dflash): cannot check that it is unchanged since the output was started")
            elif key == "settings" and k == "data" and a.get(k) != b.get(k) and _same_data(old, new):
                notes.append(f"note: --data {b.get(k)} is not the path {out} was started with ({a.get(k)}), but its "
                             "content is the same (content fingerprint): resuming")
            elif a.get(k) != b.get(k):
                diffs.append((k, a.get(k), b.get(k)))
    if diffs and diffs[0][0] == "data_fingerprint":
        data = new["settings"]["data"]
        raise ConfigError(f"--data: the content of {data} changed since {out} was started (content fingerprint "
                          f"{diffs[0][1]} then, {diffs[0][2]} now): resuming would mix conversations of both; "
                          "rerun with the data it was started with, or pass --overwrite to start over")
    if diffs:
        k, was, now = diffs[0]
        flag = "--" + SETTING_FLAGS.get(k, k).replace("_", "-")
        more = f" (also different: {', '.join(d[0] for d in diffs[1:])})" if len(diffs) > 1 else ""
        raise ConfigError(f"{flag}: {out} was regenerated with {k}={_fmt(was)}, this run has {k}={_fmt(now)}{more}; "
                          "rerun with the same settings to resume, or pass --overwrite to start over")
    return notes


def _check_weights(old: dict, weights: WeightsFingerprint | None, out: str, target: str) -> list[str]:
    """The content fingerprint of this run's target against the record's: other weights (same config, names and
    shapes) are a ConfigError naming the first tensor that differs; a record without one gets a note."""
    recorded = old.get("weights")
    if weights is None:
        return []
    if not isinstance(recorded, dict):
        return [f"note: {out} records no content fingerprint of its target's weights (written by an older dflash): "
                "cannot check that the parts still to do come from the same weights as the committed ones"]
    diff = compare_full(recorded, weights)
    if diff:
        raise ConfigError(f"--target {target}: {out} was regenerated from other weights ({diff}); resuming would mix "
                          "answers of two models: resume with the target it was started with, or pass --overwrite "
                          "to start over")
    return []


def _remove_ours(out: str) -> None:
    shutil.rmtree(os.path.join(out, "data"), ignore_errors=True)
    for name in (META_NAME, "README.md"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))


def check_out(out: str, overwrite: bool = False) -> dict | None:
    """OUT's record (None for a new or empty directory); OUT holding anything else is refused (never written into).
    A record of its own name that cannot be read is an error, except with --overwrite (which then starts over)."""

    try:
        old = read_meta(out) if os.path.isdir(out) else None
    except DataError:
        if not overwrite:
            raise
        old = {"format": FORMAT}  # regenerate's own record, damaged: --overwrite removes what regenerate writes
    entries = sorted(n for n in os.listdir(out) if not n.startswith(LOCK_NAME)) if os.path.isdir(out) else []
    if old is None and entries:
        raise ConfigError(f"--out: {out} exists and is not a dflash regenerate output (it holds "
                          f"{', '.join(entries[:5])}); choose an empty or new directory")
    return old


def prepare_out(out: str, meta: dict, overwrite: bool, weights: WeightsFingerprint | None = None,
                target: str = "") -> list[str]:
    """Create OUT or check that it holds this regeneration (rank 0 only): the module docstring's resume checks
    against `meta` and `weights` (this run's target fingerprint). Never deletes files it did not write. Returns
    notes for the user (checks an older record could not support)."""
    old = check_out(out, overwrite)
    notes: list[str] = []
    if old is not None and old.get("format") != FORMAT:
        raise ConfigError(f"--out: {out}/{META_NAME} is not a {FORMAT} record; choose another directory")
    if old is not None and not overwrite:
        notes += _check_weights(old, weights, out, target)
        notes += _check_same(old, meta, out)
    os.makedirs(out, exist_ok=True)
    if old is None or overwrite:
        _remove_ours(out)
        _atomic_write(os.path.join(out, META_NAME), json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _atomic_write(os.path.join(out, "README.md"), dataset_card(meta))
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    for stale in glob.glob(os.path.join(out, "data", TEMPORARY_GLOB)):  # left by a killed run: never a committed part
        os.remove(stale)
    return notes


def dataset_card(meta: dict) -> str:
    s, c = meta["settings"], meta.get("counts")
    lines = [
        "---", "configs:", "- config_name: default", "  data_files:", "  - split: train", "    path: data/part-*.jsonl",
        "---", "", "# Regenerated chat data", "",
        f"Assistant turns regenerated by `{meta['target']['name_or_path']}` with `dflash regenerate` "
        f"({meta['parts']} parts of {s['part_size']} conversations from `{s['data']}`).", "",
        "Each row: `messages` (OpenAI format: system and user turns verbatim, assistant turns written by the target) "
        "and `source_row` (the row of the input dataset).", "",
        *(["Only the last assistant turn of each row is the target's (`--turns last`); the earlier ones are the "
           "input's, marked `\"weight\": 0` (context, not trained on); the target's is marked `\"weight\": 1`.", ""]
          if s.get("turns") == "last" else []),
        f"Settings: max_new_tokens={s['max_new_tokens']}, temperature={s['temperature']}, top_p={s['top_p']}, "
        f"seed={s['seed']}, chat_template_kwargs={json.dumps(s['chat_template_kwargs'])}, dtype={s['dtype']}.", "",
        f"Status: {'complete' if meta.get('complete') else 'in progress'}; details in `{META_NAME}`.", "",
    ]
    if c:
        lines += [f"Counts: {json.dumps(c, sort_keys=True)}", ""]
    return "\n".join(lines)


def write_part(out: str, p: int, convs: list, stats: dict) -> None:
    """Counts first, then the part: a part file exists only complete and with its counts beside it. convs:
    the part's conversations (extract/generation/regenerate.py Conversation: .messages, .row)."""
    part, side = _paths(out, p)
    _atomic_write(side, json.dumps(stats, sort_keys=True) + "\n")
    lines = [json.dumps({"messages": c.messages, "source_row": c.row}, ensure_ascii=False) for c in convs]
    _atomic_write(part, "".join(line + "\n" for line in lines))


COUNT_KEYS = ("rows", "conversations", "skipped_no_user_turn", "turns", "generated_tokens", "prompt_tokens",
              "empty", "truncated")


def _new_stats() -> dict[str, int]:
    return {k: 0 for k in COUNT_KEYS}


def finalize(out: str, meta: dict) -> dict | None:
    """If every part is committed: totals into the metadata (complete=True). Returns the totals, else None."""
    done = committed_parts(out)
    if len(done & set(range(meta["parts"]))) < meta["parts"]:
        return None
    totals = _new_stats()
    for p in range(meta["parts"]):
        part, side = _paths(out, p)
        try:
            with open(side, encoding="utf-8") as f:
                st = json.load(f)
            counts = [int(st.get(k, 0)) for k in COUNT_KEYS]
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise DataError(f"cannot read {side} (the counts of committed part {p}): {e}; delete it and {part} and "
                            "rerun the same command to redo that part") from None
        for k, n in zip(COUNT_KEYS, counts):
            totals[k] += n
    final = dict(read_meta(out) or meta, complete=True, counts=totals)  # the record as rank 0 wrote it (weights)
    _atomic_write(os.path.join(out, META_NAME), json.dumps(final, indent=2, sort_keys=True) + "\n")
    _atomic_write(os.path.join(out, "README.md"), dataset_card(final))
    return totals
