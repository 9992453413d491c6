"""Structure discovery and the per-layer proof: what is found from the model itself, that a plausible but
wrong structure is never used, and that refusals name the layer, the sublayer and the difference."""

import threading

import pytest
import torch
import transformers as T
from tiny_models import tiny_model, token_ids

from attnres_convert.architectures import (
    FAMILIES,
    ModelPlan,
    Sublayer,
    UnsupportedModelError,
    describe,
    locate,
    plan_to_dict,
    sublayer_to_dict,
    uniform_plan,
)
from attnres_convert.conversion import discovery
from attnres_convert.conversion.proof import prove
from attnres_convert.conversion.single_thread import run_single_threaded
from attnres_convert.conversion.surgery import convert_model
from attnres_convert.conversion.trace import trace_model

LLAMA = next(family for family in FAMILIES if family.name == "llama")


def _found(model):
    plan, _ = discovery.find_plan(model)
    return plan


def test_granite_multipliers_are_part_of_the_plan_and_the_llama_pattern_is_refused():
    """Forcing the Llama structure onto Granite (residual_multiplier 0.22) is wrong by far more than rounding:
    the proof rejects it at the first sublayer; discovery finds the multiplier as the config states it."""
    model = tiny_model("granite")
    where = locate(model)
    trace = trace_model(model, where)
    llama_like = LLAMA.plan(model.config, model)
    failure = prove(model, llama_like, trace)
    assert failure is not None and failure.layer == 0 and failure.sublayer == 1  # where the stream first departs
    assert failure.relative > 1e-2
    plan = _found(model)
    assert [b.scale for s in plan.sublayers(0) for b in s.branches] == [0.22, 0.22]
    assert plan.logit_divisor == 8.0


def test_glm4_sandwich_norms_belong_to_their_sublayers():
    model = tiny_model("glm4")
    plan = _found(model)
    attention, mlp = plan.sublayers(0)
    assert attention.branches[0].post == ("post_self_attn_layernorm",)
    assert mlp.branches[0].post == ("post_mlp_layernorm",)
    trace = trace_model(model, locate(model))
    assert prove(model, LLAMA.plan(model.config, model), trace) is not None


def test_parallel_branches_and_their_norms():
    """Falcon's new decoder architecture: two norms read one stream, one sublayer with two branches.
    The two norms start with equal weights, so only the tensors' identity tells their outputs apart."""
    (sublayer,) = _found(tiny_model("falcon_new")).sublayers(0)
    assert [(b.norm, b.module) for b in sublayer.branches] == [("ln_attn", "self_attention"), ("ln_mlp", "mlp")]


def test_plan_round_trips_through_the_config():
    model = convert_model(tiny_model("deepseek_v3"), block_size=3)
    recorded = model.config.structure
    plan = ModelPlan.from_dict(recorded)
    assert plan == model._attnres_plan and plan_to_dict(plan) == recorded
    assert plan.num_layers == 3 and plan.num_sublayers == 6
    assert plan.eps == model.config.text_config.rms_norm_eps  # read from the norm module itself


def test_a_layer_that_does_more_than_its_sublayers_is_refused_naming_layer_sublayer_and_difference():
    model = tiny_model("llama")
    layer = model.model.layers[1]
    original = type(layer).forward

    def leaky(self, hidden_states, *args, **kwargs):  # a residual path no plan can express
        return original(self, hidden_states, *args, **kwargs) + 0.5 * hidden_states.flip(-1)

    layer.forward = leaky.__get__(layer)
    with pytest.raises(UnsupportedModelError) as error:
        convert_model(model)
    message = str(error.value)
    assert "decoder layer 1, sublayer 2" in message and "differs from the original by" in message
    assert "relative" in message


def test_post_norm_is_refused_by_discovery_itself():
    """OLMo-2 is refused by the table before anything runs; discovery alone says why too."""
    config = T.Olmo2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )
    model = T.AutoModelForCausalLM.from_config(config).eval()
    where = locate(model)
    trace = trace_model(model, where)
    with pytest.raises(
        UnsupportedModelError, match=r"decoder layer 0: the residual stream is read by `self_attn`.*post-norm"
    ):
        discovery.discovered_plan(model, where, trace, {})


def test_bf16_model_is_proven_at_its_own_precision():
    model = tiny_model("glm4").to(torch.bfloat16)
    converted = convert_model(model, block_size=3).eval()
    ids = token_ids()
    reference = tiny_model("glm4").to(torch.bfloat16)(ids).logits.float()
    with torch.no_grad():
        logits = converted(ids).logits.float()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.95


def test_a_folder_converted_before_plans_were_recorded_still_loads(tmp_path):
    """config.json without `structure`: the package loads it with the architecture table's plan."""
    import json

    from attnres_convert import load_converted, save_converted

    model = convert_model(tiny_model("gpt_neox_parallel"), block_size=3).eval()
    out = save_converted(model, tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert config["structure"]["kinds"][0][0]["branches"][1]["module"] == "mlp"
    config_structure = config.pop("structure")
    (out / "config.json").write_text(json.dumps(config))
    reloaded = load_converted(out).eval()
    assert reloaded.config.structure == config_structure
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def _count_of_a_new_thread() -> int:
    """The intra-op thread count a thread gets the first time it runs torch code."""
    counts = []
    thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return counts[0]


def test_the_proof_runs_on_one_thread_and_changes_no_other_threads_count():
    """find_plan computes on one thread of its own: the caller's count, that of a thread running beside it,
    and the count new threads start with stay as they were, during the proof and after it."""
    model = tiny_model("llama")
    torch.set_num_threads(2)
    try:
        beside_ready, proof_done, beside = threading.Event(), threading.Event(), []

        def running_beside():
            beside.append(torch.get_num_threads())
            beside_ready.set()
            proof_done.wait()
            beside.append(torch.get_num_threads())

        thread = threading.Thread(target=running_beside)
        thread.start()
        beside_ready.wait()
        during = run_single_threaded(lambda: (torch.get_num_threads(), _count_of_a_new_thread()))
        plan, _ = discovery.find_plan(model)
        proof_done.set()
        thread.join()
        assert during == (1, 2)
        assert plan.num_layers == model.config.num_hidden_layers
        assert torch.get_num_threads() == 2 and _count_of_a_new_thread() == 2 and beside == [2, 2]
    finally:
        torch.set_num_threads(1)


def test_an_error_in_single_threaded_work_is_raised_in_the_caller():
    torch.set_num_threads(2)
    try:
        with pytest.raises(ZeroDivisionError):
            run_single_threaded(lambda: 1 / 0)
        assert torch.get_num_threads() == 2 and _count_of_a_new_thread() == 2
    finally:
        torch.set_num_threads(1)


def test_a_layer_that_scales_its_stream_converts_exactly():
    """Gemma 4 multiplies each layer's returned stream by its `layer_scalar`. Every source so far is scaled alike, so
    the converted model keeps its sources in the embedding's units (layer k's outputs divided by P_k, the product of
    the earlier layers' scalars) and its readers read P_k times their mix: at zero queries exactly the original's
    stream, with or without the per-layer inputs, at every block size, and the hidden states are the original's."""
    from attnres_convert.conversion.tiny_configs import tiny_config

    def gemma4(scalars, **overrides):
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(tiny_config("gemma4_text", **overrides)).eval()
        for layer, scalar in zip(model.model.layers, scalars):
            layer.layer_scalar.fill_(scalar)
        return model

    ids = token_ids(batch=1, length=10)
    for overrides in ({"hidden_size_per_layer_input": 0}, {}):
        original = gemma4([1.0, 0.5], **overrides)
        with torch.no_grad():
            logits = original(ids).logits
            states = original(ids, output_hidden_states=True).hidden_states
        sublayers = 2 * (2 if overrides else 3)  # attention and MLP, and the per-layer input's gate where there is one
        for size in (1, 3, sublayers):
            converted = convert_model(gemma4([1.0, 0.5], **overrides), block_size=size)
            assert converted._attnres_plan.layer_scalars == (1.0, 0.5)
            with torch.no_grad():
                assert (converted(ids).logits - logits).abs().max() <= 1e-4
                got = converted(ids, output_hidden_states=True).hidden_states
            assert len(got) == len(states) and all((a - b).abs().max() <= 1e-5 for a, b in zip(got, states))
        plain = convert_model(gemma4([1.0, 1.0], **overrides), block_size=3)
        assert plain._attnres_plan.layer_scalars is None  # nothing recorded where every scalar is 1


def test_stream_scales_are_the_products_of_the_earlier_layer_scalars():
    from attnres_convert.architectures import Branch, ModelPlan

    plan = uniform_plan(3, (Sublayer("mlp", (Branch("norm", "mlp"),)),), 1e-6, layer_scalars=(0.5, 4.0, 3.0))
    assert plan.stream_scales() == ((1.0, 0.5, 2.0), 6.0)
    assert ModelPlan.from_dict(plan_to_dict(plan)) == plan
    assert uniform_plan(2, plan.kinds[0], 1e-6).stream_scales() == ((1.0, 1.0), 1.0)


def test_gemma4_moe_block_is_one_sublayer_with_a_side_router_and_a_norm_of_its_sum():
    """Gemma 4's MoE block: the dense MLP and the experts read the same stream (the experts' norm reads it flattened),
    the router reads the flattened raw stream for the experts' arguments, and a norm takes the sum of both: the
    layout says so, and survives the converted config (test_exactness checks the conversion's numbers)."""

    converted = convert_model(tiny_model("gemma4_moe"), block_size=3)
    moe = converted._attnres_plan.sublayers(0)[1]
    assert describe(moe) == (
        "(pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm_1 + pre_feedforward_layernorm_2 "
        "-> experts(router) -> post_feedforward_layernorm_2) -> post_feedforward_layernorm"
    )
    assert moe.name == "mlp" and moe.post == ("post_feedforward_layernorm",) and moe.side == (("router", True),)
    assert [b.flat for b in moe.branches] == [False, True]
    assert dict(moe.branches[1].arguments) == {"top_k_index": "<output:router:2>", "top_k_weights": "<output:router:1>"}
    assert Sublayer.from_dict(sublayer_to_dict(moe)) == moe
