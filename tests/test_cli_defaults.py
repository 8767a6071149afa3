"""--help shows the config dataclasses' defaults, not a copy of them.

Every option of `dflash extract|train|eval|regenerate` that maps to a config field shows that field's
dataclass default (booleans as on/off); a short human text is allowed only where the default is a rule
resolved at run time (None, 'auto' or 0); no help string carries a hand-written `[default: ...]`; and a
default changed in the dataclass shows in the rendered --help.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import click
import pytest
from click.testing import CliRunner

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.cli import main  # noqa: E402
from dflash.cli_options import COMMAND_CONFIGS, ConfigOption, command_config  # noqa: E402

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


def test_a_changed_dataclass_default_shows_in_help(monkeypatch):
    from dflash.extract.run import ExtractConfig
    from dflash.train.trainer import TrainConfig

    monkeypatch.setattr(ExtractConfig.__dataclass_fields__["seq_len"], "default", 4096)
    monkeypatch.setattr(TrainConfig.__dataclass_fields__["compile_check"], "default", False)
    runner = CliRunner()
    out = runner.invoke(main, ["extract", "--help"])
    assert out.exit_code == 0, out.output
    flat = " ".join(out.output.split())  # undo click's line wrapping
    assert "exactly T tokens. [default: 4096]" in flat
    assert "[default: 2048]" not in flat
    out = runner.invoke(main, ["train", "--help"])
    flat = " ".join(out.output.split())
    assert "train eagerly and say so. [default: off]" in flat
    assert "Drafter decoder layers. [default: 5]" in flat
