"""One writer per output: an exclusive lock record inside the output directory (or URL).

    with OutputLock(path, "dflash extract ...") as lock:   # raises LockedError when another process holds it
        ...                                                  # lock.note: "took over a stale lock of ..." or ""

The record, OUT/.dflash.lock, is JSON: host, pid, start time (UTC), command, and the torchrun job id
(TORCHELASTIC_RUN_ID) when there is one. Rules:

- Local paths: the record is written whole to a temp file of its own, then hard-linked to OUT/.dflash.lock.
  link() fails if the name exists, so of several processes racing for it exactly one wins, on one host or on
  several sharing a POSIX filesystem (local disks, NFS and Lustre honour it), and the lock is never seen
  partly written (a full disk fails the temp file, which is removed: no lock is left). On a filesystem
  without hard links it is created with O_CREAT | O_EXCL and then written (removed again if that fails).
- A record left by a process that is gone (same host, its pid no longer runs, or runs a process that
  started after the record was written) is stale, and so, by definition, is a record that cannot be read
  (empty, cut short, not a lock record: no dflash leaves one behind while running). It is taken over, and
  `note` says so. Taking over is a compare-and-replace under an flock(2) of OUT/.dflash.lock.takeover
  (released by the kernel if its holder dies, removed after use): the record is read again and replaced by
  ours (an atomic rename of our temp file) only if it is still the stale one, so of several processes taking
  over one stale lock at once exactly one wins and the others are refused by the winner's record.
- A record from another host cannot be checked for liveness: it is refused like a live one; the
  message names the host and pid and the file to delete if that process is known to be gone.
- fsspec URLs (object stores): there is no atomic exclusive create. The lock there is best effort:
  write the record if there is none, read it back after a short pause, and go on only if it is still
  ours. Two writers starting within that pause can both pass; a writer started later is refused.
- Ranks of one torchrun job are one writer: rank 0 takes the lock (callers do that) and releases it.
  The record carries the job id, so a rank-0 restart of the same job (torchrun --max-restarts) takes
  over its own job's record instead of refusing itself.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
import uuid
from typing import Any

from .format import CacheError
from .store import Store

LOCK_NAME = ".dflash.lock"


class LockedError(CacheError):
    """Another live process holds the output's lock."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_start_time(pid: int) -> float | None:
    """Wall-clock start time of a local process (Linux /proc), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def job_id() -> str | None:
    return os.environ.get("TORCHELASTIC_RUN_ID")


class OutputLock:
    """The exclusive lock of one output (see the module docstring). Not reentrant; release() is idempotent."""

    def __init__(self, path: str, command: str | None = None):
        self.store = Store(path)
        self.path = str(path)
        self.command = command or " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))
        self.record: dict[str, Any] = {}
        self.note = ""
        self.held = False

    @property
    def where(self) -> str:
        return os.path.join(self.store.root, LOCK_NAME) if self.store.local else f"{self.store.root}/{LOCK_NAME}"

    def _new_record(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "command": self.command,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "started_unix": time.time()}

    def _refuse(self, rec: dict[str, Any]) -> LockedError:
        return LockedError(
            f"{self.path} is in use by another dflash process: pid {rec.get('pid')} on host {rec.get('host')} "
            f"(since {rec.get('started')}: {rec.get('command')}); wait for it to finish, or, if that process is gone "
            f"(e.g. another machine crashed), delete {self.where}")

    def _stale(self, rec: dict[str, Any] | None, raw: bytes = b"") -> str | None:
        """Why `rec` (parsed from `raw`) is stale (so we may take it over), or None when it may be live."""
        if rec is None:
            return f"an unreadable lock record ({unreadable(raw)})"
        if rec.get("job") and rec.get("job") == job_id():
            return f"a lock of this same torchrun job (pid {rec.get('pid')})"
        if rec.get("host") != socket.gethostname():
            return None
        pid = rec["pid"]
        if pid == os.getpid():
            return None  # ourselves, through another OutputLock: refuse (not reentrant)
        if pid <= 0 or not _pid_alive(pid):
            return f"the stale lock of pid {pid} on {rec.get('host')}, which no longer runs"
        started = _pid_start_time(pid)
        written = rec.get("started_unix")
        written = float(written) if isinstance(written, (int, float)) else 0.0
        if started is not None and started > written + 2:
            return f"the stale lock of pid {pid} on {rec.get('host')} (that pid now belongs to a newer process)"
        return None

    def acquire(self) -> "OutputLock":
        if self.store.local and os.path.isdir(self.where) and not os.path.islink(self.where):
            raise CacheError(f"{self.where} is a directory, not a lock record (dflash never makes one): move it away")
        for _ in range(5):
            rec = self._new_record()
            if self._try_create(rec):
                self.record, self.held = rec, True
                return self
            raw = self.store.get(LOCK_NAME)
            if raw is None:  # released between our attempt and the read: try again
                continue
            old = parse_record(raw)
            why = self._stale(old, raw)
            if why is None:
                raise self._refuse(old)
            if self._take_over(raw, rec):
                self.record, self.held = rec, True
                self.note = f"note: took over {why} on {self.path}"
                return self
            # another process took it over first (or it changed hands): look again
        raise LockedError(f"{self.path}: could not take the lock {self.where} (it keeps changing hands)")

    def _read(self) -> dict[str, Any] | None:
        raw = self.store.get(LOCK_NAME)
        return None if raw is None else parse_record(raw)

    def _temp_record(self, rec: dict[str, Any]) -> str:
        """A complete copy of `rec` in a temp file of our own next to the lock (a failed write leaves nothing)."""
        tmp = f"{self.where}.{uuid.uuid4().hex}.tmp"
        try:
            os.makedirs(self.store.root, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(json.dumps(rec, indent=1).encode())
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            full = " (disk full)" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
            raise CacheError(f"cannot create the lock {self.where}: {e.strerror or e}{full}") from e
        return tmp

    def _try_create(self, rec: dict[str, Any]) -> bool:
        if self.store.local:
            tmp = self._temp_record(rec)
            try:
                os.link(tmp, self.where)  # exclusive and atomic: the lock appears complete, or not at all
                return True
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
                    raise CacheError(f"cannot create the lock {self.where}: {e.strerror or e}") from e
                return self._create_exclusive(tmp)  # a filesystem without hard links
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        if self.store.get(LOCK_NAME) is not None:  # object stores: no exclusive create (see the docstring)
            return False
        self.store.put(LOCK_NAME, json.dumps(rec, indent=1).encode())
        time.sleep(0.5)
        back = self._read()
        return back is not None and back.get("pid") == rec["pid"] and back.get("host") == rec["host"] \
            and back.get("started_unix") == rec["started_unix"]

    def _create_exclusive(self, tmp: str) -> bool:
        with open(tmp, "rb") as f:
            data = f.read()
        try:
            fd = os.open(self.where, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise CacheError(f"cannot create the lock {self.where}: {e.strerror or e}") from e
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except OSError as e:
            os.unlink(self.where)  # ours: created above
            raise CacheError(f"cannot create the lock {self.where}: {e.strerror or e}") from e
        return True

    def _take_over(self, stale: bytes, rec: dict[str, Any]) -> bool:
        """Replace the lock, if its bytes are still `stale`, by `rec`; True when we did (we hold the lock)."""
        if not self.store.local:  # best effort, as creation there
            self._delete_remote()
            return self._try_create(rec)
        tmp = self._temp_record(rec)
        try:
            with self._takeover_mutex():
                if self.store.get(LOCK_NAME) != stale:
                    return False
                os.replace(tmp, self.where)
                return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @contextlib.contextmanager
    def _takeover_mutex(self):
        """flock(2) of OUT/.dflash.lock.takeover: one taker at a time. The file is removed after use; a process
        that locked a file removed meanwhile notices (it is no longer the one at that path) and locks again."""
        import fcntl

        path = f"{self.where}.takeover"
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            except OSError as e:
                raise CacheError(f"cannot take over the stale lock {self.where}: {e.strerror or e}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                os.close(fd)
                raise CacheError(f"cannot take over the stale lock {self.where}: this filesystem has no file locks "
                                 f"({e.strerror or e}); if its process is gone, delete it yourself") from e
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)

    def _delete_remote(self) -> None:
        self.store._sync(self.store._zstore.delete(LOCK_NAME))

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        cur = self._read()
        if cur is not None and cur.get("pid") == self.record["pid"] and cur.get("started_unix") == self.record["started_unix"]:
            if self.store.local:
                try:
                    os.unlink(self.where)
                except FileNotFoundError:
                    pass
            else:
                self._delete_remote()

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """Who holds the lock of `path`: (its record, or None when nobody does; why that holder is gone, or None when it
    may still run: a live process of this host, or one of another host, which cannot be checked from here). A
    reader of a growing output (`dflash train --follow` on a cache being extracted) asks this to tell a writer that
    is still at work from one that died."""
    probe = OutputLock(path, "probe")
    raw = probe.store.get(LOCK_NAME)
    rec = None if raw is None else parse_record(raw)
    return rec, (probe._stale(rec, raw) if rec is not None else None)


def unreadable(raw: bytes) -> str:
    """What a lock record that parse_record refuses is, in words (for the note that takes it over)."""
    if not raw.strip():
        return "empty: left by a process that died writing it, or by a full disk"
    try:
        rec = json.loads(raw)
    except UnicodeDecodeError:
        return "not UTF-8 text: not written by dflash"
    except ValueError:
        return "not JSON: cut short by a process that died writing it, or not written by dflash"
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not a lock record"
    if not isinstance(rec.get("host"), str):
        return f"a record whose host is {rec.get('host')!r}, not a host name"
    return f"a record whose pid is {rec.get('pid')!r}, not a process id"


def parse_record(raw: bytes) -> dict[str, Any] | None:
    """The lock record in `raw`, or None when it is not one (empty, cut short, garbage: stale by definition)."""
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("host"), str) or type(rec.get("pid")) is not int:
        return None
    return rec
