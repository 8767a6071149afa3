"""`dflash export` writes --out whole or not at all, under its lock, and never deletes what dflash did not write.

Coverage (train/serve/export.py, train/serve/export_dir.py; the serving semantics are tests/test_serving_contract.py's):
- a user's `OUT.tmp` (a directory with a file, or a plain file) beside --out is left as it was;
- path forms as every command takes them (dflash/core/paths.py): DRAFTER, --out and --target as file:// URLs are the
  local paths they name; s3:// and memory:// for --out are one error line naming --out, and nothing is created;
- a full disk (a write raising ENOSPC) is one error line naming --out; nothing is left behind, and an earlier export
  in --out is kept as it was;
- four exports started at the same moment to one --out: each succeeds or is refused in one line (the output lock);
  --out is one whole export after, with nothing else beside it;
- an --out inside the drafter it exports (or holding it) is refused;
- under umask 077 the files are 0600, as the help and the docstring say (the umask decides, not "world-readable");
- a run directory given for RUN/final is pointed at RUN/final.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time

from click.testing import CliRunner

from dflash.cli import main as cli_main
from tests.test_serving_contract import drafter
from tests.test_trust import REPO, cli, env_for_subprocess, error_line, ok

EXPORT_FILES = {"config.json", "model.safetensors", "README.md"}


def test_a_users_out_tmp_is_never_touched(tmp_path):
    final = drafter(tmp_path / "final")
    (tmp_path / "exp.tmp").mkdir()
    (tmp_path / "exp.tmp" / "notes.txt").write_text("x")
    ok("export", final, "--out", tmp_path / "exp")
    assert (tmp_path / "exp.tmp" / "notes.txt").read_text() == "x"
    assert set(os.listdir(tmp_path / "exp")) == EXPORT_FILES
    (tmp_path / "other.tmp").write_text("mine")  # a plain file of that name: no FileExistsError
    ok("export", final, "--out", tmp_path / "other")
    assert (tmp_path / "other.tmp").read_text() == "mine"
    ok("export", final, "--out", tmp_path / "exp")  # an earlier export replaced, the user's file still there
    assert (tmp_path / "exp.tmp" / "notes.txt").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["exp", "exp.tmp", "final", "other", "other.tmp"]


def test_url_forms_of_the_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    final = drafter(tmp_path / "final")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 12, "hidden_size": 64,
                                                    "vocab_size": 512, "architectures": ["Qwen3ForCausalLM"]}))
    ok("export", f"file://{final}", "--out", f"file://{tmp_path}/exp")
    assert set(os.listdir(tmp_path / "exp")) == EXPORT_FILES
    assert f"read {final} as trained" in ok("check", f"file://{final}")
    ok("export", final, "--format", "speculators", "--target", f"file://{target}", "--out", tmp_path / "spec")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target)
    for url in ("s3://bucket/x", "memory://x"):
        error_line(*cli("export", final, "--out", url), "--out", url)
    assert sorted(os.listdir(tmp_path)) == ["exp", "final", "spec", "target"]  # no ./file:, ./s3:, ./memory:


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import dflash.train.serve.export as export_module

    final = drafter(tmp_path / "final")
    ok("export", final, "--out", tmp_path / "exp")
    before = {n: (tmp_path / "exp" / n).read_bytes() for n in EXPORT_FILES}

    def full(src, dst, *a, **k):
        with open(dst, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(export_module.shutil, "copyfile", full)
    error_line(*cli("export", final, "--out", tmp_path / "new"), "--out", "No space left on device", "disk full")
    error_line(*cli("export", final, "--out", tmp_path / "exp"), "--out", "No space left on device")
    assert sorted(os.listdir(tmp_path)) == ["exp", "final"]  # no new/, no staging directory, no new.tmp
    assert {n: (tmp_path / "exp" / n).read_bytes() for n in EXPORT_FILES} == before  # the earlier export kept


CONCURRENT = """
import shutil, sys, time
from dflash.cli import main
import dflash.train.serve.export  # noqa: F401  (loaded before the start: the exports overlap)
copy = shutil.copyfile
shutil.copyfile = lambda *a, **k: (time.sleep(1.0), copy(*a, **k))[1]  # weights of GBs take a while to copy
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
main(["export", sys.argv[2], "--out", sys.argv[3]])
"""


def test_concurrent_exports_to_one_out(tmp_path):
    final = drafter(tmp_path / "final")
    out = tmp_path / "exp"
    start = time.time() + 8  # after every process has imported torch
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(start), final, str(out)], cwd=REPO,
                              env=env_for_subprocess(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(4)]
    results = [(p.wait(timeout=300), p.stdout.read()) for p in procs]
    for code, output in results:
        assert "Traceback" not in output, output
        if code != 0:
            error_line(code, output, str(out), "in use by another dflash process")
    assert any(code == 0 for code, _ in results), results
    assert set(os.listdir(out)) == EXPORT_FILES
    assert json.loads((out / "config.json").read_text())["dflash_trained"]["block_size"] == 4
    assert sorted(os.listdir(tmp_path)) == ["exp", "final"]


def test_out_inside_the_drafter_or_holding_it_is_refused(tmp_path):
    final = drafter(tmp_path / "run" / "final")
    error_line(*cli("export", final, "--out", f"{final}/exp"), "--out", "lies inside the drafter")
    error_line(*cli("export", final, "--out", final), "--out", "is the drafter")
    error_line(*cli("export", final, "--out", tmp_path / "run"), "--out", "holds the drafter")
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors"]


def test_modes_follow_the_umask_as_the_help_says(tmp_path):
    final = drafter(tmp_path / "final")
    old = os.umask(0o077)
    try:
        ok("export", final, "--out", tmp_path / "exp")
    finally:
        os.umask(old)
    for name in EXPORT_FILES:
        assert stat.S_IMODE(os.stat(tmp_path / "exp" / name).st_mode) == 0o600, name
    assert stat.S_IMODE(os.stat(tmp_path / "exp").st_mode) == 0o700
    text = " ".join(CliRunner().invoke(cli_main, ["export", "--help"]).output.split())
    assert "world-readable" not in text and "0600 under 077" in text, text
    import dflash.train.serve.export as export_module

    assert "world-readable" not in export_module.__doc__ and "0600 under 077" in export_module.__doc__


def test_a_run_directory_points_at_its_final(tmp_path):
    run = tmp_path / "run"
    drafter(run / "final")
    (run / "run.json").write_text(json.dumps({"dflash": "train", "config": {}}))
    for args in (["export", run, "--out", tmp_path / "exp"], ["check", run]):
        error_line(*cli(*args), f"{run} is a training run directory", f"give its drafter, {run / 'final'}")
    assert not (tmp_path / "exp").exists()
