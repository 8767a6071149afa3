"""Small file utilities shared by every stage: atomic writes and the short content hash.

Contract:
- `atomic_write(path, data)` writes str or bytes under a hidden temporary name in the same directory
  (`.NAME.tmp-PID`, TEMPORARY_GLOB), then renames it over `path`: a reader sees the old file or the new one, never half
  of one. On any failure the temporary file is removed and the error propagates; a failure for lack of room (disk
  full, quota, file-size limit) or a read-only filesystem propagates as a WriteError naming `path` (an OSError
  with the same errno, and a DflashError: one `error:` line in the CLI).
- `durable=True` also fsyncs the file before the rename, so that after a crash (power loss, not just a
  killed process) a renamed file is never empty or short. Use it for files that a later resume trusts as
  a commit record (`dflash regenerate`'s parts, their counts and its metadata: hours of generation are
  skipped on their word). Records that are cheap to redo or that only describe a run (run.json,
  summary.json, metrics.jsonl, demo data, the checkpoint `latest` pointer, whose checkpoint files are
  not fsynced either) skip the fsync.
- `shared_mode(path)` gives a file (or directory) that a library created private (safetensors' save_file and
  tempfile.mkdtemp create 0600 / 0700) the mode this process's umask gives a new file or directory (0644 / 0755 under
  the usual 022): what dflash writes for others to read (a drafter served by another user, a shared tokenise cache)
  is readable as the user's umask says. atomic_write's files are opened with open(), which already applies it.
- `short_hash(payload, chars=16)` is the first `chars` hex digits of sha256 over bytes, a str (as
  UTF-8), or an iterable of bytes chunks hashed in order (no join in memory). Every fingerprint dflash
  records that is "sha256 of one payload" goes through it (16 digits; the tokenisation cache key uses 24,
  dflash.core.weights 32). dflash_cache keeps its own `fingerprint(*parts)` (it imports
  nothing of dflash, and it hashes JSON parts with separators: a different function).
- `tree_digests(extents)` is the content digest of byte ranges of files (the tensors of a target, whole data
  files, checkpoint and tokenise-cache files): per extent, sha256 over the sha256 digests of its consecutive
  `piece`-byte pieces (a one-level tree, so one large file is hashed by many threads at once). Pieces are read
  with os.preadv into per-thread buffers and hashed in a thread pool; both release the GIL, so the threads run
  in parallel and do nothing but file I/O and hashing. Streamed: memory is one piece per thread. A file shorter
  than its extent is an OSError naming it. `file_record(paths)` / `check_files(record, paths)` are the
  size + digest record of whole files and its check: what a later read trusts a file on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dflash.core.errors import DflashError

TEMPORARY_GLOB = ".*.tmp-*"  # atomic_write's temporary names: left behind only by a process killed mid-write

# errnos of a write that failed for the place, not for the program: no room, or no writing allowed there
NO_ROOM = {errno.ENOSPC: "disk full", errno.EFBIG: "file too large for the filesystem or the file-size limit",
           errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only filesystem", errno.EACCES: "permission denied"}


class WriteError(DflashError, OSError):
    """A file that could not be written for lack of room or permission (NO_ROOM): an OSError with the original errno
    whose message names the file."""

    def __init__(self, path: str, err: OSError):
        OSError.__init__(self, err.errno, err.strerror, path)
        self.message = f"cannot write {path}: {NO_ROOM[err.errno]} ({err.strerror}); free space or write elsewhere"

    def __str__(self) -> str:
        return self.message


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
    except BaseException as e:
        try:  # no temporary file left behind (disk full, a directory in the way, ...)
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and not isinstance(e, WriteError) and e.errno in NO_ROOM:
            raise WriteError(path, e) from e
        raise


def _umask() -> int:
    """This process's umask: read from /proc on Linux (setting it to read it would race with threads that create
    files), else set and put straight back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_mode(path: str) -> None:
    """Set path's mode to what the umask gives a new file (0o666 & ~umask) or directory (0o777 & ~umask)."""
    full = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, full & ~_umask())


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


# ------------------------------------------------------------------------------------------------ content digests

PIECE = 16 << 20  # bytes per hashed piece
DIGEST_CHARS = 32  # hex digits kept of a tree digest (128 bits)


@dataclass
class Extent:
    """Where one named run of bytes lies: `name` in `file` at [offset, offset + size)."""

    name: str
    file: str
    offset: int
    size: int


def default_threads() -> int:
    return min(32, os.cpu_count() or 1)


class _Hasher:
    """Pieces of extents hashed in a pool; each thread keeps one read buffer, and one fd per file is shared."""

    def __init__(self, threads: int, piece: int):
        self.threads, self.piece_size = max(1, threads), int(piece)
        self.local = threading.local()
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self.lock:
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_RDONLY)
            return self.fds[path]

    def piece(self, ext: Extent, start: int, size: int) -> bytes:
        buf = getattr(self.local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self.local.buf = bytearray(max(size, self.piece_size))
        view = memoryview(buf)[:size]
        fd, got = self.fd(ext.file), 0
        while got < size:
            n = os.preadv(fd, [view[got:]], ext.offset + start + got)
            if n <= 0:
                raise OSError(f"{ext.file}: {ext.name} ends past the end of the file (truncated?)")
            got += n
        return hashlib.sha256(view).digest()

    def run(self, exts: list[Extent]) -> dict[str, str]:
        step = self.piece_size
        jobs = [(i, s, min(step, e.size - s)) for i, e in enumerate(exts) for s in range(0, max(e.size, 1), step)]
        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="dflash-hash") as pool:
                digests = list(pool.map(lambda j: self.piece(exts[j[0]], j[1], j[2]) if j[2] > 0 else b"", jobs))
        finally:
            for fd in self.fds.values():
                os.close(fd)
        per: dict[int, hashlib._Hash] = {}
        for (i, _, _), d in zip(jobs, digests):
            per.setdefault(i, hashlib.sha256()).update(d)
        return {exts[i].name: h.hexdigest()[:DIGEST_CHARS] for i, h in per.items()}


def tree_digests(extents: Iterable[Extent], threads: int | None = None, piece: int = PIECE) -> dict[str, str]:
    """name -> tree digest of each extent (module docstring); OSError if a file cannot be read or is too short."""
    return _Hasher(threads or default_threads(), piece).run(list(extents))


def file_record(paths: Mapping[str, str], threads: int | None = None) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of whole files (name -> path): what check_files later compares them with."""
    sizes = {name: os.path.getsize(p) for name, p in paths.items()}
    digests = tree_digests([Extent(name, p, 0, sizes[name]) for name, p in paths.items()], threads)
    return {name: {"size": sizes[name], "sha256": digests[name]} for name in paths}


def check_files(record: Mapping[str, Mapping], paths: Mapping[str, str], threads: int | None = None) -> str | None:
    """None when every recorded file (name -> path) has its recorded size and digest, else what is wrong with the
    first one that does not ("model.safetensors: 1,234 bytes, 2,468 recorded"). Sizes are checked before any
    byte is hashed (a file cut short costs nothing to find)."""
    exts = []
    for name in sorted(record):
        want = record[name]
        path = paths.get(name)
        if path is None or not os.path.isfile(path):
            return f"{name}: missing"
        size = os.path.getsize(path)
        if not isinstance(want, Mapping) or size != want.get("size"):
            got = want.get("size") if isinstance(want, Mapping) else None
            return f"{name}: {size:,} bytes, {got if not isinstance(got, int) else f'{got:,}'} recorded"
        exts.append(Extent(name, path, 0, size))
    try:
        digests = tree_digests(exts, threads)
    except OSError as e:
        return f"cannot read: {e}"
    for e in exts:
        if digests[e.name] != record[e.name].get("sha256"):
            return f"{e.name}: its bytes differ from the checksum recorded when it was written"
    return None
