"""Errors a user can fix. Each message names the input and the fix; the CLI maps them to exit code 2."""

from __future__ import annotations


class AttnResError(Exception):
    """Bad input or environment: the message says what was wrong and what to do."""


class SourceError(AttnResError):
    """The model source (hub id, folder, GGUF file) cannot be used."""


class OutputError(AttnResError):
    """The output location cannot be written."""


class VerificationError(AttnResError):
    """The converted model does not reproduce the original within tolerance."""
