"""The Accelerator of one run: devices, mixed precision and distribution, set from the recipe; and the number of
torch threads a run on the CPU computes with."""

from __future__ import annotations

import os
from pathlib import Path

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


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_cores(seconds: float = 0.5) -> tuple[float, str]:
    """How many cores other work keeps busy now, and how that was measured: the non-idle share of /proc/stat's CPU
    time over SECONDS (this process waits meanwhile, so it is not counted); where there is no /proc/stat, the
    1-minute load average (which lags: work that just ended, such as the conversion before `make demo`'s fine-tune,
    still counts in it)."""
    import time

    def sample() -> tuple[int, int] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields[:8]), fields[3] + fields[4]  # user..steal; idle + iowait

    first = sample()
    if first is not None:
        time.sleep(seconds)
        second = sample()
        if second is not None and second[0] > first[0]:
            share = 1 - (second[1] - first[1]) / (second[0] - first[0])
            return max(0.0, share) * usable_cores(), f"busy over {seconds:g} s"
    if hasattr(os, "getloadavg"):
        return os.getloadavg()[0], "load average"
    return 0.0, "not measured"


def cpu_threads(processes: int = 1, cores: int | None = None, busy: float | None = None, env=None) -> tuple[int, str]:
    """The torch threads of each of PROCESSES training processes on the CPU, and why, in words.

    OMP_NUM_THREADS, where set, decides. Otherwise: the cores not already busy (busy_cores), shared among the
    processes, at least one each. torch's default is every core: where other jobs hold some, its threads wait
    for each other at every operation and a step takes several times longer (benchmarks/training_threads.py
    measures it); with one thread per idle core a busy machine slows the run by its load alone."""
    env = os.environ if env is None else env
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) >= 1:
        return int(given), "OMP_NUM_THREADS"
    cores = cores or usable_cores()
    how = "given"
    if busy is None:
        busy, how = busy_cores()
    per_process = max(processes, 1)
    threads = max(1, min(cores // per_process, int((cores - busy) / per_process + 0.5)))
    return threads, f"{cores} cores, {busy:.1f} of them busy ({how}): one per idle core; OMP_NUM_THREADS sets it"
