"""The run directory and its checkpoints: what --out may be, run.json, metrics.jsonl on resume, step_N/ and latest.

A run directory holds run.json (its marker, settings, the identity of the caches it trains on and, once decided,
--time-budget's steps: train/fit/time_budget.py; a resume keeps that record),
metrics.jsonl, summary.json, checkpoints/step_N (config.json, model.safetensors, optimizer.pt, trainer.json and,
written last, manifest.json; all under a temporary name, then renamed) with `latest` naming the newest, and
final/. Nothing else in it is ever removed; a failed write names its file and the last good checkpoint, which
stays intact.

What a resume checks (rank 0, before anything is loaded; check_run_dir):
  * the settings that define the run (train/fit/config.py IDENTITY) and the identity of --cache and --val-cache:
    the root attributes that define a cache's content (data, tokenizer, chat-template and weights fingerprints,
    extraction settings, rows; cache_identity). Another cache at the same path (re-extracted from other data,
    another target or settings) is refused in one line naming the field, the run and the cache; --overwrite
    starts over. Cheap: one more read of each cache's root zarr.json.
  * the checkpoint it starts from: the newest intact one (resume_checkpoint). Intact = every file has the size
    and sha256 tree digest its manifest.json recorded (dflash.core.io.check_files: sizes first, then one
    streamed read hashed in parallel threads, which leaves the files in the page cache for the load that
    follows); a checkpoint from before manifests must have its files whole (trainer.json parses, the
    safetensors header covers the file, optimizer.pt's zip directory reads). A damaged newer checkpoint is
    moved aside (checkpoints/damaged-step_N, never deleted) and `latest` names the one resumed from, with one
    note; none intact is one error line. What is loaded is the checkpoint as written: resume stays exact.
  * metrics.jsonl: records after the checkpoint are dropped (they are redone); a line that is not a whole
    record (a write cut short by a full disk) is dropped with a note.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch

from dflash.core.dist import atomic_json, print0
from dflash.core.io import atomic_write, check_files, file_record
from dflash.core.paths import check_output_dir, inside, is_url
from dflash.train.drafter.checkpoint import save_drafter
from dflash.train.fit.config import IDENTITY, IDENTITY_DEFAULTS, TrainConfig, TrainError
from dflash.train.drafter.model import DFlashDrafter
from dflash_cache.format import flatten, read_root
from dflash_cache.lock import LOCK_NAME
from dflash_cache.store import Store


# What a run directory holds: RUN/run.json ({"dflash": "train", ...}) marks it as dflash's; --overwrite removes
# exactly these entries of such a directory (and never a directory without the marker).
RUN_MARKER = "run.json"
RUN_ENTRIES = ("run.json", "metrics.jsonl", "summary.json", "checkpoints", "final", "final.tmp", "wandb", "compile")


def run_marker(out: str) -> dict | None:
    """RUN/run.json when it is a dflash train record, else None."""
    try:
        with open(os.path.join(out, RUN_MARKER)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(doc, dict) and doc.get("dflash") == "train" and isinstance(doc.get("config", {}), dict)
    return doc if ok else None


def _describe_dir(out: str, entries: list[str]) -> str:
    if "zarr.json" in entries:
        return "a zarr store (a dflash cache?)"
    head = ", ".join(sorted(entries)[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    return f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'} not written by dflash train: {head}"


def check_out_path(cfg: TrainConfig) -> None:
    """Before anything is written: --out may be a new or empty directory or a dflash train run directory, never
    a file, a user's folder, a cache, nor anything holding or inside the cache this run reads."""
    check_output_dir(cfg.out, "out")
    if not is_url(cfg.cache) and (inside(cfg.cache, cfg.out) or inside(cfg.out, cfg.cache)):
        how = "is" if os.path.realpath(cfg.cache) == os.path.realpath(cfg.out) else (
            "contains" if inside(cfg.cache, cfg.out) else "lies inside")
        raise TrainError(f"--out {cfg.out} {how} the cache this run reads (--cache {cfg.cache}); "
                         "a run directory must be apart from its cache: choose another --out")
    if not os.path.isdir(cfg.out):
        return
    for name in ("checkpoints", "final"):
        if os.path.lexists(os.path.join(cfg.out, name)) and not os.path.isdir(os.path.join(cfg.out, name)):
            raise TrainError(f"--out {cfg.out}: {name} is not a directory (a damaged run directory); choose another "
                             "--out, or delete it to start over")
    for name in ("run.json", "metrics.jsonl", "summary.json"):  # files dflash writes: a directory there is not its own
        if os.path.isdir(os.path.join(cfg.out, name)):
            raise TrainError(f"--out {cfg.out}: {name} is a directory, not the file dflash train writes (a damaged run "
                             "directory); move it away, or choose another --out")
    entries = [n for n in os.listdir(cfg.out) if not n.startswith(LOCK_NAME)]
    if entries and run_marker(cfg.out) is None and set(entries) <= set(RUN_ENTRIES):
        state = "damaged (not a dflash train record)" if RUN_MARKER in entries else "missing"
        raise TrainError(f"--out {cfg.out} holds what dflash train writes, but its {RUN_MARKER} is {state}: the run "
                         "cannot be checked or resumed; choose another --out, or delete the directory to start over")
    if entries and run_marker(cfg.out) is None:
        raise TrainError(f"--out {cfg.out} is not a dflash run directory (it holds {_describe_dir(cfg.out, entries)}); "
                         "choose another --out (--overwrite only replaces a dflash train run directory, one with run.json)")


def _remove_run(out: str) -> None:
    """Remove what dflash train wrote in RUN (RUN_ENTRIES), nothing else (not the lock, not a user's file)."""
    for name in RUN_ENTRIES:
        p = os.path.join(out, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)


# Root attributes of a cache that do not define its content: the record of the run that wrote it (volatile),
# where its inputs lay (their content is fingerprinted), how its bytes are compressed and chunked, and the
# per-tensor weights digests (their combined digest stays). Prefixes of flattened keys.
NOT_IDENTITY = ("info.run.", "info.target.name_or_path", "info.data.path", "codec", "hidden_chunk_tokens",
                "info.weights.tensors.", "info.weights.roles.")
# compared first, so that a refusal names what changed rather than what follows from it
IDENTITY_FIRST = ("info.data_fingerprint", "info.weights.digest", "info.target.config_hash",
                  "info.tokenizer_fingerprint", "info.chat_template_fingerprint", "num_rows")


def cache_identity(metadata: dict) -> dict[str, Any]:
    """What defines a cache's content, from its root attributes (flattened keys -> values; NOT_IDENTITY left out)."""
    flat = flatten(json.loads(json.dumps(metadata, default=str)))
    return {k: v for k, v in sorted(flat.items()) if not k.startswith(NOT_IDENTITY)}


def _cache_record(caches: dict[str, dict | None] | None, cfg: TrainConfig) -> dict[str, dict]:
    """{flag: {"path", "identity"}} of --cache and --val-cache; their root metadata read here unless given."""
    paths = {flag: str(p) for flag, p in (("cache", cfg.cache), ("val_cache", cfg.val_cache)) if p}
    if caches is None:  # only the root zarr.json of each: what the trainer's open read already
        caches = {flag: read_root(Store(p)) for flag, p in paths.items()}
    return {flag: {"path": paths[flag] if "://" in paths[flag] else os.path.abspath(paths[flag]),
                   "identity": cache_identity(meta)}
            for flag, meta in caches.items() if meta is not None and flag in paths}


def _identity_diffs(a: dict, b: dict) -> list[str]:
    """The identity fields (cache_identity) in which a and b differ, IDENTITY_FIRST first."""
    keys = [k for k in IDENTITY_FIRST if k in a or k in b] + sorted(set(a) | set(b) - set(IDENTITY_FIRST))
    return [k for k in keys if a.get(k) != b.get(k)]


def _moved_cache(old_doc: dict, resolved: dict[str, Any], record: dict[str, dict], out: str) -> str | None:
    """When --cache is not the path RUN was trained on: None if the cache there now has the identity recorded for
    the one it was trained on (the same cache, moved or copied: a note says so), else why it cannot be resumed and
    how to go on."""
    was_path, now_path = (old_doc.get("config") or {}).get("cache"), resolved.get("cache")
    was = (old_doc.get("caches") or {}).get("cache") if isinstance(old_doc.get("caches"), dict) else None
    now = record.get("cache")
    if isinstance(was, dict) and isinstance(was.get("identity"), dict) and now is not None:
        diffs = _identity_diffs(was["identity"], now["identity"])
        if not diffs:
            print0(f"train: note: --cache {now_path} is not the path {out} was trained on ({was_path}), but it holds "
                   "the same cache (every identity field equal): resuming")
            return None
        why = (f"the cache at --cache {now_path} is another one (field '{diffs[0]}' was {was['identity'].get(diffs[0])!r}, "
               f"now {now['identity'].get(diffs[0])!r})")
    else:
        why = f"{out}/run.json records no identity of that cache to check --cache {now_path} against (an older dflash)"
    return (f"{out} was trained on the cache at {was_path}, and {why}: resuming would mix two datasets in one run; "
            f"give --cache {was_path} (move the cache back), another --out, or --overwrite to start over")


def _cache_problem(old_doc: dict, record: dict[str, dict], out: str) -> str | None:
    """Why this run's caches are not the ones RUN was trained on (None when they are, or cannot be told)."""
    old = old_doc.get("caches")
    if not isinstance(old, dict):
        return None
    for flag in ("cache", "val_cache"):
        was, now = old.get(flag), record.get(flag)
        if not isinstance(was, dict) or now is None or was.get("path") != now["path"]:
            continue  # not recorded, not used now, or (--val-cache) another held-out set chosen on purpose
        a, b = was.get("identity") or {}, now["identity"]
        diffs = _identity_diffs(a, b)
        if diffs:
            k = diffs[0]
            more = f" (also different: {', '.join(diffs[1:4])}{', ...' if len(diffs) > 4 else ''})" if diffs[1:] else ""
            return (f"--{flag.replace('_', '-')} {now['path']}: {out} was trained on another cache at this path "
                    f"(re-extracted or replaced since): field '{k}' was {a.get(k)!r}, now {b.get(k)!r}{more}; "
                    "resuming would mix two datasets in one run: use the cache it was trained on, another --out, "
                    "or --overwrite to start over")
    return None


def check_run_dir(cfg: TrainConfig, resolved: dict[str, Any], caches: dict[str, dict | None] | None = None) -> None:
    """RUN/run.json must describe the same run, trained on the same caches (`caches`: flag -> the root metadata of
    --cache / --val-cache, or None; read from their paths when not given): else an error, or start over with
    --overwrite. Then the checkpoint a resume starts from is settled (resume_checkpoint). Rank 0 only, before the
    other ranks look at RUN."""
    check_out_path(cfg)
    path = os.path.join(cfg.out, RUN_MARKER)
    old_doc = run_marker(cfg.out)
    record = _cache_record(caches, cfg)
    if cfg.overwrite and os.path.isdir(cfg.out):  # --overwrite starts over, whatever RUN holds (never resumes)
        _remove_run(cfg.out)
        old_doc = None
    if old_doc is not None:
        old = old_doc.get("config", {})
        problem = next((f"{cfg.out} holds a different run: setting '{k}' was {old.get(k)!r}, now "
                        f"{resolved.get(k)!r}; use another --out, or --overwrite to start over"
                        for k in IDENTITY if k != "cache"
                        and json.dumps(old.get(k, IDENTITY_DEFAULTS.get(k))) != json.dumps(resolved.get(k))),
                       None)
        if not problem and json.dumps(old.get("cache")) != json.dumps(resolved.get("cache")):
            problem = _moved_cache(old_doc, resolved, record, cfg.out)
        problem = problem or _cache_problem(old_doc, record, cfg.out)
        if problem:
            raise TrainError(problem)
        if "caches" not in old_doc and record and os.path.isdir(os.path.join(cfg.out, "checkpoints")):
            print0(f"train: note: {cfg.out}/run.json records no identity of its cache (written by an older dflash): "
                   "cannot check that --cache holds the data the run was trained on")
        past = _step_past_total(resume_checkpoint(cfg.out), resolved, cfg)
        if past:
            raise TrainError(past)
    os.makedirs(os.path.join(cfg.out, "checkpoints"), exist_ok=True)
    kept = {k: old_doc[k] for k in ("time_budget",) if old_doc is not None and k in old_doc}  # train/fit/time_budget.py
    atomic_json(path, {"config": resolved, "dflash": "train", "caches": record, **kept})


def _step_past_total(ck: str | None, resolved: dict[str, Any], cfg: TrainConfig) -> str | None:
    """Why a resume from checkpoint `ck` cannot give the run asked for: it is already past the total steps
    (--max-steps 6 on a run at step 20 would leave final/ the 20-step drafter and run.json saying 6)."""
    total = resolved.get("total_steps")
    if ck is None or cfg.time_budget_s is not None or not isinstance(total, int):
        return None  # --time-budget's total is the record's (train/fit/time_budget.py)
    try:
        with open(os.path.join(ck, "trainer.json")) as f:
            step = int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if step <= total:
        return None
    asked = f"--max-steps {cfg.max_steps}" if cfg.max_steps else f"--epochs {cfg.epochs or 1} ({total} steps)"
    return (f"{cfg.out} is at step {step}, past the {total} steps of {asked}: a resume cannot go back; give at least "
            f"{step} steps to resume, or --overwrite to start over with {total}")


# ------------------------------------------------------------------------------------------------ checkpoints

class NoIntactCheckpoint(TrainError):
    """Every checkpoint of a run directory is damaged: nothing to resume from."""


MANIFEST = "manifest.json"  # written last in a step directory: the size and digest of each of its files
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "trainer.json")
STEP_DIR = re.compile(r"^step_(\d+)$")
DAMAGED = "damaged-"  # prefix of a damaged checkpoint moved aside (kept for inspection, never deleted)


def read_latest(ck: str) -> tuple[str | None, str | None]:
    """(the step directory name CK/latest holds, None) or (None, what is wrong with it): missing, empty, not UTF-8,
    not a step directory's name, or not a file. A damaged pointer is never an error: the newest intact checkpoint
    is found without it."""
    p = os.path.join(ck, "latest")
    try:
        with open(p, "rb") as f:
            raw = f.read(256)
    except FileNotFoundError:
        return None, "checkpoints/latest is missing"
    except OSError as e:
        return None, f"checkpoints/latest cannot be read ({e.strerror or e})"
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, "checkpoints/latest is damaged (not UTF-8 text)"
    if not STEP_DIR.match(name):
        return None, f"checkpoints/latest is damaged ({'empty' if not name else f'{name[:40]!r} names no step'})"
    return name, None


def latest_checkpoint(out: str) -> str | None:
    """The checkpoint `latest` names, if its trainer.json exists (no check of its bytes: resume_checkpoint)."""
    name, _ = read_latest(os.path.join(out, "checkpoints"))
    if name is None:
        return None
    full = os.path.join(out, "checkpoints", name)
    return full if os.path.exists(os.path.join(full, "trainer.json")) else None


def checkpoint_problem(ck: str) -> str | None:
    """None when the checkpoint directory `ck` is intact (module docstring), else what is wrong, naming the file."""
    manifest = os.path.join(ck, MANIFEST)
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError, TypeError):
            files = None
        if not isinstance(files, dict) or not set(CHECKPOINT_FILES) <= set(files):
            return f"{MANIFEST}: not a readable manifest"
        return check_files(files, {name: os.path.join(ck, name) for name in files})
    for name in CHECKPOINT_FILES:  # written before manifests: the files must at least be whole
        if not os.path.isfile(os.path.join(ck, name)):
            return f"{name}: missing"
    try:
        with open(os.path.join(ck, "trainer.json")) as f:
            int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return "trainer.json: not a readable record"
    try:
        from safetensors import safe_open

        with safe_open(os.path.join(ck, "model.safetensors"), framework="pt"):
            pass
    except Exception as e:  # noqa: BLE001 - any failure to open is a damaged file
        return f"model.safetensors: {e}"
    import zipfile

    try:
        with zipfile.ZipFile(os.path.join(ck, "optimizer.pt")) as z:
            z.namelist()
    except (OSError, zipfile.BadZipFile) as e:
        return f"optimizer.pt: {e}"
    return None


def resume_checkpoint(out: str) -> str | None:
    """Settle the checkpoint a resume starts from: the newest intact step_N of RUN/checkpoints. Damaged newer ones
    are moved aside (checkpoints/damaged-step_N) and `latest` is pointed at the one chosen, with one note when that
    is not what `latest` named; returns its path (None: no checkpoint, the run starts at step 0). No intact one
    among several is a TrainError naming each and what is wrong with it."""
    ck = os.path.join(out, "checkpoints")
    if not os.path.isdir(ck):
        return None
    steps = sorted((d for d in os.listdir(ck) if STEP_DIR.match(d) and os.path.isdir(os.path.join(ck, d))),
                   key=lambda d: int(STEP_DIR.match(d).group(1)), reverse=True)
    named, pointer_problem = read_latest(ck)
    if not steps:
        if named:
            print0(f"train: note: {ck}/latest names {named}, which is missing, and no other checkpoint exists: "
                   "starting from step 0")
        return None
    chosen, damaged = None, []
    for d in steps:
        problem = checkpoint_problem(os.path.join(ck, d))
        if problem is None:
            chosen = d
            break
        damaged.append((d, problem))
    if chosen is None:
        found = "; ".join(f"{d}: {p}" for d, p in damaged)
        raise NoIntactCheckpoint(f"{out}: no intact checkpoint to resume from ({found}): restore one, or pass "
                                 "--overwrite to start over")
    for d, _ in damaged:
        aside = os.path.join(ck, DAMAGED + d)
        shutil.rmtree(aside, ignore_errors=True)  # an older copy set aside under the same name
        os.replace(os.path.join(ck, d), aside)
    if damaged:
        what = "; ".join(f"{d} is damaged ({p})" for d, p in damaged)
        print0(f"train: note: {what}: kept aside as {', '.join(DAMAGED + d for d, _ in damaged)}; resuming from "
               f"{chosen}, the newest intact checkpoint")
    elif named != chosen:
        why = (pointer_problem if named is None
               else f"checkpoints/latest names {named}, which is missing" if not os.path.isdir(os.path.join(ck, named))
               else f"checkpoints/latest names {named}, but a newer one is intact (the run stopped before updating it)")
        print0(f"train: note: {why}; resuming from {chosen}, the newest intact checkpoint")
    if named != chosen:
        if os.path.isdir(os.path.join(ck, "latest")) and not os.path.islink(os.path.join(ck, "latest")):
            os.replace(os.path.join(ck, "latest"), os.path.join(ck, DAMAGED + "latest"))  # kept, never deleted
        atomic_write(os.path.join(ck, "latest"), chosen)
    return os.path.join(ck, chosen)


def finished_run(out: str, step: int, total_steps: int) -> dict[str, Any] | None:
    """The summary of a run that already finished its total_steps (restored at step == total_steps, with
    summary.json of that step and final/), with steps_this_run 0; else None. A rerun then changes nothing."""
    path = os.path.join(out, "summary.json")
    if step < total_steps or not (os.path.exists(path) and os.path.isdir(os.path.join(out, "final"))):
        return None
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None  # damaged: the rerun writes final/ and summary.json again
    return dict(summary, steps_this_run=0) if isinstance(summary, dict) and summary.get("steps") == step else None


def _metric_lines(path: str) -> tuple[list[tuple[str, dict]], list[int]]:
    """([(line, record)], [numbers of the lines that are not a whole record]) of a metrics.jsonl: a write cut
    short (disk full) leaves a partial last line, which a later append may have run into."""
    good, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, ln in enumerate(f, 1):
            if not ln.strip():
                continue
            try:
                rec = json.loads(ln)
                ok = isinstance(rec, dict) and isinstance(rec.get("step"), int)
            except ValueError:
                ok = False
            if ok:
                good.append((ln if ln.endswith("\n") else ln + "\n", rec))
            else:
                bad.append(i)
    return good, bad


def read_metrics(out: str) -> list[dict]:
    """The whole records of RUN/metrics.jsonl in order ([] before the first one is logged)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [rec for _, rec in _metric_lines(path)[0]]


def drop_metrics_after(out: str, step: int) -> None:
    """Remove the records of steps > step from RUN/metrics.jsonl (they are about to be redone), and lines that are
    not a whole record (with a note)."""
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        good, bad = _metric_lines(metrics)
        if bad:
            lines = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            print0(f"train: note: {metrics}: line{'s' if len(bad) > 1 else ''} {lines} not a whole record (a write "
                   "cut short, e.g. by a full disk): dropped")
        atomic_write(metrics, "".join(ln for ln, rec in good if rec["step"] <= step))


class DiskWriteError(TrainError):
    """A checkpoint file that could not be written (disk full, quota, file too large, I/O error)."""


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: itself, its cause/context (torch.save wraps it in a RuntimeError), or the
    `os error N` that safetensors puts in its message."""
    import re

    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, OSError):
            return e
        m = re.search(r"os error (\d+)", str(e))
        if m:
            n = int(m.group(1))
            return OSError(n, os.strerror(n))
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


class writing:
    """`with writing(file, last_good, cleanup):` turns an I/O failure while writing `file` into one DiskWriteError
    naming it and the last good checkpoint (which is left intact); `cleanup` (a partial directory) is removed."""

    def __init__(self, file: str, last_good: str | None, cleanup: str | None = None):
        self.file, self.last_good, self.cleanup = file, last_good, cleanup

    def __enter__(self):
        return self

    def __exit__(self, typ, e, tb):
        if e is None:
            return False
        err = _os_error(e)
        if err is None:
            return False  # not an I/O failure: the traceback is shown
        if self.cleanup:
            shutil.rmtree(self.cleanup, ignore_errors=True)
        import errno

        what = {errno.ENOSPC: "disk full", errno.EFBIG: "file too large for the filesystem or limit",
                errno.EDQUOT: "disk quota exceeded"}.get(err.errno, err.strerror or str(err))
        raise DiskWriteError(f"cannot write {self.file}: {what} (errno {err.errno}); the last good checkpoint "
                             f"{self.last_good or '(none yet)'} is intact: free space and rerun the same command to resume")


def save_checkpoint(out: str, step: int, model: DFlashDrafter, opt: torch.optim.Optimizer, state: dict, keep: int) -> str:
    """RUN/checkpoints/step_N (written under a temporary name, then renamed), then `latest` points to it.
    A failed write (disk full, ...) is a DiskWriteError naming the file; the previous checkpoint stays intact."""
    ck = os.path.join(out, "checkpoints")
    name = f"step_{step:08d}"
    tmp = os.path.join(ck, name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    last_good = latest_checkpoint(out)
    with writing(os.path.join(tmp, "model.safetensors"), last_good, cleanup=tmp):
        save_drafter(model, tmp, dtype=next(model.parameters()).dtype)
    with writing(os.path.join(tmp, "optimizer.pt"), last_good, cleanup=tmp):
        with open(os.path.join(tmp, "optimizer.pt"), "wb") as f:  # a file object: the OSError stays visible
            torch.save(opt.state_dict(), f)
    with writing(os.path.join(tmp, "trainer.json"), last_good, cleanup=tmp):
        atomic_json(os.path.join(tmp, "trainer.json"), state)
    with writing(os.path.join(tmp, MANIFEST), last_good, cleanup=tmp):  # last: what a resume trusts the files on
        files = {n: os.path.join(tmp, n) for n in sorted(os.listdir(tmp)) if not n.startswith(".")}
        atomic_json(os.path.join(tmp, MANIFEST), {"files": file_record(files)})
    final = os.path.join(ck, name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    with writing(os.path.join(ck, "latest"), last_good):
        atomic_write(os.path.join(ck, "latest"), name)
    olds = sorted(d for d in os.listdir(ck) if d.startswith("step_") and not d.endswith(".tmp"))
    for d in olds[:-keep]:
        shutil.rmtree(os.path.join(ck, d), ignore_errors=True)
    return final


def load_checkpoint(ck: str, model: DFlashDrafter, opt: torch.optim.Optimizer, device: torch.device) -> dict:
    """Load step_N's weights and optimizer state into model and opt; its trainer.json (the step) is returned."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(ck, "model.safetensors"), device=str(device))
    model.load_state_dict(sd, strict=False)
    opt.load_state_dict(torch.load(os.path.join(ck, "optimizer.pt"), map_location=device, weights_only=True))
    with open(os.path.join(ck, "trainer.json")) as f:
        return json.load(f)


def save_final(out: str, model: DFlashDrafter, basis=None) -> str:
    """RUN/final: the servable drafter in bf16 (written as final.tmp, then renamed); trained on a cache's basis P
    (`basis`), with the composed fc = fc' P (checkpoint.composed)."""
    final = os.path.join(out, "final")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(os.path.join(tmp, "model.safetensors"), latest_checkpoint(out), cleanup=tmp):
        save_drafter(model, tmp, dtype=torch.bfloat16, basis=basis)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final
