"""What the A/B and the retrofit study share: an arm, its run folder and recipe, training it (in this process or
a one-thread worker), the live table's context, the output check and the machine's description."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .ab_report import AB_JSON
from .recipe import Recipe, RecipeError, apply_overrides, parse_recipe, read_yaml

ARM_SETTINGS = ("output.save_model=false", "output.overwrite=true", "eval.at_start=true", "output.push_to_hub=null")


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]  # on top of the recipe and the overrides common to every arm

    @property
    def is_baseline(self) -> bool:
        return self.name == "baseline"


def folder_name(arm: Arm, seed: int) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in arm.name.replace(" ", "__"))
    return f"{safe[:120]}/seed-{seed}"


def arm_recipe(data: dict, common: list[str], arm: Arm, seed: int, workdir: Path) -> Recipe:
    overrides = [
        *common,
        *arm.overrides,
        f"train.seed={seed}",
        f"output.dir={workdir / folder_name(arm, seed)}",
        *ARM_SETTINGS,
    ]
    try:
        return parse_recipe(apply_overrides(data, overrides))
    except RecipeError as error:
        raise RecipeError(f"arm {arm.name!r}: {error}") from None


# The description documents the recipe and checkpoints only save it: neither changes what trains.
_NOT_TRAINING = {"description", "checkpoint"}


def finished(recipe: Recipe) -> bool:
    """A run folder already complete with this very recipe (checked through the current recipe schema)."""
    out = Path(recipe.output.dir)
    saved = out / "recipe.yaml"
    if not ((out / "final_metrics.json").is_file() and saved.is_file()):
        return False
    try:
        return parse_recipe(read_yaml(saved)).model_dump(exclude=_NOT_TRAINING) == recipe.model_dump(
            exclude=_NOT_TRAINING
        )
    except RecipeError:
        return False


def resume_checkpoint(recipe: Recipe, newer_than: Path | None = None) -> Path | None:
    """The last checkpoint of an unfinished run of this recipe (`checkpoint.every` in the study's overrides), if
    written after NEWER_THAN when given: `reuse` continues it from there instead of training it again from step 0."""
    from .checkpoints import latest_checkpoint
    from .run_folder import check_resume

    out = Path(recipe.output.dir)
    checkpoint = latest_checkpoint(out)
    if checkpoint is None:
        return None
    try:
        check_resume(recipe, out, checkpoint)  # unfinished, and started with this recipe
        return checkpoint if newer_than is None or _newer(checkpoint, newer_than) else None
    except (RecipeError, OSError):
        return None


def _newer(path: Path, than: Path) -> bool:
    return path.stat().st_mtime_ns > than.stat().st_mtime_ns


def continuation(recipe: Recipe, newer_than: Path | None = None) -> tuple[str, Path] | None:
    """How `reuse` continues RECIPE's run rather than training it from step 0: ("resume", the last checkpoint of
    an unfinished run), ("extend", the checkpoint a shorter run continues from: train.steps alone smaller, a
    schedule the longer one shares, `run_folder.extension_checkpoint`), or None; a checkpoint counts only if
    written after NEWER_THAN when given. (A finished run is kept: see `finished`.)"""
    from .run_folder import extension_checkpoint

    if (checkpoint := resume_checkpoint(recipe, newer_than)) is not None:
        return "resume", checkpoint
    try:
        checkpoint = extension_checkpoint(recipe, Path(recipe.output.dir))
        return ("extend", checkpoint) if newer_than is None or _newer(checkpoint, newer_than) else None
    except (RecipeError, OSError):
        return None


def reuse_start(recipe: Recipe, newer_than: Path | None = None) -> int:
    """The step from which `reuse` trains RECIPE's run when it is not kept: its checkpoint's (`continuation`), else 0."""
    from .checkpoints import checkpoint_step

    found = continuation(recipe, newer_than)
    return checkpoint_step(found[1]) if found else 0


def plan_start(recipe: Recipe, reuse: bool, kept: bool, newer_than: Path | None = None) -> int | None:
    """The step the run trains from: None when `reuse` keeps it as it is (KEPT)."""
    if not reuse:
        return 0
    return None if kept else reuse_start(recipe, newer_than)


def plan_summary(entries: list[tuple[int, int | None]]) -> str:
    """What a study is about to train, said before it starts, from (train.steps, the step each run trains from:
    None when `reuse` keeps it): '6 runs: 2 kept, 1 resumed or extended, 3 from step 0; 2,400 training steps to go'."""
    kept = sum(1 for _, start in entries if start is None)
    continued = sum(1 for _, start in entries if start)
    fresh = sum(1 for _, start in entries if start == 0)
    left = sum(steps - start for steps, start in entries if start is not None)
    parts = [f"{kept} kept"] if kept else []
    parts += [f"{continued} resumed or extended"] if continued else []
    parts += [f"{fresh} from step 0"] if fresh else []
    return f"{len(entries)} runs: {', '.join(parts)}; {left:,} training steps to go"


def run_one(data: dict, common: list[str], arm: Arm, seed: int, workdir: str, reuse: bool) -> None:
    """Train one arm at one seed (in this process or a worker process); with REUSE, a finished run is kept, an
    unfinished one resumes from its last checkpoint and a shorter one is extended (`continuation`)."""
    recipe = arm_recipe(data, common, arm, seed, Path(workdir))
    if reuse and finished(recipe):
        return
    train_arm(recipe, arm, seed, continuation(recipe) if reuse else None)


def train_arm(recipe: Recipe, arm: Arm, seed: int, how: tuple[str, Path] | None) -> None:
    """Train an arm's recipe, resumed or extended as HOW says (`continuation`; None: from step 0), its errors
    naming the arm and seed."""
    from .training import TrainingError, finetune

    kind = how[0] if how else None
    try:  # quiet: the live table shows every arm's progress
        result = finetune(recipe, resume=kind == "resume", extend=kind == "extend")
    except (RecipeError, TrainingError) as error:
        raise type(error)(f"arm {arm.name!r}, seed {seed}: {error}") from None
    del result
    gc.collect()


def _one_thread() -> None:
    """Worker processes of `jobs > 1`: one thread each (the arms share the cores)."""
    import torch

    # The pool's initializer runs in each worker process: the thread count it sets is that worker's own
    # (a spawned process), never the parent's or another arm's.
    torch.set_num_threads(1)
    from ..io.console import quiet_libraries

    # The worker is ours for its whole life: the libraries stay quiet in it (kept referenced, so that the
    # context is never closed by garbage collection).
    _WORKER_QUIET.append(quiet_libraries())
    _WORKER_QUIET[-1].__enter__()


_WORKER_QUIET: list = []


def run_tasks(tasks: list[tuple], jobs: int) -> None:
    """Call every (function, arguments) of TASKS: in turn, or (jobs > 1) in that many one-thread worker
    processes (the functions are module-level, so a spawned worker can import them)."""
    if jobs <= 1:
        for function, arguments in tasks:
            function(*arguments)
        return
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=_one_thread) as pool:
        futures = [pool.submit(function, *arguments) for function, arguments in tasks]
        for future in futures:
            future.result()


@contextlib.contextmanager
def live(console, table) -> Iterator[None]:
    """The live table, redrawn from the run folders every two seconds (Rich refreshes it in its own thread)."""
    if console is None:
        yield
        return
    from rich.live import Live

    with Live(get_renderable=table, console=console, refresh_per_second=0.5):
        yield


def check_output(out: Path, overwrite: bool, marker: str = AB_JSON) -> None:
    """OUT may be replaced only if it is an earlier A/B output (holds MARKER) and overwrite is set."""
    if out.exists() and not out.is_dir():
        raise RecipeError(f"--output: {out} is a file, not a folder; choose another path")
    if out.is_dir() and any(out.iterdir()):
        if not (out / marker).is_file():
            raise RecipeError(f"--output: {out} exists and is not an A/B output (no {marker}); choose another folder")
        if not overwrite:
            raise RecipeError(
                f"--output: {out} already holds an A/B; pass --overwrite to replace it, or choose another folder"
            )


def machine(jobs: int) -> dict:
    import torch
    from accelerate import PartialState

    return {
        "cpu": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "accelerator": torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None,
        "torch": torch.__version__,
        "threads_per_arm": 1 if jobs > 1 else torch.get_num_threads(),
        "jobs": jobs,
        "processes": PartialState().num_processes,
    }
