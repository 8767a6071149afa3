"""Paths given on the command line, checked before any work starts (errors name the flag).

An output file such as --json is written after a job that may take days: a directory in its place, or a
parent directory that does not exist, must fail in the first second, not at the end. fsspec URLs
(`s3://...`) are not checked here beyond their form (their stores say what is wrong when they are written).

The forms a path flag takes (path_form, applied by every command to every path flag before anything else): a plain
path; a `file://` URL, which is the local path it names (`file:///abs/run` is /abs/run, for every flag); and, only
for the flags of a cache (extract --out and --basis-from, train --cache and --val-cache, pipeline --cache, `cache info` and `cache
verify` PATH: each command names them to path_forms), another fsspec URL whose protocol fsspec knows and can open
here. A cache written to a
store that lives only in this process's memory (EPHEMERAL: `memory://`) is refused: it would be gone when the
command exits. Any other form is a ConfigError naming the flag.

What is checked (each a ConfigError naming the flag and the path):
- an input (check_input_path: --target, --data, --cache, --drafter, --chat-template): it exists (a dangling
  symlink is named as one), is a file or a directory as the flag needs, and can be read;
- an output directory (check_output_dir: --out, --tokenize-cache, --workdir): not a file, not a dangling symlink,
  and writable, or creatable: its nearest existing ancestor is a writable directory (a read-only filesystem
  or a directory without write permission fails here, not at the first write);
- an output file (check_output_file: --json, --plot): not a directory, in a writable directory that exists.
"""

from __future__ import annotations

import os

from dflash.core.config_error import ConfigError, flag
from dflash_cache.lock import OutputLock


LOCAL_PROTOCOLS = ("file", "local")  # fsspec's names of this machine's filesystem
EPHEMERAL = ("memory",)  # fsspec stores whose files live in this process only


def is_url(path: str) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


def url_protocol(path: str) -> str | None:
    """The protocol of a URL (`s3` of s3://bucket/x), None for a plain path."""
    head, sep, _ = str(path).partition("://")
    return head.lower() if sep and head and "/" not in head else None


def path_form(path: str | None, name: str, url: str | None = None) -> str | None:
    """The path a flag's value names (module docstring): a plain path as given, a `file://` URL as its local path,
    and an fsspec URL where `url` allows one ("read": a cache read; "write": a cache written, which must outlive the
    process). `name` is the flag's field (`val_cache`) or an argument's metavar (`PATH`). ConfigError otherwise."""
    if not path:
        return path
    path = str(path)
    protocol = url_protocol(path)
    if protocol is None:
        return path
    who = name if name.isupper() else flag(FLAG_OF.get(name, name))
    if protocol in LOCAL_PROTOCOLS:
        local = path.split("://", 1)[1]
        if local.startswith("localhost/"):
            local = local[len("localhost"):]
        if not local:
            raise ConfigError(f"{who} {path} names no path")
        return local
    if url is None:
        raise ConfigError(f"{who} {path}: this flag takes a local path or a file:// URL ({protocol}:// is read and "
                          "written only by the flags of a cache)")
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ConfigError(f"{who} {path}: unknown URL protocol {protocol}:// (fsspec knows none of that name)") from None
    except ImportError as e:
        raise ConfigError(f"{who} {path}: {protocol}:// URLs cannot be opened here ({e})") from None
    if url == "write" and protocol in EPHEMERAL:
        raise ConfigError(f"{who} {path}: a {protocol}:// store lives only in this process's memory and would be gone "
                          "when the command exits; give a directory or a lasting URL (s3://, gs://, ...)")
    return path


# the path fields of the commands' configs; what each command's cache fields take (path_form's `url`)
PATH_FIELDS = ("target", "data", "out", "cache", "val_cache", "drafter", "chat_template", "tokenize_cache",
               "compile_cache", "json_out", "plot", "workdir", "basis_from")
FLAG_OF = {"json_out": "json"}  # fields whose flag has another name
SETTING_WORDS = ("off",)  # a path field's words that are not paths (--tokenize-cache off, --compile-cache off)


def path_forms(values: dict, urls: dict[str, str] | None = None) -> dict:
    """values with every path field (PATH_FIELDS) in its path_form; `urls`: field -> "read" / "write" for the
    fields that may be fsspec URLs. A chat template given as its text (it holds Jinja braces) is not a path."""
    out = dict(values)
    for name in PATH_FIELDS:
        value = out.get(name)
        if not isinstance(value, str) or value in SETTING_WORDS or (name == "chat_template" and "{" in value):
            continue
        out[name] = path_form(value, name, (urls or {}).get(name))
    return out


def in_path_forms(cfg, urls: dict[str, str] | None = None):
    """A command's config dataclass with its path fields in their path_form (set in place; returned)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cfg)}
    for name, value in path_forms({n: getattr(cfg, n) for n in PATH_FIELDS if n in names}, urls).items():
        setattr(cfg, name, value)
    return cfg


def check_output_file(path: str | None, name: str) -> None:
    """A file that will be written later (--json, --plot): not a directory, in a directory that exists."""
    if not path or is_url(path):
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag(name)} {path} is a directory; give a file name such as "
                          f"{os.path.join(path, 'summary.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag(name)} {path}: directory {parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag(name)} {path}: directory {parent} is not writable ({_why_not_writable(parent)})")


def _dangling(path: str) -> bool:
    return os.path.islink(path) and not os.path.exists(path)


def _dangling_message(path: str, name: str) -> str:
    return f"{flag(name)} {path} is a dangling symlink (to {os.readlink(path)}, which does not exist)"


def check_input_file(path: str | None, name: str) -> None:
    """A file that must exist (--chat-template FILE)."""
    check_input_path(path, name, kind="file")


def check_input_path(path: str | None, name: str, kind: str = "any") -> None:
    """An input that must exist and be readable; kind "file" or "dir" when the flag takes only one of them. A glob
    (--data 'parts/*.jsonl') and a URL are left to the reader."""
    if not path or is_url(path) or any(c in str(path) for c in "*?["):
        return
    path = str(path)
    if _dangling(path):
        raise ConfigError(_dangling_message(path, name))
    if not os.path.exists(path):
        what = {"file": "file", "dir": "directory"}.get(kind, "file or directory")
        raise ConfigError(f"{flag(name)} {path}: no such {what}")
    is_dir = os.path.isdir(path)
    if kind == "file" and is_dir:
        raise ConfigError(f"{flag(name)} {path} is a directory, not a file")
    if kind == "dir" and not is_dir:
        raise ConfigError(f"{flag(name)} {path} is a file, not a directory")
    if not os.access(path, os.R_OK | (os.X_OK if is_dir else 0)):
        raise ConfigError(f"{flag(name)} {path}: permission denied (this user cannot read it)")


def check_cache_path(path: str | None, name: str) -> None:
    """A cache a command reads (--cache, --val-cache): a readable directory that looks like a dflash cache (its root
    zarr.json or its shards/). Whether it is a whole one is dflash_cache's to check (a damaged cache is named there)."""
    check_input_path(path, name, kind="dir")
    if path and not is_url(path) and not any(os.path.exists(os.path.join(path, n)) for n in ("zarr.json", "shards")):
        raise ConfigError(f"{flag(name)} {path} is not a dflash cache (no zarr.json in it): give a directory "
                          "written by `dflash extract --out`")


def check_output_dir(path: str | None, name: str, label: str | None = None) -> None:
    """A directory that will be created or reused (--out): not an existing file, not a dangling symlink, and
    writable (an existing one) or creatable (its nearest existing ancestor a writable directory). `label` names it
    in the messages when it does not come from the flag (an environment variable)."""
    if not path or is_url(path):
        return
    path, who = str(path), label or flag(name)
    if _dangling(path):
        raise ConfigError(f"{who} {path} is a dangling symlink (to {os.readlink(path)}, which does not exist)")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"{who} {path} is an existing file, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{who} {path} is not writable ({_why_not_writable(path)})")
        return
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if _dangling(ancestor):
        raise ConfigError(f"{who} {path}: {ancestor} is a dangling symlink (to {os.readlink(ancestor)})")
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{who} {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{who} {path}: cannot create it, {ancestor} is not writable "
                          f"({_why_not_writable(ancestor)})")


def _why_not_writable(path: str) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "a read-only filesystem"
    except OSError:
        pass
    return "no write permission for this user"


def real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def inside(path: str, root: str) -> bool:
    """True when `path` is `root` or lies under it (real paths: symlinks resolved)."""
    p, r = real(path), real(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


class output_lock:
    """`with output_lock(out, "extract", is_main, precheck):` the exclusive lock of an output (dflash_cache.lock)
    held by rank 0 of a job for the whole command; other ranks of the same job hold nothing (one writer).
    precheck(out) runs first (before anything is created in `out`): it refuses what must not be written into.
    An --out that the lock created and that is still empty at the end (a run that failed early) is removed."""

    def __init__(self, out: str, command: str, is_main: bool = True, precheck=None):
        self.out, self.command, self.is_main, self.precheck = out, command, is_main, precheck
        self.lock = None

    def __enter__(self):
        if not self.is_main:
            return None

        if self.precheck is not None:
            self.precheck(self.out)
        self.created = not is_url(self.out) and not os.path.exists(self.out)
        self.lock = OutputLock(self.out, f"dflash {self.command}").acquire()
        if self.lock.note:
            print(self.lock.note, flush=True)
        return self.lock

    def __exit__(self, *exc):
        if self.lock is not None:
            self.lock.release()
            if self.created:  # a run that failed before writing anything leaves no empty --out behind
                try:
                    os.rmdir(self.out)
                except OSError:
                    pass


def check_apart(out: str, out_flag: str = "out", **inputs: str | None) -> None:
    """No input (--data, --target, --cache) may be --out or lie inside it: writing, resuming or --overwrite there
    would change or delete what the command reads. Nor may --out lie inside an input directory: the output's own
    files would be read as input by every later run (a cache or regenerated parts inside --data)."""
    if not out or is_url(out):
        return
    for name, path in inputs.items():
        if not path or is_url(path) or not os.path.exists(path):
            continue
        if inside(path, out):
            raise ConfigError(f"{flag(out_flag)} {out} {'is' if real(path) == real(out) else 'contains'} {flag(name)} "
                              f"{path}; an output must be apart from what the command reads: choose another "
                              f"{flag(out_flag)}")
        if os.path.isdir(path) and inside(out, path):
            raise ConfigError(f"{flag(out_flag)} {out} lies inside {flag(name)} {path}; its files would be read with "
                              f"{flag(name)} by every later run: choose a {flag(out_flag)} outside it")


def check_run_apart_from_cache(out: str, cache: str) -> None:
    """A run directory (--out) is never its cache, inside it, nor holding it (train refuses it too, but `dflash
    pipeline` must refuse it before its extraction starts); neither needs to exist yet."""
    if not out or not cache or is_url(cache):
        return
    if inside(cache, out) or inside(out, cache):
        how = "is" if real(cache) == real(out) else "contains" if inside(cache, out) else "lies inside"
        raise ConfigError(f"--out {out} {how} --cache {cache}; a run directory must be apart from its cache: choose "
                          "another --out")
