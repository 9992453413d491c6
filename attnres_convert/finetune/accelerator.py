"""The Accelerator of one run: devices, mixed precision and distribution, set from the recipe."""

from __future__ import annotations

import os

import torch

from .recipe import Recipe, RecipeError


def make_accelerator(recipe: Recipe):
    """An Accelerator with the recipe's mixed precision, on a state that no earlier run in this process set."""
    from accelerate import Accelerator

    _forget_earlier_runs_settings()
    # Several processes (torchrun / `accelerate launch --multi_gpu`) on a machine without an accelerator:
    # Accelerate only picks gloo DDP when told to use the CPU; otherwise each process would train alone.
    cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()
    try:
        return Accelerator(mixed_precision=recipe.train.mixed_precision, step_scheduler_with_optimizer=False, cpu=cpu)
    except (ValueError, RuntimeError) as error:
        raise RecipeError(f"train.mixed_precision: {error}") from error


def _forget_earlier_runs_settings() -> None:
    """Accelerate keeps the settings of the first Accelerator of a process in a process-wide singleton
    (AcceleratorState): its mixed precision (a second Accelerator asking for another one raises ValueError)
    and its plugins (the FSDP plugin keeps the wrap policy `prepare` derived from the first run's model).
    A second run in the same process (the A/B's arms, tests, the Python API) needs its own. Accelerate has
    no public reset, so this is the one place that calls its private one. The distributed process group
    (PartialState) is kept: it belongs to the process, not to a run."""
    from accelerate.state import AcceleratorState, is_initialized

    if is_initialized():
        AcceleratorState._reset_state()
