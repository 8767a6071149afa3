"""Every command takes the same path forms for every path flag (dflash.core.paths.path_form; README, Guarantees).

- a `file://` URL is the local path it names, for every path flag: extract, train (its --cache and its --out: no
  literal `./file:` folder), eval and `cache verify` given only file:// URLs run as they do given the paths;
- another fsspec URL is taken only by the flags of a cache; any other flag refuses it in one `error:` line naming
  the flag (table: every local-only path flag of every command);
- a URL whose protocol fsspec does not know is one line naming the flag or argument, not a traceback;
- a cache written to a store that dies with the process (`memory://`) is refused before any work.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_hostile_input import command
from tests.test_trust import cli, error_line, ok
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

SEQ = 128


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, 12 conversations and a drafter directory stand-in (eval's checks need an existing one)."""
    import datasets

    root = tmp_path_factory.mktemp("urls")
    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf_datasets"))
    mp.setenv("DFLASH_TOKENIZE_CACHE", str(root / "tokenized"))
    target = make_tiny_target(root / "target", num_layers=4)
    data = write_jsonl(root / "chat.jsonl", chat_rows(12, seed=3))
    (root / "drafter").mkdir()
    (root / "cache").mkdir()
    (root / "cache" / "zarr.json").write_text("{}")
    yield {"root": root, "target": target, "data": data, "cache": str(root / "cache"),
           "drafter": str(root / "drafter"), "regen": root}
    mp.undo()


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Relative paths (a URL taken for one) land in the test's directory."""
    monkeypatch.chdir(tmp_path)


def url(path) -> str:
    return "file://" + os.path.abspath(str(path))


def test_file_urls_everywhere_run_as_paths(world, tmp_path):
    """Before: train refused `--cache file:///abs` ("no such directory") and wrote `--out file:///abs/run` into a
    literal ./file: folder, printing a drafter path that did not exist."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    ok("extract", "--target", url(world["target"]), "--data", url(world["data"]), "--out", url(cache),
       "--seq-len", SEQ, "--rows-per-shard", 4, "--writer-threads", 1, "--json", url(tmp_path / "extract.json"),
       "--tokenize-cache", url(tmp_path / "tok"), "--no-progress")
    assert (cache / "zarr.json").is_file() and (tmp_path / "extract.json").is_file() and (tmp_path / "tok").is_dir()
    out = ok("train", "--cache", url(cache), "--target", url(world["target"]), "--out", url(run),
             "--drafter-layers", 1, "--block-size", 4, "--num-anchors", 8, "--batch-rows", 2, "--max-steps", 1,
             "--val-cache", url(cache), "--val-rows", 2, "--no-progress")
    assert (run / "final" / "model.safetensors").is_file()
    assert f"drafter -> {run / 'final'}" in out, out[-2000:]
    assert not (tmp_path / "file:").exists()
    ok("eval", "--target", url(world["target"]), "--drafter", url(run / "final"), "--data", url(world["data"]),
       "--max-prompts", 1, "--max-new-tokens", 4, "--json", url(tmp_path / "eval.json"), "--no-progress")
    assert (tmp_path / "eval.json").is_file()
    assert "OK" in ok("cache", "verify", url(cache))
    ok("cache", "info", "file://localhost" + str(cache))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "eval.json", "extract.json", "run", "tok"]


# command, flag of a path that only a local path (or file://) can be: another protocol is refused naming the flag
LOCAL_ONLY = [("extract", "target"), ("extract", "data"), ("extract", "json"), ("extract", "tokenize-cache"),
              ("extract", "chat-template"), ("extract", "config"),
              ("train", "target"), ("train", "out"), ("train", "compile-cache"), ("train", "config"),
              ("eval", "target"), ("eval", "drafter"), ("eval", "data"), ("eval", "json"), ("eval", "plot"),
              ("regenerate", "target"), ("regenerate", "data"), ("regenerate", "out"), ("regenerate", "json"),
              ("prompts", "target"), ("prompts", "out"), ("prompts", "json")]


@pytest.mark.parametrize("cmd, flag", LOCAL_ONLY, ids=[f"{c}--{f}" for c, f in LOCAL_ONLY])
def test_a_url_where_a_local_path_belongs_is_one_line(world, tmp_path, cmd, flag):
    value = f"s3://bucket-{flag}/x"
    line = error_line(*cli(*command(cmd, world, tmp_path, **{flag: value})), f"--{flag} {value}")
    assert "local path" in line, line


def test_pipeline_and_demo_refuse_urls_for_local_paths(world, tmp_path):
    base = ["pipeline", "--target", world["target"], "--data", world["data"], "--cache", tmp_path / "c",
            "--out", tmp_path / "run"]
    error_line(*cli(*base[:-1], "gs://b/run"), "--out gs://b/run", "local path")
    error_line(*cli(*base, "--json", "s3://b/x.json"), "--json s3://b/x.json", "local path")
    error_line(*cli("demo", "--workdir", "s3://b/demo"), "--workdir s3://b/demo", "local path")


@pytest.mark.parametrize("argv, who", [
    (["cache", "verify", "nosuchproto://x"], "PATH nosuchproto://x"),
    (["cache", "info", "nosuchproto://x"], "PATH nosuchproto://x"),
    (["train", "--cache", "nosuchproto://x"], "--cache nosuchproto://x"),
    (["train", "--val-cache", "nosuchproto://x"], "--val-cache nosuchproto://x"),
    (["extract", "--out", "nosuchproto://x"], "--out nosuchproto://x"),
])
def test_an_unknown_url_protocol_is_one_line_naming_the_flag(world, tmp_path, argv, who):
    """Before: `cache verify nosuchproto://x` was a traceback (ValueError: Protocol not known)."""
    if argv[0] in ("train", "extract"):
        argv = command(argv[0], world, tmp_path, **{argv[1][2:]: argv[2]})
    error_line(*cli(*argv), who, "unknown URL protocol nosuchproto://")


def test_a_cache_in_process_memory_is_refused(world, tmp_path):
    """Before: `extract --out memory://...` said "cache complete" and exited 0; the cache vanished with the process."""
    error_line(*cli(*command("extract", world, tmp_path, out="memory://dflash-x/cache")), "--out memory://dflash-x/cache",
               "gone when the command exits")
    error_line(*cli("pipeline", "--target", world["target"], "--data", world["data"], "--cache", "memory://p/c",
                    "--out", tmp_path / "run"), "--cache memory://p/c")
    assert not Path("memory:").exists()
