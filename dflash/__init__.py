"""dflash: train DFlash speculative-decoding drafters through a hidden-state cache on disk.

Packages, top to bottom (imports point down only):

    dflash.cli, dflash.recipes                  the commands and `dflash demo`'s recipes: the only modules that import
                                                the stages
    dflash.extract   (folder extract/)          stage 1: chat data -> packed rows -> frozen target -> cache
    dflash.train     (folder train/)            stage 2: drafter model, compiled step, trainer, eval
    dflash.core                                 shared by both stages: config, dist, errors, paths, target
    dflash.configs   (folder configs/)          YAML presets, read with importlib.resources
    dflash_cache                                the cache format, writer, reader (imports nothing of dflash)

The stage folders and configs/ sit next to dflash/ in the repository (the layout of the design card); an
installed wheel has them inside dflash/ (pyproject's package-dir), an editable install maps them there
with setuptools' finder, and a source checkout on sys.path (PYTHONPATH=. or the tests) finds them
through the package path extended below.
"""

import os as _os

__version__ = "0.1.0"

_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "extract")) and all(
        _os.path.isfile(_os.path.join(_checkout, sub, "__init__.py")) for sub in ("extract", "train", "configs")):
    __path__.append(_checkout)  # a source checkout: dflash.extract -> extract/, dflash.train -> train/  # noqa: F821
del _here, _checkout
