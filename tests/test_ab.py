"""`attnres ab` on a tiny model (seconds): arms from the same start, paired deltas over seeds, the output
files and their schema; and clipping per parameter group, which keeps the A/B fair."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe
from typer.testing import CliRunner

from attnres_convert.cli import app
from attnres_convert.finetune.ab import run_ab
from attnres_convert.finetune.recipe import RecipeError, parse_recipe
from attnres_convert.finetune.training import FinetuneRecipe

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ab")
    model, corpus = tiny_model_folder(root / "tiny-llama"), write_corpus(root / "corpus")
    recipe = tiny_recipe(
        model,
        corpus,
        root / "unused",
        train={"trainable": "lora", "steps": 4, "lr": 1e-2},
        lora={"r": 4},
        eval={"every": 2, "max_sequences": 4},
    )
    return {"root": root, "model": model, "corpus": corpus, "recipe": write_recipe(root / "ab.yaml", recipe)}


def test_ab_end_to_end_writes_paired_deltas_over_seeds(setup, tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from attnres_convert import cli, cli_training

    out = tmp_path / "ab"
    screen = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    monkeypatch.setattr(cli, "console", screen)
    monkeypatch.setattr(cli_training, "console", screen)  # where `attnres ab` prints
    result = runner.invoke(
        app,
        [
            "ab",
            str(setup["recipe"]),
            "train.warmup_steps=0",
            "--seeds",
            "2",
            "-o",
            str(out),
            "--sweep",
            "train.attnres_lr=1e-3 model.num_blocks=null model.full=true",
        ],
    )
    assert result.exit_code == 0, result.output
    shown = screen.export_text()  # the final report at 80 columns: whole, the sweep arm's overrides included
    assert all(len(line) <= 80 for line in shown.splitlines()) and "…" not in shown, shown
    assert "sweep 1: train.attnres_lr=1e-3 model.num_blocks=null model.full=true" in " ".join(shown.split()), shown
    assert sorted(p.name for p in out.iterdir()) == ["ab.json", "ab.md", "ab.png"]
    report = json.loads((out / "ab.json").read_text())
    assert report["seeds"] == [0, 1] and report["steps"] == 4 and report["overrides"] == ["train.warmup_steps=0"]
    arms = report["arms"]
    assert [a["name"] for a in arms] == [
        "baseline",
        "attnres",
        "attnres train.attnres_lr=1e-3 model.num_blocks=null model.full=true",
    ]
    assert [a["overrides"] for a in arms] == [
        ["model.convert=false"],
        [],
        ["train.attnres_lr=1e-3", "model.num_blocks=null", "model.full=true"],
    ]
    for arm in arms:
        assert [step for step, _ in arm["eval"]] == [0, 2, 4]
        assert arm["tokens_per_s"] > 0 and arm["tokens"] == 4 * 4 * 32
        assert [r["seed"] for r in arm["runs"]] == [0, 1]
        assert all(r["eval_stderr_final"] > 0 for r in arm["runs"])  # the final evaluation's standard error
        assert arm["eval_stderr_final"] == pytest.approx(sum(r["eval_stderr_final"] for r in arm["runs"]) / 2)
        for step, loss in arm["eval"]:  # the mean of the seeds' curves
            assert loss == pytest.approx(sum(dict(r["eval"])[step] for r in arm["runs"]) / 2)
    base = {r["seed"]: r for r in arms[0]["runs"]}
    assert arms[0]["attnres_parameters"] == 0 and "delta_final" not in arms[0]
    for arm in arms[1:]:
        assert arm["attnres_parameters"] > 0
        for run in arm["runs"]:  # converted at step 0 = the original model, seed by seed
            assert math.isclose(run["eval"][0][1], base[run["seed"]]["eval"][0][1], rel_tol=1e-6)
            assert run["attnres_grad_norm"] and all(value > 0 for _, value in run["attnres_grad_norm"])
        deltas = [r["eval_loss_final"] - base[r["seed"]]["eval_loss_final"] for r in arm["runs"]]
        assert arm["delta_final"]["per_seed"] == pytest.approx(deltas)
        assert arm["delta_final"]["mean"] == pytest.approx(sum(deltas) / 2)
        assert arm["delta_final"]["std"] == pytest.approx(abs(deltas[0] - deltas[1]) / math.sqrt(2))
    # Different seeds: a different LoRA init and data order, so different curves.
    assert base[0]["train"] != base[1]["train"]
    table = (out / "ab.md").read_text()
    assert "| baseline | `model.convert=false` |" in table and "| converted (step 0) |" in table
    assert f"{arms[1]['delta_final']['mean']:+.4f} ± {arms[1]['delta_final']['std']:.4f}" in table
    assert (out / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The same A/B again: every arm is read back from the work folder, not trained again.
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "ab-runs").rglob("metrics.jsonl")}
    assert len(stamps) == 6
    # --throughput: every arm's training steps also timed interleaved in one process.
    again = run_ab(
        setup["recipe"],
        ["train.warmup_steps=0"],
        seeds=2,
        output=out,
        reuse=True,
        overwrite=True,
        sweep=[["train.attnres_lr=1e-3", "model.num_blocks=null", "model.full=true"]],
        throughput=1,
    )
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    speeds = [arm.pop("tokens_per_s_interleaved") for arm in again.report["arms"]]
    assert json.loads(json.dumps(again.report["arms"])) == arms
    assert all(speed > 0 for speed in speeds)
    assert f"(interleaved {speeds[1]:,.0f}, {speeds[1] / speeds[0]:.2f}x)" in (out / "ab.md").read_text()


def test_ab_reuse_resumes_an_unfinished_arm_from_its_checkpoint(setup, tmp_path):
    """A study stopped mid-arm (checkpoint.every set) loses at most the steps since the last checkpoint:
    `reuse` continues the arm from it and ends where the uninterrupted arm ends; a finished arm is kept
    even when only the checkpoint settings differ (they do not change what trains)."""
    from attnres_convert.finetune.recipe import apply_overrides, read_yaml
    from attnres_convert.finetune.study import Arm, arm_recipe, finished, resume_checkpoint
    from attnres_convert.finetune.training import TrainingInterrupted, finetune

    common = ["train.warmup_steps=0", "checkpoint.every=1"]
    whole = run_ab(setup["recipe"], common, output=tmp_path / "whole" / "ab")
    work = tmp_path / "stopped" / "ab-runs"
    recipe = arm_recipe(read_yaml(setup["recipe"]), common, Arm("attnres", ()), 0, work)
    arm = Path(recipe.output.dir)
    # An earlier attempt stopped before its first checkpoint: nothing to keep, so the arm (output.overwrite)
    # starts over in place rather than staged beside it, where a stop would discard its checkpoints.
    arm.mkdir(parents=True)
    (arm / "recipe.yaml").write_text(recipe.to_yaml())
    (arm / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.0}\n')
    with pytest.raises(TrainingInterrupted):
        finetune(recipe, stop_at_step=2)
    assert (arm / "checkpoints" / "step-0000002").is_dir() and not (arm / "final_metrics.json").exists()
    before = (arm / "metrics.jsonl").read_text()  # steps 1 and 2, with their measured speeds
    later = tmp_path / "save-written-after"  # a retrofit's starting save, rewritten since the checkpoint
    later.write_text("")
    assert resume_checkpoint(recipe) == arm / "checkpoints" / "step-0000002"
    assert resume_checkpoint(recipe, newer_than=later) is None
    resumed = run_ab(setup["recipe"], common, output=tmp_path / "stopped" / "ab", reuse=True)
    records = [json.loads(line) for line in (arm / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "train"] == [1, 2, 3, 4]
    assert (arm / "metrics.jsonl").read_text().startswith(before)  # steps 1 and 2 kept, not trained again
    for ran, reference in zip(resumed.report["arms"], whole.report["arms"], strict=True):
        assert dict(ran["eval"]) == pytest.approx(dict(reference["eval"]), rel=1e-5), ran["name"]
    data = apply_overrides(read_yaml(setup["recipe"]), ["checkpoint.every=0"])
    assert finished(arm_recipe(data, ["train.warmup_steps=0"], Arm("attnres", ()), 0, work))


def test_ab_reuse_extends_shorter_arms_to_more_steps(setup, tmp_path):
    """A study run again with more train.steps (a wsd schedule) continues each finished arm from its checkpoint
    before the decay instead of training it again: the same curves as arms trained that long from the start."""
    common = ["train.warmup_steps=0", "train.schedule=wsd", "train.decay_fraction=0.25", "checkpoint.every=2"]
    longer = [*common, "train.steps=8", "checkpoint.keep_last=5"]
    whole = run_ab(setup["recipe"], longer, output=tmp_path / "whole" / "ab")
    run_ab(setup["recipe"], [*common, "checkpoint.keep_last=5"], output=tmp_path / "ab-4", workdir=tmp_path / "runs")
    shorter = {
        arm: (tmp_path / "runs" / arm / "seed-0" / "metrics.jsonl").read_text().splitlines()
        for arm in ("baseline", "attnres")
    }
    import io

    from rich.console import Console

    screen = Console(width=200, file=io.StringIO(), color_system=None)
    extended = run_ab(
        setup["recipe"], longer, output=tmp_path / "ab-8", workdir=tmp_path / "runs", reuse=True, console=screen
    )
    # Said before it starts: each arm goes on from step 2, 6 steps of 8 to train.
    assert "2 runs: 2 resumed or extended; 12 training steps to go" in screen.file.getvalue()
    for ran, reference in zip(extended.report["arms"], whole.report["arms"], strict=True):
        assert dict(ran["eval"]) == pytest.approx(dict(reference["eval"]), rel=1e-5), ran["name"]
        assert dict(ran["runs"][0]["train"]) == pytest.approx(dict(reference["runs"][0]["train"]), rel=1e-5)
    for arm, lines in shorter.items():
        now = (tmp_path / "runs" / arm / "seed-0" / "metrics.jsonl").read_text().splitlines()
        # 4 steps decay over the last one: steps 1-3 share the 8-step rates, the checkpoint at 2 is the latest
        # before; its records (steps 0 to 2, with their measured speeds) are kept, not trained again.
        kept = [line for line in lines if json.loads(line)["step"] <= 2]
        assert now[: len(kept)] == kept and json.loads(now[-1])["step"] == 8


def test_ab_refuses_what_it_cannot_compare(setup, tmp_path):
    with pytest.raises(RecipeError, match="the A/B needs a recipe that trains something besides AttnRes"):
        run_ab(setup["recipe"], ["train.trainable=attnres"], output=tmp_path / "ab")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="is not an A/B output"):
        run_ab(setup["recipe"], output=tmp_path / "taken")
    with pytest.raises(RecipeError, match=r"arm 'attnres model.bogus=1': model.bogus: unknown key"):
        run_ab(setup["recipe"], sweep=[["model.bogus=1"]], output=tmp_path / "ab")
    assert not (tmp_path / "ab").exists() and (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def _first_step_gradients(setup, out, convert: bool = True, **train) -> tuple[dict[str, torch.Tensor], object]:
    """The gradients the optimizer applies at step 1 (after clipping), by parameter name, and the step's stats."""
    from attnres_convert.finetune.stopping import GracefulStop

    sections = dict(
        model={"convert": convert},
        train={"trainable": "lora", "steps": 2, "warmup_steps": 0, **train},
        lora={"r": 4},
        eval={"at_start": False},
    )
    run = FinetuneRecipe(parse_recipe(tiny_recipe(setup["model"], setup["corpus"], out, **sections)))
    run.setup()
    seen: dict[str, torch.Tensor] = {}
    step = run.optimizer.step

    def record(*args, **kwargs):
        seen.update({name: p.grad.clone() for name, p in run.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    run.optimizer.step = record
    with GracefulStop() as run._stop:
        stats = run.train_step()
    return seen, stats


def test_attnres_gradients_never_scale_the_base_update(setup, tmp_path):
    """At step 1 the converted model computes exactly what the original does, so the LoRA gradients of the
    AttnRes arm are the baseline's: clipped at max_grad_norm to the same values, however large the AttnRes
    gradients are (one global norm would shrink them). The AttnRes gradients are clipped on their own."""
    tight = {"max_grad_norm": 1e-3}
    baseline, base_stats = _first_step_gradients(setup, tmp_path / "b", convert=False, **tight)
    assert base_stats.attnres_grad_norm is None and base_stats.grad_norm > 1e-3  # clipping is active
    lora = [name for name in baseline if "lora_" in name]
    norm = lambda grads, names: torch.linalg.vector_norm(torch.stack([grads[n].norm() for n in names])).item()  # noqa: E731
    assert lora and norm(baseline, lora) == pytest.approx(1e-3, rel=1e-3)

    unclipped, stats = _first_step_gradients(setup, tmp_path / "a", **tight)
    assert stats.grad_norm == pytest.approx(base_stats.grad_norm, rel=1e-4)
    # One global norm would include these: the LoRA gradients would come out smaller than the baseline's.
    assert stats.attnres_grad_norm > 0.1 * stats.grad_norm
    assert all(torch.allclose(unclipped[name], baseline[name], rtol=1e-4, atol=1e-9) for name in lora)
    new = [name for name in unclipped if "_res_" in name]
    assert norm(unclipped, new) == pytest.approx(stats.attnres_grad_norm, rel=1e-4)  # not clipped by default

    clipped, clipped_stats = _first_step_gradients(setup, tmp_path / "c", attnres_max_grad_norm=1e-2, **tight)
    assert clipped_stats.attnres_grad_norm == pytest.approx(stats.attnres_grad_norm, rel=1e-4)
    assert norm(clipped, new) == pytest.approx(1e-2, rel=1e-3)
    assert all(torch.allclose(clipped[name], baseline[name], rtol=1e-4, atol=1e-9) for name in lora)


def _lora_train_records(setup, out, **train) -> list[dict]:
    """The train records of a short LoRA run of the tiny model (no evaluation), with `train` overrides."""
    from attnres_convert.finetune.training import finetune

    sections = dict(
        train={"trainable": "lora", "lr": 3e-2, "warmup_steps": 0, **train},
        lora={"r": 4},
        eval={"every": 0, "max_sequences": 4},
    )
    result = finetune(parse_recipe(tiny_recipe(setup["model"], setup["corpus"], out, **sections)))
    return [r for r in result.records if r["kind"] == "train"]


def test_kl_term_to_the_starting_model(setup, tmp_path):
    """train.kl_weight: KL(original || model) joins the loss. At step 1 the converted model is the original
    (KL 0 up to float rounding); afterwards the KL is recorded and the term changes the run."""

    def records(out, **train):
        return _lora_train_records(setup, out, steps=3, **train)

    plain, anchored = records(tmp_path / "plain"), records(tmp_path / "kl", kl_weight=1.0)
    assert "kl" not in plain[0]
    assert abs(anchored[0]["kl"]) < 1e-6 and anchored[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert all(r["kl"] > 1e-4 for r in anchored[1:])
    assert anchored[-1]["loss"] != pytest.approx(plain[-1]["loss"], rel=1e-4)
    with pytest.raises(RecipeError, match=r"train\.kl_weight: must be >= 0"):
        records(tmp_path / "bad", kl_weight=-1.0)


def test_a_failing_arm_is_named_and_the_finished_ones_are_kept(setup, tmp_path):
    from attnres_convert.finetune.training import NonFiniteLossError

    broken = [
        "train.trainable=full",
        "train.lr=1e6",
        "train.attnres_lr=1e6",
        "train.max_grad_norm=null",
        "train.steps=10",
    ]
    with pytest.raises(
        NonFiniteLossError, match=r"arm 'attnres train\.trainable=full .*', seed 0: training stopped at step \d+"
    ):
        run_ab(setup["recipe"], ["train.warmup_steps=0"], sweep=[broken], plain=False, output=tmp_path / "ab")
    assert not (tmp_path / "ab").exists()
    assert (tmp_path / "ab-runs" / "baseline" / "seed-0" / "final_metrics.json").is_file()


def test_depth_gate_ramps_the_mix_in(setup, tmp_path):
    """train.depth_gate_steps: at step 1 the gate is 0, so every reader reads the plain stream and the AttnRes
    parameters get no gradient at all; it rises to 1 and the run differs from one without it. The gate is a
    training schedule: a length that would end the run with a partial gate is refused."""

    def records(out, **train):
        return _lora_train_records(setup, out, steps=4, **train)

    plain, ramped = records(tmp_path / "plain"), records(tmp_path / "gated", depth_gate_steps=2)
    assert "depth_gate" not in plain[0]
    assert [r["depth_gate"] for r in ramped] == [0.0, 0.5, 1.0, 1.0]
    assert ramped[0]["attnres_grad_norm"] == 0.0 and plain[0]["attnres_grad_norm"] > 0
    assert ramped[1]["attnres_grad_norm"] > 0
    assert ramped[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)  # exact at conversion either way
    assert ramped[-1]["loss"] != pytest.approx(plain[-1]["loss"], rel=1e-4)
    with pytest.raises(RecipeError, match=r"depth_gate_steps \(4\) must be smaller than steps \(4\)"):
        records(tmp_path / "bad", depth_gate_steps=4)


def test_an_arm_run_again_replaces_its_earlier_folder_only_once_finished(setup, tmp_path, monkeypatch):
    """The arms run with output.overwrite: an arm trained again over its earlier run folder writes beside it (the
    live table follows it there) and replaces it only when finished; an A/B that fails keeps the earlier runs."""
    from attnres_convert.finetune import ab

    out, runs = tmp_path / "ab", tmp_path / "ab-runs"
    arm = runs / "baseline" / "seed-0"
    run_ab(setup["recipe"], ["train.steps=2"], output=out)
    (arm / "marker.txt").write_text("the earlier run")
    earlier = (arm / "final_metrics.json").read_text()
    train_step, seen = FinetuneRecipe.train_step, []

    def fail_at_step_2(self):
        if self.state.step == 1:
            live = ab._live_folder(arm)
            seen.append((live, ab._progress_of(live)))
            raise RuntimeError("CUDA out of memory (simulated)")
        return train_step(self)

    monkeypatch.setattr(FinetuneRecipe, "train_step", fail_at_step_2)
    with pytest.raises(RuntimeError, match="simulated"):
        run_ab(setup["recipe"], ["train.steps=3"], output=out, overwrite=True)
    assert (arm / "marker.txt").is_file() and (arm / "final_metrics.json").read_text() == earlier
    [(live, (step, loss, done))] = seen
    assert live.parent == arm.parent and live.name.startswith(
        ".seed-0.partial-"
    )  # the run in progress, not the earlier one
    assert step == 1 and loss is not None and not done
    assert not [p for p in arm.parent.iterdir() if p.name.startswith(".")]

    monkeypatch.setattr(FinetuneRecipe, "train_step", train_step)
    again = run_ab(setup["recipe"], ["train.steps=3"], output=out, overwrite=True)
    assert not (arm / "marker.txt").exists() and json.loads((arm / "final_metrics.json").read_text())["steps"] == 3
    assert again.report["steps"] == 3 and [step for step, _ in again.report["arms"][0]["eval"]] == [0, 2, 3]
    assert ab._live_folder(arm) == arm and not [p for p in arm.parent.iterdir() if p.name.startswith(".")]


def test_the_default_output_names_the_recipe_once():
    from pathlib import Path

    from attnres_convert.finetune.ab import default_output

    assert default_output(Path("recipes/ab-scratch-cpu.yaml")) == Path("outputs/ab-scratch-cpu")
    assert default_output(Path("recipes/quickstart-cpu.yaml")) == Path("outputs/ab-quickstart-cpu")
    assert "ab-ab-" not in str(default_output(Path("ab-smollm2-shakespeare.yaml")))
