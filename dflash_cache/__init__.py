"""dflash_cache: the hidden-state cache shared by `dflash extract` (writer) and `dflash train` (reader).

See format.py for the on-disk layout. Usable on its own:

    import dflash_cache
    cache = dflash_cache.open("path/to/cache")
    row = cache[0]            # input_ids, loss_mask, doc_ids, hidden (bf16 [T, K*H])

Hidden states are stored as bf16, or quantised (fp8 e4m3 / experimental fp4 e2m1, with scales): quant.py
holds the formulas (and the torch (de)quantisers), format.py the layout.
"""

from .format import (
    CODECS,
    FORMAT_NAME,
    FORMAT_VERSION,
    CacheCorruptError,
    CacheError,
    CacheIncompleteError,
    CacheMismatchError,
    CacheNotFoundError,
    CacheSpec,
    CacheVersionError,
    NotACacheError,
    fingerprint,
)
from . import quant
from .inspect import VerifyReport, info, verify
from .reader import Batch, Cache, open, shard_order
from .writer import CacheWriter

__all__ = [
    "CODECS", "FORMAT_NAME", "FORMAT_VERSION", "Batch", "Cache", "CacheCorruptError", "CacheError", "CacheIncompleteError",
    "CacheMismatchError", "CacheNotFoundError", "CacheSpec", "CacheVersionError", "CacheWriter", "NotACacheError",
    "VerifyReport", "fingerprint", "info", "open", "quant", "shard_order", "verify",
]
