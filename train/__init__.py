"""Stage 2 of dflash: a drafter from the cache, what it is worth, and a checkpoint each engine reads as trained.

One folder per concern, imports pointing one way (tests/test_imports.py):

    drafter/   the DFlash / DFlash2 model, its RoPE, block attention, loss and checkpoint layout (imports no other room)
    fit/       `dflash train`: settings, compiled step, run directory, time budget, follower, validation
    evaluate/  `dflash eval`: greedy speculative decoding with the target, the drafters as proposers
    serve/     `dflash export` and `dflash check`: the engines' reading of a drafter, replayed

evaluate/ and serve/ import drafter/; fit/ imports drafter/ and serve/ (its closing serving check).
"""
