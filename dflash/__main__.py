from dflash.cli import main
from dflash.core.dist import finish

try:
    main()
except SystemExit as e:
    if e.code in (0, None):  # under torchrun: the ranks leave together (dflash.core.dist.finish)
        finish()
    raise
