from dflash.cli import main

main()
