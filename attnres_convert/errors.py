"""Errors a user can fix, and what makes a message safe to show: the CLI maps AttnResError to exit code 2.

The bottom of the package: it imports nothing else of attnres_convert.
"""

from __future__ import annotations

import re

_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{20,}")


class AttnResError(Exception):
    """Bad input or environment: the message says what was wrong and what to do."""


class SourceError(AttnResError):
    """The model source (hub id, folder, GGUF file) cannot be used."""


class OutputError(AttnResError):
    """The output location cannot be written."""


class VerificationError(AttnResError):
    """The converted model does not reproduce the original within tolerance."""


class DataError(AttnResError):
    """A text file cannot be read as documents (e.g. a record without the text field)."""


def first_line(error: BaseException) -> str:
    """The first line of an upstream error (its class name when it has no message): enough to name the
    cause inside one of our messages without pasting a traceback-sized text."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def scrub(text: str, token: str | None = None) -> str:
    """TEXT with TOKEN (and anything shaped like a HuggingFace token) replaced by ***."""
    if token:
        text = text.replace(token, "***")
    return _TOKEN_PATTERN.sub("hf_***", text)
