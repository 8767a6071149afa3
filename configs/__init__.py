"""dflash.configs: the YAML presets (`--config NAME`), shipped as package data and read with importlib.resources."""
