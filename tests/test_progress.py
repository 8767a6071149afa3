"""The ETA of a generation's bar (dflash/core/progress.py: GeneratedTokens, Bar), driven by the bar's own clock.

A generation like regenerate's on a CPU is simulated: 240 turns of at most 64 tokens, their lengths drawn from a
geometric law (mean ~15 tokens), written 32 rows at a time with a free row refilled at once; a decode step costs
0.2 s + 25 ms a row (on a CPU the step's matmuls grow with its rows; on a GPU, where a step of few rows costs nearly
as much as a full one, the last rows' steps make the end longer than the tokens say). The bar counting the generated
tokens against their estimated total shows an ETA from its second step on, within 2x of the truth until 80% of the
run and mostly within 1.5x.
"""

from __future__ import annotations

import io
import random
import re

import pytest

from dflash.core.progress import Bar, GeneratedTokens

TURNS, BUDGET, BATCH = 240, 64, 32


def lengths(seed: int = 0, p_end: float = 0.06) -> list[int]:
    rng = random.Random(seed)
    out = []
    for _ in range(TURNS):
        n = 1
        while n < BUDGET and rng.random() >= p_end:
            n += 1
        out.append(n)
    return out


def simulate(seed: int = 0) -> list[tuple[float, float, float | None]]:
    """(time, fraction of the true run done, the bar's ETA over the true time left, or None) after every decode step
    of the simulated generation, its bar counting the generated tokens against their estimated total."""
    lens = lengths(seed)
    now = [0.0]
    bar = Bar(total=TURNS * BUDGET, file=io.StringIO(), mininterval=0, warmup=1, unit="tok", clock=lambda: now[0])
    est = GeneratedTokens(TURNS, BUDGET)
    queue, rows = list(range(TURNS)), []  # rows: [turn, tokens written]
    generated = ended = at_eos = ended_tokens = 0
    trace = []
    while queue or rows:
        while queue and len(rows) < BATCH:
            rows.append([queue.pop(0), 0])
        now[0] += 0.2 + 0.025 * len(rows)  # one decode step: every row writes a token
        step_tokens = 0
        for r in rows:
            r[1] += 1
            step_tokens += 1
        done = [r for r in rows if r[1] == lens[r[0]]]
        rows = [r for r in rows if r[1] < lens[r[0]]]
        generated += step_tokens
        ended += len(done)
        at_eos += sum(r[1] < BUDGET for r in done)
        ended_tokens += sum(r[1] for r in done)
        est.update(generated, ended, at_eos, len(rows), generated - ended_tokens)
        bar.total = est.total()
        bar.update(step_tokens)
        trace.append((now[0], bar.eta_rate.eta(bar.n, bar.total, now[0])))
    bar.close()
    end = now[0]
    return [(t, t / end, None if eta is None else eta / (end - t) if end > t else None) for t, eta in trace]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_generated_tokens_bar_gives_an_honest_eta_from_its_first_steps(seed):
    trace = simulate(seed)
    first = next(f for _, f, ratio in trace if ratio is not None)
    assert first < 0.03  # an ETA from the second decode step on
    shown = [(round(f, 2), round(ratio, 2)) for _, f, ratio in trace if ratio is not None and f <= 0.8]
    assert all(0.5 <= ratio <= 2 for _, ratio in shown), shown  # within 2x of the truth until 80% of the run
    assert sum(0.67 <= ratio <= 1.5 for _, ratio in shown) >= 0.8 * len(shown), shown  # mostly within 1.5x


def test_the_estimate_and_its_end():
    est = GeneratedTokens(turns=10, budget=64)
    assert est.total() == 640  # nothing seen: every turn fills its budget (an upper bound)
    est.update(generated=100, ended=4, ended_at_eos=4, running=4, running_generated=40)
    h = 4 / 100
    assert est.hazard() == pytest.approx(h)
    want = 100 + 4 * (1 - (1 - h) ** 54) / h + 2 * (1 - (1 - h) ** 64) / h
    assert est.total() == round(want)
    est.update(generated=300, ended=10, ended_at_eos=7, running=0, running_generated=0)
    assert est.total() == 300  # every turn ended: the total is what was written
    truncated = GeneratedTokens(turns=3, budget=8)
    truncated.update(generated=16, ended=2, ended_at_eos=0, running=1, running_generated=0)
    assert truncated.total() == 24  # no turn ends on its own (stop_at_eos off): each fills its budget


def test_the_bar_runs_on_its_own_clock():
    now = [500.0]
    out = io.StringIO()
    bar = Bar(total=10, file=out, mininterval=0, warmup=1, unit="tok", clock=lambda: now[0])
    now[0] += 30.0
    bar.update(1)
    now[0] += 2.0
    bar.update(2)
    text = str(bar)
    assert re.search(r"3/10 \[00:32<00:07, +1\.00tok/s\]", text), text
    bar.close()


def test_a_logged_bar_prints_its_first_eta_at_once():
    """In a log a bar draws a line every 30 s: in a 40 s stage that put the first ETA at 73%. The line with the
    first ETA is drawn as soon as the rate is known; the next waits for the interval again."""
    now = [0.0]
    out = io.StringIO()
    bar = Bar(total=10, file=out, mininterval=30, warmup=0, unit="tok", clock=lambda: now[0], eta_line=True)
    now[0] += 4.0
    bar.update(1)
    assert re.search(r"1/10 \[00:04<00:36", out.getvalue()), out.getvalue()
    drawn = out.getvalue()
    now[0] += 4.0
    bar.update(1)
    assert out.getvalue() == drawn  # within the interval: nothing more
    quiet = Bar(total=10, file=io.StringIO(), mininterval=30, warmup=0, unit="tok", clock=lambda: now[0])
    now[0] += 4.0
    quiet.update(1)
    assert not re.search(r"<\d\d:\d\d", quiet.fp.getvalue())  # eta_line off: tqdm's interval alone (the terminal's bar)
    bar.close()
    quiet.close()


def test_extract_on_a_cpu_logs_an_eta_within_the_first_quarter(tmp_path):
    """`dflash extract` on a CPU, its stderr a file (no tty): the first line with an ETA comes after at most a quarter
    of the tokens (a forward of ~4k tokens on a CPU, the first ETA line drawn at once); it came at the end before."""
    import os
    import subprocess
    import sys

    from tests.tiny import chat_rows, make_tiny_target, write_jsonl

    target = make_tiny_target(tmp_path / "target", num_layers=2, hidden=32)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(200, seed=5, turns=(1, 1)))
    log = tmp_path / "extract.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with open(log, "w") as err:
        p = subprocess.run([sys.executable, "-m", "dflash", "extract", "--target", target, "--data", data, "--out",
                            str(tmp_path / "cache"), "--seq-len", "256", "--layers", "0,1", "--device", "cpu",
                            "--tokenize-cache", "off"], stdout=subprocess.PIPE, stderr=err, text=True, timeout=300)
    text = log.read_text()
    assert p.returncode == 0, p.stdout + text
    lines = [s for s in re.split(r"[\r\n]+", text) if s.startswith("extract:")]
    with_eta = [s for s in lines if re.search(r"<\d+:\d\d", s)]
    assert with_eta, lines
    d, dk, t, tk = re.search(r"([\d.]+)(k?)/([\d.]+)(k?) \[", with_eta[0]).groups()
    done, total = float(d) * (1000 if dk else 1), float(t) * (1000 if tk else 1)
    assert done / total <= 0.25, (with_eta[0], lines)
