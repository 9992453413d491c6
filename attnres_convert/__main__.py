"""`python3 -m attnres_convert ...` runs the `attnres` command line, also from a checkout with nothing
installed: the package is found in the working directory, and a command names any optional package it
needs that is missing (attnres_convert/optional.py)."""

import sys

from attnres_convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
