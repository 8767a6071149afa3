"""Serving: `dflash export` (export.py, export_dir.py) and `dflash check` (contract.py), how each engine reads a
drafter (engines.py), and what a run recorded of its target (target_record.py). Imports train.drafter."""
