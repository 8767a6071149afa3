"""What every `dflash` command shares (dflash/cli.py): one-line errors for known failures, the checks of the paths a
command writes, the --gpus relaunch under torchrun, and options whose --help default is the command's config
dataclass default (ConfigOption / option).
"""

from __future__ import annotations

import functools
import os
import sys

import click

import dflash_cache
from dflash.core.errors import DflashError
from dflash.core.paths import check_apart, check_input_path, check_output_dir, check_output_file


class CleanErrors(click.Group):
    """Known errors (bad input, bad cache) print one clear line and exit 2, never a deep traceback. click's own usage
    errors (a value of the wrong type, an unknown option or command) are such a line too, followed by where --help is.
    Anything else is a bug and keeps its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            click.echo(f"error: {one_line(e.format_message())}", err=True)
            if e.ctx is not None:
                click.echo(f"(see `{e.ctx.command_path} --help`)", err=True)
            sys.exit(2)
        except known_errors() as e:
            click.echo(f"error: {one_line(str(e))}", err=True)
            sys.exit(2)


def one_line(message: str) -> str:
    """A message on one line (a library's multi-line reason joined with ' | ')."""
    return " | ".join(part.strip() for part in message.splitlines() if part.strip())


def known_errors() -> tuple[type[Exception], ...]:
    return (dflash_cache.CacheError, DflashError)


# what each input flag must be (dflash.core.paths.check_input_path): a directory, a file, or either
INPUT_KINDS = {"cache": "dir", "val_cache": "dir", "drafter": "dir", "chat_template": "file"}


def check_paths(json=None, plot=None, chat_template=None, out=None, read=None, **inputs) -> None:
    """Every path a command will write or read is checked before the work starts (dflash.core.paths): outputs
    (json, plot: files; out: a directory) can be written, inputs exist and can be read (`read` and `inputs`: flag ->
    path), and `inputs` (data, target) lie outside --out."""

    check_output_file(json, "json")
    check_output_file(plot, "plot")
    if chat_template and "{" not in chat_template:  # a file name (a template's text holds Jinja braces)
        check_input_path(chat_template, "chat_template", "file")
    for name, path in {**inputs, **(read or {})}.items():
        check_input_path(path, name, INPUT_KINDS.get(name, "any"))
    check_output_dir(out, "out")
    check_apart(out, **inputs)


def check_tokenize_cache(setting: str | None) -> None:
    """extract's tokenise cache directory can be written: --tokenize-cache DIR, else $DFLASH_TOKENIZE_CACHE (the
    default under ~/.cache is left to the first write)."""
    if setting == "off":
        return
    if setting:
        check_output_dir(setting, "tokenize_cache")
    elif os.environ.get("DFLASH_TOKENIZE_CACHE"):
        check_output_dir(os.environ["DFLASH_TOKENIZE_CACHE"], "tokenize_cache", label="$DFLASH_TOKENIZE_CACHE")


def refuse_gpus_under_torchrun(gpus: str | None) -> None:
    """--gpus inside a process torchrun started is a usage error (checked first: nothing else matters then)."""
    from dflash.core.dist import under_torchrun

    if gpus and under_torchrun():
        raise click.UsageError("--gpus cannot be used under torchrun (torchrun already chose the GPUs)")


def relaunch_with_gpus(gpus: str | None, command: str) -> bool:
    """The --gpus convenience: re-run this command under torchrun on those GPUs (returns True if it did)."""
    if not gpus:
        return False
    from dflash.core.dist import launch_torchrun

    refuse_gpus_under_torchrun(gpus)
    sys.exit(launch_torchrun("dflash", argv_without_gpus(sys.argv[1:]), gpus))


def argv_without_gpus(argv: list[str]) -> list[str]:
    """The command line that each torchrun process gets: argv without `--gpus IDS` / `--gpus=IDS`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--gpus":
            skip = True
            continue
        if a.startswith("--gpus="):
            continue
        out.append(a)
    return out


# Where a command's option shows its default in --help: the config dataclass of the command, read from its module's
# source (config_fields: the stage modules load torch, ~3 s, which --help never does), so a default changed there
# shows here.
COMMAND_CONFIGS = {
    "extract": ("dflash.extract.run", "ExtractConfig"),
    "train": ("dflash.train.fit.config", "TrainConfig"),
    "eval": ("dflash.train.evaluate.eval", "EvalConfig"),
    "regenerate": ("dflash.extract.generation.regenerate", "RegenerateConfig"),
    "prompts": ("dflash.extract.generation.prompts", "PromptsConfig"),
}


def command_config(command: str):
    """The command's config dataclass itself (imports its stage module: torch)."""
    import importlib

    module, name = COMMAND_CONFIGS[command]
    return getattr(importlib.import_module(module), name)


@functools.lru_cache(maxsize=None)
def config_fields(command: str) -> tuple[dict, frozenset]:
    """(field -> default, required fields) of the command's config dataclass, read from its module's source with ast,
    without importing it. A default is the field's literal value (or a module constant's); one that is not a literal
    (a default_factory, a call, an expression) is dataclasses.MISSING, as a default_factory is in dataclasses.fields.
    Required: the fields its __post_init__ checks with `check(bool(self.NAME), "NAME", "is required ...")`."""
    import ast
    import dataclasses
    import importlib.util

    module, name = COMMAND_CONFIGS[command]
    origin = importlib.util.find_spec(module).origin  # imports the stage package's __init__ only (no torch)
    with open(origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), origin)
    constants = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)

    def literal(node):
        node = constants.get(node.id, node) if isinstance(node, ast.Name) else node
        try:
            return ast.literal_eval(node)
        except ValueError:
            return dataclasses.MISSING

    defaults, required = {}, set()
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and "ClassVar" not in ast.unparse(
                stmt.annotation):
            defaults[stmt.target.id] = dataclasses.MISSING if stmt.value is None else literal(stmt.value)
        elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__post_init__":
            for call in ast.walk(stmt):
                if (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "check" and len(call.args) >= 3
                        and ast.unparse(call.args[0]).startswith("bool(self.")
                        and isinstance(call.args[2], ast.Constant) and str(call.args[2].value).startswith("is required")):
                    required.add(ast.literal_eval(call.args[1]))
    return defaults, frozenset(required)


def format_default(value) -> str | None:
    """How a dataclass default reads in --help: on/off for booleans, nothing for None, "" and containers."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "" or isinstance(value, (dict, list, tuple)):
        return None
    return str(value)


MAX_INT = 2**63 - 1  # what torch and numpy hold: a larger integer flag is a typo, refused before it reaches them


class BoundedInt(click.types.IntParamType):
    """click's INT, refusing integers beyond +-MAX_INT (99999999999999999999 was an OverflowError or TypeError deep
    in torch). Each setting's own sane bound is its config dataclass's check (e.g. train/fit/config.py)."""

    def convert(self, value, param, ctx):
        n = super().convert(value, param, ctx)
        if abs(n) > MAX_INT:
            self.fail(f"{value} is too large (at most {MAX_INT})", param, ctx)
        return n


BOUNDED_INT = BoundedInt()


class ConfigOption(click.Option):
    """A command option whose `[default: ...]` is its config field's dataclass default (the field of the same
    name in COMMAND_CONFIGS[command], config_fields); `default_text` replaces it where the default is a rule ('auto',
    None or 0 resolved at run time: "bf16 on GPU, fp32 on CPU"). Plain flags (--overwrite) show no default. A field
    the config requires shows `required` (given here or by the command's --config preset)."""

    def __init__(self, *args, default_text: str | None = None, **kwargs):
        if kwargs.get("type") is int:
            kwargs["type"] = BOUNDED_INT
        super().__init__(*args, **kwargs)
        self.default_text = default_text

    def config_default(self, command: str):
        """The dataclass default of this option's field (dataclasses.MISSING if there is none)."""
        import dataclasses

        return config_fields(command)[0].get(self.name, dataclasses.MISSING)

    def shown_default(self, command: str) -> str | None:
        import dataclasses

        if self.default_text is not None:
            return self.default_text
        if self.is_flag and not self.secondary_opts:
            return None
        value = self.config_default(command)
        return None if value is dataclasses.MISSING else format_default(value)

    def get_help_extra(self, ctx):
        extra = super().get_help_extra(ctx)
        if ctx.command.name not in COMMAND_CONFIGS:
            return extra
        shown = self.shown_default(ctx.command.name)
        if shown is not None:
            extra["default"] = shown
        if self.name in config_fields(ctx.command.name)[1]:
            extra["required"] = "required"
        return extra


option = functools.partial(click.option, cls=ConfigOption)
