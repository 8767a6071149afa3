"""Imports point one way (DESIGN.md section 2): the commands on top, the two stages, the bottom, the cache.

    dflash.cli, dflash.pipeline, dflash.recipes  may import everything below
    dflash.extract   |   dflash.train             import dflash.core and dflash_cache, never each other
    dflash.core                                   imports dflash_cache only (no stage, no command)
    dflash_cache                                  imports nothing of dflash

Checked twice: dynamically, by importing every module of a layer in a fresh interpreter and listing what got
loaded (this sees imports made at import time, including those of the modules imported); and statically, by
reading every .py file of the repository with ast (this sees imports inside function bodies too, which run
only when called). Also: nothing installs or loads a top-level `extract` or `train` module.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STAGES = {"extract": REPO / "extract", "train": REPO / "train"}
RECIPES = REPO / "dflash" / "recipes"
# the command layer: the CLI, the pipeline and every module of dflash.recipes (`dflash demo`)
COMMANDS = {"dflash.cli", "dflash.cli_options", "dflash.__main__", "dflash.pipeline", "dflash.recipes",
            *("dflash.recipes." + p.stem for p in RECIPES.glob("*.py") if p.stem != "__init__")}


def _modules(package: str, folder: Path) -> list[str]:
    return sorted(package + ("" if p.stem == "__init__" else "." + ".".join(p.relative_to(folder).with_suffix("").parts))
                  for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _loaded_after_importing(modules: list[str]) -> list[str]:
    """The dflash/dflash_cache/extract/train modules loaded by importing `modules` in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('dflash', 'dflash_cache', 'extract', 'train'))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in ("extract", "train"):
        return parts[0]  # a top-level name: must not exist at all (checked separately)
    if parts[0] == "dflash" and len(parts) > 1 and parts[1] in ("extract", "train"):
        return parts[1]
    return None


@pytest.mark.parametrize("stage,other", [("extract", "train"), ("train", "extract")])
def test_importing_a_stage_never_loads_the_other_stage_nor_a_command(stage, other):
    loaded = _loaded_after_importing(_modules(f"dflash.{stage}", STAGES[stage]))
    assert f"dflash.{stage}.run" in loaded or f"dflash.{stage}.fit.trainer" in loaded  # the stage itself was imported
    assert not [m for m in loaded if _stage(m) == other], f"dflash.{stage} loads dflash.{other}: {loaded}"
    assert not COMMANDS & set(loaded), f"dflash.{stage} loads a command module: {sorted(COMMANDS & set(loaded))}"
    assert not [m for m in loaded if m.split(".")[0] in ("extract", "train")], f"top-level stage names loaded: {loaded}"


def test_the_bottom_loads_neither_stage_nor_a_command():
    loaded = _loaded_after_importing(_modules("dflash.core", REPO / "dflash" / "core"))
    assert "dflash.core.target" in loaded and "dflash.core.config" in loaded
    assert not [m for m in loaded if _stage(m)], loaded
    assert not COMMANDS & set(loaded), loaded


def test_dflash_cache_loads_nothing_of_dflash():
    loaded = _loaded_after_importing(_modules("dflash_cache", REPO / "dflash_cache"))
    assert "dflash_cache.reader" in loaded
    assert [m for m in loaded if not m.startswith("dflash_cache")] == [], loaded


def test_the_commands_start_without_torch():
    """`dflash --help` and the cache commands import the CLI, not torch (the stages are imported by the commands
    that run them)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", "import sys, dflash.cli; print('torch' in sys.modules, "
                        "sorted(m for m in sys.modules if m.startswith(('dflash.extract', 'dflash.train'))))"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[0] == "False" and r.stdout.strip().endswith("[]"), r.stdout


def test_every_command_help_resolves_the_stages_by_their_dflash_names():
    """--help of each command imports its config dataclass by module name (the defaults it shows): those names
    are dflash.extract.* / dflash.train.*; no top-level `extract` or `train` module is ever loaded."""
    code = ("import sys\nfrom click.testing import CliRunner\nfrom dflash.cli import main\n"
            "for cmd in ('extract', 'train', 'eval', 'regenerate', 'prompts', 'demo', 'cache'):\n"
            "    r = CliRunner().invoke(main, [cmd, '--help'])\n"
            "    assert r.exit_code == 0, (cmd, r.output, r.exception)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('extract', 'train')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


# ------------------------------------------------------------------------------------------------ static


def _layer_of_file(rel: Path) -> str | None:
    top = rel.parts[0]
    if top in ("extract", "train"):
        return top
    if top == "dflash_cache":
        return "dflash_cache"
    if top == "dflash":
        if len(rel.parts) > 1 and rel.parts[1] == "core":
            return "core"
        return "command"
    return None  # tests, bench: they may import anything


def _imported_modules(path: Path, rel: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, function bodies included, and of every string
    literal that names a stage module by a top-level name ("extract.run": importlib, monkeypatch targets)."""
    tree = ast.parse(path.read_text(), str(path))
    if rel.parts[0] in ("extract", "train"):
        package = ["dflash", *rel.parts[:-1]]
    else:
        package = list(rel.parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` may import a submodule: count it as pkg.sub
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # code in a string (a script a test writes and runs): its import lines count too
            out += [(node.lineno, m.group(1)) for m in re.finditer(r"(?m)^\s*(?:import|from)\s+([\w.]+)", node.value)
                    if m.group(1).split(".")[0] in STAGES]
            first = node.value.split(".")[0]
            if first in STAGES and "." in node.value and node.value.replace(".", "").replace("_", "").isalnum():
                second = STAGES[first] / node.value.split(".")[1]
                if second.with_suffix(".py").exists() or (second / "__init__.py").exists():
                    out.append((node.lineno, node.value))
    return out


def _forbidden(layer: str, module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in ("extract", "train"):
        return "a top-level stage name (the stages are dflash.extract and dflash.train)"
    if layer == "dflash_cache":
        return "dflash_cache imports nothing of dflash" if parts[0] == "dflash" else None
    if parts[0] != "dflash" or len(parts) < 2:
        return None
    target = parts[1]
    if layer == "core":
        if target in ("extract", "train"):
            return "the bottom imports no stage"
        if f"dflash.{target}" in COMMANDS:
            return "the bottom imports no command"
        if target != "core" and target not in ("__version__",):
            return f"the bottom imports only dflash.core and dflash_cache (got {module})"
    if layer in ("extract", "train"):
        if target in ("extract", "train") and target != layer:
            return f"dflash.{layer} never imports dflash.{target}"
        if f"dflash.{target}" in COMMANDS:
            return "a stage imports no command"
    return None


def test_no_file_imports_across_or_up_the_layers():
    """Every import statement of every source file, function bodies included, points down or stays in its layer."""
    bad = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("work", "build", "dist") or "__pycache__" in rel.parts:
            continue
        layer = _layer_of_file(rel)
        for line, module in _imported_modules(path, rel):
            why = _forbidden(layer, module) if layer else (
                "a top-level stage name (the stages are dflash.extract and dflash.train)"
                if module.split(".")[0] in ("extract", "train") else None)
            if why:
                bad.append(f"{rel}:{line}: {module}: {why}")
    assert not bad, "\n".join(bad)


def test_the_static_check_catches_a_cross_stage_import_in_a_function_body(tmp_path):
    """The check above is not vacuous: a cross-stage import hidden in a function, an upward import from the bottom,
    a dflash import in the cache, and a top-level stage name are all found."""
    cases = {
        ("extract", "from dflash.train.drafter.model import DFlashDrafter"): "never imports dflash.train",
        ("train", "from dflash.extract import data"): "never imports dflash.extract",
        ("core", "from dflash.cli import main"): "imports no command",
        ("core", "from dflash.train import trainer"): "imports no stage",
        ("dflash_cache", "from dflash.core.errors import DflashError"): "imports nothing of dflash",
        ("train", "from %s.target import load_config" % "extract"): "top-level stage name",
        ("core", "importlib.import_module('%s.fit.trainer')" % "train"): "top-level stage name",
        ("core", 'SCRIPT = """\n%s train.fit.trainer as t\n"""' % "import"): "top-level stage name",
    }
    folders = {"extract": Path("extract"), "train": Path("train"), "core": Path("dflash/core"),
               "dflash_cache": Path("dflash_cache")}
    for (layer, stmt), want in cases.items():
        rel = folders[layer] / "probe.py"
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"def f():\n    {stmt}\n")
        found = [_forbidden(_layer_of_file(rel), m) for _, m in _imported_modules(path, rel)]
        assert any(w and want in w for w in found), (layer, stmt, found)
    # relative imports resolve inside the stage: extract/x.py's `from ..train import model` is dflash.train
    rel = Path("extract/probe.py")
    path = tmp_path / rel
    path.write_text("def f():\n    from ..train import model\n")
    assert any(_forbidden("extract", m) for _, m in _imported_modules(path, rel))


# ------------------------------------------------------------------------------------------------ circles


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[0] in ("extract", "train"):
        parts = ["dflash", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the repository modules it imports (function bodies included; `from pkg import sub` counts as
    pkg.sub where that is a module, else as pkg)."""
    files = {}
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in ("dflash", "dflash_cache", "extract", "train") and "__pycache__" not in rel.parts:
            files[_module_name(rel)] = (path, rel)
    graph: dict[str, set[str]] = {}
    for name, (path, rel) in files.items():
        deps = set()
        for _, module in _imported_modules(path, rel):
            while module and module not in files:
                module = module.rpartition(".")[0]
            if module and module != name and not name.startswith(module + "."):  # a package's own __init__
                deps.add(module)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """No two modules import each other, directly or round a longer circle (imports in function bodies count)."""
    assert circles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# the rooms of each stage and the rooms each may import (the stage's own modules import within their room)
ROOMS = {"train/drafter": set(), "train/evaluate": {"train/drafter"}, "train/serve": {"train/drafter"},
         "train/fit": {"train/drafter", "train/serve", "train/evaluate"}, "extract": set(),
         "extract/generation": {"extract"}}


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["dflash", "train"] and len(parts) > 3:
        return "train/" + parts[2]
    if parts[:2] == ["dflash", "extract"]:
        return "extract/generation" if len(parts) > 3 and parts[2] == "generation" else "extract"
    return None


def test_each_concern_is_a_folder_and_imports_point_one_way():
    """train/ is four rooms (drafter, fit, evaluate, serve), extract/ two (extraction, generation): every module of
    a stage lives in a room, and a room imports only the rooms below it."""
    graph = import_graph()
    flat = [m for m in graph if m.count(".") == 2 and m.startswith("dflash.train.")
            and m.split(".")[2] not in ("drafter", "fit", "evaluate", "serve")]
    assert flat == [], f"modules of train/ outside a room: {flat}"
    bad = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                 if _room(a) and _room(b) and _room(a) != _room(b) and _room(b) not in ROOMS[_room(a)])
    assert bad == [], "\n".join(bad)
