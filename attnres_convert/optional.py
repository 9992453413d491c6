"""Packages that only some commands need, and the message a command gives when one is missing.

attnres runs from a checkout (`python3 -m attnres_convert`) in an environment that has only torch,
transformers, accelerate, peft, typer and rich (REQUIRED: where one of those is missing, the command says which
and how to install them instead of failing on the import), such as a stock GPU training image. numpy, pyyaml,
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


# The packages every command needs (imported by the command line itself, or by every model it loads), with the
# lower bounds of pyproject.toml: their absence is answered before anything is imported (`missing_required`).
REQUIRED = {
    "torch": "torch>=2.6",
    "transformers": "transformers>=5.16.1,<6",
    "accelerate": "accelerate>=1.15",
    "peft": "peft>=0.15",
    "typer": "typer>=0.29",
    "rich": "rich>=13.8",
}


def missing_required() -> list[str]:
    """Those of REQUIRED that are not installed, found without importing them (torch takes seconds)."""
    import importlib.util

    missing = []
    for module in REQUIRED:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    return missing


def missing_required_message(missing: list[str]) -> str:
    """What `python3 -m attnres_convert` says where MISSING (required packages) are not installed."""
    names = ", ".join(missing)
    specs = " ".join(shlex.quote(REQUIRED[module]) for module in missing)
    torch_note = (
        " (on a machine without a GPU, the CPU build of torch is smaller: add "
        "--index-url https://download.pytorch.org/whl/cpu to install torch alone first)"
        if "torch" in missing
        else ""
    )
    return (
        f"attnres needs the Python package{'s' if len(missing) > 1 else ''} {names}, which "
        f"{'are' if len(missing) > 1 else 'is'} not installed in this environment. Install "
        f"{'them' if len(missing) > 1 else 'it'} with: {shlex.quote(sys.executable)} -m pip install {specs}{torch_note}; "
        "or, in this checkout, everything at once: make install"
    )


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
