"""What `dflash demo` adds around its stages (both recipes, dflash/recipes/demo.py and dflash/recipes/gpu.py):

  * a line as each stage starts, with its place and its expected share of the demo's time
    ("demo: [3/5] extract  (~11% of the demo)"): StagePlan, from measured seconds per stage;
  * a rerun of a finished demo prints the stored result and changes no file: stored_result() finds the summary of a
    finished run made with the same settings (and the eval reports it names), show_stored() says so and prints it;
  * the files a demo's stages would write outside the workdir (the datasets library's cache, matplotlib's font cache
    and config, extract's tokenise cache) go under WORKDIR/caches instead: caches_under();
  * training's rate named by what it covers: the run mean and the last window (train_rates).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class StagePlan:
    """The stages of one demo run, in order, with their expected seconds (a share of the whole is what is shown: the
    seconds themselves depend on the machine and its load)."""

    seconds: dict[str, float]
    prefix: str = "demo"

    def share(self, name: str) -> float:
        total = sum(self.seconds.values())
        return self.seconds[name] / total if total > 0 else 1.0 / len(self.seconds)

    def line(self, name: str) -> str:
        names = list(self.seconds)
        return (f"{self.prefix}: [{names.index(name) + 1}/{len(names)}] {name}  "
                f"(~{max(1, round(100 * self.share(name)))}% of the demo)")

    def start(self, name: str) -> None:
        """Print the stage's line (a stage not in the plan prints nothing)."""
        if name in self.seconds:
            print(self.line(name), flush=True)


def finished_at(summary: dict[str, Any], path: str) -> str:
    """When the stored run finished: its "finished_at", else the summary file's modification time (local time)."""
    stamp = summary.get("finished_at")
    if isinstance(stamp, str) and stamp:
        return stamp
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(path)))


def now_stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M")


def read_dict(path: str) -> dict | None:
    """The JSON object in the file at path, or None (missing, unreadable, not JSON, or JSON but not an object)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def stored_result(summary_path: str, request: dict[str, Any], key: str,
                  reports: list[str]) -> tuple[dict, list[dict]] | None:
    """(summary, eval reports) of a finished demo made with the same settings, or None (run the demo). Finished: the
    summary exists, its `key` entry equals `request` (the settings that make the result; a summary written before
    they were recorded is not taken as finished) and every eval report in `reports` (paths) can be read."""
    summary = read_dict(summary_path)
    if summary is None or summary.get(key) != json.loads(json.dumps(request)):
        return None
    evals = [read_dict(p) for p in reports]
    if any(e is None for e in evals):
        return None
    return summary, evals


def show_stored(prefix: str, summary_path: str, summary: dict[str, Any], workdir: str,
                again: str = "delete that file to measure again") -> None:
    """The line that says the result shown is the stored one, and how to get a new one (`again`)."""
    print(f"{prefix}: already done: the stored result of {finished_at(summary, summary_path)} "
          f"({os.path.abspath(summary_path)}); {again}, or delete {os.path.abspath(workdir)} to start over", flush=True)


@contextlib.contextmanager
def caches_under(workdir: str) -> Iterator[str]:
    """Within: the datasets library's cache (HF_DATASETS_CACHE) and matplotlib's config and cache (MPLCONFIGDIR) in
    WORKDIR/caches/ (environment restored after); yields WORKDIR/caches/tokenized for extract's --tokenize-cache.
    datasets reads its variable once, on import: when it is imported already, its config is set too (and restored).
    matplotlib also reads its own once: imported already, it keeps the directories it has."""
    root = os.path.abspath(os.path.join(workdir, "caches"))
    env = {"HF_DATASETS_CACHE": os.path.join(root, "datasets"), "MPLCONFIGDIR": os.path.join(root, "matplotlib")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import datasets.config  # noqa: E402  (after the variable: a first import reads it)
    from pathlib import Path

    old_ds = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = Path(env["HF_DATASETS_CACHE"])
    try:
        yield os.path.join(root, "tokenized")
    finally:
        datasets.config.HF_DATASETS_CACHE = old_ds
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train_rates(hist: list[dict[str, Any]]) -> dict[str, Any]:
    """Training's context tokens per second from its logged windows (RUN/metrics.jsonl, from step 0): the run mean,
    total tokens over total time of the windows after the first (the first holds the warm-up), or of the only one;
    and the last window's, the figure train's own last line prints. Each with the steps it covers ([first, last])."""
    if not hist:
        return {"train_tokens_per_s": None, "train_tokens_per_s_steps": None,
                "train_tokens_per_s_last_window": None, "train_last_window_steps": None}
    starts = [0] + [h["step"] for h in hist[:-1]]
    windows = [(a, h) for a, h in zip(starts, hist)]
    timed = windows[1:] or windows
    secs = [(h["step"] - a) * h["step_ms"] / 1000 for a, h in timed]
    toks = sum(h["ctx_tokens_per_s"] * s for (_, h), s in zip(timed, secs))
    return {"train_tokens_per_s": toks / sum(secs) if sum(secs) > 0 else None,
            "train_tokens_per_s_steps": [timed[0][0] + 1, hist[-1]["step"]],
            "train_tokens_per_s_last_window": hist[-1]["ctx_tokens_per_s"],
            "train_last_window_steps": [windows[-1][0] + 1, hist[-1]["step"]]}
