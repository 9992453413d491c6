"""`attnres ab --from-scratch`: both arms from the same random initialisation (equal logits at step 0), the
same data order, paired differences; the compute-equivalent figure on known curves; bad input refused
before any training."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import torch
from finetune_helpers import tiny_recipe, write_corpus, write_recipe
from tiny_models import CONFIGS
from typer.testing import CliRunner

from attnres_convert.cli import app
from attnres_convert.finetune.ab import compute_equivalent, compute_equivalent_lines, run_ab, tokens_to_reach
from attnres_convert.finetune.recipe import RecipeError, parse_recipe
from attnres_convert.finetune.starting_model import load_starting_model

runner = CliRunner()
SCRATCH = {"from_scratch": True, "tokenizer": "bytes", "layers": 4, "hidden": 32, "heads": 4, "kv_heads": 2}


def _config_folder(folder, config):
    """A model given by its config alone: training from scratch reads no weights."""
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scratch")
    model, corpus = _config_folder(root / "llama-config", CONFIGS["llama"]()), write_corpus(root / "corpus")
    recipe = tiny_recipe(
        model,
        corpus,
        root / "unused",
        model=SCRATCH,
        train={"trainable": "full", "steps": 3, "lr": 3e-3},
        eval={"every": 0, "max_sequences": 4},
    )
    return {
        "root": root,
        "model": model,
        "corpus": corpus,
        "data": recipe,
        "recipe": write_recipe(root / "scratch.yaml", recipe),
    }


def _recipe(setup, **model):
    data = json.loads(json.dumps(setup["data"]))
    data["model"].update(model)
    return parse_recipe(data)


def test_both_arms_start_from_the_same_initialisation_with_equal_logits(setup):
    baseline = load_starting_model(_recipe(setup, convert=False))
    converted = load_starting_model(_recipe(setup))
    assert not baseline.converted and converted.converted and converted.summary.num_sublayers == 8
    base = baseline.model.state_dict()
    shared = {name: tensor for name, tensor in converted.model.state_dict().items() if name in base}
    assert shared.keys() == base.keys()  # every base weight is in the converted model, under its own name
    for name, tensor in shared.items():
        assert torch.equal(tensor, base[name]), name
    # The resized config and the byte tokenizer: 4 layers of 32, 259 ids.
    config = baseline.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.vocab_size) == (
        4,
        32,
        4,
        259,
    )
    ids = torch.tensor([list(b"To be, or not to be, that is the question")]) + 3
    with torch.no_grad():
        plain, attnres = baseline.model.eval()(ids).logits, converted.model.eval()(ids).logits
    torch.testing.assert_close(attnres, plain, rtol=0, atol=1e-5)
    # Another seed is another initialisation.
    other = load_starting_model(parse_recipe({**setup["data"], "train": {**setup["data"]["train"], "seed": 1}}))
    assert not torch.equal(other.model.get_input_embeddings().weight, converted.model.get_input_embeddings().weight)


def test_tokens_to_reach_a_loss_on_a_known_curve():
    curve = [(0, 5.0), (100, 3.0), (200, 2.0), (300, 1.5)]
    assert tokens_to_reach(curve, 2.5, 1000) == pytest.approx(150_000)  # halfway between steps 100 and 200
    assert tokens_to_reach(curve, 2.0, 1000) == pytest.approx(200_000)
    assert tokens_to_reach(curve, 1.75, 10) == pytest.approx(2_500)
    assert tokens_to_reach(curve, 1.4, 1000) is None
    # The first crossing counts: a curve that dips below the target and comes back up.
    assert tokens_to_reach([(0, 4.0), (10, 2.0), (20, 3.0), (30, 1.0)], 2.5, 1) == pytest.approx(7.5)
    # The AttnRes arm ends at 2.5 after 200 steps of 1,000 tokens: the baseline gets there after 150,000 tokens.
    assert compute_equivalent(curve, 2.5, 200_000, 200) == {
        "target_loss": 2.5,
        "arm_tokens": 200_000,
        "baseline_tokens": pytest.approx(150_000),
        "ratio": pytest.approx(0.75),
    }
    # An arm at 1.6 after 200 steps: the baseline needs 280 steps, 1.4x the tokens.
    assert compute_equivalent(curve, 1.6, 200_000, 200)["ratio"] == pytest.approx(1.4)
    # An arm that ends at 1.0, below anything the baseline reaches, and passes the baseline's final 1.5 at step 200:
    # the baseline needs more than the 300 steps it had, at least 1.5x the tokens.
    never = compute_equivalent(curve, 1.0, 300_000, 300, arm_curve=[(0, 5.0), (100, 2.0), (200, 1.5), (300, 1.0)])
    assert never["ratio"] is None and never["baseline_tokens"] is None
    assert never["arm_tokens_to_baseline_final"] == pytest.approx(200_000) and never[
        "ratio_at_baseline_final"
    ] == pytest.approx(1.5)
    figure = {**never, "per_seed": [None, 1.25], "per_seed_at_baseline_final": [1.5, 1.4]}
    lines = "\n".join(
        compute_equivalent_lines([{"name": "baseline"}, {"name": "attnres", "compute_equivalent": figure}])
    )
    assert (
        "| attnres | 1.0000 | not reached (> 300,000 tokens) | not reached, 1.25x | 200,000 tokens: 1.50x | 1.50x, 1.40x |"
        in lines
    )


@pytest.mark.slow  # six short trainings
def test_ab_from_scratch_end_to_end(setup, tmp_path):
    out = tmp_path / "ab"
    result = runner.invoke(
        app,
        [
            "ab",
            str(setup["recipe"]),
            "--seeds",
            "2",
            "-o",
            str(out),
            "--sweep",
            "model.num_blocks=null model.full=true",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "ab.json").read_text())
    assert report["from_scratch"] is True and report["seeds"] == [0, 1]
    arms = report["arms"]
    assert [a["name"] for a in arms] == ["baseline", "attnres", "attnres model.num_blocks=null model.full=true"]
    base = {r["seed"]: r for r in arms[0]["runs"]}
    for arm in arms[1:]:
        for run in arm["runs"]:
            paired = base[run["seed"]]
            # Same initialisation: equal held-out loss before training; same data order: equal training loss
            # at step 1 (the loss of the first batch, taken before the first update).
            assert run["eval"][0][1] == pytest.approx(paired["eval"][0][1], abs=1e-6)
            assert run["train"][0][1] == pytest.approx(paired["train"][0][1], abs=1e-6)
            assert run["eval"][-1][1] != paired["eval"][-1][1]  # then they train apart
        deltas = [r["eval_loss_final"] - base[r["seed"]]["eval_loss_final"] for r in arm["runs"]]
        assert arm["delta_final"]["per_seed"] == pytest.approx(deltas)
        figure = arm["compute_equivalent"]
        assert figure["target_loss"] == arm["eval_loss_final"] and len(figure["per_seed"]) == 2
        expected = tokens_to_reach(arms[0]["eval"], arm["eval_loss_final"], arm["tokens"] / 3)
        assert figure["baseline_tokens"] == (pytest.approx(expected) if expected is not None else None)
    # Different seeds: different initialisations.
    assert base[0]["eval"][0][1] != base[1]["eval"][0][1]
    table = (out / "ab.md").read_text()
    assert "| random initialisation (step 0) |" in table and "Compute equivalent" in table


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.from_scratch=false"],
            "model.layers, model.hidden, model.heads, model.kv_heads, model.tokenizer resize a model trained from scratch",
        ),
        (["model.hidden=30"], "hidden (30) must be a multiple of heads (4)"),
        (["model.kv_heads=3"], "heads (4) must be a multiple of kv_heads (3)"),
        (
            ["train.trainable=lora"],
            "belong to a retrofit of a pretrained model, not to training from scratch: train.trainable (lora; "
            "a random model trains every weight: use full)",
        ),
        (
            ["train.kl_weight=0.1", "train.depth_gate_steps=1"],
            "scratch: train.kl_weight (a KL term to a random model); train.depth_gate_steps",
        ),
    ],
)
def test_bad_recipes_are_refused_before_training(setup, tmp_path, overrides, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        run_ab(setup["recipe"], overrides, output=tmp_path / "ab")
    assert not (tmp_path / "ab").exists() and not (tmp_path / "ab-runs").exists()


def test_sizes_that_make_no_model_and_a_config_that_is_not_prenorm(setup, tmp_path):
    # Only heads given: the source's hidden size (64) must divide among them.
    with pytest.raises(RecipeError, match="model.hidden: 64 is not divisible by the 5 attention heads"):
        run_ab(setup["recipe"], ["model.hidden=null", "model.heads=5", "model.kv_heads=1"], output=tmp_path / "ab")
    import transformers as T

    olmo2 = _config_folder(
        tmp_path / "olmo2",
        T.Olmo2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128),
    )
    with pytest.raises(RecipeError, match="arm 'attnres': model.source: the olmo2 config .* is not a PreNorm model"):
        run_ab(setup["recipe"], [f"model.source={olmo2}"], output=tmp_path / "ab")
    # Refused before the baseline trained: no run folder was written.
    assert not (tmp_path / "ab").exists() and not list((tmp_path / "ab-runs").rglob("metrics.jsonl"))


def _arm(name, overrides, loss, deltas=None, stderr=0.01, ratio=1.5, delta_se=0.0141):
    entry = {
        "name": name,
        "overrides": overrides,
        "eval": [(0, 5.0), (30, loss)],
        "eval_loss_final": loss,
        "eval_stderr_final": stderr,
        "tokens": 30_544,
        "runs": [],
    }
    if deltas is not None:
        entry["delta_final"] = {
            "mean": sum(deltas) / len(deltas),
            "per_seed": deltas,
            "std": statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
            "min": min(deltas),
            "max": max(deltas),
            "eval_se": delta_se,  # the evaluation's standard error of the mean Δ (`ab.difference_se`)
            "eval_se_paired": True,
        }
        entry["compute_equivalent"] = {
            "target_loss": loss,
            "arm_tokens": 30_544,
            "baseline_tokens": ratio * 30_544,
            "ratio": ratio,
            "arm_tokens_to_baseline_final": 20_000,
            "ratio_at_baseline_final": 1.53,
            "per_seed": [ratio] * len(deltas),
            "per_seed_at_baseline_final": [1.53] * len(deltas),
        }
    return entry


def test_a_difference_within_the_noise_claims_no_savings():
    from attnres_convert.finetune.ab import within_noise

    base = _arm("baseline", ["model.convert=false"], 3.0)
    assert within_noise(_arm("attnres", [], 2.9998, [-0.0002])) == (
        "one seed; |Δ| 0.0002 <= the evaluation's standard error 0.0141"
    )
    assert within_noise(_arm("attnres", [], 2.9, [-0.3])) == "one seed"  # a clear difference, but one seed
    assert "the seeds' spread" in within_noise(_arm("attnres", [], 2.99, [-0.05, 0.03, -0.01]))
    assert within_noise(_arm("attnres", [], 2.99, [-0.012, -0.011])) == (
        "|Δ| 0.0115 <= the evaluation's standard error 0.0141"
    )
    assert within_noise(_arm("attnres", [], 2.8, [-0.21, -0.19, -0.2])) is None  # clear: a figure stands
    # ab.md gives no figure for a difference within the noise.
    noisy = _arm("attnres", [], 2.9998, [-0.0002])
    noisy["compute_equivalent"]["noise"] = within_noise(noisy)
    lines = "\n".join(compute_equivalent_lines([base, noisy]))
    assert (
        "| attnres | 2.9998 | within the noise (one seed; |Δ| 0.0002 <= the evaluation's standard error 0.0141): no savings claim |"
        in lines
    )
    assert "1.50x" not in lines and "1.53x" not in lines


def test_the_ab_console_report_is_whole_at_80_columns():
    import io

    from rich.console import Console

    from attnres_convert.finetune.ab import console_report, within_noise

    base = _arm("baseline", ["model.convert=false"], 3.0)
    long = ["train.attnres_lr=1e-3", "model.num_blocks=null", "model.full=true", "train.depth_gate_steps=100"]
    arms = [
        base,
        _arm("attnres", [], 2.9998, [-0.0002, 0.0001]),
        _arm("attnres " + " ".join(long), long, 2.5, [-0.51, -0.49]),
    ]
    for arm in arms[1:]:
        arm["compute_equivalent"]["noise"] = within_noise(arm)
    report = {"recipe": "ab-scratch-cpu", "steps": 30, "seeds": [0, 1], "arms": arms, "from_scratch": True}
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    console.print(console_report(report, Path("outputs/ab-scratch-cpu")))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text
    words = " ".join(text.split())
    assert "sweep 1: " + " ".join(long) in words  # the overrides whole
    assert "baseline: model.convert=false" in words and "attnres: none: the recipe as written" in words
    for cell in (
        "random init (step 0)",
        "3.0000 ± 0.0100",
        "-0.0001 ± 0.0002",
        "within the noise",
        "-0.5000 ± 0.0141",
        "1.50x",
    ):
        assert any(cell in line for line in text.splitlines()), f"{cell!r} cut or missing:\n{text}"
    assert "Within the noise, so no savings claimed: attnres: |Δ| 0.0001 <= the seeds' spread 0.0002" in words
    assert "outputs/ab-scratch-cpu/ab.md" in words
