"""dflash.core: the bottom layer, shared by both stages and the CLI; it imports neither stage.

config (presets + flags -> dataclasses), errors, dist (process setup, torchrun), progress, paths (flag
checks, output lock), weights (fingerprints, role checks), target (Hugging Face target loading, decoder
layers, hidden-state capture, GGUF conversion), layers (which target layers a drafter reads), chat (chat
datasets -> lists of messages, eos ids), io (atomic writes, short content hashes). `dflash.extract` and
`dflash.train` import from here and from `dflash_cache`, never from each other; only the CLI and the demo
(dflash/cli.py, dflash/recipes/) import the stages.
"""
