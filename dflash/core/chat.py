"""Chat datasets, shared by extraction, regeneration and eval: load local files, normalise a row to messages,
iterate rows, and the end-of-sequence ids generation stops at.

    ds = load_chat_dataset("chats.jsonl", max_samples=10_000)   # a datasets.Dataset, local files only
    for batch in iter_row_batches(ds, "chats.jsonl"):         # lists of row dicts, only the chat columns
        msgs = row_messages(batch[0], 0, "chats.jsonl")       # [{"role", "content"}, ...]

A row is a conversation in the OpenAI format (`messages`: [{role, content}]) or the ShareGPT format
(`conversations`: [{from, value}]); where `prompt=True` (regenerate, eval), a row with neither may instead
have a `prompt` string, read as one user turn. Every problem with the input raises DataError with a message
that names the file, the row (0-based index in the dataset) and the field. A directory written by
`dflash regenerate` carries REGENERATE_META beside its parts: that file is not data, and a directory whose
record says it is incomplete is refused.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Mapping

from dflash.core.errors import DflashError


class DataError(DflashError):
    """Bad input data (or a tokenizer/template that cannot be used on it). The message says where and why."""


# ----------------------------------------------------------------------------------------------------------------
# loading

_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_SUPPORTED = ".json, .jsonl or .parquet (json/jsonl may be compressed: .gz, .bz2, .xz, .zst)"


def _file_kind(path: str) -> str | None:
    name = os.path.basename(path).lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            kind = "json" if name.endswith((".json", ".jsonl")) else None
            return kind
    if name.endswith((".json", ".jsonl")):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    return None


def _is_saved_dataset(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(directory, "state.json"))
        and os.path.isfile(os.path.join(directory, "dataset_info.json"))
    )


REGENERATE_META = "dflash_regenerate.json"  # written beside its parts by `dflash regenerate`: not data


def _data_files_under(directory: str) -> list[str]:
    files = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files.extend(os.path.join(root, n) for n in names
                     if not n.startswith(".") and n != REGENERATE_META and _file_kind(n))
    return sorted(files)


def _check_regenerated(directory: str) -> None:
    """A `dflash regenerate` output must be complete: a partial one would be used as if it were the whole."""
    try:
        with open(os.path.join(directory, REGENERATE_META), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(meta, dict) and meta.get("complete") is False:
        raise DataError(f"{directory} is an unfinished `dflash regenerate` output (not every part is committed); "
                        "rerun the same `dflash regenerate` command to finish it")


def _load_files(path: str, files: list[str], split: str):
    import datasets

    kinds = {}
    for f in files:
        kind = _file_kind(f)
        if kind is None:
            raise DataError(f"{f}: unsupported data file type; expected {_SUPPORTED}")
        kinds.setdefault(kind, f)
    if len(kinds) > 1:
        raise DataError(f"{path} mixes file types ({', '.join(sorted(kinds))}: e.g. {', '.join(kinds.values())}); "
                        "use one type per dataset")
    if split != "train":
        raise DataError(f"{path}: split {split!r} requested, but data files have a single split 'train'; "
                        "point --data at the files of that split instead")
    (kind,) = kinds
    if _no_rows(kind, files):  # datasets cannot build an empty split: say so before it fails obscurely
        raise DataError(f"{path} has no rows")
    try:
        # A packaged builder on local files: no network access (nothing is resolved on the Hub).
        return datasets.load_dataset(kind, data_files=files, split="train")
    except Exception as e:  # pyarrow / json errors: say which path failed
        if "corresponds to no data" in str(e):
            raise DataError(f"{path} has no rows") from e
        raise DataError(f"could not read {path} as {kind}: {type(e).__name__}: {e}") from e


def _no_rows(kind: str, files: list[str]) -> bool:
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            return sum(pq.ParquetFile(f).metadata.num_rows for f in files) == 0
        for f in files:
            if f.lower().endswith(_COMPRESSION_SUFFIXES):
                return False  # compressed: let the loader decide
            if os.path.getsize(f) > 64:
                return False
            with open(f, encoding="utf-8", errors="replace") as fh:
                if fh.read().strip() not in ("", "[]"):
                    return False
        return True
    except Exception:  # unreadable: the loader reports it
        return False


def _load_saved(path: str, split: str):
    import datasets

    def saved_rows_empty(directory: str) -> bool:  # datasets cannot load a saved dataset with no data files
        try:
            with open(os.path.join(directory, "state.json"), encoding="utf-8") as f:
                return json.load(f).get("_data_files") == []
        except (OSError, ValueError):
            return False

    where = path
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        try:
            with open(os.path.join(path, "dataset_dict.json"), encoding="utf-8") as f:
                splits = list(json.load(f)["splits"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"could not read {os.path.join(path, 'dataset_dict.json')}: {e}") from e
        if split not in splits:
            raise DataError(f"{path} has no split {split!r}; available splits: {', '.join(sorted(splits))}")
        where = os.path.join(path, split)
    if saved_rows_empty(where):
        raise DataError(f"{path} has no rows" + (f" in split {split!r}" if where != path else ""))
    try:
        # A DatasetDict's split is a saved Dataset of its own: load only that one (datasets fails on the whole
        # dict when any split is empty).
        loaded = datasets.load_from_disk(where)
    except Exception as e:
        raise DataError(f"could not load the saved dataset at {where}: {type(e).__name__}: {e}") from e
    if isinstance(loaded, datasets.DatasetDict):  # not reached for a well-formed save; kept for safety
        if split not in loaded:
            raise DataError(f"{path} has no split {split!r}; available splits: {', '.join(sorted(loaded))}")
        return loaded[split]
    if where != path:
        return loaded
    recorded = getattr(loaded, "split", None)
    if split != "train" and recorded is not None and str(recorded) != split:
        raise DataError(f"{path} is a single dataset of split {str(recorded)!r}, not {split!r}")
    return loaded


def load_chat_dataset(path: str, split: str = "train", max_samples: int | None = None):
    """Load a chat dataset from local files only (never the network).

    `path`: a .json/.jsonl/.parquet file, a glob of them, a directory of them (searched recursively, sorted), or a
    directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (then `split` picks the split).
    `max_samples`: keep the first N rows (deterministic). Returns a `datasets.Dataset`.
    """
    if max_samples is not None and int(max_samples) < 1:
        raise DataError(f"max_samples must be >= 1, got {max_samples}")
    path = os.fspath(path)
    local = os.path.expanduser(path)
    if any(c in local for c in "*?[") and not os.path.exists(local):
        files = sorted(f for f in glob.glob(local, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"no files match {path}")
        ds = _load_files(path, files, split)
    elif os.path.isdir(local):
        if _is_saved_dataset(local):
            ds = _load_saved(local, split)
        else:
            _check_regenerated(local)
            files = _data_files_under(local)
            if not files:
                raise DataError(f"{path} is a directory with no {_SUPPORTED} files and no save_to_disk dataset")
            ds = _load_files(path, files, split)
    elif os.path.isfile(local):
        ds = _load_files(path, [local], split)
    else:
        raise DataError(f"data path {path} does not exist")
    if len(ds) == 0:
        raise DataError(f"{path} has no rows" + (f" in split {split!r}" if split != "train" else ""))
    if max_samples is not None and max_samples < len(ds):
        ds = ds.select(range(int(max_samples)))
    return ds


# ----------------------------------------------------------------------------------------------------------------
# normalising one row

ROLES = ("system", "user", "assistant")
_TOOL_ROLES = {"tool", "function", "ipython", "tool_call", "tool_calls", "tool_response", "function_call",
               "function_response", "observation"}
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
}


def _text_content(content, where: str, fld: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # OpenAI content parts: keep the text parts, joined as templates do
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise DataError(f"{where}: {fld}[{k}] must be a {{'type': 'text', 'text': ...}} part, "
                                f"got {type(part).__name__}")
            kind = part.get("type") or ("text" if part.get("text") is not None else None)
            if kind != "text":
                raise DataError(f"{where}: {fld}[{k}] is a {kind!r} part; only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise DataError(f"{where}: {fld}[{k}].text must be a string, got {type(part.get('text')).__name__}")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        raise DataError(f"{where}: {fld} is missing")
    raise DataError(f"{where}: {fld} must be a string (or a list of text parts), got {type(content).__name__}")


def _openai_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise DataError(f"{where}: field 'messages' must be a list of {{role, content}}, got {type(messages).__name__}")
    out = []
    for j, m in enumerate(messages):
        fld = f"messages[{j}]"
        if not isinstance(m, Mapping):
            raise DataError(f"{where}: {fld} must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role is None:
            raise DataError(f"{where}: {fld} has no 'role'")
        if not isinstance(role, str):
            raise DataError(f"{where}: {fld}.role must be a string, got {type(role).__name__}")
        if role in _TOOL_ROLES or (role == "assistant" and m.get("tool_calls")):
            what = "tool calls" if role == "assistant" else f"role {role!r}"
            raise DataError(f"{where}: {fld} has {what}: tool/function messages are not supported yet")
        if role not in ROLES:
            raise DataError(f"{where}: {fld}.role {role!r} is unknown; expected one of {', '.join(ROLES)}")
        if "content" not in m:
            raise DataError(f"{where}: {fld} has no 'content'")
        msg = {"role": role, "content": _text_content(m["content"], where, f"{fld}.content")}
        weight = m.get("weight")  # OpenAI's fine-tuning convention: weight 0 = context only, not trained on
        if weight is not None:
            if role != "assistant" or isinstance(weight, bool) or weight not in (0, 1):
                raise DataError(f"{where}: {fld}.weight must be 0 or 1 on an assistant message (0: kept as context, "
                                f"not trained on), got {weight!r} on a {role} message")
            if weight == 0:
                msg["weight"] = 0
        out.append(msg)
    return out


def _sharegpt_messages(conversations, where: str) -> list[dict]:
    if not isinstance(conversations, (list, tuple)):
        raise DataError(f"{where}: field 'conversations' must be a list of {{from, value}}, "
                        f"got {type(conversations).__name__}")
    out = []
    for j, m in enumerate(conversations):
        fld = f"conversations[{j}]"
        if not isinstance(m, Mapping):
            raise DataError(f"{where}: {fld} must be an object with 'from' and 'value', got {type(m).__name__}")
        who = m.get("from")
        if who is None:
            raise DataError(f"{where}: {fld} has no 'from'")
        if not isinstance(who, str):
            raise DataError(f"{where}: {fld}.from must be a string, got {type(who).__name__}")
        if who.lower() in _TOOL_ROLES:
            raise DataError(f"{where}: {fld}.from {who!r}: tool/function messages are not supported yet")
        role = _SHAREGPT_ROLES.get(who.lower())
        if role is None:
            raise DataError(f"{where}: {fld}.from {who!r} is unknown; expected one of "
                            f"{', '.join(sorted(_SHAREGPT_ROLES))}")
        value = m.get("value")
        if value is None:
            raise DataError(f"{where}: {fld} has no 'value'")
        if not isinstance(value, str):
            raise DataError(f"{where}: {fld}.value must be a string, got {type(value).__name__}")
        out.append({"role": role, "content": value})
    return out


def to_messages(example: dict, row: int, source: str) -> list[dict]:
    """One dataset row -> [{"role": "system"|"user"|"assistant", "content": str}, ...].

    Accepts the OpenAI format (column "messages": [{role, content}], content a string or a list of text parts)
    and the ShareGPT format (column "conversations": [{from, value}]).
    """
    where = f"{source}, row {row}"
    if not isinstance(example, Mapping):
        raise DataError(f"{where}: expected an object with a 'messages' or 'conversations' field, "
                        f"got {type(example).__name__}")
    if example.get("messages") is not None:
        return _openai_messages(example["messages"], where)
    if example.get("conversations") is not None:
        return _sharegpt_messages(example["conversations"], where)
    present = [k for k in ("messages", "conversations") if k in example]
    if present:
        raise DataError(f"{where}: field {present[0]!r} is null")
    raise DataError(f"{where}: no 'messages' (OpenAI format) or 'conversations' (ShareGPT format) field; "
                    f"fields are: {', '.join(map(str, example)) or '(none)'}")


def row_messages(example, row: int, source: str, *, prompt: bool = False) -> list[dict]:
    """to_messages, and with prompt=True: a row without `messages`/`conversations` (absent or null) whose
    `prompt` is a string is one user turn (prompt datasets for regenerate and eval)."""
    if prompt and isinstance(example, Mapping) and example.get("messages") is None \
            and example.get("conversations") is None and isinstance(example.get("prompt"), str):
        return [{"role": "user", "content": example["prompt"]}]
    return to_messages(example, row, source)


def iter_row_batches(ds, source: str, *, prompt: bool = False, lo: int = 0, hi: int | None = None,
                     batch_size: int = 256) -> Iterator[list[dict]]:
    """Rows lo..hi of a datasets.Dataset (or a list of dicts) in lists of up to batch_size row dicts holding
    only the chat columns (`messages`, `conversations`, and `prompt` when prompt=True). A dataset without any
    of them is a DataError naming its fields."""
    names = getattr(ds, "column_names", None)
    hi = len(ds) if hi is None else hi
    if names is not None and hasattr(ds, "select"):
        cols = [c for c in ("messages", "conversations", *(("prompt",) if prompt else ())) if c in names]
        if not cols:
            raise DataError(f"{source}, row {lo}: no 'messages' (OpenAI format) or 'conversations' (ShareGPT format) "
                            f"field; fields are: {', '.join(names) or '(none)'}")
        sub = ds if (lo, hi) == (0, len(ds)) else ds.select(range(lo, hi))
        for batch in sub.select_columns(cols).with_format(None).iter(batch_size=batch_size):
            n = len(batch[cols[0]])
            yield [{c: batch[c][j] for c in cols} for j in range(n)]
    else:
        rows = list(ds)[lo:hi]
        for b in range(0, len(rows), batch_size):
            yield rows[b:b + batch_size]


# ----------------------------------------------------------------------------------------------------------------
# generation


def eos_ids_of(model, tokenizer=None) -> set[int]:
    """End-of-sequence ids: the tokenizer's eos plus the model's generation_config eos ids (without a
    tokenizer: the model config's own eos too)."""
    ids: list = []
    config = getattr(model.config, "text_config", None) or model.config
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(config, "eos_token_id", None) if tokenizer is None else None):
        ids += src if isinstance(src, (list, tuple)) else [src]
    return {int(i) for i in ids if i is not None}
