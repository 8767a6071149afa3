"""Stage 1 of dflash: chat dataset -> chat tokens + loss masks -> packed rows -> frozen target -> cache shards.

extract.data: loading and tokenising chat datasets; extract.pack: best-fit packing into fixed-length rows;
extract.target and extract.compiled: the frozen target's packed forward; extract.run: the command.
extract.generation: the target writing text (`dflash regenerate`, `dflash prompts`); it imports extraction's chat data,
extraction imports nothing of it (tests/test_imports.py).
"""
