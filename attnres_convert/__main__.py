"""`python3 -m attnres_convert ...` runs the `attnres` command line, also from a checkout with nothing
installed: the package is found in the working directory, a missing required package (torch, typer, ...) is
named with the pip command that installs it, and a command names any optional package it needs that is missing
(attnres_convert/optional.py)."""

import sys

from attnres_convert.optional import missing_required, missing_required_message

if __name__ == "__main__":
    if missing := missing_required():
        print(f"error: {missing_required_message(missing)}", file=sys.stderr)
        sys.exit(2)
    from attnres_convert.cli import main

    sys.exit(main())
