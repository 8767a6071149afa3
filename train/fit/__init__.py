"""Training: `dflash train` (trainer.py), its settings (config.py), the compiled step, the run directory and its
checkpoints, the time budget, the follower of a growing cache and held-out validation. Imports train.drafter, and
train.serve for the closing serving check."""
