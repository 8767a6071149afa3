"""`dflash train --follow`: train from a cache while `dflash extract` is still writing it.

The reader does the reading (dflash_cache.reader: `open(path, follow=True)` gives every row of the cache's plan,
known from its creation; `batches(..., wait=...)` decodes a batch once the shards of its rows are committed, in
the one data order every run uses, so a followed run equals a run over the finished cache). This module is what
the trainer does when the next batch's shards are not there yet: wait, say why, and give up when nothing will
commit them.

    follower = Follower(cache_path, world, timeout_s)
    follower.wait_for_cache()                       # the extraction may still be tokenising: no cache yet
    cache = dflash_cache.open(cache_path, follow=True)
    follower.attach(cache)
    for batch in cache.batches(..., wait=follower):  # follower(missing, rows) sleeps, reports, or raises
        ...

Who writes the cache: `dflash extract` holds CACHE/.dflash.lock (dflash_cache.lock) for the whole command, from
before the cache exists until after its last commit. So, while a shard is missing:
  * the lock's holder runs (a live process of this host) or is on another host (not checkable from here): the
    extraction is at work. If it commits nothing for `timeout_s` seconds it is stalled: give up.
  * the holder is gone (its pid no longer runs) or nobody holds the lock (the extraction stopped on an error):
    wait GRACE_S seconds (a restarted extraction takes the lock over and is followed on), then give up.
Giving up raises ExtractionGone (a TrainError: one `error:` line, exit 2) naming the cache, the holder, what is
committed and how to go on: rerun the extract command, then rerun the same `dflash train --follow` command, which
resumes from its last checkpoint (kill -9 of either side resumes exactly: the extraction redoes its uncommitted
shards, the trainer restores model, optimizer, schedule and data position).

While it waits, rank 0 prints a line after FIRST_REPORT_S seconds, then every REPORT_S seconds, and at once when a
line said a rate was not measured yet and both rates are now known:

    train: --follow: waiting for shard 57 (the next batch needs 2 more): 23 of 100 shards committed (184 of 800
    rows); extraction 4.1 rows/s, training 12.3 rows/s; dflash extract pid 1234 on host h is running
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from dflash.core.dist import print0
from dflash_cache.lock import LOCK_NAME, holder

from dflash.train.fit.config import TrainError

GRACE_S = 10.0  # a gone holder: time for a restarted extraction to take the lock over before giving up
START_GRACE_S = 120.0  # no cache and no lock: time for an extraction started alongside to take the lock
POLL_S = 0.25  # between looks at the missing shards
REFRESH_S = 5.0  # between full listings of the commits (progress, rates, stall detection)
FIRST_REPORT_S = 2.0  # a wait shorter than this says nothing
REPORT_S = 30.0


class ExtractionGone(TrainError):
    """The cache a --follow run reads will not be completed by anyone (dead, stopped or stalled extraction)."""


def describe_holder(rec: dict[str, Any]) -> str:
    here = rec.get("host") == socket.gethostname()
    return (f"{rec.get('command') or 'dflash extract'} pid {rec.get('pid')} on "
            f"{'this host' if here else 'host ' + str(rec.get('host'))}")


class Follower:
    """The wait policy of a trainer that follows a growing cache (module docstring). Called by the reader as
    wait(missing shards, rows this rank was given so far); keeps the figures that summary() reports."""

    def __init__(self, cache_path: str, world: int = 1, timeout_s: float = 1800.0, say=print0):
        self.path = str(cache_path)
        self.world = world
        self.timeout_s = timeout_s
        self.say = say
        self.cache = None
        self.checkpoint_step: int | None = None  # the trainer's last checkpoint (for the error's advice)
        self.waited_s = 0.0
        self.waits = 0
        self._wait_start = 0.0  # when the current (or last) wait began
        self._wait_served: int | None = None  # rows handed out when it began
        self._last_return: float | None = None  # when the last look ended, and the rows handed out then
        self._last_served = 0
        self._last_report = 0.0
        self._rates_said = False  # a report has given both rates
        self._last_refresh = 0.0
        self._gone_since: float | None = None
        self._progress_t = time.monotonic()  # when the committed rows last grew
        self._samples: list[tuple[float, int]] = []  # (time, committed rows) at each full listing
        self._train_rate: float | None = None  # rows/s of the job over the last stretch between two waits

    # -- before the cache exists ---------------------------------------------------------------------------
    def wait_for_cache(self) -> None:
        """Block until the cache's root exists (its extraction tokenises, packs and hashes the target first);
        ExtractionGone if no extraction is there to create it."""
        from dflash_cache.format import CacheNotFoundError, NotACacheError, read_root
        from dflash_cache.store import Store

        t0 = time.monotonic()
        said = False
        while True:
            try:
                read_root(Store(self.path))
                return
            except (CacheNotFoundError, NotACacheError):
                pass
            rec, gone = holder(self.path) if os.path.isdir(self.path) or "://" in self.path else (None, None)
            waited = time.monotonic() - t0
            grace = min(START_GRACE_S, self.timeout_s)  # --follow-timeout bounds this wait too
            if rec is None and waited > grace:
                bound = f"--follow-timeout {self.timeout_s:g}" if grace < START_GRACE_S else f"{grace:.0f} s"
                raise ExtractionGone(
                    f"--follow: there is no cache at {self.path} and no `dflash extract` is writing one (no "
                    f"{LOCK_NAME} in {waited:.0f} s, {bound}); start the extraction with --out {self.path}, then "
                    "rerun this command")
            if gone is not None:
                self._gone_or_wait(rec, gone, "it had not created the cache")
            else:
                self._gone_since = None
                if rec is not None and waited > self.timeout_s:
                    raise ExtractionGone(
                        f"--follow: the extraction that holds {self.path} ({describe_holder(rec)}) has not created the "
                        f"cache in {waited:.0f} s (--follow-timeout {self.timeout_s:g}): stalled? Stop it, rerun the "
                        "extract command, then rerun this command")
            if not said and waited >= FIRST_REPORT_S:
                who = describe_holder(rec) + " is preparing it" if rec else "no extraction has taken its lock yet"
                self.say(f"train: --follow: waiting for the cache {self.path} to be created ({who})")
                said = True
            time.sleep(POLL_S)

    def attach(self, cache) -> None:
        """The opened (follow=True) cache whose commits this follower watches."""
        self.cache = cache
        now = time.monotonic()
        self._samples = [(now, cache.committed_rows)]
        self._progress_t = now  # (the training rate is measured between two waits: setup and compilation apart)

    # -- the reader's wait hook ----------------------------------------------------------------------------
    def __call__(self, missing: list[int], served_rows: int) -> None:
        """One look: the reader calls this while the next batch's shards are `missing` (again and again in one
        wait; a new wait starts once it has handed out more rows). Sleeps POLL_S, reports, or raises."""
        now = time.monotonic()
        if served_rows != self._wait_served or self._last_return is None:  # a new wait
            self.waits += 1
            self._wait_start, self._wait_served = now, served_rows
            if self._last_return is not None and served_rows > self._last_served:  # the stretch that trained
                self._train_rate = (served_rows - self._last_served) * self.world / max(now - self._last_return, 1e-6)
        else:
            self.waited_s += now - self._last_return  # the reader's own look between two calls
        if now - self._last_refresh >= REFRESH_S:
            self._refresh(now)
        rec, gone = holder(self.path)
        if gone is not None or rec is None:
            self._gone_or_wait(rec, gone or f"no `dflash extract` holds the lock of {self.path}: it ended before the "
                                            "cache was complete", f"the next batch needs shard {missing[0]}")
        else:
            self._gone_since = None
            if now - self._progress_t > self.timeout_s:
                raise ExtractionGone(
                    f"--follow: the extraction writing {self.path} ({describe_holder(rec)}) has committed nothing for "
                    f"{now - self._progress_t:.0f} s (--follow-timeout {self.timeout_s:g}): stalled; "
                    f"{self._committed()}. Stop it, rerun the extract command, then rerun this command"
                    f"{self._resumes()}")
        long_wait = now - self._wait_start >= FIRST_REPORT_S or self.waited_s >= FIRST_REPORT_S  # or many short
        rates_now = not self._rates_said and self._train_rate is not None and self.extraction_rate() is not None
        if long_wait and (now - self._last_report >= REPORT_S or (rates_now and self._last_report > 0)):
            self._last_report = now
            self._rates_said = self._train_rate is not None and self.extraction_rate() is not None
            self.say(self.report(missing, rec))
        time.sleep(POLL_S)
        end = time.monotonic()
        self.waited_s += end - now
        self._last_return, self._last_served = end, served_rows

    # -- helpers ---------------------------------------------------------------------------------------------
    def _refresh(self, now: float) -> None:
        self._last_refresh = now
        if self.cache is None:
            return
        self.cache.refresh()
        rows = self.cache.committed_rows
        if not self._samples or rows > self._samples[-1][1]:
            self._progress_t = now
        self._samples.append((now, rows))

    def extraction_rate(self) -> float | None:
        """Committed rows per second over what this follower has seen (None before two listings)."""
        if len(self._samples) < 2 or self._samples[-1][1] == self._samples[0][1]:
            return None  # nothing committed since this follower began to look: no rate yet
        (t0, r0), (t1, r1) = self._samples[0], self._samples[-1]
        return (r1 - r0) / max(t1 - t0, 1e-3)

    def _committed(self) -> str:
        c = self.cache
        if c is None:
            return "the cache has not been created"
        return (f"{len(c.commits)} of {c.spec.num_shards} shards are committed "
                f"({c.committed_rows} of {c.spec.num_rows} rows)")

    def _resumes(self) -> str:
        if self.checkpoint_step is None:
            return " (it starts over: no checkpoint was written yet)"
        return f" (it resumes from its last checkpoint, step {self.checkpoint_step})"

    def _gone_or_wait(self, rec, why: str, need: str) -> None:
        now = time.monotonic()
        if self._gone_since is None:
            self._gone_since = now
            self._refresh(now)
        if now - self._gone_since < GRACE_S:
            return
        who = f" ({rec.get('command') or 'dflash extract'}: {why})" if rec else f" ({why})"
        raise ExtractionGone(
            f"--follow: the extraction writing {self.path} is gone{who}; {self._committed()} and {need}. Rerun the "
            f"extract command to finish the cache, then rerun this command{self._resumes()}")

    def report(self, missing: list[int], rec) -> str:
        ext = self.extraction_rate()
        rates = [f"extraction {ext:.3g} rows/s" if ext is not None else "extraction rate not measured yet",
                 f"training {self._train_rate:.3g} rows/s" if self._train_rate else "training rate not measured yet"]
        more = f" (the next batch needs {len(missing) - 1} more)" if len(missing) > 1 else ""
        who = f"; {describe_holder(rec)} is running" if rec else ""
        return (f"train: --follow: waiting for shard {missing[0]}{more}: {self._committed()}; "
                f"{', '.join(rates)}{who}")

    def summary(self, trained_rows_per_s: float | None = None) -> dict[str, Any]:
        """The figures of the closing line. The training rate is the one measured between two waits; a run that
        waited once (at its start) measured none, and the trainer's own rate of its last log window
        (`trained_rows_per_s`) stands in."""
        rate = self._train_rate or trained_rows_per_s
        return {"waited_s": round(self.waited_s, 3), "waits": self.waits,
                "extraction_rows_per_s": self.extraction_rate(), "training_rows_per_s": rate}


def closing_line(follow: dict[str, Any], elapsed_s: float) -> str:
    """What the trainer prints at the end of a --follow run, from Follower.summary(): how long it waited, and
    both rates."""
    ext, tr = follow.get("extraction_rows_per_s"), follow.get("training_rows_per_s")
    rates = [f"extraction {ext:.3g} rows/s" if ext is not None else "extraction rate not measured",
             f"training {tr:.3g} rows/s" if tr else "training rate not measured"]
    share = f" ({100 * follow['waited_s'] / elapsed_s:.0f}% of the run)" if elapsed_s > 0 else ""
    n = follow["waits"]
    return (f"train: --follow: waited {follow['waited_s']:.1f} s{share} in {n} wait{'s' if n != 1 else ''} for the "
            f"extraction; {', '.join(rates)}")
