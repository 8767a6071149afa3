"""dflash.recipes: `dflash demo`, the whole pipeline on a real chat model from data shipped in packages.

A command layer (like dflash/cli.py): the only modules besides the CLI that import the stages, and never imported by
them. demo.py is the command's entry (its settings, the choice of recipe); the CPU recipe (demo.py) and the GPU
recipe (gpu.py, configs/demo-gpu.yaml) share the assets (assets.py), the data sources (sources.py), the stage lines,
the stored result and the caches kept under the workdir (stages.py); the GPU recipe adds the user turns the target
writes itself (self_prompts.py).
"""
