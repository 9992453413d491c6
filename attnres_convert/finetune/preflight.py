"""The second validation pass of a recipe: what the file system can tell before anything is loaded or
written (data files, the model source and its positions, the hub settings, the run folder)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import AttnResError
from ..io.files import expand_files
from ..io.paths import is_converted_folder, resolve_source, write_problem
from ..io.paths import max_positions as positions_on_file
from ..optional import available, missing_message
from .recipe import Recipe, RecipeError


def _max_positions(source, converted: bool, trust_remote_code: bool) -> int | None:
    """From the config file or GGUF header when it says (no torch import); else from transformers' config."""
    if (positions := positions_on_file(source)) is not None:
        return positions
    from ..io.sources import cached_config

    config = cached_config(source, converted, trust_remote_code)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)


def is_run_folder(path: Path) -> bool:
    """A folder `attnres finetune` wrote: the only kind output.overwrite may delete."""
    return (path / "recipe.yaml").is_file() and (path / "metrics.jsonl").is_file()


def nothing_to_resume(path: Path) -> bool:
    """A run folder of a run stopped before its first checkpoint (only recipe.yaml and metrics.jsonl, no
    checkpoint, no result): nothing in it can be resumed, so a plain run starts it over."""
    if not is_run_folder(path) or (path / "final_metrics.json").exists() or (path / "model").exists():
        return False
    checkpoints = path / "checkpoints"
    return not (checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir()))


def existing_output_problem(recipe: Recipe, resume: bool = False, extend: bool = False) -> str | None:
    """Why `attnres finetune` (with or without --resume or --extend) cannot write the recipe's output.dir as it
    stands, or None."""
    out = Path(recipe.output.dir).expanduser()
    if not (out.is_dir() and any(out.iterdir())):
        return None
    if not is_run_folder(out):
        return (
            f"output.dir: {out} already exists and is not an attnres run folder (no recipe.yaml and metrics.jsonl); "
            "choose another folder (output.overwrite only replaces earlier runs, never other folders)"
        )
    if not (resume or extend or recipe.output.overwrite):
        if nothing_to_resume(out):
            return None  # started over (FinetuneRecipe says so)
        return (
            f"output.dir: {out} already holds a run; pass --resume to continue it, --extend to continue it for more "
            "train.steps, output.overwrite=true to replace it, or choose another folder"
        )
    if not resume and (unwritable := write_problem(Path(os.path.realpath(out)).parent)) is not None:
        # The new run is written beside the earlier one and renamed into its place once finished.
        return f"output.dir: cannot replace the run in {out}: {unwritable}; choose an output.dir in a folder you can write to"
    return None


def check_recipe(
    recipe: Recipe, resume: bool = False, check_output: bool = True, token: str | None = None, extend: bool = False
) -> None:
    """What the file system can tell, before anything is loaded or written. `check_output=False` skips the
    run-folder check (`attnres recipes validate`: the folder may exist from an earlier run)."""
    problems: list[str] = []
    train_files: list[Path] = []
    if recipe.data.train.files is not None:
        train_files, found = expand_files(recipe.data.train.files, "data.train.files")
        problems += found
    if recipe.data.eval.files is not None:
        eval_files, found = expand_files(recipe.data.eval.files, "data.eval.files")
        problems += found
        if train_files and eval_files and not set(train_files) - set(eval_files):
            problems.append(
                "data.train.files: every training file is also a held-out file; nothing is left to train on"
            )
    for name, text in (("train", recipe.data.train), ("eval", recipe.data.eval)):
        if text.dataset is not None and not available("datasets"):
            problems.append(
                f"data.{name}.dataset: {missing_message('datasets', f'reading the dataset {text.dataset!r}')}"
            )

    max_positions = None
    try:
        source = resolve_source(None if recipe.model.is_default else recipe.model.source)
    except AttnResError as error:
        problems.append(f"model.source: {error}")
        source = None
    if source is not None and source.kind in ("folder", "default", "gguf"):
        converted = source.kind == "folder" and is_converted_folder(source.location)
        if converted and not recipe.model.convert:
            problems.append(
                "model.convert: false asks for the original model, but model.source is an AttnRes model; "
                "give the original model as the source for a baseline"
            )
        try:
            max_positions = _max_positions(source, converted, recipe.model.trust_remote_code)
        except AttnResError as error:
            problems.append(f"model.source: {error}")
        except Exception as error:  # noqa: BLE001 - report, never crash validation
            problems.append(f"model.source: cannot read its config ({error})")
    if max_positions and recipe.data.seq_len > max_positions:
        problems.append(
            f"data.seq_len: {recipe.data.seq_len} is longer than the model's {max_positions} positions; use at most {max_positions}"
        )

    if recipe.output.push_to_hub:
        # Fail now, not after hours of training: the repo id must be valid and a token must exist.
        from ..hub.push import check_repo_id, resolve_token

        for check in (lambda: check_repo_id(recipe.output.push_to_hub), lambda: resolve_token(token)):
            try:
                check()
            except AttnResError as error:
                problems.append(f"output.push_to_hub: {error}")
        if not recipe.output.save_model:
            problems.append("output.push_to_hub: needs output.save_model=true (there is no model folder to push)")

    out = Path(recipe.output.dir).expanduser()
    if out.exists() and not out.is_dir():
        problems.append(f"output.dir: {out} is a file, not a folder")
    elif (unwritable := write_problem(out)) is not None:
        problems.append(f"output.dir: cannot write {out}: {unwritable}; choose a folder you can write to")
    elif check_output and (taken := existing_output_problem(recipe, resume, extend)) is not None:
        problems.append(taken)
    if problems:
        raise RecipeError("\n".join(problems))
