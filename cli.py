"""`python cli.py ...` in a checkout runs the `attnres` command line.

The Typer app lives in `attnres_convert/cli.py` (the package's top layer), so the console script of an
installed wheel and this file run the same commands."""

import sys

from attnres_convert.optional import missing_required, missing_required_message

if __name__ == "__main__" and (missing := missing_required()):
    print(f"error: {missing_required_message(missing)}", file=sys.stderr)
    sys.exit(2)

from attnres_convert.cli import app, main  # noqa: E402, F401  (app: for `typer cli.py` and tests)

if __name__ == "__main__":
    sys.exit(main())
