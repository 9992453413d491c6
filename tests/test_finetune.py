"""`attnres finetune` end to end on tiny models (seconds each): what trains, what is saved, resume, two
processes, loading the result. One short run on the real SmolLM2 at the end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe
from safetensors.torch import load_file

from attnres_convert.finetune.checkpoints import list_checkpoints
from attnres_convert.finetune.recipe import RecipeError, parse_recipe
from attnres_convert.finetune.training import NonFiniteLossError, TrainingInterrupted, finetune
from attnres_convert.io.saving import load_converted

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    return {"root": root, "model": tiny_model_folder(root / "tiny-llama"), "corpus": write_corpus(root / "corpus")}


def run(setup, out: Path, **sections):
    return finetune(parse_recipe(tiny_recipe(setup["model"], setup["corpus"], out, **sections)))


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def train_losses(result) -> list[float]:
    return [r["loss"] for r in result.records if r["kind"] == "train"]


def is_attnres(name: str) -> bool:
    return "_res_proj" in name or "_res_norm" in name or "output_attn_res" in name


def test_attnres_only_trains_the_new_parameters_and_lowers_held_out_loss(setup, tmp_path):
    result = run(setup, tmp_path / "run", train={"trainable": "attnres", "steps": 8})
    metrics = result.metrics
    assert metrics["steps"] == 8 and metrics["tokens"] == 8 * 4 * 32
    assert metrics["eval_loss"] < metrics["eval_loss_start"] - 0.01, metrics
    assert metrics["trainable_parameters"] == metrics["attnres_parameters"] > 0
    trained, original = weights(result.model_dir), weights(setup["model"])
    new = [name for name in trained if is_attnres(name)]
    assert len(new) == 3 * 4 + 2  # 3 layers x (attention, mlp) x (query, key norm) + the output aggregation
    queries = {name: trained[name].abs().sum().item() for name in new if name.endswith("_proj.weight")}
    # The first sublayer reads one source (the embedding): a softmax over one source has no gradient.
    assert queries.pop("model.layers.0.self_attention_res_proj.weight") == 0
    assert all(value > 0 for value in queries.values()), queries
    for name, tensor in original.items():  # every base weight bit-identical
        assert torch.equal(trained[name], tensor), name


def test_full_training_changes_everything_and_lowers_loss_more(setup, tmp_path):
    result = run(setup, tmp_path / "run", train={"trainable": "full", "steps": 8, "lr": 3e-3})
    assert result.metrics["eval_loss"] < result.metrics["eval_loss_start"] - 0.3, result.metrics
    trained, original = weights(result.model_dir), weights(setup["model"])
    changed = [name for name, tensor in original.items() if not torch.equal(trained[name], tensor)]
    assert len(changed) == len(original)


def test_lora_trains_adapters_and_attnres_merged_or_kept(setup, tmp_path):
    sections = dict(
        train={"trainable": "lora", "steps": 6, "lr": 1e-2},
        lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    )
    merged = run(setup, tmp_path / "merged", **sections)
    kept = run(setup, tmp_path / "kept", **{**sections, "lora": {**sections["lora"], "merge": False}})
    assert train_losses(merged) == train_losses(kept)
    assert merged.metrics["eval_loss"] < merged.metrics["eval_loss_start"]
    original = weights(setup["model"])
    folded = weights(merged.model_dir)
    for name, tensor in original.items():  # LoRA merged into its targets only
        assert torch.equal(folded[name], tensor) != (".q_proj." in name or ".v_proj." in name), name
    assert not any("lora" in name for name in folded)

    base = weights(kept.model_dir)  # merge: false = the converted model (trained AttnRes) + adapter/
    for name, tensor in original.items():
        assert torch.equal(base[name], tensor), name
    assert any(base[name].abs().sum() > 0 for name in base if name.endswith("_res_proj.weight"))
    adapter = load_file(kept.model_dir / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)

    from peft import PeftModel

    ids = torch.randint(4, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged_logits = load_converted(merged.model_dir).eval()(ids).logits
        with_adapter = PeftModel.from_pretrained(load_converted(kept.model_dir), kept.model_dir / "adapter").eval()
        assert torch.allclose(with_adapter(input_ids=ids).logits, merged_logits, atol=1e-4)


def test_gradient_checkpointing_trains_the_same_without_deprecation_warnings(setup, tmp_path, recwarn):
    """train.gradient_checkpointing (non-reentrant, the only kind AttnRes accepts) with LoRA, where PEFT
    needs input gradients for the frozen layers: the same losses as without it, and no FutureWarning
    from transformers' deprecated `gradient_checkpointing_enable`."""
    sections = dict(
        train={"trainable": "lora", "steps": 4, "lr": 1e-2},
        lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    )
    plain = run(setup, tmp_path / "plain", **sections)
    checkpointed = run(
        setup, tmp_path / "ckpt", **{**sections, "train": {**sections["train"], "gradient_checkpointing": True}}
    )
    assert train_losses(checkpointed) == pytest.approx(train_losses(plain), rel=1e-5)
    assert checkpointed.metrics["eval_loss"] == pytest.approx(plain.metrics["eval_loss"], rel=1e-5)
    assert not [w for w in recwarn if "checkpointing_enable" in str(w.message)]


def test_baseline_trains_the_original_model_from_the_same_start(setup, tmp_path):
    sections = dict(train={"trainable": "lora", "steps": 3}, lora={"r": 4})
    baseline = run(setup, tmp_path / "baseline", model={"convert": False}, **sections)
    attnres = run(setup, tmp_path / "attnres", **sections)
    # Step 0: the converted model is the original model.
    assert math.isclose(baseline.metrics["eval_loss_start"], attnres.metrics["eval_loss_start"], rel_tol=1e-6)
    assert json.loads((baseline.model_dir / "config.json").read_text())["model_type"] == "llama"
    assert not baseline.metrics["converted"] and baseline.metrics["attnres_parameters"] == 0
    assert (
        attnres.metrics["trainable_parameters"] - baseline.metrics["trainable_parameters"]
        == attnres.metrics["attnres_parameters"]
    )


def test_a_baseline_model_folder_has_a_card_ready_to_push(setup, tmp_path):
    """model.convert=false with output.push_to_hub: the folder must pass the push checks (front matter)."""
    from attnres_convert.hub.push import check_push_ready
    from attnres_convert.io.card import read_front_matter

    baseline = run(
        setup, tmp_path / "baseline", model={"convert": False}, train={"trainable": "lora", "steps": 2}, lora={"r": 4}
    )
    assert "README.md" in check_push_ready(baseline.model_dir)  # raises HubError listing problems otherwise
    card = (baseline.model_dir / "README.md").read_text()
    meta = read_front_matter(card)
    assert "attnres-baseline" in meta["tags"] and meta["library_name"] == "transformers"
    assert "(baseline, no AttnRes)" in card and "## Held-out evaluation" in card


def test_a_crash_while_saving_keeps_the_previous_model_folder(setup, tmp_path, monkeypatch):
    """The model folder is swapped for the new one only once that one is complete."""
    import attnres_convert.finetune.result as result

    sections = dict(train={"steps": 3}, checkpoint={"every": 1, "keep_last": 1}, eval={"every": 0, "max_sequences": 4})
    recipe = parse_recipe(tiny_recipe(setup["model"], setup["corpus"], tmp_path / "run", **sections))
    with pytest.raises(TrainingInterrupted):
        finetune(recipe, stop_at_step=2)
    previous = tmp_path / "run" / "model"
    previous.mkdir()
    (previous / "kept.txt").write_text("an earlier attempt's model")

    def broken_card(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(result, "model_card", broken_card)
    with pytest.raises(Exception, match="No space left on device"):
        finetune(recipe, resume=True)
    assert (previous / "kept.txt").read_text() == "an earlier attempt's model"
    assert (
        sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")) == []
    )  # no temporary folder left


def test_resume_refuses_a_checkpoint_missing_trainable_tensors(setup, tmp_path):
    from safetensors.torch import save_file

    sections = dict(
        train={"trainable": "lora", "steps": 4},
        lora={"r": 4},
        checkpoint={"every": 1},
        eval={"every": 0, "max_sequences": 4},
    )
    recipe = parse_recipe(tiny_recipe(setup["model"], setup["corpus"], tmp_path / "run", **sections))
    with pytest.raises(TrainingInterrupted) as stopped:
        finetune(recipe, stop_at_step=2)
    file = stopped.value.checkpoint / "model.safetensors"
    tensors = load_file(file)
    dropped = sorted(name for name in tensors if "lora_B" in name)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, file)
    with pytest.raises(
        RecipeError, match=rf"--resume: checkpoint .*step-0000002 lacks 1 trainable tensor\(s\) \({dropped}\)"
    ):
        finetune(recipe, resume=True)
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, file)
    with pytest.raises(RecipeError, match=r"holds 1 tensor\(s\) this recipe does not train \(model.extra.weight\)"):
        finetune(recipe, resume=True)
    save_file(tensors, file)
    assert finetune(recipe, resume=True).metrics["steps"] == 4


def test_run_folder_contents(setup, tmp_path):
    result = run(setup, tmp_path / "run", train={"steps": 4, "log_every": 2}, eval={"every": 2, "max_sequences": 4})
    out = result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "final_metrics.json",
        "loss_curve.png",
        "metrics.jsonl",
        "model",
        "recipe.yaml",
    ]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("eval", 0),
        ("train", 2),
        ("eval", 2),
        ("train", 4),
        ("eval", 4),
    ]
    assert {"loss", "lr", "attnres_lr", "grad_norm", "attnres_grad_norm", "tokens", "tokens_per_s"} <= set(records[1])
    assert records[-1]["perplexity"] == pytest.approx(math.exp(records[-1]["loss"]))
    assert parse_recipe(__import__("yaml").safe_load((out / "recipe.yaml").read_text())).train.log_every == 2
    assert json.loads((out / "final_metrics.json").read_text())["eval_loss"] == pytest.approx(records[-1]["loss"])
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = out / "model"
    for name in (
        "README.md",
        "recipe.yaml",
        "finetune_metrics.json",
        "loss_curve.png",
        "modeling_attnres.py",
        "tokenizer.json",
    ):
        assert (model / name).is_file(), name
    card = (model / "README.md").read_text()
    assert (
        "## Held-out evaluation" in card
        and "## Recipe" in card
        and "![training and held-out loss](loss_curve.png)" in card
    )


def test_schedules_follow_warmup_and_decay(setup, tmp_path):
    result = run(
        setup,
        tmp_path / "wsd",
        train={
            "trainable": "full",
            "steps": 10,
            "warmup_steps": 2,
            "schedule": "wsd",
            "decay_fraction": 0.3,
            "min_lr_ratio": 0.0,
            "lr": 1e-3,
            "attnres_lr": 1e-2,
        },
        eval={"every": 0, "max_sequences": 2},
    )
    lrs = [r["attnres_lr"] / 1e-2 for r in result.records if r["kind"] == "train"]  # the rate each step used
    assert lrs == pytest.approx([0.5, 1, 1, 1, 1, 1, 1, 1, 2 / 3, 1 / 3])  # warmup 2, stable, decay over the last 3
    base = [r["lr"] / 1e-3 for r in result.records if r["kind"] == "train"]
    assert base == pytest.approx(lrs)


def test_resume_reproduces_the_uninterrupted_losses(setup, tmp_path):
    # LoRA dropout makes the run depend on the RNG: a checkpoint must carry it.
    sections = dict(
        train={"trainable": "lora", "steps": 6},
        lora={"r": 4, "dropout": 0.1},
        eval={"every": 2, "max_sequences": 4},
        checkpoint={"every": 2, "keep_last": 2},
    )
    whole = run(setup, tmp_path / "whole", **sections)
    recipe = parse_recipe(tiny_recipe(setup["model"], setup["corpus"], tmp_path / "cut", **sections))
    with pytest.raises(TrainingInterrupted, match="stopped by stop_at_step after step 3; checkpoint saved") as stopped:
        finetune(recipe, stop_at_step=3)
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step-0000002", "step-0000003"]
    assert stopped.value.checkpoint.name == "step-0000003"
    assert not (tmp_path / "cut" / "model").exists()
    with pytest.raises(RecipeError, match="already holds a run; pass --resume"):
        finetune(recipe)
    resumed = finetune(recipe, resume=True)
    assert [(r["kind"], r["step"], r["loss"]) for r in resumed.records] == [
        (r["kind"], r["step"], r["loss"]) for r in whole.records
    ]
    assert weights(resumed.model_dir).keys() == weights(whole.model_dir).keys()
    for name, tensor in weights(whole.model_dir).items():
        assert torch.equal(weights(resumed.model_dir)[name], tensor), name
    # Checkpoints hold what trains, not the frozen model.
    saved = load_file(list_checkpoints(tmp_path / "cut")[-1] / "model.safetensors")
    assert saved and all("lora_" in name or is_attnres(name) for name in saved)


def test_resume_refuses_a_different_recipe(setup, tmp_path):
    recipe = tiny_recipe(setup["model"], setup["corpus"], tmp_path / "run", train={"steps": 4}, checkpoint={"every": 1})
    with pytest.raises(TrainingInterrupted):
        finetune(parse_recipe(recipe), stop_at_step=2)
    changed = tiny_recipe(
        setup["model"], setup["corpus"], tmp_path / "run", train={"steps": 4, "lr": 5e-4}, checkpoint={"every": 1}
    )
    with pytest.raises(RecipeError, match=r"--resume: the recipe differs .*\n  train\.lr: 0\.001 -> 0\.0005"):
        finetune(parse_recipe(changed), resume=True)
    done = finetune(parse_recipe(recipe), resume=True)
    assert done.metrics["steps"] == 4
    with pytest.raises(RecipeError, match="is complete"):
        finetune(parse_recipe(recipe), resume=True)


def test_non_finite_loss_stops_and_saves_no_model(setup, tmp_path):
    recipe = parse_recipe(
        tiny_recipe(
            setup["model"],
            setup["corpus"],
            tmp_path / "run",
            train={
                "trainable": "full",
                "lr": 1e6,
                "attnres_lr": 1e6,
                "max_grad_norm": None,
                "warmup_steps": 0,
                "schedule": "constant",
                "steps": 10,
            },
            checkpoint={"every": 1},
            eval={"every": 0, "max_sequences": 2},
        )
    )
    with pytest.raises(
        NonFiniteLossError,
        match=r"training stopped at step 2: the loss is nan \(non-finite\). No model was saved; "
        r"the last good checkpoint is .*step-0000001 \(step 1\)",
    ):
        finetune(recipe)
    assert not (tmp_path / "run" / "model").exists() and not (tmp_path / "run" / "final_metrics.json").exists()
    good = load_file(list_checkpoints(tmp_path / "run")[-1] / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in good.values())


def _finetune_in_two_processes(recipe: Path, cwd: Path) -> subprocess.CompletedProcess:
    """`attnres finetune RECIPE` under `accelerate launch` with 2 CPU processes (gloo DDP); it must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(ROOT / "cli.py"),
            "finetune",
            str(recipe),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=cwd,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    return launched


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(setup, tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo DDP): same losses as 1 process with twice the gradient
    accumulation, and only the main process writes the run folder."""
    sections = dict(
        train={"trainable": "lora", "steps": 4, "grad_accum": 1, "micro_batch": 2},
        lora={"r": 4},
        eval={"every": 2, "max_sequences": 5},
        checkpoint={"every": 2},
    )
    recipe = write_recipe(
        tmp_path / "recipe.yaml", tiny_recipe(setup["model"], setup["corpus"], tmp_path / "two", **sections)
    )
    launched = _finetune_in_two_processes(recipe, tmp_path)
    assert "Fine-tuned 4 steps, 512 tokens (2 processes)" in " ".join(launched.stdout.split())
    assert launched.stdout.count("held-out loss") == 1  # one summary table, from the main process

    single = run(setup, tmp_path / "one", **{**sections, "train": {**sections["train"], "grad_accum": 2}})
    two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in two] == [(r["kind"], r["step"]) for r in single.records]  # written once
    for a, b in zip(two, single.records):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a, b)
    checkpoint = tmp_path / "two" / "checkpoints" / "step-0000002"
    assert sorted(p.name for p in checkpoint.glob("random_states_*")) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())


@pytest.mark.slow
def test_two_processes_replace_an_earlier_run(setup, tmp_path):
    """output.overwrite under `accelerate launch` (2 CPU processes): the main process picks the staging folder
    and every process writes its part of each checkpoint there; the finished run replaces the earlier one."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("recipe.yaml", "metrics.jsonl", "marker.txt"):
        (out / name).write_text("an earlier run")
    sections = dict(
        train={"trainable": "lora", "steps": 3, "grad_accum": 1, "micro_batch": 2},
        lora={"r": 4},
        eval={"every": 0, "max_sequences": 4},
        checkpoint={"every": 2},
        output={"overwrite": True},
    )
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_recipe(setup["model"], setup["corpus"], out, **sections))
    _finetune_in_two_processes(recipe, tmp_path)
    assert not (out / "marker.txt").exists() and json.loads((out / "final_metrics.json").read_text())["processes"] == 2
    checkpoint = out / "checkpoints" / "step-0000002"
    assert sorted(p.name for p in checkpoint.glob("random_states_*")) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert (out / "model" / "model.safetensors").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_result_loads_with_trust_remote_code_without_the_package(setup, tmp_path):
    result = run(setup, tmp_path / "run", train={"steps": 2}, eval={"every": 0, "max_sequences": 2})
    ids = [[5, 17, 33, 40, 2, 9, 60]]
    with torch.no_grad():
        expected = load_converted(result.model_dir).eval()(torch.tensor(ids)).logits
    script = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(result.model_dir)!r}, trust_remote_code=True).eval()\n"
        "assert not any(name.startswith('attnres_convert') for name in sys.modules), 'used the installed package'\n"
        f"print(json.dumps(model(torch.tensor({ids})).logits.tolist()))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert torch.allclose(torch.tensor(json.loads(loaded.stdout.splitlines()[-1])), expected, atol=1e-5)


@pytest.mark.slow
def test_real_smollm2_short_run(smollm2_folder, tmp_path):
    """SmolLM2-135M converted and trained for 2 steps on Shakespeare: runs, learns something, saves a card."""
    recipe = parse_recipe(
        {
            "model": {"source": str(smollm2_folder)},
            "data": {"train": {"files": ["shakespeare:hamlet"]}, "eval": {"fraction": 0.5}, "seq_len": 64},
            "train": {"trainable": "attnres", "steps": 2, "micro_batch": 2, "lr": 1e-4, "attnres_lr": 1e-4},
            "eval": {"every": 0, "max_sequences": 4},
            "output": {"dir": str(tmp_path / "run"), "save_model": False},
        }
    )
    result = finetune(recipe)
    metrics = result.metrics
    assert metrics["attnres_parameters"] == 70_272 and metrics["tokens"] == 2 * 2 * 64
    assert 1.0 < metrics["eval_loss_start"] < 6.0 and math.isfinite(metrics["eval_loss"])
    assert abs(metrics["eval_loss"] - metrics["eval_loss_start"]) < 0.5


def test_a_converted_folder_continues_its_learned_routing(setup, tmp_path):
    first = run(setup, tmp_path / "first", train={"steps": 4}, eval={"every": 0, "max_sequences": 8})
    sections = dict(
        model={"source": str(first.model_dir), "num_blocks": None},
        train={"steps": 2},
        eval={"every": 0, "max_sequences": 8},
    )
    second = run(setup, tmp_path / "second", **sections)
    assert second.metrics["converted"] and math.isclose(
        second.metrics["eval_loss_start"], first.metrics["eval_loss"], rel_tol=1e-6
    )
    with pytest.raises(
        RecipeError, match=r"model\.block_size: .* is already converted with block size 4; it cannot be trained as 2"
    ):
        run(setup, tmp_path / "third", **{**sections, "model": {**sections["model"], "block_size": 2}})


# --- output.overwrite: the earlier run is kept until the new one has finished ---------------------


def _earlier_run(setup, out: Path, **sections) -> str:
    """A finished run in OUT, with a marker file only it has; returns its final_metrics.json."""
    run(setup, out, train={"steps": 2}, eval={"every": 0, "max_sequences": 4}, **sections)
    (out / "marker.txt").write_text("the earlier run")
    return (out / "final_metrics.json").read_text()


def _hidden_siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith("."))


def test_overwrite_keeps_the_earlier_run_until_the_new_one_has_finished(setup, tmp_path, monkeypatch):
    """A run with output.overwrite=true that fails part-way (here: out of memory at step 2) leaves the earlier
    run exactly as it was and no partial folder; one that finishes replaces it with a complete run folder."""
    from attnres_convert.finetune.training import FinetuneRecipe

    out = tmp_path / "run"
    earlier = _earlier_run(setup, out)
    train_step, seen = FinetuneRecipe.train_step, []

    def out_of_memory_at_step_2(self):
        if self.state.step == 1:
            staged = {name: sorted(p.name for p in (tmp_path / name).iterdir()) for name in _hidden_siblings(out)}
            seen.append(((out / "marker.txt").is_file(), staged))
            raise RuntimeError("CUDA out of memory (simulated)")
        return train_step(self)

    monkeypatch.setattr(FinetuneRecipe, "train_step", out_of_memory_at_step_2)
    sections = dict(
        train={"steps": 3}, eval={"every": 0, "max_sequences": 4}, checkpoint={"every": 1}, output={"overwrite": True}
    )
    with pytest.raises(RuntimeError, match="simulated"):
        run(setup, out, **sections)
    assert (out / "marker.txt").read_text() == "the earlier run" and (out / "final_metrics.json").read_text() == earlier
    assert load_converted(out / "model") is not None
    assert _hidden_siblings(out) == []
    # Meanwhile, it was training in a hidden folder beside the earlier run, which was still there.
    [(kept_meanwhile, staged)] = seen
    assert kept_meanwhile and len(staged) == 1 and next(iter(staged)).startswith(".run.partial-"), staged
    assert list(staged.values()) == [["checkpoints", "metrics.jsonl", "recipe.yaml"]]

    monkeypatch.setattr(FinetuneRecipe, "train_step", train_step)
    result = run(setup, out, **sections)
    assert result.output == out and result.model_dir == out / "model"
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints",
        "final_metrics.json",
        "loss_curve.png",
        "metrics.jsonl",
        "model",
        "recipe.yaml",
    ]
    assert json.loads((out / "final_metrics.json").read_text())["steps"] == 3 == result.metrics["steps"]
    assert [p.name for p in list_checkpoints(out)] == [
        "step-0000001",
        "step-0000002",
    ]  # keep_last 2; none at the last step
    assert [r["step"] for r in result.records if r["kind"] == "train"] == [1, 2, 3]
    assert load_converted(result.model_dir) is not None
    assert _hidden_siblings(out) == []


def test_overwrite_interrupted_or_diverging_keeps_the_earlier_run(setup, tmp_path):
    """Ctrl-C (here stop_at_step) or a non-finite loss in a run replacing an earlier one: the earlier run is
    kept and the message says so; no checkpoint to resume, no partial folder left."""
    out = tmp_path / "run"
    earlier = _earlier_run(setup, out)
    sections = dict(
        train={"steps": 4}, eval={"every": 0, "max_sequences": 4}, checkpoint={"every": 1}, output={"overwrite": True}
    )
    recipe = parse_recipe(tiny_recipe(setup["model"], setup["corpus"], out, **sections))
    with pytest.raises(
        TrainingInterrupted, match=r"stopped by stop_at_step after step 2; the earlier run in .* is unchanged"
    ) as stopped:
        finetune(recipe, stop_at_step=2)
    assert stopped.value.checkpoint is None and "--resume" not in str(stopped.value)
    assert (out / "marker.txt").is_file() and (out / "final_metrics.json").read_text() == earlier
    assert _hidden_siblings(out) == []
    with pytest.raises(RecipeError, match="is complete"):  # the earlier run: nothing to resume
        finetune(recipe, resume=True)

    diverging = parse_recipe(
        tiny_recipe(
            setup["model"],
            setup["corpus"],
            out,
            output={"overwrite": True},
            train={
                "trainable": "full",
                "lr": 1e6,
                "attnres_lr": 1e6,
                "max_grad_norm": None,
                "warmup_steps": 0,
                "schedule": "constant",
                "steps": 10,
            },
            checkpoint={"every": 1},
            eval={"every": 0, "max_sequences": 2},
        )
    )
    with pytest.raises(
        NonFiniteLossError,
        match=r"training stopped at step 2: .* No model was saved; the earlier run in .* is unchanged",
    ):
        finetune(diverging)
    assert (out / "marker.txt").is_file() and (out / "final_metrics.json").read_text() == earlier
    assert _hidden_siblings(out) == []


def test_resume_with_overwrite_continues_in_place(setup, tmp_path):
    """--resume with output.overwrite=true continues the interrupted run in its folder (nothing staged)."""
    out = tmp_path / "run"
    sections = dict(
        train={"steps": 4}, eval={"every": 0, "max_sequences": 4}, checkpoint={"every": 1}, output={"overwrite": True}
    )
    recipe = parse_recipe(tiny_recipe(setup["model"], setup["corpus"], out, **sections))
    with pytest.raises(TrainingInterrupted, match="checkpoint saved"):  # a first run: nothing to replace
        finetune(recipe, stop_at_step=2)
    (out / "marker.txt").write_text("this run's folder")
    resumed = finetune(recipe, resume=True)
    assert resumed.metrics["steps"] == 4 and (out / "marker.txt").is_file()
    assert [r["step"] for r in resumed.records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert _hidden_siblings(out) == []


def test_a_tied_model_checkpoints_quietly_and_resumes_to_the_same_weights(tmp_path, caplog, capfd):
    """Tied input and output embeddings share one tensor: Accelerate's checkpoint keeps it under one name and
    logs "Removed shared tensor {'lm_head.weight'} ... check ...". Harmless: a run stopped and resumed from such a
    checkpoint ends with the uninterrupted run's weights, still tied; and the line stays off the console."""
    import logging

    from finetune_helpers import char_tokenizer
    from rich.console import Console
    from tiny_models import tiny_model

    folder = tmp_path / "tied"
    model = tiny_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    corpus = write_corpus(tmp_path / "corpus")
    sections = dict(
        train={"trainable": "full", "steps": 4, "lr": 1e-3},
        eval={"every": 0, "max_sequences": 4},
        checkpoint={"every": 0},
    )
    whole = finetune(parse_recipe(tiny_recipe(folder, corpus, tmp_path / "whole", **sections)))
    recipe = parse_recipe(tiny_recipe(folder, corpus, tmp_path / "cut", **sections))
    shown = Console(width=80, file=__import__("io").StringIO(), record=True, color_system=None)
    with caplog.at_level(logging.WARNING), pytest.raises(TrainingInterrupted) as stopped:
        finetune(recipe, stop_at_step=2, console=shown)
    saved = load_file(stopped.value.checkpoint / "model.safetensors")
    assert any("embed_tokens" in name for name in saved) and not any(
        "lm_head" in name for name in saved
    )  # one name kept
    said = shown.export_text() + caplog.text + "".join(capfd.readouterr())
    assert "Removed shared tensor" not in said, said
    resumed = finetune(recipe, resume=True)
    final = weights(resumed.model_dir)
    assert final.keys() == weights(whole.model_dir).keys()
    for name, tensor in weights(whole.model_dir).items():
        assert torch.equal(final[name], tensor), name
    loaded = load_converted(resumed.model_dir)
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight  # still tied after the reload


def test_routing_first_holds_the_base_then_runs_its_own_schedule():
    """train.attnres_first_steps: the base's groups at rate 0 for K steps, then their warmup and schedule over the
    steps left; the AttnRes group on the usual schedule throughout; off for a model without AttnRes parameters."""
    from attnres_convert.finetune.optim import Schedule, make_scheduler

    recipe = parse_recipe(
        {
            "model": {"source": "default"},
            "data": {"train": {"files": ["x.txt"]}},
            "train": {"steps": 10, "lr": 1e-3, "attnres_lr": 1e-2, "warmup_steps": 2, "attnres_first_steps": 3},
            "output": {"dir": "out"},
        }
    )
    weights = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.AdamW(
        [{"name": "base", "params": [weights[0]], "lr": 1e-3}, {"name": "attnres", "params": [weights[1]], "lr": 1e-2}]
    )
    scheduler = make_scheduler(optimizer, recipe)
    rates = []
    for _ in range(10):
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    usual, later = Schedule("cosine", 10, 2, 0.1, 0.2), Schedule("cosine", 7, 2, 0.1, 0.2)
    assert [r[0] for r in rates] == pytest.approx([0, 0, 0] + [1e-3 * later(k) for k in range(7)])
    assert [r[1] for r in rates] == pytest.approx([1e-2 * usual(k) for k in range(10)])
    assert rates[3][0] == pytest.approx(0.5e-3)  # the base's own warmup, from its first step
    # The schedule round-trips through the scheduler's state_dict (a resumed run continues the same phase).
    restored = make_scheduler(
        torch.optim.AdamW(
            [
                {"name": "base", "params": [weights[0]], "lr": 1e-3},
                {"name": "attnres", "params": [weights[1]], "lr": 1e-2},
            ]
        ),
        recipe,
    )
    restored.load_state_dict(scheduler.state_dict())
    assert restored.lr_lambdas[0].delay == 3 and restored.last_epoch == 10
    # Without AttnRes parameters (the A/B's baseline) there is nothing to route: the usual schedule.
    alone = torch.optim.AdamW([{"name": "base", "params": [weights[0]], "lr": 1e-3}])
    assert make_scheduler(alone, recipe).lr_lambdas[0].delay == 0
