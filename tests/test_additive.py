"""The additive (Delta-style) mix, `additive`: a reader reads its residual stream plus a zero-initialised gate times
the softmax mix of the embedding and the completed blocks. Exact at conversion (logits, cached greedy generation,
the streamed conversion, save and load without this package); the gates get a gradient at step 0 and the queries
once the gates have moved; refused by the static-query kernels; carried through `attnres finetune`."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus
from isolated import assert_same_logits_without_the_package
from safetensors.torch import load_file
from tiny_models import tiny_model, token_ids
from typer.testing import CliRunner

from attnres_convert import load_converted, save_converted
from attnres_convert.analysis.inspection import original_behaviour, queries_are_zero
from attnres_convert.cli import app
from attnres_convert.conversion.surgery import convert_model
from attnres_convert.depth_controls import record_depth_weights
from attnres_convert.finetune.recipe import RecipeError, parse_recipe
from attnres_convert.finetune.training import finetune
from attnres_convert.modeling.modeling_attnres import KERNEL_ENV, AttnResQuery

GENERATE = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)


def _readers(model) -> list[AttnResQuery]:
    return [m for m in model.modules() if isinstance(m, AttnResQuery)]


def _trained(model, gate: float = 0.7, query: float = 0.3, seed: int = 0):
    """MODEL with gates and queries drawn, so that the additive term really changes what the readers read."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for reader in _readers(model):
            reader.gate.copy_(torch.randn(1, generator=generator) * gate)
            reader.weight.copy_(torch.randn(reader.weight.shape, generator=generator) * query)
    return model


@pytest.mark.parametrize("family", ["llama", "gpt_neox_parallel"])
def test_an_additive_conversion_reproduces_the_original(family):
    """Logits bit for bit as the plain conversion's (the original's up to rounding), greedy generation with and
    without the KV cache; zeroing the gates of a trained model gives the original back."""
    base = tiny_model(family)
    ids = token_ids()
    with torch.no_grad():
        reference = base(ids).logits
    plain = convert_model(copy.deepcopy(base), block_size=3).eval()
    model = convert_model(copy.deepcopy(base), block_size=3, additive=True).eval()
    assert model.config.additive and not plain.config.additive
    assert all(reader.gate.shape == (1,) and not reader.gate.any() for reader in _readers(model))
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, plain(ids).logits)
    assert (logits - reference).abs().max().item() <= 1e-4
    prompt = token_ids(batch=1, length=10, seed=1)
    expected = base.generate(prompt, **GENERATE).tolist()
    assert model.generate(prompt, use_cache=True, **GENERATE).tolist() == expected
    assert model.generate(prompt, use_cache=False, **GENERATE).tolist() == expected

    _trained(model)
    with torch.no_grad():
        assert (model(ids).logits - logits).abs().max() > 1e-3  # the gated mix changes the model
        assert not queries_are_zero(model)
        with original_behaviour(model):
            assert torch.equal(model(ids).logits, logits)


def test_the_gates_learn_first_then_the_queries():
    """At conversion the gates have a gradient (the added mix leaves out the partial sum, so it is not the stream's
    own direction, which the reader's norm would ignore) and the queries none (they are multiplied by the gate);
    once the gates move, the queries' gradients are not zero where there is a choice. The scheduled depth gate and the recorder see it."""
    model = convert_model(tiny_model("llama"), block_size=3, additive=True).train()
    ids = token_ids()
    model(ids, labels=ids).loss.backward()
    gates = torch.stack([reader.gate.grad.abs()[0] for reader in _readers(model)])
    # Readers whose block has an output already (all but the block's first readers) add a mix off the stream's line.
    assert int((gates > 1e-4).sum()) >= len(gates) // 2
    assert all(not reader.weight.grad.any() for reader in _readers(model))
    with torch.no_grad():
        for reader in _readers(model):
            reader.gate.fill_(0.5)
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    # A reader with one completed source (the embedding: block size 3, the first three) has a constant softmax.
    moved = [bool(reader.weight.grad.abs().sum() > 0) for reader in _readers(model)]
    assert moved == [False, False, False, True, True, True, True]

    model.eval()
    with torch.no_grad(), record_depth_weights(model) as weights:
        model(ids)
    assert len(weights) == len(_readers(model))
    # An additive reader weighs the embedding and the completed blocks (block size 3: 1, 1, 1, 2, 2, 2 and 2 of them
    # for the output aggregation, whose last block is still the partial sum).
    assert [w.shape[0] for w in weights] == [1, 1, 1, 2, 2, 2, 2]
    assert all(torch.allclose(w.sum(0), torch.ones(())) for w in weights)


def test_a_trained_additive_model_saves_and_loads_without_this_package(tmp_path):
    model = _trained(convert_model(tiny_model("llama"), block_size=3, additive=True).eval())
    ids = token_ids()
    with torch.no_grad():
        expected = model(ids).logits
    out = save_converted(model, tmp_path / "converted")
    assert json.loads((out / "config.json").read_text())["additive"] is True
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.mlp_res_proj.gate"].shape == (1,) and "model.output_attn_res_proj.gate" in tensors
    with torch.no_grad():
        assert torch.equal(load_converted(out).eval()(ids).logits, expected)
    assert_same_logits_without_the_package(out, ids, expected, tmp_path)


def test_the_static_query_kernels_are_refused(monkeypatch):
    model = convert_model(tiny_model("llama"), additive=True).eval()
    monkeypatch.setenv(KERNEL_ENV, "cpu")
    with pytest.raises(RuntimeError, match=r"ATTNRES_KERNEL=cpu: .*an additive mix.*Unset ATTNRES_KERNEL"):
        with torch.no_grad():
            model(token_ids())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("additive")
    return {"model": tiny_model_folder(root / "tiny-llama"), "corpus": write_corpus(root / "corpus")}


def test_convert_and_finetune_carry_the_additive_mix(setup, tmp_path):
    """`attnres convert --additive` (streamed) verifies and says so on screen and in the card; `model.additive=true`
    trains the gates in the AttnRes group from the original's step-0 loss, and the saved model reloads additive.
    A folder converted without it cannot be trained with it."""
    result = CliRunner().invoke(
        app,
        ["convert", str(setup["model"]), "-o", str(tmp_path / "conv"), "--additive", "--verify-tokens", "32"],
    )
    assert result.exit_code == 0 and "PASS" in result.output and "additive" in result.output, result.output
    assert "- mix: additive" in (tmp_path / "conv" / "README.md").read_text()
    assert load_converted(tmp_path / "conv").config.additive

    sections = dict(
        model={"additive": True},
        train={"trainable": "lora", "steps": 3, "lr": 1e-2, "warmup_steps": 0},
        lora={"r": 4},
        eval={"every": 3, "max_sequences": 4, "at_start": True},
    )
    run = finetune(parse_recipe(tiny_recipe(setup["model"], setup["corpus"], tmp_path / "run", **sections)))
    plain = finetune(
        parse_recipe(
            tiny_recipe(
                setup["model"], setup["corpus"], tmp_path / "plain", **{**sections, "model": {"convert": False}}
            )
        )
    )
    assert run.metrics["eval_loss_start"] == pytest.approx(plain.metrics["eval_loss_start"], rel=1e-6)
    assert run.metrics["attnres_parameters"] == 7 * (64 + 64 + 1)  # w, g and the gate of 6 sublayers and the output
    gates = [t for name, t in load_file(run.model_dir / "model.safetensors").items() if name.endswith(".gate")]
    assert len(gates) == 7 and sum(bool(gate.any()) for gate in gates) >= 6
    assert load_converted(run.model_dir).config.additive

    plain_folder = tmp_path / "plain-conv"
    assert CliRunner().invoke(app, ["convert", str(setup["model"]), "-o", str(plain_folder)]).exit_code == 0
    with pytest.raises(RecipeError, match=r"model\.additive: .* already converted without the additive mix"):
        finetune(parse_recipe(tiny_recipe(plain_folder, setup["corpus"], tmp_path / "bad", **sections)))
    assert not (tmp_path / "bad").exists()
