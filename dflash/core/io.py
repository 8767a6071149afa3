"""Small file utilities shared by every stage: atomic writes and the short content hash.

Contract:
- `atomic_write(path, data)` writes str or bytes under a hidden temporary name in the same directory
  (`.NAME.tmp-PID`, TEMPORARY_GLOB), then renames it over `path`: a reader sees the old file or the new one, never half
  of one. On any failure the temporary file is removed and the error propagates.
- `durable=True` also fsyncs the file before the rename, so that after a crash (power loss, not just a
  killed process) a renamed file is never empty or short. Use it for files that a later resume trusts as
  a commit record (`dflash regenerate`'s parts, their counts and its metadata: hours of generation are
  skipped on their word). Records that are cheap to redo or that only describe a run (run.json,
  summary.json, metrics.jsonl, demo data, the checkpoint `latest` pointer, whose checkpoint files are
  not fsynced either) skip the fsync.
- `short_hash(payload, chars=16)` is the first `chars` hex digits of sha256 over bytes, a str (as
  UTF-8), or an iterable of bytes chunks hashed in order (no join in memory). Every fingerprint dflash
  records that is "sha256 of one payload" goes through it (16 digits; the tokenisation cache key uses 24,
  dflash.core.weights 32). dflash_cache keeps its own `fingerprint(*parts)` (it imports
  nothing of dflash, and it hashes JSON parts with separators: a different function).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

TEMPORARY_GLOB = ".*.tmp-*"  # atomic_write's temporary names: left behind only by a process killed mid-write


def temporary_name(path: str) -> str:
    """Where atomic_write stages `path`: hidden, in the same directory (so the rename is atomic), per process."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")


def atomic_write(path: str, data: str | bytes, *, durable: bool = False) -> None:
    """Write data (str as UTF-8, or bytes) to path through a temporary file and a rename; see the module doc."""
    path = os.fspath(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:  # no temporary file left behind (disk full, a directory in the way, ...)
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_json(path: str, obj, *, durable: bool = False) -> None:
    """obj as indented JSON (non-JSON values through str), written atomically."""
    atomic_write(path, json.dumps(obj, indent=2, default=str), durable=durable)


def atomic_jsonl(path: str, rows: Iterable[dict], *, ensure_ascii: bool = True, durable: bool = False) -> None:
    """One JSON object per line, written atomically."""
    atomic_write(path, "".join(json.dumps(r, ensure_ascii=ensure_ascii) + "\n" for r in rows), durable=durable)


def short_hash(payload: bytes | str | Iterable[bytes], chars: int = 16) -> str:
    """First `chars` hex digits of sha256 of payload (bytes, a UTF-8 str, or bytes chunks in order)."""
    h = hashlib.sha256()
    if isinstance(payload, str):
        h.update(payload.encode("utf-8"))
    elif isinstance(payload, (bytes, bytearray, memoryview)):
        h.update(payload)
    else:
        for chunk in payload:
            h.update(chunk)
    return h.hexdigest()[:chars]
