"""Evaluation by real speculative decoding: `dflash eval` (eval.py), the decoding loop (decode.py), the drafters as
proposers (drafting.py, dflash2_drafting.py) and the target that verifies (verify.py). Imports train.drafter."""
