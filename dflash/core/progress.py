"""Progress bars with an honest ETA: tqdm on an interactive terminal; in logs (not a tty) a line every 30 s instead
of \\r spam.

tqdm's own ETA divides the work left by the rate since the start (or a moving average of it), so the slow first units
of a stage - a compile, a first prefill, the wait for the first finished conversation - count as if every unit took
that long (a log once showed an ETA of 6 h 18 min for a stage that took 5.5 minutes). Here the rate behind the ETA
is measured from the end of a warm-up on (EtaRate): the first `warmup` units after the bar's `initial` are not timed,
and until they are done, and one more unit after them, the bar shows no ETA ("?") rather than a wrong one.

Where the work to do is not known in advance (generation: a turn ends at its end-of-sequence token or at its budget),
the bar counts the work actually done, generated tokens, and its total is an estimate that improves as turns end
(GeneratedTokens): counting the budget instead (every token a turn may write, its unused part added when it ends)
made regenerate's first ETA 18.6x too long, nothing being added until the first turns ended. The bar's description
says what it counts. In a log (stderr not a tty) a bar prints a line every 30 s, and one more as soon as its first
ETA is known. `clock` (any function giving seconds) drives a bar's time in tests.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


class EtaRate:
    """The rate (units per second) of a bar after its warm-up: `observe(n, t)` at every update (n: units done so far,
    t: seconds on any clock); `rate(n, t)` is (n - n_w) / (t - t_w), where (n_w, t_w) is the first observation with
    n - initial >= warmup, or None until a unit after the warm-up is done; `eta(n, total, t)` the seconds left at
    that rate, or None."""

    def __init__(self, warmup: float = 1, initial: float = 0):
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.warmup, self.initial = warmup, initial
        self.mark: tuple[float, float] | None = None  # (n_w, t_w): where the timed part starts

    def observe(self, n: float, t: float) -> None:
        if self.mark is None and n - self.initial >= self.warmup:
            self.mark = (n, t)

    def rate(self, n: float, t: float) -> float | None:
        if self.mark is None or n <= self.mark[0] or t <= self.mark[1]:
            return None
        return (n - self.mark[0]) / (t - self.mark[1])

    def eta(self, n: float, total: float | None, t: float) -> float | None:
        r = self.rate(n, t)
        return None if r is None or total is None else max(0.0, total - n) / r


class GeneratedTokens:
    """The tokens a generation will have written when done, estimated while it runs: `turns` turns of at most `budget`
    tokens each, each ending at an end-of-sequence token or at its budget.

    A turn's length is modelled as geometric (each token ends the turn with one probability h), which lets the
    unfinished turns count: h = turns ended by their own end / every token generated so far (of ended and running
    turns alike), the maximum-likelihood estimate with the running turns censored. Until a turn has ended on its
    own, h = 0: every turn is taken to fill its budget (the estimate can only come down from there).

        est = GeneratedTokens(turns=240, budget=64)
        est.update(generated=1900, ended=40, ended_at_eos=31, running=32, running_generated=700)
        est.total()   # tokens written + what the running and unstarted turns are expected to write
    """

    def __init__(self, turns: int, budget: int):
        self.turns, self.budget = turns, budget
        self.generated = self.ended = self.ended_at_eos = self.running = self.running_generated = 0

    def update(self, generated: int, ended: int, ended_at_eos: int, running: int, running_generated: int) -> None:
        self.generated, self.ended, self.ended_at_eos = generated, ended, ended_at_eos
        self.running, self.running_generated = running, running_generated

    def hazard(self) -> float:
        return self.ended_at_eos / self.generated if self.generated else 0.0

    def expected_length(self, done: float = 0.0) -> float:
        """A turn's expected further tokens once it has written `done` (a geometric turn forgets its past; the
        budget left bounds it)."""
        left = max(0.0, self.budget - done)
        h = self.hazard()
        return left if h <= 0 else min(left, (1 - (1 - h) ** left) / h)

    def total(self) -> int:
        unstarted = max(0, self.turns - self.ended - self.running)
        mean_done = self.running_generated / self.running if self.running else 0.0
        ahead = self.running * self.expected_length(mean_done) + unstarted * self.expected_length()
        return self.generated + round(ahead)


class Bar(tqdm):
    """tqdm whose rate (and so its ETA) is EtaRate's: none shown during the warm-up. clock: the time source
    (seconds; default tqdm's, time.time). eta_line: draw the bar as soon as its first ETA is known, whatever
    `mininterval` says (a log's bar prints a line every 30 s, which in a 40 s stage put its first ETA at 73%)."""

    def __init__(self, *args, warmup: float = 1, clock=None, eta_line: bool = False, **kw):
        self.eta_rate = EtaRate(warmup, kw.get("initial", 0) or 0)  # before tqdm's __init__, which may draw
        self.eta_line = eta_line
        super().__init__(*args, **kw)
        if clock is not None:
            self._time = clock
            self.start_t = self.last_print_t = clock()
        if not self.disable:
            self.eta_rate.observe(self.n, self._time())  # warmup 0: timed from the start

    def update(self, n: float | None = 1):
        if self.disable:
            return super().update(n)
        t = self._time()
        had_rate = self.eta_rate.rate(self.n, t) is not None
        self.eta_rate.observe(self.n + (n or 0), t)
        out = super().update(n)
        if self.eta_line and not had_rate and self.eta_rate.rate(self.n, t) is not None:
            self.refresh()  # the first ETA, now rather than at the next interval
            self.eta_line = False
        return out

    @property
    def format_dict(self):
        d = super().format_dict
        # a rate of 0 (not None: tqdm would fall back to its average since the start) prints "?" for rate and ETA
        d["rate"] = self.eta_rate.rate(d["n"], self._time()) or 0.0
        return d


def bar(enabled: bool = True, warmup: float = 1, **kw) -> Bar:
    """A progress bar on stderr (tqdm's keywords, and clock); `warmup`: the units before the ETA's rate is timed
    (EtaRate)."""
    tty = sys.stderr.isatty()
    kw.setdefault("dynamic_ncols", True)
    if not tty:
        kw.setdefault("mininterval", 30.0)
        kw.setdefault("ncols", 100)
        kw.setdefault("eta_line", True)
    kw.setdefault("file", sys.stderr)
    return Bar(disable=not enabled, warmup=warmup, **kw)
