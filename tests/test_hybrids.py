"""State-space and hybrid stacks converted, saved and loaded in a Python without this package: a pure SSM
(Mamba), a hybrid of Mamba and attention layers with MoE (Jamba), a hybrid of gated delta-net and attention layers
(Qwen3-Next) and one with Mamba-2 and attention in parallel (Falcon-H1). Their recurrent and convolution states
travel in the cache the base model passes to each layer, so the rewritten layers carry them as they are. The same
for layers whose modules take the residual and add it themselves (Bloom, MPT) or take their input twice (CTRL).

Each reloaded folder gives the original's logits (fp32, within the tolerance of `attnres convert`'s check) and,
with its own cache, the original's greedy tokens; cached and uncached generation agree.

RWKV and xLSTM layers hand their recurrent state back to the base model, which keeps it; both base models also act
on the stream between layers at inference (RWKV halves it, xLSTM runs a long prompt in chunks), which the converted
model does not (conversion/stream_settings.py): the reference for their logits is the original with that setting
off, and what the setting itself changes in the original is checked on its own."""

import json

import pytest
import torch
from isolated import run_isolated
from tiny_models import tiny_model, token_ids

from attnres_convert import save_converted
from attnres_convert.conversion import stream_settings
from attnres_convert.conversion.coverage import LOGIT_TOLERANCE  # 1e-4, as the coverage table
from attnres_convert.conversion.surgery import convert_model

pytestmark = pytest.mark.slow  # each case saves a folder and loads it in a fresh Python

HYBRIDS = ("mamba", "jamba", "qwen3_next", "falcon_h1")
LONG_TAIL = ("bloom", "mpt", "ctrl")
RECURRENT = ("rwkv", "xlstm")
NEW_TOKENS = 8


def _greedy(model, ids, use_cache=True):
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=use_cache,
        pad_token_id=0,
    )
    return out[:, ids.shape[1] :]


# Settings at which the base model acts between its layers at inference: RWKV halves the stream at every layer,
# xLSTM runs a prompt of more than 8 tokens in chunks.
AT_INFERENCE = {"rwkv": {"rescale_every": 1}, "xlstm": {"max_inference_chunksize": 8}}


def _settled(family):
    """The original as the converted model runs it: the stream setting off (a no-op but for RWKV and xLSTM)."""
    model = tiny_model(family, **AT_INFERENCE.get(family, {}))
    stream_settings.settle(model)
    return model


@pytest.mark.parametrize("family", HYBRIDS + LONG_TAIL + RECURRENT)
def test_hybrid_converts_exactly_and_reloads_without_this_package(family, tmp_path):
    original = tiny_model(family, **AT_INFERENCE.get(family, {}))
    ids = token_ids(batch=1, length=12, seed=3)
    with torch.no_grad():
        logits = _settled(family)(ids).logits
    tokens = _greedy(original, ids)

    converted = convert_model(tiny_model(family, **AT_INFERENCE.get(family, {})), block_size=3).eval()
    with torch.no_grad():
        assert (converted(ids).logits - logits).abs().max().item() <= LOGIT_TOLERANCE
    assert torch.equal(_greedy(converted, ids), tokens)
    assert torch.equal(_greedy(converted, ids, use_cache=False), tokens)

    folder = save_converted(converted, tmp_path / "converted")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "attnres" and config["base_model_type"] == original.config.model_type
    torch.save({"ids": ids, "logits": logits, "tokens": tokens}, tmp_path / "expected.pt")
    result = run_isolated(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert "transformers_modules" in type(model).__module__, type(model).__module__
        ids = data["ids"]
        with torch.no_grad():
            delta = (model(ids).logits - data["logits"]).abs().max().item()
        assert delta <= {LOGIT_TOLERANCE!r}, delta
        for use_cache in (True, False):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens={NEW_TOKENS},
                                 min_new_tokens={NEW_TOKENS}, do_sample=False, use_cache=use_cache, pad_token_id=0)
            assert torch.equal(out[:, ids.shape[1]:], data["tokens"]), (use_cache, out, data["tokens"])
        print("REMOTE-OK", delta)
        """
    )
    assert "REMOTE-OK" in result.stdout, result.stderr[-3000:]


def test_recurrent_models_run_without_their_stream_settings(tmp_path):
    """RWKV divides its output weights in place at its first inference forward and halves the stream every
    `rescale_every` layers: converting a model that already ran restores the trained weights, the converted config
    keeps the halving off, and the original's logits in inference mode differ from the converted model's only by
    what the halving changes in the original itself (its LayerNorms' eps). xLSTM runs a prompt longer than
    `max_inference_chunksize` in chunks; the converted model runs it whole, with the same logits."""
    from safetensors.torch import load_file

    ids = token_ids(batch=1, length=12, seed=3)
    used = tiny_model("rwkv", **AT_INFERENCE["rwkv"])
    with torch.no_grad():
        inference = used(ids).logits  # divides the weights of layers 1 and 2 in place
    trained = tiny_model("rwkv", **AT_INFERENCE["rwkv"]).state_dict()
    assert not torch.equal(
        used.rwkv.blocks[2].attention.output.weight, trained["rwkv.blocks.2.attention.output.weight"]
    )
    folder = save_converted(convert_model(used, block_size=3), tmp_path / "rwkv")
    saved = load_file(folder / "model.safetensors")
    for name in ("rwkv.blocks.1.attention.output.weight", "rwkv.blocks.2.feed_forward.value.weight"):
        assert torch.equal(saved[name], trained[name]), name
    assert json.loads((folder / "config.json").read_text())["text_config"]["rescale_every"] == 0
    converted = convert_model(tiny_model("rwkv", **AT_INFERENCE["rwkv"]), block_size=3).eval()
    with torch.no_grad():
        plain, got = _settled("rwkv")(ids).logits, converted(ids).logits
    halving = (inference - plain).abs().max().item()
    assert 0 < halving < 1e-2 and (got - plain).abs().max().item() <= LOGIT_TOLERANCE
    assert (got - inference).abs().max().item() <= halving + LOGIT_TOLERANCE

    original = tiny_model("xlstm", **AT_INFERENCE["xlstm"])  # 12 prompt tokens: chunked
    with torch.no_grad():
        chunked = original(ids, use_cache=True).logits
        converted = convert_model(tiny_model("xlstm", **AT_INFERENCE["xlstm"]), block_size=3).eval()
        assert converted.config.text_config.max_inference_chunksize == 2**31 - 1
        assert (converted(ids, use_cache=True).logits - chunked).abs().max().item() <= LOGIT_TOLERANCE


def test_a_batch_the_base_model_itself_mixes_up_is_refused_with_the_reason():
    """transformers' RWKV decodes a batch of several sequences wrongly: its token shift broadcasts the state's
    [batch, hidden] against the step's [batch, 1, hidden], so a module returns [batch, batch, hidden]. The
    original carries on with that; the converted model stops and says what the module returned."""
    converted = convert_model(tiny_model("rwkv"), block_size=3).eval()
    ids = token_ids(batch=2, length=6, seed=3)
    with pytest.raises(
        ValueError, match=r"`attention` \(RwkvSelfAttention\) returned \(2, 2, 64\) for an input of \(2, 1, 64\)"
    ):
        converted.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    one = converted.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)  # one sequence decodes
    assert one.shape == (1, 8)


def test_finetune_trains_a_converted_hybrid_on_cpu(tmp_path):
    """`attnres finetune` converts a Jamba folder (Mamba and attention layers, MoE) and trains it: every loss
    finite, the held-out loss falls, the base weights and the AttnRes parameters all move."""
    from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus
    from safetensors.torch import load_file

    from attnres_convert.finetune.recipe import parse_recipe
    from attnres_convert.finetune.training import finetune

    model_dir = tiny_model_folder(tmp_path / "tiny-jamba", family="jamba")
    corpus = write_corpus(tmp_path / "corpus")
    recipe = tiny_recipe(model_dir, corpus, tmp_path / "run", train={"trainable": "full", "steps": 8, "lr": 3e-3})
    result = finetune(parse_recipe(recipe))
    losses = [r["loss"] for r in result.records if r["kind"] == "train"]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert result.metrics["eval_loss"] < result.metrics["eval_loss_start"] - 0.1, result.metrics
    trained, original = load_file(result.model_dir / "model.safetensors"), load_file(model_dir / "model.safetensors")
    mamba = [name for name in original if ".mamba." in name and name.endswith("weight")]
    assert mamba and all(not torch.equal(trained[name], original[name]) for name in mamba)
    queries = [name for name in trained if name.endswith("_res_proj.weight") and trained[name].abs().sum() > 0]
    assert queries
