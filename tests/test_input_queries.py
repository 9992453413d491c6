"""Input-dependent queries (`query_rank` r > 0): q = w + B A x / rms(x) per token, B zero at conversion.
Still exact at conversion (logits, cached greedy generation, left padding, bf16, save and load without this
package, the streamed conversion), trainable (B first, then A), refused where it cannot run (Triton kernels,
negative ranks), and carried through `attnres finetune` (LoRA and full, save, reload, resume)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus
from isolated import assert_same_logits_without_the_package
from safetensors.torch import load_file
from tiny_models import randomize_queries, tiny_model, token_ids
from typer.testing import CliRunner

from attnres_convert import convert, load_converted, save_converted
from attnres_convert.cli import app
from attnres_convert.conversion.options import OptionsError
from attnres_convert.conversion.surgery import convert_model
from attnres_convert.finetune.checkpoints import list_checkpoints
from attnres_convert.finetune.recipe import RecipeError, parse_recipe
from attnres_convert.finetune.training import TrainingInterrupted, finetune
from attnres_convert.modeling.configuration_attnres import AttnResConfig
from attnres_convert.modeling.modeling_attnres import KERNEL_ENV, AttnResQuery

RANK = 4
GENERATE = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)


def _folder_tensors(folder) -> dict[str, torch.Tensor]:
    return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}


def _projections(model) -> list[AttnResQuery]:
    return [m for m in model.modules() if isinstance(m, AttnResQuery)]


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox_parallel"])
def test_conversion_with_query_rank_reproduces_the_original(family):
    """Logits bit for bit as the static-query conversion (and the original up to rounding), greedy generation
    with and without the KV cache, a left-padded batch."""
    base = tiny_model(family)
    ids = token_ids()
    with torch.no_grad():
        reference = base(ids).logits
    static = convert_model(copy.deepcopy(base), block_size=3).eval()
    model = convert_model(copy.deepcopy(base), block_size=3, query_rank=RANK).eval()
    assert model.config.query_rank == RANK and static.config.query_rank == 0
    queries = _projections(model)
    assert queries and all(q.down.shape == (RANK, 64) and q.up.shape == (64, RANK) for q in queries)
    assert all(q.down.abs().min() > 0 and not q.up.any() for q in queries)
    with torch.no_grad():
        logits, static_logits = model(ids).logits, static(ids).logits
    assert torch.equal(logits, static_logits)
    assert (logits - reference).abs().max().item() <= 1e-4

    prompt = token_ids(batch=1, length=10, seed=1)
    expected = base.generate(prompt, **GENERATE)
    assert model.generate(prompt, use_cache=True, **GENERATE).tolist() == expected.tolist()
    assert model.generate(prompt, use_cache=False, **GENERATE).tolist() == expected.tolist()

    short, long = token_ids(1, 7, seed=2), token_ids(1, 12, seed=3)
    batch, mask = torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 12, dtype=torch.long)
    batch[0, 5:], mask[0, 5:] = short[0], 1
    batch[1], mask[1] = long[0], 1
    together = model.generate(batch, attention_mask=mask, **GENERATE)
    assert together[0, 5:].tolist() == model.generate(short, **GENERATE)[0].tolist()
    assert together[1].tolist() == model.generate(long, **GENERATE)[0].tolist()


def test_bfloat16_conversion_with_query_rank_matches_the_static_one():
    base = tiny_model("llama").to(torch.bfloat16)
    ids = token_ids()
    with torch.no_grad():
        reference = base(ids).logits
        static = convert_model(copy.deepcopy(base)).eval()(ids).logits
        logits = convert_model(copy.deepcopy(base), query_rank=RANK).eval()(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, static)
    assert (logits.float() - reference.float()).abs().max().item() <= 0.05  # bf16 rounding, as the static conversion


def test_trained_projections_save_and_load_without_this_package(tmp_path):
    """A model whose projections have learned (B != 0, so the queries really depend on the input) reloads with
    the same logits, through the package and through trust_remote_code where it cannot be imported."""
    model = randomize_queries(
        convert_model(tiny_model("llama"), block_size=3, query_rank=RANK).eval(), 0.3, parts=("up", "weight")
    )
    ids = token_ids()
    with torch.no_grad():
        expected = model(ids).logits
        static_routing = copy.deepcopy(model)
        for query in _projections(static_routing):
            query.up.zero_()
        assert (static_routing(ids).logits - expected).abs().max() > 1e-3  # the input-dependent part matters
    out = save_converted(model, tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert config["query_rank"] == RANK
    names = load_file(out / "model.safetensors")
    assert names["model.layers.0.mlp_res_proj.down"].shape == (RANK, 64)
    assert names["model.output_attn_res_proj.up"].shape == (64, RANK)
    with torch.no_grad():
        assert torch.equal(load_converted(out).eval()(ids).logits, expected)
    assert_same_logits_without_the_package(out, ids, expected, tmp_path)


def test_projections_keep_their_names_through_the_base_models_renaming_rules(tmp_path):
    """Mixtral's checkpoint rules rename `.mlp.` when saving: `mlp_res_proj.down` must come back as it was."""
    model = randomize_queries(convert_model(tiny_model("mixtral"), query_rank=RANK).eval(), 0.3, parts=("up",))
    with torch.no_grad():
        expected = model(token_ids()).logits
    out = save_converted(model, tmp_path / "converted")
    assert "model.layers.0.mlp_res_proj.down" in _folder_tensors(out)
    with torch.no_grad():
        assert torch.equal(load_converted(out).eval()(token_ids()).logits, expected)


def test_streamed_and_in_memory_conversions_write_the_same_projections(tmp_path):
    """A is drawn from a generator seeded by the reader's index: a conversion is reproducible, streamed or not."""
    tiny_model("llama").save_pretrained(tmp_path / "plain")
    streamed = CliRunner().invoke(
        app,
        [
            "convert",
            str(tmp_path / "plain"),
            "-o",
            str(tmp_path / "streamed"),
            "--query-rank",
            str(RANK),
            "--verify-tokens",
            "32",
            "--verify-new-tokens",
            "4",
        ],
    )
    assert streamed.exit_code == 0, streamed.output
    assert "input-dependent, rank 4" in streamed.output and "PASS" in streamed.output
    in_memory = convert(
        tmp_path / "plain", tmp_path / "memory", query_rank=RANK, stream=False, verify_tokens=32, verify_new_tokens=4
    )
    assert in_memory.verification.passed and in_memory.verification.max_abs_logit_diff == 0.0
    a, b = _folder_tensors(tmp_path / "streamed"), _folder_tensors(tmp_path / "memory")
    assert a.keys() == b.keys() and any(name.endswith(".down") for name in a)
    assert all(torch.equal(a[name], b[name]) for name in a)
    card = (tmp_path / "streamed" / "README.md").read_text()
    assert f"input-dependent, `query_rank` {RANK}" in card


def test_gradients_reach_b_first_then_a():
    """At conversion B = 0: B has a gradient (A x is not zero), A none (it is multiplied by B). After B moves,
    A's gradient is not zero either. Gradient checkpointing gives the same gradients."""
    model = convert_model(tiny_model("llama"), block_size=3, query_rank=RANK).train()
    ids = token_ids()
    model(ids, labels=ids).loss.backward()
    readers = [q for q in _projections(model) if q.up.grad is not None and q.up.grad.abs().sum() > 0]
    assert len(readers) >= len(_projections(model)) - 1  # all but the first sublayer, which reads one source
    assert all(not q.down.grad.any() for q in _projections(model))
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    checkpointed = copy.deepcopy(model)
    checkpointed.zero_grad()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed(ids, labels=ids).loss.backward()
    for name, param in checkpointed.named_parameters():
        assert torch.allclose(param.grad, expected[name], rtol=1e-4, atol=1e-7), name

    optimizer = torch.optim.SGD([q.up for q in _projections(model)], lr=1.0)
    optimizer.step()
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    assert sum(bool(q.down.grad.abs().sum() > 0) for q in _projections(model)) >= len(readers)


def test_triton_kernels_are_refused_for_input_dependent_queries(monkeypatch):
    model = convert_model(tiny_model("llama"), query_rank=RANK).eval()
    monkeypatch.setenv(KERNEL_ENV, "triton")
    with (
        pytest.raises(RuntimeError, match=r"ATTNRES_KERNEL=triton: .*query_rank > 0.*Unset ATTNRES_KERNEL"),
        torch.no_grad(),
    ):
        model(token_ids())
    with torch.no_grad():
        monkeypatch.delenv(KERNEL_ENV)  # what the message says: auto, the built-in path
        auto = model(token_ids()).logits
        monkeypatch.setenv(KERNEL_ENV, "eager")
        assert torch.equal(model(token_ids()).logits, auto)


def test_negative_or_fractional_ranks_are_refused(tmp_path):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"query_rank must be a whole number >= 0"):
            AttnResConfig(text_config={"model_type": "llama"}, query_rank=bad)
    with pytest.raises(ValueError, match=r"query rank -2 is not valid: give a whole number >= 0"):
        convert_model(tiny_model("llama"), query_rank=-2)
    with pytest.raises(OptionsError, match=r"invalid convert option: query_rank must be >= 0, got -1"):
        convert(None, tmp_path / "out", query_rank=-1)
    result = CliRunner().invoke(app, ["convert", "-o", str(tmp_path / "cli"), "--query-rank", "-1"])
    assert result.exit_code == 2 and "--query-rank must be >= 0" in result.output, result.output  # named as typed
    assert not (tmp_path / "out").exists() and not (tmp_path / "cli").exists()
    assert "--query-rank" in CliRunner().invoke(app, ["convert", "--help"]).output
    with pytest.raises(RecipeError, match=r"model\.query_rank: must be >= 0"):
        parse_recipe({"model": {"query_rank": -1}})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("iq")
    return {"model": tiny_model_folder(root / "tiny-llama"), "corpus": write_corpus(root / "corpus")}


@pytest.mark.parametrize("trainable", ["lora", "full"])
def test_finetune_trains_the_projections_with_the_attnres_group(setup, tmp_path, trainable):
    """model.query_rank=4 end to end: the step-0 held-out loss is the original's, A and B train in the AttnRes
    group, the saved model reloads (A/B included) to the trained logits; with LoRA, a resumed run reproduces
    the uninterrupted one from checkpoints that hold A and B."""
    sections = dict(
        model={"query_rank": RANK},
        train={"trainable": trainable, "steps": 4, "lr": 1e-2, "warmup_steps": 0},
        lora={"r": 4},
        eval={"every": 2, "max_sequences": 4, "at_start": True},
        checkpoint={"every": 2, "keep_last": 2},
    )
    recipe = parse_recipe(tiny_recipe(setup["model"], setup["corpus"], tmp_path / "run", **sections))
    baseline = finetune(
        parse_recipe(
            tiny_recipe(
                setup["model"],
                setup["corpus"],
                tmp_path / "base",
                **{**sections, "model": {"convert": False}, "train": {**sections["train"], "steps": 1}},
            )
        )
    )
    if trainable == "lora":
        with pytest.raises(TrainingInterrupted):
            finetune(recipe, stop_at_step=2)
        saved = load_file(list_checkpoints(tmp_path / "run")[-1] / "model.safetensors")
        assert any(name.endswith("_res_proj.down") for name in saved) and any(
            name.endswith("_res_proj.up") for name in saved
        )
        result = finetune(recipe, resume=True)
        whole = finetune(parse_recipe(tiny_recipe(setup["model"], setup["corpus"], tmp_path / "whole", **sections)))
        assert [r["loss"] for r in result.records] == [r["loss"] for r in whole.records]
    else:
        result = finetune(recipe)
    assert result.metrics["eval_loss_start"] == pytest.approx(baseline.metrics["eval_loss_start"], rel=1e-6)
    per_reader = 64 + 64 + 2 * RANK * 64  # w, g, A, B
    assert result.metrics["attnres_parameters"] == 7 * per_reader  # 6 sublayers + the output aggregation
    trained = load_file(result.model_dir / "model.safetensors")
    ups = [trained[name] for name in trained if name.endswith("_res_proj.up")]
    downs = {name: trained[name] for name in trained if name.endswith("_res_proj.down")}
    assert len(ups) == len(downs) == 7 and sum(bool(up.any()) for up in ups) >= 6
    initial = convert_model(tiny_model("llama"), num_blocks=2, query_rank=RANK).state_dict()
    assert sum(not torch.equal(tensor, initial[name]) for name, tensor in downs.items()) >= 5  # A moved after B did
    model = load_converted(result.model_dir).eval()
    assert model.config.query_rank == RANK
    ids = token_ids(1, 16)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
