"""Packages that only some commands need, and the message a command gives when one is missing.

attnres runs from a checkout (`python3 -m attnres_convert`) in an environment that has only torch,
transformers, accelerate, peft, typer and rich, such as a stock GPU training image. numpy, pyyaml,
safetensors, huggingface_hub and psutil come with those (transformers, accelerate and peft require them); the
packages below do not, so each is imported where a command needs it, through `require`, and a command that
does not need one works without it.

The bottom of the package beside errors.py: it imports nothing else of attnres_convert but errors.
"""

from __future__ import annotations

import importlib
import shlex
import sys
from types import ModuleType

from .errors import AttnResError

# import name -> the requirement that installs it (the lower bounds of pyproject.toml)
REQUIREMENTS = {
    "pydantic": "pydantic>=2.5.3",
    "datasets": "datasets>=3.0",
    "pyarrow": "pyarrow",
    "gguf": "gguf>=0.17.1",
    "matplotlib": "matplotlib>=3.9",
}


class MissingPackageError(AttnResError):
    """A package the command needs is not installed: the message names it, why, and how to install it."""


def install_command(module: str) -> str:
    """The command that installs MODULE's package into the Python running now."""
    return f"{shlex.quote(sys.executable)} -m pip install {shlex.quote(REQUIREMENTS[module])}"


def missing_message(module: str, needed_for: str) -> str:
    return (
        f"{needed_for} needs the Python package {module!r}, which is not installed in this environment. "
        f"Install it with: {install_command(module)}"
    )


def require(module: str, needed_for: str) -> ModuleType:
    """MODULE imported, or a MissingPackageError saying that NEEDED_FOR (what the command does with it, e.g.
    'reading a GGUF file') needs it and the pip command that installs it."""
    if module not in REQUIREMENTS:
        raise ValueError(f"{module!r} is not one of the optional packages: {', '.join(REQUIREMENTS)}")
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackageError(missing_message(module, needed_for)) from None


def available(module: str) -> bool:
    """Whether MODULE imports (for output that is written only when it does, such as a plot)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
