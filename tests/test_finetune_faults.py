"""Faults during `finetune`: SIGKILL at any moment loses at most the steps since the last checkpoint
and `--resume` continues with the same losses as an uninterrupted run; a checkpoint killed half-way is never
taken for a checkpoint; SIGINT saves a checkpoint and exits cleanly; a non-finite loss stops the run naming
the step, keeps the last good checkpoint and saves no model. Real signals to real processes (forked from a
preloaded forkserver, and the installed command for SIGINT)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe
from reliability_helpers import ONE_THREAD_ENV, ROOT, finetune_in_child, forkserver_context, run_cli, squash
from safetensors.torch import load_file

STEPS, EVERY = 10, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune-faults")
    return {"root": root, "model": tiny_model_folder(root / "tiny-llama"), "corpus": write_corpus(root / "corpus")}


def _recipe(path: Path, setup, out: Path, **sections) -> Path:
    sections.setdefault("train", {})
    sections["train"] = {"trainable": "full", "steps": STEPS, "lr": 3e-3, "attnres_lr": 3e-2, **sections["train"]}
    sections.setdefault("checkpoint", {"every": EVERY, "keep_last": 2})
    sections.setdefault("eval", {"every": 0, "max_sequences": 4})
    return write_recipe(path, tiny_recipe(setup["model"], setup["corpus"], out, **sections))


def _train_losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records if r.get("kind") == "train"]
    assert len(steps) == len(set(steps)), f"a step is logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def _checkpoint_steps(out: Path) -> list[int]:
    from attnres_convert.finetune.checkpoints import list_checkpoints

    return [int(p.name.split("-")[1]) for p in list_checkpoints(out)]


@pytest.fixture(scope="module")
def reference(setup):
    """The same recipe, uninterrupted: the losses a resumed run must reproduce."""
    out = setup["root"] / "reference"
    recipe = _recipe(setup["root"] / "reference.yaml", setup, out)
    result = run_cli("finetune", recipe)
    assert result.exit_code == 0, result.output
    losses = _train_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _kill_when(context, recipe: Path, resume: bool, ready) -> bool:
    """Run finetune on RECIPE in a child; SIGKILL it as soon as `ready()` is true. False if it finished first."""
    process = context.Process(target=finetune_in_child, args=(str(recipe), resume))
    process.start()
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and process.is_alive():
            if ready():
                process.kill()
                break
            time.sleep(0.0005)
    finally:
        process.join(60)
    return process.exitcode == -signal.SIGKILL


def _last_logged_step(out: Path) -> int:
    try:
        text = (out / "metrics.jsonl").read_text()
    except OSError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in text.splitlines() if line.strip().endswith("}")]
    return max(steps, default=0)


@pytest.mark.parametrize("kill_after_step", [2, 5, 7])
def test_sigkill_then_resume_loses_at_most_the_steps_since_the_last_checkpoint(
    tmp_path, setup, reference, kill_after_step
):
    context = forkserver_context()
    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "recipe.yaml", setup, out)
    killed = _kill_when(context, recipe, False, lambda: _last_logged_step(out) >= kill_after_step)
    assert killed, "the run finished before the kill"
    done = _last_logged_step(out)
    checkpoints = _checkpoint_steps(out)
    last = max(checkpoints, default=0)
    assert done - last <= EVERY, (done, checkpoints)  # lost at most the steps since the last checkpoint
    assert (out / "model").exists() is False

    result = run_cli("finetune", recipe, "--resume")
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    if last:
        assert f"step {last}" in flat and "Resumed from" in flat, flat
    losses = _train_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # the same losses as the uninterrupted run, before and after the kill
        assert math.isclose(losses[step], reference[step], rel_tol=1e-5, abs_tol=1e-6), (
            step,
            losses[step],
            reference[step],
        )
    assert (out / "model" / "model.safetensors").is_file()


def test_sigkill_while_writing_a_checkpoint(tmp_path, setup, reference):
    """Killed while a checkpoint folder is being written: that half-written checkpoint is never listed or
    resumed from; --resume continues from the previous complete one and reproduces the losses."""
    context = forkserver_context()
    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "recipe.yaml", setup, out, checkpoint={"every": 1, "keep_last": 3})
    folder = out / "checkpoints"

    def writing_a_checkpoint() -> bool:
        """A checkpoint after the first is half-written (so a complete one exists to resume from)."""
        try:
            return any(
                p.name.startswith(".") and p.name.endswith(".partial") and any(p.iterdir())
                for p in folder.iterdir()
                if p.name != ".step-0000001.partial"
            )
        except OSError:
            return False

    hit = False
    for _ in range(4):  # a checkpoint of this tiny model takes milliseconds: retry until a kill lands inside one
        if _kill_when(context, recipe, False, writing_a_checkpoint) and writing_a_checkpoint():
            hit = True
            break
        shutil.rmtree(out, ignore_errors=True)
    if not hit:
        pytest.skip("no kill landed while a checkpoint was being written")
    partial = [p for p in folder.iterdir() if p.name.endswith(".partial")]
    assert partial, "expected the half-written checkpoint"
    for checkpoint in _checkpoint_steps(out):
        assert (folder / f"step-{checkpoint:07d}" / "trainer_state.json").is_file()  # only complete ones are listed

    result = run_cli("finetune", recipe, "--resume")
    assert result.exit_code == 0, result.output
    losses = _train_losses(out)
    for step in range(1, STEPS + 1):
        assert math.isclose(losses[step], reference[step], rel_tol=1e-5, abs_tol=1e-6), step
    assert not [p for p in folder.iterdir() if p.name.endswith(".partial")], "the half-written checkpoint was left"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_saves_a_checkpoint_and_exits_cleanly(tmp_path, setup, reference, sig):
    """Ctrl-C (or SIGTERM) on the installed command: the current step finishes, a checkpoint is written, exit
    code 128 + signal with a message saying how to resume, no traceback; --resume then completes with the
    same losses."""
    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "recipe.yaml", setup, out, checkpoint={"every": 0, "keep_last": 2})
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from attnres_convert.cli import main; sys.exit(main())",
            "finetune",
            str(recipe),
        ],
        cwd=ROOT,
        env={**os.environ, **ONE_THREAD_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None and _last_logged_step(out) < 2:
        time.sleep(0.001)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=120)
    if process.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert process.returncode == 128 + sig, stderr
    message = squash(stderr)
    assert "Traceback" not in stderr, stderr
    assert squash("interrupted:") in message and "--resume" in message and squash("checkpoint saved") in message, stderr
    steps = _checkpoint_steps(out)
    assert steps and steps[-1] == _last_logged_step(out) < STEPS, (steps, _last_logged_step(out))
    assert not (out / "model").exists()

    result = run_cli("finetune", recipe, "--resume")
    assert result.exit_code == 0, result.output
    losses = _train_losses(out)
    for step in range(1, STEPS + 1):
        assert math.isclose(losses[step], reference[step], rel_tol=1e-5, abs_tol=1e-6), step


def test_non_finite_loss_stops_naming_the_step(tmp_path, setup):
    """A learning rate that blows the weights up: the loss of step 2 is NaN. The run stops with a message naming
    step 2 and the last good checkpoint (step 1), whose weights are finite; no model folder is saved."""
    import torch

    out = tmp_path / "run"
    recipe = _recipe(
        tmp_path / "recipe.yaml",
        setup,
        out,
        train={"lr": 1e6, "attnres_lr": 1e6, "max_grad_norm": None, "warmup_steps": 0, "schedule": "constant"},
        checkpoint={"every": 1, "keep_last": 5},
    )
    result = run_cli("finetune", recipe)
    assert result.exit_code == 1, result.output
    flat = " ".join(result.output.split())
    assert "training stopped at step 2" in flat and "non-finite" in flat, flat
    assert "last good checkpoint" in flat and "step-0000001" in squash(result.output), flat
    assert _checkpoint_steps(out) == [1]
    assert not (out / "model").exists()
    assert all(math.isfinite(loss) for loss in _train_losses(out).values())
    for weights in (out / "checkpoints").rglob("*.safetensors"):
        for name, tensor in load_file(weights).items():
            assert torch.isfinite(tensor).all(), f"{weights}: {name} holds non-finite values"
    # Nothing anywhere in the run folder holds NaN weights.
    assert not list(out.rglob("model.safetensors")) or all(
        all(torch.isfinite(t).all() for t in load_file(p).values()) for p in out.rglob("model.safetensors")
    )


# --- output.overwrite: a run replacing an earlier one --------------------------------------------


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _staged(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial-")]


def _earlier_run(setup, out: Path) -> dict[str, bytes]:
    """A copy of the finished reference run at OUT, with a marker file; returns every file's bytes."""
    shutil.copytree(setup["root"] / "reference", out)
    (out / "marker.txt").write_text("the earlier run")
    return _files(out)


def test_sigkill_of_a_run_replacing_an_earlier_one_keeps_it(tmp_path, setup, reference):
    """output.overwrite=true killed mid-run: the earlier run folder is byte for byte as it was; the next run
    removes the killed run's hidden folder and, once finished, replaces the earlier run."""
    context = forkserver_context()
    out = tmp_path / "run"
    before = _earlier_run(setup, out)
    recipe = _recipe(tmp_path / "recipe.yaml", setup, out, output={"overwrite": True})
    killed = _kill_when(context, recipe, False, lambda: any(_last_logged_step(p) >= 5 for p in _staged(out)))
    assert killed, "the run finished before the kill"
    assert _files(out) == before
    assert len(_staged(out)) == 1  # the killed run's folder: hidden, never taken for the run

    result = run_cli("finetune", recipe)
    assert result.exit_code == 0, result.output
    assert _staged(out) == [] and not (out / "marker.txt").exists()
    assert _train_losses(out) == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert (out / "model" / "model.safetensors").is_file() and (out / "final_metrics.json").is_file()


@pytest.mark.slow
def test_sigint_of_a_run_replacing_an_earlier_one_keeps_it(tmp_path, setup, reference):
    """Ctrl-C on the installed command during an output.overwrite run: exit code 130, a message saying the
    earlier run is unchanged (no --resume: nothing of the new run is kept), no traceback, no hidden folder."""
    out = tmp_path / "run"
    before = _earlier_run(setup, out)
    recipe = _recipe(tmp_path / "recipe.yaml", setup, out, output={"overwrite": True})
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from attnres_convert.cli import main; sys.exit(main())",
            "finetune",
            str(recipe),
        ],
        cwd=ROOT,
        env={**os.environ, **ONE_THREAD_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while (
        time.monotonic() < deadline
        and process.poll() is None
        and not any(_last_logged_step(p) >= 2 for p in _staged(out))
    ):
        time.sleep(0.001)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    if process.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr, stderr
    message = squash(stderr)
    assert squash("interrupted:") in message and squash(f"the earlier run in {out} is unchanged") in message, stderr
    assert "--resume" not in message, stderr
    assert _files(out) == before and _staged(out) == []


# ---------------------------------------------------------------- Ctrl-C before the first checkpoint


def _ctrl_c_in(monkeypatch, module, name):
    """KeyboardInterrupt (a Ctrl-C before training's own handler is installed) when MODULE.NAME is called."""

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, name, interrupt)


def test_ctrl_c_while_loading_says_nothing_was_written(tmp_path, setup, monkeypatch):
    """Stopped while the model loads: the message says nothing was written and names no checkpoints folder."""
    from attnres_convert.finetune import training

    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "recipe.yaml", setup, out)
    _ctrl_c_in(monkeypatch, training, "load_starting_model")
    result = run_cli("finetune", recipe)
    assert result.exit_code == 130, result.output
    message = squash(result.output)
    assert squash(f"interrupted: finetune stopped; nothing was written to {out}.") in message, result.output
    assert "checkpoints" not in result.output and "--resume" not in result.output, result.output
    assert not out.exists()


def test_ctrl_c_during_the_first_evaluation_then_a_plain_rerun_starts_over(tmp_path, setup, monkeypatch, reference):
    """Stopped during the step-0 evaluation: the folder holds recipe.yaml and metrics.jsonl but no checkpoint; the
    message says so, and the same command run again (no --resume) starts the run over and finishes it."""
    from attnres_convert.finetune import training

    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "recipe.yaml", setup, out, eval={"every": 0, "max_sequences": 4, "at_start": True})
    _ctrl_c_in(monkeypatch, training, "heldout_loss_across_processes")
    result = run_cli("finetune", recipe)
    assert result.exit_code == 130, result.output
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "recipe.yaml"]
    message = squash(result.output)
    assert squash(f"{out} holds only recipe.yaml and metrics.jsonl, no checkpoint;") in message, result.output
    assert squash("run the same command again to start over") in message, result.output
    assert squash("/checkpoints") not in message, result.output

    monkeypatch.undo()
    again = run_cli("finetune", recipe)
    assert again.exit_code == 0, again.output
    assert squash(
        f"{out} holds a run stopped before its first checkpoint (nothing to resume): starting it over"
    ) in squash(again.output)
    assert _train_losses(out) == pytest.approx(reference, rel=1e-5, abs=1e-6)


def test_ctrl_c_before_training_after_an_earlier_checkpoint_names_it(tmp_path, setup, monkeypatch):
    """A second run of a folder that holds a checkpoint, stopped while loading (--resume): the message names that
    checkpoint and how to continue from it."""
    from attnres_convert.finetune import training
    from attnres_convert.finetune.recipe import load_recipe
    from attnres_convert.finetune.training import TrainingInterrupted, finetune

    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "recipe.yaml", setup, out)
    with pytest.raises(TrainingInterrupted):
        finetune(load_recipe(str(recipe)), stop_at_step=EVERY)
    _ctrl_c_in(monkeypatch, training, "load_starting_model")
    result = run_cli("finetune", recipe, "--resume")
    assert result.exit_code == 130, result.output
    message = squash(result.output)
    last = out / "checkpoints" / f"step-{EVERY:07d}"
    assert squash(f"this stop saved no checkpoint; the last one is {last} (--resume continues from it)") in message, (
        result.output
    )
