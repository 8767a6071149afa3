"""Chat datasets, shared by extraction, regeneration and eval: load local files, normalise a row to messages,
iterate rows, and the end-of-sequence ids generation stops at.

    ds = load_chat_dataset("chats.jsonl", max_samples=10_000)   # a datasets.Dataset, local files only
    for batch in iter_row_batches(ds, "chats.jsonl"):         # lists of row dicts, only the chat columns
        msgs = row_messages(batch[0], 0, "chats.jsonl")       # [{"role", "content"}, ...]

A row is a conversation in the OpenAI format (`messages`: [{role, content}]) or the ShareGPT format
(`conversations`: [{from, value}]); where `prompt=True` (regenerate, eval), a row with neither may instead
have a `prompt` string, read as one user turn. Every problem with the input raises DataError with a message
that names the file, the row (0-based index in the dataset) and the field; invalid JSON names the file and line.

Content, not names: `load_chat_dataset` fingerprints the files it reads by their bytes (content_fingerprint:
sizes + a streamed sha256 tree digest, hashed in parallel threads; no path, no mtime) and records it on the
dataset as `ds.dflash_content`. The datasets library keys its own cache of a local file by path and mtime only,
so a file rewritten with its mtime restored (or copied over with `cp -p`, or edited within the mtime's
resolution) would be served stale from that cache; the load is therefore pointed at a cache directory named by
the content fingerprint (HF_DATASETS_CACHE/dflash-content/<fingerprint>): an entry there can only hold these
bytes, a first load of new content parses the files once as before, and a repeated load reuses it. Hashing
costs one read of the files (page-cached by the load that follows) at a few hundred MB/s per core.

A `dflash regenerate` output (OUT) carries REGENERATE_META beside its parts (OUT/data/part-*.jsonl): that file
is not data, and data that lies in an output whose parts are not all committed (pointed at as OUT, OUT/data, a
glob or a part file) is refused naming how many parts are committed and which are missing.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator, Mapping

from dflash.core.errors import DflashError
from dflash.core.io import Extent, short_hash, tree_digests


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
PROMPTS_META = "dflash_prompts.json"  # written beside prompts.jsonl by `dflash prompts`: not data
REGENERATE_PART = re.compile(r"^part-(\d{5,})\.jsonl$")  # OUT/data/part-00007.jsonl; its counts beside it first


def committed_regenerate_parts(out: str) -> set[int]:
    """The parts of the regenerate output OUT that are committed: a part file with its counts file
    (OUT/data/.part-00007.stats.json, written first) beside it."""
    d = os.path.join(out, "data")
    try:
        names = set(os.listdir(d))
    except OSError:
        return set()
    return {int(m.group(1)) for n in names if (m := REGENERATE_PART.match(n))
            and f".part-{m.group(1)}.stats.json" in names}


def _data_files_under(directory: str) -> list[str]:
    files = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files.extend(os.path.join(root, n) for n in names
                     if not n.startswith(".") and n not in (REGENERATE_META, PROMPTS_META) and _file_kind(n))
    return sorted(files)


def _check_regenerated(path: str, local: str, files: list[str]) -> None:
    """Data inside a `dflash regenerate` output must come from a finished one: a partial output would be used as
    if it were the whole. OUT is recognised from --data itself (OUT, or OUT/data) and from every file read. The
    same for a `dflash prompts` output (its prompts.jsonl appears when it is finished)."""
    if os.path.isdir(local):  # the folder and every folder below it that the loader reads
        dirs = []
        for root, subdirs, names in os.walk(local):
            subdirs[:] = [d for d in subdirs if not d.startswith(".")]
            if PROMPTS_META in names:
                dirs.append(root)
    else:
        dirs = sorted({os.path.dirname(os.path.abspath(f)) for f in files or [local]})
    for d in dirs:
        try:
            with open(os.path.join(d, PROMPTS_META), encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("complete") is False:
            raise DataError(f"--data {path}: {d} is an unfinished `dflash prompts` output (its record says "
                            "incomplete); rerun the same `dflash prompts` command to finish it")
    outs = set()
    if os.path.isdir(local):
        outs.add(os.path.abspath(local))
        if os.path.basename(os.path.abspath(local)) == "data":
            outs.add(os.path.dirname(os.path.abspath(local)))
    for f in files:
        d = os.path.dirname(os.path.abspath(f))
        if os.path.basename(d) == "data":
            outs.add(os.path.dirname(d))
    for out in sorted(outs):
        try:
            with open(os.path.join(out, REGENERATE_META), encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict):
            continue
        parts = meta.get("parts")
        done = committed_regenerate_parts(out)
        if isinstance(parts, int) and parts >= 0:
            missing = sorted(set(range(parts)) - done)
            if not missing and meta.get("complete") is not False:
                continue
            if not missing:  # every part is there but the record was not finalised (killed at the very end)
                raise DataError(f"--data {path}: {out} is an unfinished `dflash regenerate` output ({parts} of "
                                f"{parts} parts committed, its record not finalised); rerun the same `dflash "
                                "regenerate` command to finish it")
            names = ", ".join(f"part-{p:05d}.jsonl" for p in missing[:4]) + (
                f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            how = ("its record says complete, but parts were removed" if meta.get("complete")
                   else "an unfinished `dflash regenerate` output")
            raise DataError(f"--data {path}: {out} is {how}: {parts - len(missing)} of {parts} parts committed "
                            f"(missing {names}); rerun the same `dflash regenerate` command to finish it")
        elif meta.get("complete") is False:
            raise DataError(f"--data {path}: {out} is an unfinished `dflash regenerate` output (not every part is "
                            "committed); rerun the same `dflash regenerate` command to finish it")


def content_fingerprint(files: list[str], threads: int | None = None) -> str:
    """A fingerprint of the bytes of `files`, in order: each file's size and sha256 tree digest (dflash.core.io,
    hashed in parallel threads), not its name, path or mtime. A copy elsewhere has the same fingerprint."""
    sizes = [os.path.getsize(f) for f in files]
    try:
        digests = tree_digests([Extent(str(i), f, 0, n) for i, (f, n) in enumerate(zip(files, sizes))], threads)
    except OSError as e:
        raise DataError(f"cannot read the data: {e}") from e
    return short_hash(json.dumps([[n, digests[str(i)]] for i, n in enumerate(sizes)]), chars=32)


def _content_cache_dir(content: str) -> str:
    """datasets' cache directory for files of this content (module docstring: why not its default one)."""
    import datasets

    return os.path.join(str(datasets.config.HF_DATASETS_CACHE), "dflash-content", content)


def _open_bytes(path: str):
    """A binary file object of a data file, decompressed by its suffix (None: a codec that is not installed)."""
    lower = path.lower()
    try:
        if lower.endswith(".gz"):
            import gzip

            return gzip.open(path, "rb")
        if lower.endswith(".bz2"):
            import bz2

            return bz2.open(path, "rb")
        if lower.endswith(".xz"):
            import lzma

            return lzma.open(path, "rb")
        if lower.endswith((".zst", ".lz4")):
            return None
        return open(path, "rb")
    except (OSError, ImportError):
        return None


def first_bad_utf8(path: str, piece: int = 16 << 20) -> str | None:
    """Where a data file is not UTF-8 text ("line 3: not UTF-8 text (invalid start byte at byte 12 of the line)"),
    else None; read in pieces of whole lines. The JSON loader stores such bytes unchecked and a later read of the row
    fails, so a JSON file is checked before its first load (load_chat_dataset)."""
    fh = _open_bytes(path)
    if fh is None:
        return None
    line, carry = 1, b""
    with fh:
        while True:
            chunk = fh.read(piece)
            text = carry + chunk
            cut = len(text) if not chunk else text.rfind(b"\n") + 1  # whole lines now, the rest with the next piece
            block, carry = text[:cut], text[cut:]
            try:
                block.decode("utf-8")
            except UnicodeDecodeError as e:
                start, at_line = block.rfind(b"\n", 0, e.start) + 1, line + block.count(b"\n", 0, e.start)
                return f"line {at_line}: not UTF-8 text ({e.reason} at byte {e.start - start} of the line)"
            if not chunk:
                return None
            line += block.count(b"\n")


def first_bad_json(path: str) -> str | None:
    """Where a .json/.jsonl file is not valid JSON ("line 8: invalid JSON (...)"), else None. JSON Lines
    (its first line alone is a JSON value) is checked line by line, each line an object; otherwise the file is
    one JSON document. Read only when the loader has failed, to say where."""
    fh = _open_bytes(path)
    if fh is None:
        return None
    try:
        with fh:
            data = fh.read()
    except (OSError, EOFError, ValueError) as e:
        return f"cannot be read: {e}"
    lines = data.split(b"\n")

    def text(i: int, raw: bytes) -> str | None:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"line {i}: not UTF-8 text ({e.reason} at byte {e.start} of the line)")

    try:
        first = next(((i, ln) for i, ln in enumerate(lines, 1) if ln.strip()), None)
        if first is None:
            return None
        try:
            json.loads(text(*first))
            jsonl = True
        except json.JSONDecodeError:
            jsonl = False
        if not jsonl:
            try:
                json.loads(data.decode("utf-8"))
            except UnicodeDecodeError:
                for i, ln in enumerate(lines, 1):
                    text(i, ln)
            except json.JSONDecodeError as e:
                return f"line {e.lineno}: invalid JSON ({e.msg}, column {e.colno})"
            return None
        for i, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(text(i, raw))
            except json.JSONDecodeError as e:
                return f"line {i}: invalid JSON ({e.msg}, column {e.colno})"
            if not isinstance(value, dict):
                return f"line {i}: a JSON Lines row must be an object, got {type(value).__name__}"
    except ValueError as e:
        return str(e)
    return None


def _load_files(path: str, files: list[str], split: str, content: str):
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
    if kind == "json" and not os.path.isdir(_content_cache_dir(content)):  # a first load of these bytes
        for f in files:
            where = first_bad_utf8(f)
            if where:
                raise DataError(f"could not read {f}: {where}")
    try:
        # A packaged builder on local files: no network access (nothing is resolved on the Hub); its cache
        # directory is named by the files' content (module docstring).
        return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=_content_cache_dir(content))
    except Exception as e:  # pyarrow / json errors: say which path failed
        if "corresponds to no data" in str(e):
            raise DataError(f"{path} has no rows") from e
        for f in files if kind == "json" else ():
            where = first_bad_json(f)
            if where:
                raise DataError(f"could not read {f} as json: {where}") from e
        if kind == "json" and len(files) > 1:
            apart = _keys_apart(files)
            if apart:
                raise DataError(f"could not read {path} as json: {apart}") from e
        raise DataError(f"could not read {path} as {kind}: {type(e).__name__}: {e}") from e


def _keys(value, at: str = "") -> set[str]:
    """The key paths of a JSON value: "messages[].weight" for a key of the objects in a list."""
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in {at + k} | _keys(v, at + k + ".")}
    if isinstance(value, list):
        return {p for v in value for p in _keys(v, at.rstrip(".") + "[].")}
    return set()


def _keys_apart(files: list[str]) -> str | None:
    """When the files' rows do not share one set of keys (datasets reads every file with the columns it found in
    the first): the first file with a key the first file's rows lack, and those keys; else None."""
    def keys_of(f):
        fh = _open_bytes(f)
        if fh is None:
            raise OSError(f)
        with fh:
            text = fh.read().decode("utf-8", errors="replace")
        try:
            doc = json.loads(text)
            rows = doc if isinstance(doc, list) else [doc]
        except ValueError:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return set().union(*(_keys(r) for r in rows)) if rows else set()

    try:
        first = keys_of(files[0])
        for f in files[1:]:
            extra = sorted(keys_of(f) - first)
            if extra:
                return (f"{f} has {', '.join(extra[:4])} that no row of {files[0]} has, and the files are read with "
                        "the first one's columns: give every file's rows the same keys, or load the files apart")
    except (OSError, ValueError):
        return None
    return None


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


def _saved_files(directory: str) -> list[str]:
    """The files of a save_to_disk dataset (what its content is), in name order."""
    return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                  if not n.startswith(".") and os.path.isfile(os.path.join(directory, n)))


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
        return loaded[split], _saved_files(where)
    if where != path:
        return loaded, _saved_files(where)
    recorded = getattr(loaded, "split", None)
    if split != "train" and recorded is not None and str(recorded) != split:
        raise DataError(f"{path} is a single dataset of split {str(recorded)!r}, not {split!r}")
    return loaded, _saved_files(where)


def load_chat_dataset(path: str, split: str = "train", max_samples: int | None = None):
    """Load a chat dataset from local files only (never the network).

    `path`: a .json/.jsonl/.parquet file, a glob of them, a directory of them (searched recursively, sorted), or a
    directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (then `split` picks the split).
    `max_samples`: keep the first N rows (deterministic). Returns a `datasets.Dataset` whose `dflash_content` is the
    content fingerprint of the files it was read from (content_of; the module docstring says why).
    """
    if max_samples is not None and int(max_samples) < 1:
        raise DataError(f"max_samples must be >= 1, got {max_samples}")
    path = os.fspath(path)
    local = os.path.expanduser(path)
    if any(c in local for c in "*?[") and not os.path.exists(local):
        files = sorted(f for f in glob.glob(local, recursive=True) if os.path.isfile(f))
        _check_regenerated(path, local, files)
        if not files:
            raise DataError(f"no files match {path}")
        content = content_fingerprint(files)
        ds = _load_files(path, files, split, content)
    elif os.path.isdir(local):
        if _is_saved_dataset(local):
            ds, saved = _load_saved(local, split)
            content = content_fingerprint(saved)
        else:
            files = _data_files_under(local)
            _check_regenerated(path, local, files)
            if not files:
                raise DataError(f"{path} is a directory with no {_SUPPORTED} files and no save_to_disk dataset")
            content = content_fingerprint(files)
            ds = _load_files(path, files, split, content)
    elif os.path.isfile(local):
        _check_regenerated(path, local, [local])
        content = content_fingerprint([local])
        ds = _load_files(path, [local], split, content)
    else:
        raise DataError(f"data path {path} does not exist")
    if len(ds) == 0:
        raise DataError(f"{path} has no rows" + (f" in split {split!r}" if split != "train" else ""))
    if max_samples is not None and max_samples < len(ds):
        ds = ds.select(range(int(max_samples)))
    ds.dflash_content = content
    return ds


def content_of(ds) -> str | None:
    """The content fingerprint of the files a dataset from load_chat_dataset was read from (None otherwise: a
    dataset built in memory, or one derived from it by select/map)."""
    return getattr(ds, "dflash_content", None)


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
