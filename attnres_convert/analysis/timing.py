"""Timing two models side by side in one process: interleaved runs, medians, ratios.

Used by `attnres bench` (analysis/bench.py) and the scripts in benchmarks/. Nothing here is a pass/fail
check: it measures and returns numbers.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch

KERNEL_ENV = "ATTNRES_KERNEL"


def resident(model):
    """MODEL with its weights copied into process memory. from_pretrained maps safetensors files, and a
    mapped weight runs at the speed of the page-cache pages the kernel gave that file: measured on SmolLM2,
    the same decoding loop ran 0.88-1.22x depending on which folder had been written or read last. Both
    models get this copy, so it is still like for like. (Tied weights are one Parameter object: one copy
    keeps them tied.) Called again, it draws new memory: see `replace_weights`."""
    for param in {id(p): p for p in model.parameters()}.values():
        param.data = param.data.clone()
    return model


def replace_weights(models: dict, order: list[str]) -> None:
    """Copies every model's weights anew, in ORDER, before a timed round on CPU. Where a copy lands in memory changes
    its speed, and that draw stays with a process: two copies of the same SmolLM2 prefilled 2 % apart for a whole
    run, and single products of the same weight 7 % apart. A fresh draw every round makes placement a per-round
    noise that the medians average out, instead of a bias one of the models keeps."""
    for name in order:
        resident(models[name])


@contextlib.contextmanager
def kernel_env(mode: str | None) -> Iterator[None]:
    """ATTNRES_KERNEL=MODE while the block runs (a converted model reads it at every forward); None: as set."""
    if mode is None:
        yield
        return
    before = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(KERNEL_ENV, None)
        else:
            os.environ[KERNEL_ENV] = before


def with_kernel(mode: str | None, fn: Callable[[], object]) -> Callable[[], object]:
    """FN run with ATTNRES_KERNEL=MODE."""

    def run():
        with kernel_env(mode):
            return fn()

    return run


def interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    sync: Callable[[], None] = lambda: None,
    after_run: Callable[[str], None] = lambda name: None,
    before_round: Callable[[list[str]], None] = lambda names: None,
) -> dict[str, list[float]]:
    """Seconds of each callable per round, alternating them so drift hits all alike, in reversed order
    every other round: a run leaves the allocator and caches in its own state for the next one (measured:
    the original's decoding step ran 0.5 ms slower right after a converted model's than after its own),
    so each callable follows each other one equally often. WARMUP untimed runs each first. SYNC waits for
    the device (CUDA runs asynchronously); AFTER_RUN(name) is told of every run, for a progress bar;
    BEFORE_ROUND(names) is called untimed before each timed round with the order of its runs."""
    for _ in range(warmup):
        for name, fn in fns.items():
            fn()
            sync()
            after_run(name)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        before_round(order)
        for name in order:
            sync()
            start = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - start)
            after_run(name)
    return times


def compared(original: list[float], converted: list[float]) -> dict:
    """Medians of paired runs, their ratio (converted / original), and the median of the per-round ratios
    (a slow phase of the machine that spans a round hits both runs of it, so this one moves less)."""
    return {
        "original": statistics.median(original),
        "converted": statistics.median(converted),
        "ratio": statistics.median(converted) / statistics.median(original),
        "paired_ratio": statistics.median(b / a for a, b in zip(original, converted)),
        "original_runs": list(original),
        "converted_runs": list(converted),
    }


def device_sync(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for DEVICE's queued work (nothing to wait for on CPU)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


# A ratio is noise, not a result, where the per-round ratios range wider than this around their median (a factor),
# or where one timed round ran while other work held cores the timed threads needed.
RATIO_SPREAD_LIMIT = 1.5


def ratio_noise(row: dict, machine: dict) -> str | None:
    """Why ROW's ratio (a dict of `compared`, with the runs) says nothing about the models, in words; None where it is
    a result. MACHINE: what bench records (cpu_count, torch_threads, load averages at the start and end, gpu)."""
    original, converted = row.get("original_runs") or [], row.get("converted_runs") or []
    ratios = [b / a for a, b in zip(original, converted) if a > 0]
    if len(ratios) >= 3:
        low, high = min(ratios), max(ratios)
        if high / low > RATIO_SPREAD_LIMIT:
            return (
                f"its {len(ratios)} rounds gave ratios from {low:.2f} to {high:.2f} (the machine's speed changed "
                "between runs)"
            )
    loads = [m[0] for m in (machine.get("load_average_start"), machine.get("load_average_end")) if m]
    cores, threads = machine.get("cpu_count") or 1, machine.get("torch_threads") or 1
    if ratios and len(ratios) < 3 and not machine.get("gpu") and loads and max(loads) > cores - threads + 0.5:
        rounds = "one timed round" if len(ratios) == 1 else f"{len(ratios)} timed rounds"
        return (
            f"{rounds} on a busy machine (load average {max(loads):.1f} on {cores} cores, {threads} torch "
            f"thread{'s' if threads != 1 else ''}): other work's share of the cores, not the models, can set it"
        )
    return None
