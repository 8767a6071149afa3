"""Generation with the target: `dflash regenerate` (regenerate.py, regen_out.py) and `dflash prompts`
(prompts.py), their engines (engine.py; slot_engine.py on a static cache, kind_engine.py per layer kind; generate.py
chooses) with their KV cache (slab.py) and sampling (sampling.py). Imports extraction's chat data (extract.data)."""
