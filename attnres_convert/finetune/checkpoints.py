"""Resumable checkpoints of a fine-tuning run, written with Accelerate's `save_state`.

A checkpoint (OUT/checkpoints/step-0000100/) holds the trainable weights, the optimizer, the LR
scheduler, every process's RNG state and the trainer state (step and data position). Frozen weights
are not stored: they are rebuilt from the recipe (same source, same conversion) on resume, so a
checkpoint of an AttnRes-only run is kilobytes, not the whole model.

Atomic: every process writes into a hidden `.step-0000100.partial` folder, and the main process
renames it into place only once all have finished; a crash leaves at worst a partial folder, which
is ignored and removed by the next save. Only the last `keep_last` checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ..io.saving import fsync_tree

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    """Where the run is: registered with Accelerate so that it travels in every checkpoint."""

    step: int = 0  # optimizer steps done
    position: int = 0  # training sequences consumed (the data stream position)
    tokens: int = 0  # training tokens seen, all processes
    train_seconds: float = 0.0  # time spent in training steps (for tokens/s over the whole run)
    train_sequences: int = 0  # the training set's size: the data order is a permutation of it (SequenceOrder)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINTS / f"step-{step:07d}"


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    folder = out / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def latest_checkpoint(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def remove_partial_checkpoints(out: Path) -> None:
    folder = out / CHECKPOINTS
    if folder.is_dir():
        for partial in folder.glob(".step-*.partial"):
            shutil.rmtree(partial, ignore_errors=True)


def trainable_only_hook(models, weights, output_dir) -> None:
    """Accelerate save hook: keep only parameters that train (frozen ones are rebuilt on resume)."""
    for model, state in zip(models, weights):
        keep = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        for key in [k for k in state if k not in keep]:
            del state[key]


def save_checkpoint(accelerator, out: Path, state: TrainerState, keep_last: int) -> Path:
    """Called on every process (each saves its RNG state); returns the checkpoint folder."""
    final = checkpoint_dir(out, state.step)
    partial = final.with_name(f".{final.name}.partial")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with _tied_copies_dropped_quietly():
        accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # Readable copy of the trainer state, for people and for the resume message.
        (partial / "trainer_state.json").write_text(json.dumps(state.state_dict(), indent=2))
        fsync_tree(partial)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in list_checkpoints(out)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


class _NotTiedCopies(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


@contextlib.contextmanager
def _tied_copies_dropped_quietly() -> Iterator[None]:
    """Accelerate's safetensors save keeps one name of tensors that share storage (tied input and output
    embeddings: lm_head.weight is embed_tokens.weight) and logs "[RANK 0] Removed shared tensor ... This should
    be OK, but check ...". Here it is: the model is rebuilt from the recipe with its weights tied before a
    checkpoint is loaded into it, so loading embed_tokens.weight sets lm_head.weight too
    (tests/test_finetune.py resumes a tied model to the uninterrupted run's weights). The line stays off the
    console; every other message of that logger still shows."""
    logger = logging.getLogger("accelerate.utils.other")
    quiet = _NotTiedCopies()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def check_checkpoint_is_data(path: Path) -> None:
    """Accelerate reads registered objects (scheduler, trainer state: custom_checkpoint_*.pkl) with
    torch.load(weights_only=False), which runs any code a tampered file holds. Read each one first with
    weights_only=True (tensors, numbers, strings, containers only) and refuse the checkpoint otherwise."""
    from accelerate.utils import load

    from .recipe import RecipeError

    for file in sorted(Path(path).glob("custom_checkpoint_*.pkl")):
        try:
            load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any refusal of the safe unpickler
            found = re.search(r"GLOBAL ([\w.]+)", str(error))
            raise RecipeError(
                f"--resume: {file} holds Python objects other than plain data{f' ({found.group(1)})' if found else ''}; "
                "refusing to unpickle it, as it could run code. Resume only from checkpoints attnres wrote, or start "
                "a new run (output.overwrite=true or another output.dir)."
            ) from None


def check_checkpoint_weights(path: Path, model) -> None:
    """The checkpoint must hold every trainable tensor of MODEL (the prepared model; frozen ones are rebuilt
    from the recipe) and nothing else: loading it non-strictly would otherwise resume with some weights
    silently reset to their starting values. Tied parameters are stored once, under either name. FSDP
    checkpoints (a sharded folder) are checked by Accelerate itself."""
    from .recipe import RecipeError

    files = [Path(path) / "model.safetensors", Path(path) / "pytorch_model.bin"]
    found = next((f for f in files if f.is_file()), None)
    if found is None:
        if any(Path(path).glob("pytorch_model_fsdp_*")):
            return
        raise RecipeError(
            f"--resume: {path} holds no model weights (model.safetensors); it is not a complete checkpoint. {_START_OVER}"
        )
    if found.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(found), framework="pt") as handle:
            stored = set(handle.keys())
    else:
        import torch

        stored = set(torch.load(found, map_location="cpu", weights_only=True))
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            names.setdefault(id(param), []).append(name)
    missing = [aliases[0] for aliases in names.values() if not stored & set(aliases)]
    unexpected = sorted(stored - {name for aliases in names.values() for name in aliases})
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} trainable tensor(s) ({_some(missing)})")
        if unexpected:
            parts.append(f"holds {len(unexpected)} tensor(s) this recipe does not train ({_some(unexpected)})")
        raise RecipeError(
            f"--resume: checkpoint {path} {' and '.join(parts)}: it was not written by this recipe's run, or it is "
            f"damaged. Resuming would silently start those weights over. {_START_OVER}"
        )


_START_OVER = "Resume from another checkpoint (delete this one), or start a new run (output.overwrite=true or another output.dir)."


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... {len(names) - shown} more" if len(names) > shown else "")


def load_checkpoint(accelerator, path: Path, model) -> None:
    check_checkpoint_is_data(path)
    check_checkpoint_weights(path, model)
    # strict=False: the checkpoint holds the trainable weights only (checked above to be all of them).
    accelerator.load_state(str(path), strict=False)
