"""dflash: train DFlash speculative-decoding drafters through a hidden-state cache on disk."""

__version__ = "0.1.0"
