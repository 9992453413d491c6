"""`--extend`: a finished run continued to a larger train.steps from a checkpoint both schedules share ends exactly
where the longer run trained from the start ends; what cannot be extended is refused, the earlier run untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe
from safetensors.torch import load_file
from typer.testing import CliRunner

from attnres_convert.cli import app
from attnres_convert.finetune.checkpoints import list_checkpoints
from attnres_convert.finetune.optim import shared_schedule_steps
from attnres_convert.finetune.recipe import RecipeError, parse_recipe
from attnres_convert.finetune.training import finetune

# wsd: warmup 2, flat, then a linear decay over the last quarter of the steps (2 of 8, 3 of 12).
WSD = {"trainable": "lora", "schedule": "wsd", "warmup_steps": 2, "decay_fraction": 0.25}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("extend")
    return {"model": tiny_model_folder(root / "tiny-llama"), "corpus": write_corpus(root / "corpus")}


def recipe(setup, out: Path, steps: int, **train):
    return parse_recipe(
        tiny_recipe(
            setup["model"],
            setup["corpus"],
            out,
            train={**WSD, "steps": steps, **train},
            lora={"r": 4, "dropout": 0.1},  # dropout: the run depends on the RNG state the checkpoint carries
            eval={"every": 2, "max_sequences": 4},
            checkpoint={"every": 2, "keep_last": 10},
        )
    )


def records(folder: Path) -> list[tuple]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [(r["kind"], r["step"], r["loss"], r.get("lr")) for r in map(json.loads, lines)]


def test_the_schedules_share_their_steps_until_the_shorter_decays(setup, tmp_path):
    short, long = recipe(setup, tmp_path, 8).train, recipe(setup, tmp_path, 12).train
    assert shared_schedule_steps(short, long) == 7  # the 8-step run's rate first falls at its step 8, the 12's at 11
    constant = recipe(setup, tmp_path, 8, schedule="constant").train
    assert shared_schedule_steps(constant, recipe(setup, tmp_path, 80, schedule="constant").train) == 8
    # cosine: every rate after the warmup and the first at the peak depends on train.steps
    cosine = recipe(setup, tmp_path, 8, schedule="cosine").train
    assert shared_schedule_steps(cosine, recipe(setup, tmp_path, 12, schedule="cosine").train) == 3


def test_an_extended_run_ends_where_the_longer_run_ends(setup, tmp_path):
    whole = finetune(recipe(setup, tmp_path / "whole", 12))
    folder = tmp_path / "extended"
    finetune(recipe(setup, folder, 8))
    assert [p.name for p in list_checkpoints(folder)] == ["step-0000002", "step-0000004", "step-0000006"]
    extended = finetune(recipe(setup, folder, 12), extend=True)
    # Steps 1-6 are the shorter run's (not trained again), 7-12 continue from its checkpoint at 6, before its decay:
    # every loss and learning rate is the longer run's, and so is the model.
    assert records(folder) == records(whole.output)
    assert extended.metrics["steps"] == 12 and extended.metrics["tokens"] == whole.metrics["tokens"]
    ours, theirs = load_file(extended.model_dir / "model.safetensors"), load_file(whole.model_dir / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_what_cannot_be_extended_is_refused_and_the_run_kept(setup, tmp_path):
    folder = tmp_path / "run"
    finetune(recipe(setup, folder, 8))
    kept = (folder / "final_metrics.json").read_text(), (folder / "metrics.jsonl").read_text()
    with pytest.raises(RecipeError, match=r"in more than train\.steps:\n  train\.lr: 0\.001 -> 0\.002"):
        finetune(recipe(setup, folder, 12, lr=2e-3), extend=True)
    with pytest.raises(RecipeError, match=r"train\.steps=8 does not extend the run in .* \(8 steps\)"):
        finetune(recipe(setup, folder, 8), extend=True)
    with pytest.raises(RecipeError, match="choose one"):
        finetune(recipe(setup, folder, 12), extend=True, resume=True)
    with pytest.raises(RecipeError, match="holds no run to extend"):
        finetune(recipe(setup, tmp_path / "nothing", 12), extend=True)
    assert ((folder / "final_metrics.json").read_text(), (folder / "metrics.jsonl").read_text()) == kept
    # cosine: no checkpoint past the warmup shares the longer schedule's rates; the message says what would.
    cosine = tmp_path / "cosine"
    finetune(recipe(setup, cosine, 8, schedule="cosine", warmup_steps=0))
    path = write_recipe(tmp_path / "cosine.yaml", tiny_recipe(setup["model"], setup["corpus"], cosine))
    result = CliRunner().invoke(
        app,
        [
            "finetune",
            str(path),
            "--extend",
            *(f"train.{k}={v}" for k, v in {**WSD, "schedule": "cosine", "warmup_steps": 0, "steps": 12}.items()),
            "lora.r=4",
            "lora.dropout=0.1",
            "eval.every=2",
            "eval.max_sequences=4",
            "checkpoint.every=2",
            "checkpoint.keep_last=10",
        ],
    )
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "no checkpoint of the run in" in message and "lies within the first 1 step," in message
    assert "train.schedule=wsd" in message
    # wsd decaying over the last half, its checkpoints kept only from after the decay began (keep_last 1: step 7).
    late = tmp_path / "late"
    short = recipe(setup, late, 8, decay_fraction=0.5)
    short.checkpoint.every, short.checkpoint.keep_last = 1, 1
    finetune(short)
    assert [p.name for p in list_checkpoints(late)] == ["step-0000007"]
    with pytest.raises(
        RecipeError, match=r"within the first 5 steps, .*its checkpoints: steps 7; keep one from before"
    ):
        finetune(recipe(setup, late, 12, decay_fraction=0.5), extend=True)
