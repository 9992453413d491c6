"""The run folder (output.dir): what it holds, whether a run may resume in it, and how a run that replaces
an earlier one is staged beside it and swapped in only once finished.

    recipe.yaml          the resolved recipe (written at the start)
    metrics.jsonl        training steps and held-out evaluations
    checkpoints/         resumable state, the last checkpoint.keep_last of them
    loss_curve.png       at the end
    final_metrics.json   at the end
    model/               the trained model (converted format; LoRA merged unless lora.merge=false)
"""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoints import CHECKPOINTS
from .metrics import METRICS
from .preflight import is_run_folder, nothing_to_resume
from .recipe import Recipe, RecipeError, parse_recipe, read_yaml

RECIPE_FILE = "recipe.yaml"
FINAL_METRICS = "final_metrics.json"
LOSS_CURVE = "loss_curve.png"
MODEL_DIR = "model"
# Sections a resumed run must share with the run it continues (eval/checkpoint/output may change).
RESUME_LOCKED = ("model", "data", "train", "lora")


def check_resume(recipe: Recipe, out: Path, checkpoint: Path | None) -> None:
    """--resume: the run in OUT must be unfinished, and continued with the recipe it started with."""
    if (out / FINAL_METRICS).is_file():
        raise RecipeError(f"output.dir: the run in {out} is complete ({FINAL_METRICS} exists); nothing to resume")
    if checkpoint is not None and (out / RECIPE_FILE).is_file():
        differences = resume_differences(parse_recipe(read_yaml(out / RECIPE_FILE)), recipe)
        if differences:
            raise RecipeError(
                f"--resume: the recipe differs from the one the run in {out} started with:\n  "
                + "\n  ".join(differences)
                + "\nResume with the same recipe, or start a new run in another output.dir"
            )


def extension_checkpoint(recipe: Recipe, out: Path) -> Path:
    """--extend: the checkpoint of the shorter run in OUT from which RECIPE continues it. The run's recipe must
    differ in train.steps alone (longer now; eval, checkpoint and output may change), and the checkpoint lie within
    the steps whose learning rates both schedules share (`shared_schedule_steps`): the latest such. RecipeError
    saying why not."""
    from .checkpoints import checkpoint_step, list_checkpoints
    from .optim import shared_schedule_steps

    if not (out / RECIPE_FILE).is_file():
        raise RecipeError(f"--extend: {out} holds no run to extend (no {RECIPE_FILE}); run without --extend")
    saved = parse_recipe(read_yaml(out / RECIPE_FILE))
    others = [d for d in resume_differences(saved, recipe) if not d.startswith("train.steps:")]
    if others:
        raise RecipeError(
            f"--extend: the recipe differs from the run in {out} in more than train.steps:\n  "
            + "\n  ".join(others)
            + "\nExtend with the same recipe and a larger train.steps, or start a new run in another output.dir"
        )
    old, new = saved.train.steps, recipe.train.steps
    if new <= old:
        raise RecipeError(
            f"--extend: train.steps={new} does not extend the run in {out} ({old} steps); give more steps than {old}"
        )
    shared = shared_schedule_steps(saved.train, recipe.train)
    found = list_checkpoints(out)
    usable = [c for c in found if checkpoint_step(c) <= shared]
    if not usable:
        why = (
            "a cosine schedule depends on train.steps from its first step after warmup; a run trained with "
            "train.schedule=wsd extends from a checkpoint before its decay, one with constant from any"
            if saved.train.schedule == "cosine"
            else f"its checkpoints: steps {', '.join(str(checkpoint_step(c)) for c in found) or 'none'}; keep one from "
            "before the decay with checkpoint.every and checkpoint.keep_last"
        )
        raise RecipeError(
            f"--extend: no checkpoint of the run in {out} lies within the first {shared} step{'s' * (shared != 1)}, "
            "whose learning rates "
            f"the {new}-step schedule shares with the {old}-step one ({why})"
        )
    return usable[-1]


def left_behind(out: Path) -> str:
    """What a run stopped before it saved a checkpoint of its own leaves in OUT, in words (for the Ctrl-C
    message): nothing, an earlier complete run, a checkpoint to resume from, or a run folder with nothing to resume."""
    from .checkpoints import latest_checkpoint

    if not out.is_dir() or not any(out.iterdir()):
        return f"nothing was written to {out}"
    if (out / FINAL_METRICS).is_file():
        return f"the earlier run in {out} is unchanged"
    if (checkpoint := latest_checkpoint(out)) is not None:
        return f"this stop saved no checkpoint; the last one is {checkpoint} (--resume continues from it)"
    if nothing_to_resume(out):
        return (
            f"{out} holds only {RECIPE_FILE} and metrics.jsonl, no checkpoint; "
            "run the same command again to start over (no --resume needed)"
        )
    return f"nothing of this run was saved in {out}"


def resume_differences(saved: Recipe, current: Recipe) -> list[str]:
    """`key: old -> new` for every setting of RESUME_LOCKED that differs."""

    def flat(data, prefix=""):
        if isinstance(data, dict):
            for key, value in data.items():
                yield from flat(value, f"{prefix}{key}.")
        else:
            yield prefix.rstrip("."), data

    old = dict(flat({k: saved.model_dump(mode="json")[k] for k in RESUME_LOCKED}))
    new = dict(flat({k: current.model_dump(mode="json")[k] for k in RESUME_LOCKED}))
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]


def prepare_output(recipe: Recipe, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RECIPE_FILE).write_text(recipe.to_yaml())


def replaces_run(recipe: Recipe, out: Path, resuming: bool) -> bool:
    """A new run over an earlier one (check_recipe made sure OUT is an earlier run, not some other folder). A run
    stopped before its first checkpoint, its folder holding nothing else, has nothing worth keeping: the new run
    starts it over in place, where its own checkpoints survive if it is stopped in turn (a staged run's are
    discarded with it)."""
    if resuming or not recipe.output.overwrite or not out.exists() or not is_run_folder(out):
        return False
    return not (nothing_to_resume(out) and {p.name for p in out.iterdir()} <= {RECIPE_FILE, METRICS, CHECKPOINTS})


def stage_run(out: Path) -> Path:
    """The folder a run replacing OUT writes into: beside OUT (where it can be renamed into place), hidden,
    named so that a later run removes it if this one is killed. Deleting OUT first would lose the earlier
    run whenever the new one fails."""
    from ..io.saving import clean_stale_partials, new_partial_folder

    target = Path(os.path.realpath(out))  # a symbolic link keeps pointing at the run
    clean_stale_partials(target)
    try:
        return new_partial_folder(target, mode=0o777)  # the umask applies, as to any run folder
    except OSError as error:
        raise RecipeError(
            f"output.dir: cannot write the new run beside {out} ({error.strerror or error}); "
            "choose an output.dir in a folder you can write to"
        ) from error


def publish_run(staging: Path, out: Path) -> None:
    """Swap the finished run in STAGING for the earlier one at OUT, which is then removed."""
    from ..io.saving import fsync_tree, publish_folder

    fsync_tree(staging)  # metrics, final metrics, loss curve: never published as empty files
    publish_folder(staging, Path(os.path.realpath(out)))
