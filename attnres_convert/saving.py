"""Careful saving: a converted folder appears complete or not at all.

Everything is written to a hidden temporary folder beside the output and moved into place at the end
(a rename on the same filesystem), so a crash or SIGKILL never leaves a half-written model at the
output path, and an existing output is untouched until its replacement is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_attnres import AttnResConfig
from .errors import OutputError, SourceError
from .modeling_attnres import AttnResForCausalLM

# save_pretrained copies the modeling code (and its relative imports) next to the weights and writes
# `auto_map`, so the folder loads with trust_remote_code=True where this package is not installed.
AttnResConfig.register_for_auto_class()
AttnResForCausalLM.register_for_auto_class("AutoModelForCausalLM")
AutoConfig.register("attnres", AttnResConfig, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)

SHIPPED_CODE = ("configuration_attnres.py", "modeling_attnres.py", "architectures.py", "depth_attention.py")


def check_output(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Fail early, before any work, if the output cannot be written."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise OutputError(f"output {out} is a file, not a folder. Choose another output path.")
    if path.is_dir() and not overwrite and any(path.iterdir()):
        raise OutputError(f"output folder {out} already exists. Pass --overwrite to replace it, or choose another path.")
    parent = path.resolve().parent
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write to {existing} (read-only or not a folder). Choose an output path you can write to.")
    return path


def atomic_folder(out: Path, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Run `write(tmp)` into a temporary folder beside `out`, then move it into place."""
    out = check_output(out, overwrite)
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.resolve().parent))
    try:
        write(tmp)
        _fsync_tree(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def write_converted(model: AttnResForCausalLM, folder: Path, tokenizer=None, extra: dict[str, str] | None = None) -> None:
    """Weights (safetensors), config, generation config, self-contained code, tokenizer, extras."""
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    for name, text in (extra or {}).items():
        (folder / name).write_text(text)
    missing = [name for name in SHIPPED_CODE if not (folder / name).is_file()]
    if missing:
        raise OutputError(f"internal error: save_pretrained did not copy {missing}; the folder would not load")


def save_converted(
    model: AttnResForCausalLM,
    out: str | os.PathLike,
    tokenizer=None,
    overwrite: bool = False,
    extra: dict[str, str] | None = None,
) -> Path:
    return atomic_folder(Path(out), lambda tmp: write_converted(model, tmp, tokenizer, extra), overwrite)


def is_converted_folder(path: str | os.PathLike) -> bool:
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") == "attnres"
    except (OSError, ValueError):
        return False


def load_converted(path: str | os.PathLike, **kwargs) -> AttnResForCausalLM:
    """Load a converted folder with this package's classes (no remote code needed)."""
    if not is_converted_folder(path):
        raise SourceError(f"{path} is not an AttnRes model folder (no config.json with model_type 'attnres').")
    return AttnResForCausalLM.from_pretrained(path, **kwargs)
