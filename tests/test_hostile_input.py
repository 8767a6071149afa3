"""The hostile-user probe: every flag given bad values, every path kind, every input file damaged.

Each case must end as README's "Bad input" guarantee says: exit code 2 and exactly one `error: ...` line that names
the flag, file or row, never a traceback (an unexpected exception fails the test with its traceback:
tests/test_trust.py's `cli`). The cases are tables, so that a new flag or file kind is one more row:

    1. numbers      every integer and float option of extract, train, eval, regenerate, prompts, cache verify and demo (found
                    by walking the click commands; NUMBERS must know each one's valid range): just below its range,
                    negative, nan/inf, a fraction for an integer, an integer beyond int64 (and the sane bounds of the
                    flags that size memory or threads: --block-size, --log-every, --drafter-layers, --threads), a word
    2. words        every choice option given an unknown value; --layers, --device, --gpus, --split,
                    --chat-template-kwargs (`x=[`, `=3`, no `=`), unknown options
    3. paths        each path flag given a missing path, a dangling symlink, a file where a directory belongs and a
                    directory where a file belongs, an unreadable directory (as a non-root user), a read-only
                    directory or filesystem as --out
    4. presets      --config: a directory, malformed YAML, a list, a section that is no mapping, an unknown key, a
                    value of the wrong type, not UTF-8, a dangling symlink; YAML 1.1 words (`off`, `no`, `on`)
                    read as the strings they are for string settings; a flag overrides the preset's other choice of
                    an exclusive pair (--config tiny --epochs 1), and a preset that sets both is named
    5. damaged      a target with config.json missing/garbled/not a model config, weights missing or cut in half,
       inputs       tokenizer files missing or garbled (named as the target's, not blamed on the data); data that is
                    empty, not JSON on a line, of the wrong schema, with no usable row; a drafter directory that is the
                    target, misses or garbles a file, has weights cut in half or of another shape, or belongs to
                    another target; a cache path that is not a cache
    6. dflash's     a regenerate output whose record or a part's counts are garbled (named; --overwrite starts over),
       own files    a part cut short (extract names it and the line); a run directory whose run.json is garbled, a
                    list, or gone, a file named checkpoints (named), a garbled summary.json (rewritten)
    7. disk full    regenerate on a full disk (a real full tmpfs where this process may mount one, else a file-size
                    limit in a subprocess): one line naming the file; a rerun with space resumes
    8. export and   a drafter config with a field of the wrong kind (block_size [4], "4" or 4.0, target_layer_ids
       check        "1,3,5", layer_types one entry short) or weights of another shape than it builds: one line naming
                    the field or tensor from both commands, never read as trained; a RUN/final whose config.json was
                    edited after training (ids shifted, block_size or the mask token removed) is checked against
                    what RUN/run.json records; the drafter commands' bad paths (tests/test_export.py: the writes)

Most cases fail before any model loads; the rest load the tiny target of tests/tiny.py (4 layers).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import click
import pytest

from dflash.cli import main as cli_main
from tests.test_trust import PY, REPO, cli, env_for_subprocess, error_line, ok
from tests.tiny import chat_rows, make_tiny_target, write_jsonl

SEQ = 128
REGEN = ["regenerate", "--max-samples", 4, "--part-size", 2, "--max-new-tokens", 4, "--no-progress"]
ROOT = os.geteuid() == 0


def _mode_bits_bind_us() -> bool:
    """Whether a directory's mode bits stop this process (false for root with its usual capabilities)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        locked = os.path.join(d, "locked")
        os.mkdir(locked, 0o500)
        try:
            open(os.path.join(locked, "x"), "w").close()
            return False
        except PermissionError:
            return True
        finally:
            os.chmod(locked, 0o700)


MODE_BITS_BIND = _mode_bits_bind_us()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, 12 conversations, a cache extracted from them and a drafter trained on it for 2 steps; datasets'
    and dflash's tokenise caches live under the test's directory."""
    import datasets

    root = tmp_path_factory.mktemp("hostile")
    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf_datasets"))
    mp.setenv("DFLASH_TOKENIZE_CACHE", str(root / "tokenized"))
    target = make_tiny_target(root / "target", num_layers=4)
    data = write_jsonl(root / "chat.jsonl", chat_rows(12, seed=3))
    cache = root / "cache"
    ok("extract", "--target", target, "--data", data, "--out", cache, "--seq-len", SEQ, "--rows-per-shard", 4,
       "--writer-threads", 1, "--no-progress")
    run = root / "run"
    ok("train", "--cache", cache, "--target", target, "--out", run, "--drafter-layers", 1, "--block-size", 4,
       "--num-anchors", 8, "--batch-rows", 2, "--max-steps", 2, "--no-progress")
    regen = root / "regen"
    ok(*REGEN, "--target", target, "--data", data, "--out", regen)
    yield {"root": root, "target": target, "data": data, "cache": str(cache), "drafter": str(run / "final"),
           "run": run, "regen": regen}
    mp.undo()


def command(name: str, w: dict, tmp: Path, **flags) -> list:
    """argv of a command that would succeed on `world` (fresh outputs under tmp), with `flags` set (None: dropped)."""
    base = {
        "extract": {"target": w["target"], "data": w["data"], "out": tmp / "cache", "seq-len": SEQ,
                    "rows-per-shard": 4, "writer-threads": 1},
        "train": {"cache": w["cache"], "target": w["target"], "out": tmp / "run", "drafter-layers": 1,
                  "block-size": 4, "num-anchors": 8, "batch-rows": 2, "max-steps": 1},
        "eval": {"target": w["target"], "drafter": w["drafter"], "data": w["data"], "max-prompts": 1,
                 "max-new-tokens": 4},
        "regenerate": {"target": w["target"], "data": w["data"], "out": tmp / "regen", "max-samples": 2,
                       "max-new-tokens": 4},
        "prompts": {"target": w["target"], "out": tmp / "prompts", "num": 2, "max-new-tokens": 4},
    }[name]
    base.update(flags)
    argv = [name]
    for k, v in base.items():
        if v is not None:
            argv += [f"--{k}", v]
    return argv + ["--no-progress"]


# ------------------------------------------------------------------------------------------------ 1. numbers

# flag -> (lowest valid value, highest valid value or None, whether the bounds themselves are valid). Floats must
# also be finite. Every integer/float option of the probed commands must be here (test_every_numeric_flag_is_probed).
INF = None
MAX_THREADS = max(64, 4 * (os.cpu_count() or 1))  # dflash/core/threads.py max_threads: 100000 crashed the process
HUGE = "99999999999999999999"  # beyond int64: was an OverflowError, a TypeError or a ValueError in torch
NUMBERS: dict[str, dict[str, tuple]] = {
    "extract": {"--max-samples": (1, INF), "--seq-len": (16, INF), "--num-context-layers": (1, INF),
                "--rows-per-shard": (0, INF), "--batch-rows": (0, INF), "--writer-threads": (1, INF),
                "--tokenize-workers": (0, INF), "--basis-rank": (0, INF), "--basis-fit-tokens": (1, INF)},
    "train": {"--max-steps": (1, INF), "--epochs": (0.0, INF, "open"), "--drafter-layers": (1, 256),
              "--draft-window": (1, 2**31 - 1), "--block-size": (2, 4096), "--num-anchors": (1, INF),
              "--gamma": (0.0, INF, "open"), "--batch-rows": (1, INF), "--grad-accum": (1, INF), "--lr": (0.0, INF, "open"),
              "--warmup-ratio": (0.0, 1.0, "right-open"), "--min-lr-ratio": (0.0, 1.0), "--weight-decay": (0.0, INF),
              "--grad-clip": (0.0, INF, "open"), "--mask-token-id": (0, INF), "--seed": (0, 2**28 - 1),
              "--shuffle-window": (0, INF), "--follow-timeout": (0.0, INF, "open"), "--val-rows": (0, INF),
              "--val-max-new-tokens": (0, INF), "--log-every": (1, 1_000_000), "--save-every": (1, INF),
              "--keep-checkpoints": (1, INF), "--loader-threads": (1, INF), "--conv-kernel-size": (1, INF),
              "--conv-group-size": (1, INF), "--selector-rank": (1, INF), "--selector-top-k": (1, INF),
              "--selector-loss-alpha": (0.0, INF), "--time-budget-probe": (1, INF)},
    "eval": {"--max-prompts": (1, INF), "--skip-prompts": (0, INF), "--max-new-tokens": (1, INF),
             "--ngram-max": (1, INF), "--threads": (0, MAX_THREADS)},
    "regenerate": {"--max-samples": (1, INF), "--max-new-tokens": (1, INF), "--temperature": (0.0, INF),
                   "--top-p": (0.0, 1.0, "left-open"), "--seed": (0, INF), "--part-size": (1, INF),
                   "--batch-size": (0, INF), "--max-batch-tokens": (0, INF), "--prefill-tokens": (0, INF),
                   "--threads": (0, MAX_THREADS)},
    "prompts": {"--num": (1, INF), "--max-new-tokens": (1, INF), "--temperature": (0.0, INF, "open"),
                "--top-p": (0.0, 1.0, "left-open"), "--seed": (0, INF), "--part-size": (1, INF), "--batch-size": (0, INF),
                "--threads": (0, MAX_THREADS)},
    "cache verify": {"--threads": (1, 1024)},
    "demo": {"--train-prompts": (8, INF), "--eval-prompts": (1, INF), "--train-steps": (1, INF),
             "--drafter-layers": (1, INF)},
}


def click_command(path: str) -> click.Command:
    cmd = cli_main
    for part in path.split():
        cmd = cmd.commands[part]
    return cmd


def numeric_options(path: str) -> dict[str, str]:
    """--flag -> 'integer' or 'float' for every numeric option of a command."""
    return {p.opts[0]: "integer" if isinstance(p.type, click.types.IntParamType) else "float"
            for p in click_command(path).params
            if isinstance(p, click.Option)
            and isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType))}


def bad_numbers(kind: str, rng: tuple) -> list[str]:
    """Values just outside the range, negative, not a number, infinite, a fraction (integers), a word."""
    lo, hi, *how = rng
    how = how[0] if how else "closed"
    bad = {"abc", "-1", "nan"}
    if kind == "integer":
        bad |= {str(lo - 1), "1.5", HUGE, "-" + HUGE}
        if hi is not None:
            bad.add(str(hi + 1))
    else:
        bad |= {"inf", "-inf", repr(lo) if how in ("open", "left-open") else repr(lo - 0.5)}
        if hi is not None:
            bad.add(repr(hi) if how in ("open", "right-open") else repr(hi + 0.5))
    return sorted(bad)


NUMBER_CASES = [pytest.param(cmd, flag, value, id=f"{cmd.replace(' ', '-')}{flag}={value}")
                for cmd, flags in NUMBERS.items() for flag, rng in flags.items()
                for value in bad_numbers("float" if isinstance(rng[0], float) else "integer", rng)]


def test_every_numeric_flag_is_probed():
    for cmd, flags in NUMBERS.items():
        have = numeric_options(cmd)
        assert set(have) == set(flags), (cmd, sorted(set(have) ^ set(flags)))
        for flag, rng in flags.items():
            assert have[flag] == ("float" if isinstance(rng[0], float) else "integer"), (cmd, flag)


def numeric_argv(cmd: str, flag: str, value: str, w: dict, tmp: Path) -> list:
    if cmd == "cache verify":
        return ["cache", "verify", w["cache"], flag, value]
    if cmd == "demo":
        return ["demo", "--recipe", "cpu", "--workdir", tmp / "demo", flag, value, "--no-progress"]
    over = {flag[2:]: value}
    if cmd == "train" and flag == "--epochs":
        over["max-steps"] = None
    if cmd == "train" and flag.startswith(("--conv-", "--selector-")):  # dflash2's: its range, not the arch, refused
        over["arch"] = "dflash2"
    return command(cmd, w, tmp, **over)


@pytest.mark.parametrize("cmd, flag, value", NUMBER_CASES)
def test_bad_number(world, tmp_path, cmd, flag, value):
    error_line(*cli(*numeric_argv(cmd, flag, value, world, tmp_path)), flag)
    assert not [p for p in tmp_path.iterdir()], "nothing is written for a bad flag"


# ------------------------------------------------------------------------------------------------ 2. words


def choice_cases():
    for cmd in ("extract", "train", "eval", "regenerate", "prompts", "demo"):
        for p in click_command(cmd).params:
            if isinstance(p, click.Option) and isinstance(p.type, click.Choice):
                yield pytest.param(cmd, p.opts[0], id=f"{cmd}{p.opts[0]}")


@pytest.mark.parametrize("cmd, flag", list(choice_cases()))
def test_unknown_choice(world, tmp_path, cmd, flag):
    argv = (["demo", "--workdir", tmp_path / "demo", flag, "bogus"] if cmd == "demo"
            else command(cmd, world, tmp_path, **{flag[2:]: "bogus"}))
    error_line(*cli(*argv), flag, "bogus")


WORDS = [
    # (command, flag, value, what the error line must also hold)
    ("extract", "layers", "1,x", "--layers"),
    ("extract", "layers", "1,99", "--layers"),
    ("extract", "layers", "-1", "--layers"),
    ("extract", "layers", "1,1", "--layers"),
    ("extract", "layers", ",", "--layers"),
    ("extract", "device", "tpu", "--device"),
    ("train", "device", "cuda:x", "--device"),
    ("eval", "device", "gpu", "--device"),
    ("regenerate", "device", "meta", "--device"),
    ("extract", "gpus", "a,b", "--gpus"),
    ("train", "gpus", "-1", "--gpus"),
    ("extract", "split", "nope", "nope"),
    ("eval", "split", "nope", "nope"),
    ("regenerate", "split", "nope", "nope"),
    ("extract", "chat-template-kwargs", "x=[", "--chat-template-kwargs"),
    ("extract", "chat-template-kwargs", "=3", "--chat-template-kwargs"),
    ("eval", "chat-template-kwargs", "enable_thinking", "--chat-template-kwargs"),
    ("regenerate", "chat-template-kwargs", "x={", "--chat-template-kwargs"),
    ("regenerate", "chat-template-kwargs", "a b=1", "--chat-template-kwargs"),
    ("prompts", "chat-template-kwargs", "x=[", "--chat-template-kwargs"),
    ("prompts", "device", "meta", "--device"),
    ("train", "mask-token-id", "100000", "--mask-token-id"),
    ("train", "draft-layer-types", "sliding", "--draft-layer-types"),
    ("train", "draft-layer-types", "full_attention,full_attention", "--draft-layer-types"),
    ("train", "time-budget", "soon", "--time-budget"),
    ("train", "time-budget", "0", "--time-budget"),
    ("train", "time-budget", "-5m", "--time-budget"),
    ("train", "time-budget", "inf", "--time-budget"),
    ("train", "time-budget", "2d", "--time-budget"),
    ("train", "time-budget", "1e30", "--time-budget is at most 30 days"),  # was trained at a learning rate of ~1e-29
    ("train", "time-budget", "721h", "--time-budget is at most 30 days"),
    ("train", "block-size", "300", "--block-size 300 is longer than the rows of --cache"),  # rows of SEQ = 128 tokens
]


@pytest.mark.parametrize("cmd, flag, value, needle", [pytest.param(*c, id=f"{c[0]}--{c[1]}={c[2]}") for c in WORDS])
def test_bad_word(world, tmp_path, cmd, flag, value, needle):
    error_line(*cli(*command(cmd, world, tmp_path, **{flag: value})), needle)


@pytest.mark.parametrize("cmd", ["extract", "train", "eval", "regenerate", "prompts", "demo", "cache verify",
                                 "cache info"])
def test_unknown_option_and_missing_value(world, tmp_path, cmd):
    head = cmd.split()
    error_line(*cli(*head, "--no-such-flag"), "--no-such-flag")
    if cmd in ("extract", "train", "eval", "regenerate", "prompts"):
        error_line(*cli(*command(cmd, world, tmp_path)[:-1],
                        "--seed" if cmd in ("train", "regenerate", "prompts") else "--split"))


def test_unknown_command():
    error_line(*cli("trian"), "trian")
    error_line(*cli("cache", "inf"), "inf")


# ------------------------------------------------------------------------------------------------ 3. paths


def _mount_tmpfs(path: Path, size: str, readonly: bool = False) -> bool:
    if not ROOT or not shutil.which("mount"):
        return False
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if readonly else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode == 0


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory nothing can be written into: a read-only tmpfs where this process may mount one, else a
    directory without write permission (meaningless for root: skipped)."""
    d = tmp_path / "ro"
    if _mount_tmpfs(d, "64k", readonly=True):
        yield d
        subprocess.run(["umount", str(d)], check=True)
    elif MODE_BITS_BIND:
        d.mkdir(exist_ok=True)
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
    else:
        pytest.skip("no directory is read-only to this process (it may not mount, and mode bits do not bind it)")


@pytest.fixture
def unreadable_dir(tmp_path):
    if not MODE_BITS_BIND:
        pytest.skip("mode bits do not bind this process (root): run as another user, or root without "
                    "CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH")
    d = tmp_path / "noperm"
    d.mkdir()
    (d / "x.jsonl").write_text("{}\n")
    d.chmod(0)
    yield d
    d.chmod(0o755)


def dangling(tmp: Path) -> Path:
    link = tmp / "dangling"
    link.symlink_to(tmp / "gone")
    return link


def a_file(tmp: Path) -> Path:
    f = tmp / "afile.txt"
    f.write_text("not what you think\n")
    return f


def an_empty_dir(tmp: Path) -> Path:
    d = tmp / "adir"
    d.mkdir()
    return d


# command, flag, kind of the flag's path: "in" (must exist), "out_dir", "out_file"
PATH_FLAGS = [
    ("extract", "target", "in"), ("extract", "data", "in"), ("extract", "out", "out_dir"),
    ("extract", "chat-template", "in_file"), ("extract", "json", "out_file"), ("extract", "tokenize-cache", "out_dir"),
    ("train", "cache", "in"), ("train", "target", "in"), ("train", "out", "out_dir"), ("train", "val-cache", "in"),
    ("eval", "target", "in"), ("eval", "drafter", "in"), ("eval", "data", "in"), ("eval", "json", "out_file"),
    ("eval", "plot", "out_file"),
    ("regenerate", "target", "in"), ("regenerate", "data", "in"), ("regenerate", "out", "out_dir"),
    ("regenerate", "chat-template", "in_file"), ("regenerate", "json", "out_file"),
    ("prompts", "target", "in"), ("prompts", "out", "out_dir"), ("prompts", "chat-template", "in_file"),
    ("prompts", "json", "out_file"),
]
PATH_KINDS = {
    "in": ["missing", "dangling", "empty_dir", "file"],
    "in_file": ["missing", "dangling", "empty_dir"],
    "out_dir": ["dangling", "file", "in_missing_parent_file"],
    "out_file": ["missing_parent", "empty_dir", "dangling_dir"],
}


def make_path(kind: str, tmp: Path) -> Path:
    if kind == "missing":
        return tmp / "missing"
    if kind == "dangling":
        return dangling(tmp)
    if kind == "empty_dir":
        return an_empty_dir(tmp)
    if kind == "file":
        return a_file(tmp)
    if kind == "in_missing_parent_file":  # a path below a file
        return a_file(tmp) / "sub"
    if kind == "missing_parent":
        return tmp / "nodir" / "x.json"
    if kind == "dangling_dir":  # a file to write inside a dangling symlink
        return dangling(tmp) / "x.json"
    raise ValueError(kind)


PATH_CASES = [pytest.param(cmd, flag, kind, id=f"{cmd}--{flag}:{kind}")
              for cmd, flag, role in PATH_FLAGS for kind in PATH_KINDS[role]
              if not (flag == "data" and kind == "empty_dir")  # an empty directory of data: damaged inputs below
              and not (cmd, flag, kind) == ("train", "cache", "file")]


@pytest.mark.parametrize("cmd, flag, kind", PATH_CASES)
def test_bad_path(world, tmp_path, cmd, flag, kind):
    p = make_path(kind, tmp_path)
    line = error_line(*cli(*command(cmd, world, tmp_path, **{flag: p})), str(p))
    if not (flag == "data" and kind == "file"):  # a file of no data type: the reader names it and the types it takes
        assert f"--{flag}" in line, line


@pytest.mark.parametrize("cmd", ["extract", "train", "regenerate", "prompts"])
def test_out_on_a_readonly_filesystem(world, tmp_path, readonly_dir, cmd):
    out = readonly_dir / "out"
    error_line(*cli(*command(cmd, world, tmp_path, out=out)), "--out", str(readonly_dir))
    out = readonly_dir  # the read-only directory itself
    error_line(*cli(*command(cmd, world, tmp_path, out=out)), "--out", str(readonly_dir))


@pytest.mark.parametrize("cmd, flag", [("extract", "json"), ("eval", "json"), ("eval", "plot"),
                                       ("extract", "tokenize-cache")])
def test_output_file_in_a_readonly_directory(world, tmp_path, readonly_dir, cmd, flag):
    p = readonly_dir / ("x.json" if flag != "tokenize-cache" else "tok")
    error_line(*cli(*command(cmd, world, tmp_path, **{flag: p})), f"--{flag}", str(readonly_dir))


@pytest.mark.parametrize("cmd, flag", [("extract", "data"), ("extract", "target"), ("train", "cache"),
                                       ("eval", "drafter"), ("regenerate", "data")])
def test_unreadable_input_directory(world, tmp_path, unreadable_dir, cmd, flag):
    error_line(*cli(*command(cmd, world, tmp_path, **{flag: unreadable_dir})), f"--{flag}", str(unreadable_dir))


def test_tokenize_cache_from_the_environment_is_checked(world, tmp_path, monkeypatch):
    """Before: $DFLASH_TOKENIZE_CACHE naming a file was a FileExistsError traceback after the data was read."""
    f = a_file(tmp_path)
    monkeypatch.setenv("DFLASH_TOKENIZE_CACHE", str(f))
    error_line(*cli(*command("extract", world, tmp_path)), "$DFLASH_TOKENIZE_CACHE", str(f))
    ok(*command("extract", world, tmp_path, **{"tokenize-cache": "off"}))  # off: the variable is not used


def test_cache_commands_on_bad_paths(world, tmp_path):
    for p in (tmp_path / "missing", dangling(tmp_path), a_file(tmp_path), an_empty_dir(tmp_path)):
        for sub in ("info", "verify"):
            error_line(*cli("cache", sub, p), str(p))


def test_demo_workdir_that_is_a_file(tmp_path):
    f = a_file(tmp_path)
    error_line(*cli("demo", "--recipe", "cpu", "--workdir", f, "--no-progress"), "--workdir", str(f))
    d = dangling(tmp_path)
    error_line(*cli("demo", "--recipe", "cpu", "--workdir", d, "--no-progress"), "--workdir", str(d))


def test_demo_device_is_checked_before_the_work(tmp_path):
    """Before: a bad --device failed only at the first stage, after the target was converted (~20 s)."""
    error_line(*cli("demo", "--recipe", "cpu", "--workdir", tmp_path / "demo", "--device", "tpu", "--no-progress"),
               "--device", "tpu")
    assert not (tmp_path / "demo").exists()


# ------------------------------------------------------------------------------------------------ 4. presets


def preset(tmp: Path, text: str | bytes, name: str = "p.yaml") -> Path:
    p = tmp / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


PRESETS = {
    "directory": (None, "is a directory"),
    "malformed": ("train: {lr: [1, 2\n", "line"),
    "tab_indent": ("train:\n\tlr: 1\n", "YAML"),
    "a_list": ("- 1\n- 2\n", "mapping"),
    "section_list": ("train: [1, 2]\n", "train"),
    "unknown_key": ("train: {learning_rate: 1}\n", "learning_rate"),
    "wrong_type_int": ("train: {drafter_layers: two}\n", "--drafter-layers"),
    "wrong_type_float": ("train: {lr: fast}\n", "--lr"),
    "bool_for_int": ("train: {batch_rows: true}\n", "--batch-rows"),
    "list_for_str": ("train: {attn: [split]}\n", "--attn"),
    "negative": ("train: {weight_decay: -1}\n", "--weight-decay"),
    "nan": ("train: {gamma: .nan}\n", "--gamma"),
    "both_exclusive": ("train: {max_steps: 3, epochs: 1}\n", "--max-steps"),
    "not_utf8": (b"train: {lr: \xff\xfe}\n", "UTF-8"),
    "key_not_a_word": ("train: {1: 2}\n", "1"),
    "dangling": (None, "dangling"),
}


@pytest.mark.parametrize("case", list(PRESETS))
def test_bad_preset(world, tmp_path, case):
    text, needle = PRESETS[case]
    if case == "directory":
        p = an_empty_dir(tmp_path)
    elif case == "dangling":
        p = dangling(tmp_path)
    else:
        p = preset(tmp_path, text)
    argv = command("train", world, tmp_path, **{"max-steps": None}) + ["--config", p]
    line = error_line(*cli(*argv), "--config", needle)
    assert str(p) in line or case in ("wrong_type_int", "wrong_type_float", "bool_for_int", "list_for_str",
                                      "negative", "nan"), line


def test_preset_value_errors_say_the_preset_set_them(world, tmp_path):
    p = preset(tmp_path, "train: {weight_decay: -1}\n")
    line = error_line(*cli(*command("train", world, tmp_path), "--config", p), "--weight-decay", str(p))
    assert "must be" in line


def test_a_flag_overrides_the_presets_other_choice(world, tmp_path):
    """Before: `--config tiny --epochs 1` said "--max-steps and --epochs are exclusive" (tiny sets max_steps)."""
    out = ok(*command("train", world, tmp_path, **{"max-steps": None, "epochs": 1, "drafter-layers": None,
                                                   "block-size": None, "num-anchors": None}),
             "--config", "tiny", "--log-every", 1)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    cfg = run.get("config", run)
    assert cfg["epochs"] == 1 and cfg["max_steps"] is None, cfg
    assert "train: step" in out
    p = preset(tmp_path, "train: {epochs: 2}\n")
    ok(*command("train", world, tmp_path, out=tmp_path / "run2"), "--config", p)  # --max-steps 1 beats epochs: 2
    both = error_line(*cli(*command("train", world, tmp_path, epochs=1, out=tmp_path / "run3")),
                      "--max-steps", "--epochs")
    assert "exclusive" in both


def test_yaml_words_are_strings_for_string_settings(world, tmp_path, monkeypatch):
    """YAML 1.1 reads off/no/on as booleans: `tokenize_cache: off` was read as false and ignored (the tokenise cache
    was written); `compile: off` was refused. Now string settings keep the words; booleans take them too."""
    tok = tmp_path / "tokenized"
    monkeypatch.setenv("DFLASH_TOKENIZE_CACHE", str(tok))
    p = preset(tmp_path, "extract: {tokenize_cache: off, compile: off, overwrite: no, hidden_dtype: bf16}\n"
                         "train: {compile: off, compile_check: yes, attn: split, lr: 6e-4}\n")
    ok(*command("extract", world, tmp_path), "--config", p)
    assert not tok.exists(), "tokenize_cache: off must mean no tokenise cache"
    ok(*command("train", world, tmp_path, cache=tmp_path / "cache"), "--config", p)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    cfg = run.get("config", run)
    assert cfg["lr"] == 6e-4 and cfg["compile"] == "off", cfg


def test_gpu_recipe_preset_values_are_typed(tmp_path):
    """The demo's GPU recipe section is read like the stages' sections (before: a word for a number was a TypeError
    traceback in its checks, and 5e0 a string)."""
    from dflash.core.config import ConfigError
    from dflash.recipes.gpu_config import load_recipe

    with pytest.raises(ConfigError, match=r"--max-turns expects an integer.*set by --config"):
        load_recipe(str(preset(tmp_path, "recipe: {max_turns: many}\n")))
    r = load_recipe(str(preset(tmp_path, "recipe: {heldout_percent: 5e0, validation: off, history: target}\n",
                               name="q.yaml")))
    assert r.heldout_percent == 5.0 and r.validation is False and r.history == "target"


# ------------------------------------------------------------------------------------------------ 5. damaged inputs


def damaged_target(w: dict, tmp: Path, how: str) -> Path:
    t = tmp / "target"
    shutil.copytree(w["target"], t)
    st = t / "model.safetensors"
    if how == "config_missing":
        (t / "config.json").unlink()
    elif how == "config_garbled":
        (t / "config.json").write_text('{"model_type": "qwen3", "hidden_size": ')
    elif how == "config_not_a_model":
        (t / "config.json").write_text('{"hello": "world"}')
    elif how == "config_a_list":
        (t / "config.json").write_text("[1, 2]")
    elif how == "weights_missing":
        st.unlink()
    elif how == "weights_truncated":
        b = st.read_bytes()
        st.write_bytes(b[: len(b) // 2])
    elif how == "weights_garbage":
        st.write_bytes(b"\x00" * 64)
    elif how == "tokenizer_missing":
        for f in t.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                f.unlink()
    elif how == "tokenizer_garbled":
        (t / "tokenizer.json").write_text("{not json")
    else:
        raise ValueError(how)
    return t


TARGET_DAMAGE = {  # how -> what the error line names besides the target's path
    "config_missing": "config.json", "config_garbled": "config.json", "config_not_a_model": "config.json",
    "config_a_list": "config.json", "weights_missing": "weights", "weights_truncated": "model.safetensors",
    "weights_garbage": "model.safetensors", "tokenizer_missing": "tokenizer", "tokenizer_garbled": "tokenizer",
}


@pytest.mark.parametrize("cmd", ["extract", "train", "eval", "regenerate"])
@pytest.mark.parametrize("how", list(TARGET_DAMAGE))
def test_damaged_target(world, tmp_path, cmd, how):
    t = damaged_target(world, tmp_path, how)
    line = error_line(*cli(*command(cmd, world, tmp_path, target=t)), "--target", str(t), TARGET_DAMAGE[how])
    assert "data" not in line.split(str(t))[0], line  # the target is blamed, not the data


def test_load_tokenizer_without_tokenizer_files_names_them(world, tmp_path):
    """Before: transformers built an empty tokenizer of the model's class (no vocabulary, no chat template) and the
    failure surfaced later as a data problem, or not at all (train ran with a made-up mask token)."""
    from dflash.core.target import TargetError, load_tokenizer

    t = damaged_target(world, tmp_path, "tokenizer_missing")
    with pytest.raises(TargetError, match="no tokenizer files.*tokenizer.json"):
        load_tokenizer(str(t))


def damaged_data(tmp: Path, how: str) -> Path:
    p = tmp / "data.jsonl"
    rows = chat_rows(6, seed=5)
    if how == "empty":
        p.write_text("")
    elif how == "blank_lines":
        p.write_text("\n\n\n")
    elif how == "invalid_json_line":
        lines = [json.dumps(r) for r in rows]
        lines[3] = lines[3][:-5]
        p.write_text("\n".join(lines) + "\n")
    elif how == "not_text":
        p.write_bytes(bytes(range(256)) * 8)
    elif how == "wrong_schema":
        write_jsonl(p, [{"text": "hello"} for _ in range(4)])
    elif how == "wrong_message_type":
        write_jsonl(p, [{"messages": "hello"}])
    elif how == "unknown_role":
        write_jsonl(p, [{"messages": [{"role": "robot", "content": "x"}]}])
    elif how == "no_assistant_turn":
        write_jsonl(p, [{"messages": [{"role": "user", "content": "hi"}]} for _ in range(4)])
    elif how == "assistant_only":
        write_jsonl(p, [{"messages": [{"role": "assistant", "content": "hi"}]} for _ in range(4)])
    elif how == "unsupported_file":
        p = tmp / "data.txt"
        p.write_text("hello\n")
    elif how == "empty_dir":
        p = an_empty_dir(tmp)
    elif how == "keys_apart":  # a later file's rows have a key the first file's lack (datasets reads the first's)
        p = tmp / "parts"
        p.mkdir()
        write_jsonl(p / "a.jsonl", rows[:3])
        write_jsonl(p / "b.jsonl", [{"messages": [dict(m, weight=0) if m["role"] == "assistant" else m
                                                  for m in r["messages"]] + [{"role": "user", "content": "more"},
                                                                            {"role": "assistant", "content": "x"}]}
                                    for r in rows[3:]])
    else:
        raise ValueError(how)
    return p


DATA_DAMAGE = {
    # how -> {command: needle} (a missing command: that input is fine for it, e.g. prompts without answers for eval)
    "empty": {"extract": "no rows", "eval": "no rows", "regenerate": "no rows"},
    "blank_lines": {"extract": "no rows", "eval": "no rows", "regenerate": "no rows"},
    "invalid_json_line": {"extract": "data.jsonl", "eval": "data.jsonl", "regenerate": "data.jsonl"},
    "not_text": {"extract": "data.jsonl", "eval": "data.jsonl", "regenerate": "data.jsonl"},
    "wrong_schema": {"extract": "row 0", "eval": "row 0", "regenerate": "row 0"},
    "wrong_message_type": {"extract": "row 0", "eval": "row 0", "regenerate": "row 0"},
    "unknown_role": {"extract": "row 0", "eval": "row 0", "regenerate": "row 0"},
    "no_assistant_turn": {"extract": "assistant"},
    "assistant_only": {"eval": "row 0", "regenerate": "row"},  # extract: an answer without a prompt is trained on
    "unsupported_file": {"extract": "data.txt", "eval": "data.txt", "regenerate": "data.txt"},
    "empty_dir": {"extract": "adir", "eval": "adir", "regenerate": "adir"},
    "keys_apart": {c: "b.jsonl has messages[].weight that no row of" for c in ("extract", "eval", "regenerate")},
}


@pytest.mark.parametrize("cmd, how", [pytest.param(c, h, id=f"{c}:{h}") for h, d in DATA_DAMAGE.items() for c in d])
def test_damaged_data(world, tmp_path, cmd, how):
    p = damaged_data(tmp_path, how)
    error_line(*cli(*command(cmd, world, tmp_path, data=p)), DATA_DAMAGE[how][cmd])


def damaged_drafter(w: dict, tmp: Path, how: str) -> Path:
    if how == "the_target":
        return Path(w["target"])
    d = tmp / "drafter"
    shutil.copytree(w["drafter"], d)
    st, cfg = d / "model.safetensors", d / "config.json"
    if how == "config_missing":
        cfg.unlink()
    elif how == "config_garbled":
        cfg.write_text(cfg.read_text()[:40])
    elif how == "config_a_list":
        cfg.write_text("[]")
    elif how == "config_without_dflash_fields":
        c = json.loads(cfg.read_text())
        for k in ("block_size", "dflash_config", "num_target_layers"):
            c.pop(k)
        cfg.write_text(json.dumps(c))
    elif how == "weights_missing":
        st.unlink()
    elif how == "weights_truncated":
        b = st.read_bytes()
        st.write_bytes(b[: len(b) // 2])
    elif how == "weights_of_another_shape":
        c = json.loads(cfg.read_text())
        c["intermediate_size"] *= 2
        cfg.write_text(json.dumps(c))
    elif how == "another_target":  # drafts from layers this target does not have
        c = json.loads(cfg.read_text())
        c["dflash_config"]["target_layer_ids"] = [30]
        c["num_target_layers"] = 36
        cfg.write_text(json.dumps(c))
    elif how == "another_width":
        c = json.loads(cfg.read_text())
        c["hidden_size"] *= 2
        cfg.write_text(json.dumps(c))
    else:
        raise ValueError(how)
    return d


DRAFTER_DAMAGE = {
    "the_target": "not a DFlash drafter", "config_missing": "config.json", "config_garbled": "config.json",
    "config_a_list": "config.json", "config_without_dflash_fields": "config.json",
    "weights_missing": "model.safetensors", "weights_truncated": "model.safetensors",
    "weights_of_another_shape": "model.safetensors", "another_target": "layer", "another_width": "hidden",
}


@pytest.mark.parametrize("how", list(DRAFTER_DAMAGE))
def test_damaged_drafter(world, tmp_path, how):
    """Before: `eval --drafter TARGET_DIR` and a truncated drafter were tracebacks (KeyError, SafetensorError)."""
    d = damaged_drafter(world, tmp_path, how)
    error_line(*cli(*command("eval", world, tmp_path, drafter=d)), "--drafter", str(d), DRAFTER_DAMAGE[how])


@pytest.mark.parametrize("flag", ["cache", "val-cache"])
def test_cache_path_that_is_not_a_cache(world, tmp_path, flag):
    for p in (an_empty_dir(tmp_path), Path(world["target"])):
        error_line(*cli(*command("train", world, tmp_path, **{flag: p})), str(p))


# ------------------------------------------------------------------------------------------------ 6. what dflash wrote


REGEN_DAMAGE = {  # how -> (what to do to a copy of a regenerate output, what the error line names)
    "record_garbled": (lambda o: (o / "dflash_regenerate.json").write_text('{"format": "dflash-re'),
                       "dflash_regenerate.json"),
    "record_a_list": (lambda o: (o / "dflash_regenerate.json").write_text("[]"), "dflash_regenerate.json"),
    "record_emptied": (lambda o: (o / "dflash_regenerate.json").write_text(""), "dflash_regenerate.json"),
    "counts_garbled": (lambda o: (o / "data" / ".part-00000.stats.json").write_text("{"), ".part-00000.stats.json"),
    "counts_a_list": (lambda o: (o / "data" / ".part-00000.stats.json").write_text("[1]"), ".part-00000.stats.json"),
}


@pytest.mark.parametrize("how", list(REGEN_DAMAGE))
def test_damaged_regenerate_output_is_named_and_overwrite_starts_over(world, tmp_path, how):
    """Before: a record that is a JSON list, or a part's counts garbled, was a traceback on the rerun; a garbled
    record said "pass --overwrite to start over", and --overwrite then gave the same error."""
    out = tmp_path / "regen"
    shutil.copytree(world["regen"], out)
    damage, needle = REGEN_DAMAGE[how]
    damage(out)
    args = [*REGEN, "--target", world["target"], "--data", world["data"], "--out", out]
    error_line(*cli(*args), needle)
    if how.startswith("record"):
        ok(*args, "--overwrite")
        assert json.loads((out / "dflash_regenerate.json").read_text())["complete"] is True


def test_regenerate_part_cut_short_is_named_by_extract(world, tmp_path):
    out = tmp_path / "regen"
    shutil.copytree(world["regen"], out)
    part = out / "data" / "part-00000.jsonl"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    error_line(*cli(*command("extract", world, tmp_path, data=out)), "part-00000.jsonl", "line")


RUN_DAMAGE = {  # how -> (what to do to a copy of a finished run directory, what the error line names or None: healed)
    "run_json_garbled": (lambda r: (r / "run.json").write_text("{"), "run.json"),
    "run_json_a_list": (lambda r: (r / "run.json").write_text("[]"), "run.json"),
    "run_json_config_a_list": (lambda r: (r / "run.json").write_text('{"dflash": "train", "config": []}'), "run.json"),
    "run_json_removed": (lambda r: (r / "run.json").unlink(), "run.json"),
    "checkpoints_a_file": (lambda r: (shutil.rmtree(r / "checkpoints"), (r / "checkpoints").write_text("x")),
                           "checkpoints"),
    "summary_garbled": (lambda r: (r / "summary.json").write_text("{"), None),
    "summary_a_list": (lambda r: (r / "summary.json").write_text("[]"), None),
}


@pytest.mark.parametrize("how", list(RUN_DAMAGE))
def test_damaged_run_directory_on_rerun(world, tmp_path, how):
    """Before: run.json whose config is a list, a garbled summary.json of a finished run and a file named checkpoints
    were tracebacks; a damaged or missing run.json was called "entries not written by dflash train" (they were)."""
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    damage, needle = RUN_DAMAGE[how]
    damage(run)
    args = command("train", world, tmp_path, **{"max-steps": 2})
    if needle is None:
        ok(*args)
        assert json.loads((run / "summary.json").read_text())["steps"] == 2
        return
    line = error_line(*cli(*args), "--out", needle)
    assert "not written by dflash" not in line, line


# ------------------------------------------------------------------------------------------------ 7. disk full


@pytest.mark.parametrize("disk", ["tmpfs", "rlimit"])
def test_regenerate_on_a_full_disk(world, tmp_path, disk):
    """Before: OSError traceback. Now: one line naming the file that could not be written; a rerun with space
    resumes. A real full tmpfs (room for the lock only) where this process may mount one, else a file-size limit
    (the same ENOSPC/EFBIG path) in a subprocess."""
    args = command("regenerate", world, tmp_path)
    out = tmp_path / "regen"
    if disk == "tmpfs":
        mnt = tmp_path / "mnt"
        if not _mount_tmpfs(mnt, "64k"):
            pytest.skip("this process may not mount a tmpfs (the rlimit case covers the same path)")
        try:
            (mnt / "filler").write_bytes(b"\0" * (60 << 10))  # one page left: the lock fits, the record does not
            out = mnt / "regen"
            args[args.index("--out") + 1] = out
            line = error_line(*cli(*args), "cannot write", str(out))
            assert "disk full" in line, line
            assert not out.exists() or not [n for n in os.listdir(out) if ".tmp" in n], os.listdir(out)
            (mnt / "filler").unlink()  # space again: the same command runs to the end
            ok(*args)
            assert (out / "dflash_regenerate.json").exists()
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
        return
    import datasets
    import resource

    def fsize():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    env = env_for_subprocess(HF_DATASETS_CACHE=str(datasets.config.HF_DATASETS_CACHE),
                             DFLASH_TOKENIZE_CACHE=os.environ["DFLASH_TOKENIZE_CACHE"])
    p = subprocess.run([PY, "-m", "dflash", *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                       preexec_fn=fsize, timeout=300)
    line = error_line(p.returncode, p.stdout + p.stderr, "cannot write", str(out))
    assert "file too large" in line, line
    assert not out.exists() or not [n for n in os.listdir(out) if ".tmp" in n], os.listdir(out)
    ok(*args)  # without the limit: the same command runs to the end


# ------------------------------------------------------------------------------------------------ 8. export and check


def _small_drafter(tmp: Path, name: str = "final") -> str:
    from tests.test_serving_contract import drafter

    return drafter(tmp / name)


def _edit_config(d: str, fn) -> str:
    p = os.path.join(d, "config.json")
    with open(p) as f:
        c = json.load(f)
    fn(c)
    with open(p, "w") as f:
        json.dump(c, f)
    return d


def _fc_of_another_shape(d: str) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(d, "model.safetensors"))
    sd["fc.weight"] = torch.zeros(sd["fc.weight"].shape[0], sd["fc.weight"].shape[1] - 64)
    save_file(sd, os.path.join(d, "model.safetensors"))
    return d


FIELD_DAMAGE = {  # how -> (damage, what the error line names)
    "block_size_a_list": (lambda d: _edit_config(d, lambda c: c.update(block_size=[4])), "block_size is [4]"),
    "block_size_a_string": (lambda d: _edit_config(d, lambda c: c.update(block_size="4")), 'block_size is "4"'),
    "block_size_a_float": (lambda d: _edit_config(d, lambda c: c.update(block_size=4.0)), "block_size is 4.0"),
    "ids_a_string": (lambda d: _edit_config(d, lambda c: c["dflash_config"].update(target_layer_ids="1,3,5")),
                     'dflash_config.target_layer_ids is "1,3,5"'),
    "layer_types_short": (lambda d: _edit_config(d, lambda c: c.update(layer_types=c["layer_types"][:-1])),
                          "layer_types has 1 entries for 2 layers"),
    "fc_of_another_shape": (_fc_of_another_shape, "fc.weight is [64, 128] in model.safetensors, [64, 192] by"),
}


@pytest.mark.parametrize("cmd", ["check", "export"])
@pytest.mark.parametrize("how", list(FIELD_DAMAGE))
def test_damaged_drafter_fields_in_export_and_check(tmp_path, how, cmd):
    """Before: [4] and "1,3,5" and a short layer_types were tracebacks; "4", 4.0 and a wrong fc were read as trained."""
    damage, needle = FIELD_DAMAGE[how]
    d = damage(_small_drafter(tmp_path))
    argv = ["check", d] if cmd == "check" else ["export", d, "--out", tmp_path / "exp"]
    error_line(*cli(*argv), d, needle)
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("cmd", ["check", "export"])
@pytest.mark.parametrize("how", list(DRAFTER_DAMAGE))
def test_damaged_drafter_in_export_and_check(world, tmp_path, how, cmd):
    d = damaged_drafter(world, tmp_path, how)
    if how in ("another_target", "another_width"):
        return  # a drafter of another target is a whole drafter: export and check read it as what it is
    argv = ["check", d] if cmd == "check" else ["export", d, "--out", tmp_path / "exp"]
    needle = {"config_without_dflash_fields": "DFlash drafter", "weights_of_another_shape": "by config.json"}.get(
        how, DRAFTER_DAMAGE[how])
    error_line(*cli(*argv), str(d), needle)


RUN_EDITS = {  # an edit of RUN/final/config.json after training -> what the check names (trained: RUN/run.json)
    "ids_shifted": (lambda c: c["dflash_config"].update(target_layer_ids=[2, 6, 10]),
                    "SGLang: target layers: would hook [2, 6, 10] (trained [1, 5, 9])"),
    "block_size_removed": (lambda c: c.pop("block_size"), "SGLang: block size: would draft blocks of 16 (trained 4)"),
    "mask_token_removed": (lambda c: c["dflash_config"].pop("mask_token_id"),
                           "TensorRT-LLM: mask token: would use 512 (trained 511)"),
}


@pytest.mark.parametrize("how", list(RUN_EDITS))
def test_a_run_final_is_checked_against_its_run_record(tmp_path, how):
    from dflash.train.drafter.checkpoint import read_drafter_config

    run = tmp_path / "run"
    final = _small_drafter(run)
    (run / "run.json").write_text(json.dumps({"dflash": "train", "config": {"drafter":
                                                                            read_drafter_config(final).to_dict()}}))
    edit, needle = RUN_EDITS[how]
    _edit_config(final, edit)
    error_line(*cli("check", final), needle)
    code, out = cli("export", final, "--out", tmp_path / "exp")  # written as final/ says, and the misread said
    warning = [ln for ln in out.splitlines() if ln.startswith("warning:")]
    assert code == 0 and len(warning) == 1 and needle.split(": ")[1] + ":" in warning[0], out
