"""How `dflash export` writes its --out directory: whole or not at all, under OUT's lock, never touching what it did
not write.

    with export_dir(out) as stage:      # OUT locked (OUT/.dflash.lock, dflash_cache.lock), a new staging directory
        write files into stage          # beside OUT; a failed write (a full disk) removes the stage: OUT unchanged
    # on success the stage has taken OUT's place; the export OUT held before is removed

Contract:
  * OUT must be new, empty, or an earlier dflash export (its config.json carries `dflash_trained`); anything else
    is refused before a byte is written (`precheck`).
  * One writer per OUT: the lock is the project's output lock, taken on OUT itself; a second export to the same
    OUT while one runs is one error line naming the holder (LockedError).
  * The files are written into a staging directory of a name no one else holds (`.OUT.export-XXXX` beside OUT,
    made by mkdtemp), then swapped in: OUT is renamed to another such name and the stage to OUT. The lock record
    is linked into the stage first, so OUT is locked throughout. `OUT.tmp` or any other path of the user's is
    never created, read or deleted.
  * A write that fails (OSError: a full disk, a quota, permissions) is an ExportError naming --out and the
    reason; the stage is removed and OUT is as it was (an OUT that the lock created is removed again).
  * Modes: each file and OUT itself get the mode the umask gives a new file or directory (0644 / 0755 under the
    usual 022, 0600 / 0700 under 077): safetensors' own 0600 is not kept, the umask decides.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile

from dflash.core.errors import DflashError
from dflash.core.io import shared_mode
from dflash.core.paths import output_lock
from dflash_cache.lock import LOCK_NAME

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class ExportError(DflashError, ValueError):
    """An export that cannot be written as asked (one `error:` line naming the flag or file)."""


def own_entry(name: str) -> bool:
    """An entry the output lock puts in OUT (its record, its takeover mutex, a record being written)."""
    return name.startswith(LOCK_NAME)


def write_error(out: str, e: OSError) -> ExportError:
    full = " (disk full)" if e.errno in FULL else ""
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return ExportError(f"--out {out}: the export could not be written: {e.strerror or e}{full}{where}; nothing was "
                       "changed")


@contextlib.contextmanager
def export_dir(out: str, precheck):
    """The staging directory to write an export into (module docstring); `precheck(out)` refuses an OUT that must
    not be written, before the lock is taken."""
    parent = os.path.dirname(os.path.abspath(out))
    base = os.path.basename(os.path.abspath(out))
    with output_lock(out, "export", precheck=precheck) as lock:
        try:
            stage = tempfile.mkdtemp(prefix=f".{base}.export-", dir=parent)
        except OSError as e:
            raise write_error(out, e) from None
        old = None
        try:
            yield stage
            for name in os.listdir(stage):
                shared_mode(os.path.join(stage, name))
            shared_mode(stage)
            os.link(lock.where, os.path.join(stage, LOCK_NAME))  # OUT stays locked through the swap
            old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rename(out, old)  # onto an empty directory of our own: replaced
            try:
                os.rename(stage, out)
            except OSError:
                with contextlib.suppress(OSError):
                    os.rename(old, out)  # OUT back as it was
                    old = None
                raise
        except OSError as e:
            raise write_error(out, e) from None
        finally:
            for d in (stage, old):
                if d is not None and os.path.isdir(d):
                    shutil.rmtree(d, ignore_errors=True)
