"""`python -m kvsplice ...`: the same command line as the `kvsplice` script."""

from kvsplice.cli import main

main()
