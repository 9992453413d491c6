"""Re-save a folder converted by an earlier attnres with this release's code (`attnres upgrade`).

A converted folder runs the code it ships, so an older folder keeps loading and generating as it did. To give it
this release's two code files (and the plan recorded in its config, where it predates recorded plans), the
weights and config are loaded with this package's classes and written again; the new folder's logits are checked
against the folder's own code on probe tokens, which must agree exactly.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SourceError, VerificationError
from ..io.paths import check_output, is_converted_folder
from ..io.saving import atomic_folder, load_converted, write_converted
from ..kernels import code_paths_only

PROBE_TOKENS = 24
OLD_CODE = (".py", ".cpp")  # the folder's code files, replaced by this release's


@dataclass(frozen=True)
class UpgradeResult:
    folder: Path
    max_difference: float  # of the logits of the re-saved folder against the folder's own code
    files: tuple[str, ...]  # the code files the new folder ships


def _probe_ids(model) -> torch.Tensor:
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, PROBE_TOKENS), generator=generator)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _own_code_model(folder: Path):
    """FOLDER's model on the code it ships. Not through AutoModelForCausalLM: where this process has registered the
    package's AttnRes classes (it has, to load the new model), transformers prefers them to a folder's own code, and
    the check would compare this release's code with itself."""
    from ..transformers_compat import get_class_from_dynamic_module

    try:
        reference = json.loads((folder / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    except (KeyError, TypeError, ValueError) as error:
        raise SourceError(
            f"{folder}'s config.json names no code of its own (auto_map): there is nothing to upgrade against."
        ) from error
    return get_class_from_dynamic_module(reference, str(folder)).from_pretrained(folder, dtype=torch.float32)


def upgrade_folder(
    folder: str | os.PathLike,
    output: str | os.PathLike | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> UpgradeResult:
    """Write FOLDER again with this release's code, to OUTPUT (FOLDER itself where None, replaced atomically).
    The check runs FOLDER's own code once (`trust_remote_code`: the caller's consent, as for any model code)."""

    folder = Path(folder)
    if not is_converted_folder(folder):
        raise SourceError(f"{folder} is not an AttnRes model folder (no config.json with model_type 'attnres').")
    if not trust_remote_code:
        raise SourceError(
            f"upgrading {folder} checks it against the code it ships, which runs that code: pass --trust-remote-code "
            "if you trust the folder (an attnres conversion you made, or its hub repository)."
        )
    target = Path(output) if output is not None else folder
    in_place = output is None or target.resolve() == folder.resolve()
    check_output(target, overwrite or in_place, owned=in_place)  # before any model runs
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    except Exception:  # noqa: BLE001 - a folder without a tokenizer is re-saved without one
        tokenizer = None
    old = _own_code_model(folder).eval()
    new = load_converted(folder, trust_remote_code=True, dtype=torch.float32).eval()
    ids = _probe_ids(new)
    with code_paths_only():  # code against code: the C++ kernels' sums would differ from either by rounding
        difference = (_logits(old, ids) - _logits(new, ids)).abs().max().item()
    del old
    if difference != 0.0:
        raise VerificationError(
            f"{folder}: this release's code gives logits {difference:.3g} away from the folder's own code on "
            f"{PROBE_TOKENS} probe tokens; the folder was left as it is. Keep using it with its own code."
        )

    def write(tmp: Path) -> None:
        write_converted(new, tmp, tokenizer)
        for path in folder.iterdir():  # everything else the folder holds (its card, reports), but its old code
            if path.suffix in OLD_CODE or (tmp / path.name).exists():
                continue
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, tmp / path.name)

    written = atomic_folder(target, write, overwrite=overwrite or in_place, owned=in_place)
    files = tuple(sorted(path.name for path in written.glob("*.py")))
    return UpgradeResult(written, difference, files)
