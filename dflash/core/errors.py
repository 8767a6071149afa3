"""The one error base the CLI knows: bad input, or a run that cannot proceed.

Each stage raises its own subclass (ConfigError, DataError, TargetError, TrainError, ...) with a
message that names the file, row, flag or field; `dflash` prints it as one `error:` line and exits 2.
Cache errors have their own base in dflash_cache (usable without the rest of dflash).
"""


class DflashError(Exception):
    pass
