"""--help shows the config dataclasses' defaults, not a copy of them.

Every option of `dflash extract|train|eval|regenerate` that maps to a config field shows that field's
dataclass default (booleans as on/off); a short human text is allowed only where the default is a rule
resolved at run time (None, 'auto' or 0); no help string carries a hand-written `[default: ...]`; and a
default changed in the dataclass shows in the rendered --help. The defaults are read from the stage module's source
(dflash.cli_options.config_fields), so --help imports no torch; the fields a config requires are marked `required`.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dflash.cli import main  # noqa: E402
from dflash.cli_options import COMMAND_CONFIGS, ConfigOption, command_config, config_fields  # noqa: E402

NOT_CONFIG = {"preset", "gpus", "no_progress", "json_out"}  # handled by the command itself (json_out: eval has one)


def expected_text(value) -> str | None:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "" or value is dataclasses.MISSING:
        return None
    return str(value)


def help_of(command: str, option: click.Option) -> str:
    ctx = click.Context(main.commands[command], info_name=command)
    return option.get_help_record(ctx)[1]


@pytest.mark.parametrize("command", sorted(COMMAND_CONFIGS))
def test_shown_defaults_are_the_dataclass_defaults(command):
    fields = {f.name: f for f in dataclasses.fields(command_config(command))}
    checked = 0
    for opt in main.commands[command].params:
        assert isinstance(opt, ConfigOption), f"{command} {opt.opts}: declare it with option(), not click.option()"
        assert "[default:" not in (opt.help or ""), f"{command} {opt.opts}: a hand-written default in the help"
        if opt.name not in fields:
            assert opt.name in NOT_CONFIG or (command != "eval" and opt.name == "json_out"), \
                f"{command} {opt.opts}: no field {opt.name!r} in {command_config(command).__name__}"
            continue
        default = fields[opt.name].default
        shown = help_of(command, opt)
        if opt.default_text is not None:  # a rule resolved at run time: the human text stands for it
            assert default in (None, "auto", 0), \
                f"{command} {opt.opts}: default {default!r} is a value, show it instead of {opt.default_text!r}"
            assert shown.endswith(f"[default: {opt.default_text}]"), shown
        elif opt.is_flag and not opt.secondary_opts:
            assert "[default:" not in shown, shown  # --overwrite and friends: off unless given
        else:
            want = expected_text(default)
            if want is None:
                assert "[default:" not in shown, f"{command} {opt.opts}: {shown}"
            else:
                assert shown.endswith(f"[default: {want}]"), f"{command} {opt.opts}: {shown!r}, dataclass {default!r}"
                checked += 1
    assert checked >= 3  # every command shows some derived defaults


@pytest.mark.parametrize("command", sorted(COMMAND_CONFIGS))
def test_defaults_read_from_the_source_are_the_dataclass_defaults(command):
    """Every field, not only those with a flag: the value, or MISSING for a default_factory (as dataclasses says)."""
    defaults, required = config_fields(command)
    fields = dataclasses.fields(command_config(command))
    assert defaults == {f.name: f.default for f in fields}
    assert required and required <= set(defaults)
    for name in required:  # each is refused when empty, naming its flag
        with pytest.raises(Exception, match=f"--{name.replace('_', '-')} is required"):
            command_config(command)(**{f: "x" for f in required - {name}})


def test_a_changed_dataclass_default_shows_in_help(tmp_path, monkeypatch):
    """A default edited in the module's source shows in --help (read from the file, never a copy)."""
    import importlib.util

    src = open(importlib.util.find_spec("dflash.extract.run").origin).read()
    assert "    seq_len: int = 2048\n" in src
    (tmp_path / "probe_extract_config.py").write_text(src.replace("    seq_len: int = 2048\n", "    seq_len: int = 4096\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(COMMAND_CONFIGS, "extract", ("probe_extract_config", "ExtractConfig"))
    config_fields.cache_clear()
    try:
        out = CliRunner().invoke(main, ["extract", "--help"])
    finally:
        config_fields.cache_clear()
    assert out.exit_code == 0, out.output
    flat = " ".join(out.output.split())  # undo click's line wrapping
    assert "exactly T tokens. [default: 4096]" in flat
    assert "[default: 2048]" not in flat
    assert "probe_extract_config" not in sys.modules  # read, not imported
    out = CliRunner().invoke(main, ["train", "--help"])
    flat = " ".join(out.output.split())
    assert "train eagerly and say so. [default: on]" in flat
    assert "Drafter decoder layers. [default: 5]" in flat


def test_help_loads_no_torch_and_marks_the_required_flags():
    """--help of every stage command is built without importing torch (it took ~2.7 s with it), and says which
    flags the command needs."""
    code = ("import json, sys\nimport click\nfrom click.testing import CliRunner\nfrom dflash.cli import main\n"
            "required = {}\n"
            "for c in ('extract', 'train', 'eval', 'regenerate', 'prompts'):\n"
            "    r = CliRunner().invoke(main, [c, '--help'])\n"
            "    assert r.exit_code == 0, (c, r.output)\n"
            "    ctx = click.Context(main.commands[c], info_name=c)\n"
            "    required[c] = sorted(p.name for p in main.commands[c].params\n"
            "                         if (p.get_help_record(ctx) or ('', ''))[1].endswith('[required]'))\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'required': required}))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["torch"] is False
    assert out["required"] == {"extract": ["data", "out", "target"], "train": ["cache", "out", "target"],
                               "eval": ["data", "drafter", "target"], "regenerate": ["data", "out", "target"],
                               "prompts": ["out", "target"]}
