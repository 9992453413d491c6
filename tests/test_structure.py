"""The math beyond zero init: block structure and a plain reference written from docs/design.md."""

import pytest
import torch
from design_reference import design_sources, reference_llama, reference_neox_parallel
from tiny_models import randomize_queries, tiny_model, token_ids

from attnres_convert.block_sizes import default_block_size, source_ranges
from attnres_convert.conversion.surgery import convert_model
from attnres_convert.modeling.modeling_attnres import plan_sublayers

# docs/design.md, block structure: Block AttnRes with S = 3 over seven sublayers.
DESIGN_TEST_VECTOR = [
    [(0, 0)],
    [(0, 0), (1, 1)],
    [(0, 0), (1, 2)],
    [(0, 0), (1, 3)],
    [(0, 0), (1, 3), (4, 4)],
    [(0, 0), (1, 3), (4, 5)],
    [(0, 0), (1, 3), (4, 6)],
    [(0, 0), (1, 3), (4, 6), (7, 7)],  # output aggregation
]


def test_source_structure_is_the_design_test_vector():
    assert source_ranges(7, 3) == DESIGN_TEST_VECTOR
    plans = plan_sublayers(7, 3)
    assert [p.num_sources for p in plans] == [len(r) for r in DESIGN_TEST_VECTOR[:-1]]
    assert [p.closes_block for p in plans] == [False, False, False, True, False, False, True]
    outputs = [torch.tensor(float(10**i)) for i in range(8)]  # y_i = 10^i: sums read as digit patterns
    for reader, expected in enumerate(DESIGN_TEST_VECTOR, start=1):
        got = design_sources(reader, 3, outputs)
        want = [sum(outputs[a : b + 1]) for a, b in expected]
        assert [float(x) for x in got] == [float(x) for x in want], reader


def test_full_attnres_reads_every_output_and_one_block_reads_embedding_and_running_sum():
    assert source_ranges(4, 1) == [
        [(0, 0)],
        [(0, 0), (1, 1)],
        [(0, 0), (1, 1), (2, 2)],
        [(0, 0), (1, 1), (2, 2), (3, 3)],
        [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)],
    ]
    assert source_ranges(4, 4) == [[(0, 0)], [(0, 0), (1, 1)], [(0, 0), (1, 2)], [(0, 0), (1, 3)], [(0, 0), (1, 4)]]


def test_default_block_size_is_whole_layers_with_at_most_n_blocks():
    assert default_block_size(60, 2, 8) == 8  # SmolLM2-135M: 30 layers -> S = 8, 8 blocks
    assert default_block_size(6, 2, 8) == 2
    assert default_block_size(7, 1, 3) == 3
    assert default_block_size(48, 2, 4) == 12


@pytest.mark.parametrize("block_size", [1, 3, 4, 6])
def test_random_queries_match_plainreference_llama(block_size):
    model = convert_model(tiny_model("llama"), block_size=block_size).eval()
    randomize_queries(model, 0.5, seed=block_size, key_norms=0.3)
    ids = token_ids()
    with torch.no_grad():
        got = model(ids).logits
        want = reference_llama(model, ids, block_size)
        zero_init = convert_model(tiny_model("llama"), block_size=block_size).eval()(ids).logits
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - zero_init).abs().max().item() > 1e-2  # the queries really changed the routing


def test_random_queries_match_reference_on_the_design_test_vector():
    """GPT-NeoX with parallel residual, 7 layers: exactly seven sublayers, S = 3 (section 3's table)."""
    model = convert_model(tiny_model("gpt_neox_parallel", num_hidden_layers=7), block_size=3).eval()
    randomize_queries(model, 0.5, seed=7, key_norms=0.3)
    ids = token_ids()
    with torch.no_grad():
        got = model(ids).logits
        want = reference_neox_parallel(model, ids, 3)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("scaling", ["count", "mean"])
@pytest.mark.parametrize("family", ["llama", "gpt_neox_parallel"])
@pytest.mark.parametrize("length", [20, 60])
@pytest.mark.parametrize("block_size", [1, 3])
def test_inference_buffer_and_autograd_state_compute_the_same(family, length, block_size, scaling):
    """Without autograd the state is one preallocated buffer updated in place (SourceBuffer, or the token-major
    StepBuffer for few tokens): for more tokens a reader reads the completed sources' scores from the table written
    when each completed (with a block completing between a layer's readers when S = 1). With autograd it is a
    TrainState (blocks in a cache outside autograd); recording the depth weights runs the plain BlockState. All
    paths compute the same function."""
    from attnres_convert.depth_controls import record_depth_weights
    from attnres_convert.kernels.step import SMALL_STEP_TOKENS
    from attnres_convert.kernels.training import TrainState
    from attnres_convert.modeling.modeling_attnres import SourceBuffer

    model = convert_model(tiny_model(family), block_size=block_size, source_scaling=scaling).eval()
    randomize_queries(model, 0.5, seed=3, key_norms=0.3)
    ids = token_ids(2, length)
    assert (ids.numel() <= SMALL_STEP_TOKENS) == (length == 20)
    states = []
    last_layer = [m for m in model.modules() if hasattr(m, "_attnres_spec")][-1]
    hook = last_layer.register_forward_hook(lambda module, args, output: states.append(type(output)))
    with torch.no_grad():
        inference = model(ids).logits
    training = model(ids).logits.detach()
    hook.remove()
    assert issubclass(states[0], SourceBuffer) and issubclass(states[1], TrainState)
    # Where this machine has built the C++ kernels, inference runs them (auto): their sums in another order differ
    # from autograd's path by a few 1e-5 of the logits through sharp random depth softmaxes (test_cpu_kernels.py).
    tolerance = 2e-4
    assert (inference - training).abs().max().item() <= tolerance
    with torch.no_grad(), record_depth_weights(model) as inference_weights:
        recorded = model(ids).logits
    with record_depth_weights(model) as training_weights:
        model(ids)
    assert (recorded - inference).abs().max().item() <= tolerance
    readers = sum(len(layer._attnres_spec.sublayers) for layer in model.modules() if hasattr(layer, "_attnres_spec"))
    assert len(inference_weights) == len(training_weights) == readers + 1
    for a, b in zip(inference_weights, training_weights):
        assert a.shape[1:] == ids.shape and torch.allclose(a.sum(0), torch.ones(ids.shape))
        assert (a - b.detach()).abs().max().item() <= 1e-4


@pytest.mark.parametrize("folded", [True, False], ids=["folded-queries", "per-reader-queries"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("block_size", [1, 3])
def test_decoding_steps_with_the_kv_cache_match_a_full_forward(batch, block_size, folded, monkeypatch):
    """A decoding step (one token per sequence) has its own formulation of the scores and mix (StepViews;
    a matrix-vector product for one sequence, a product and sum for several). With trained (random)
    queries, every step's logits must be those of the plain reference over the whole sequence; also where
    each reader folds its own query (parameters that are not whole tensors, as under FSDP)."""
    from attnres_convert.modeling import modeling_attnres

    if not folded:
        monkeypatch.setattr(modeling_attnres, "_all_queries", lambda spec, like: None)
    model = convert_model(tiny_model("llama"), block_size=block_size).eval()
    randomize_queries(model, 0.5, seed=5, key_norms=0.3)
    ids = token_ids(batch, 16, seed=4)
    with torch.no_grad():
        full = reference_llama(model, ids, block_size)
        out = model(ids[:, :10], use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(10, 16):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits[:, -1])
    assert (torch.stack(steps, 1) - full[:, 9:]).abs().max().item() <= 1e-4


def _gradients(model, logits_fn, ids, backwards=1):
    model.zero_grad(set_to_none=True)
    logits = logits_fn()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("table", [True, False], ids=["score-table", "no-table"])
@pytest.mark.parametrize("scaling", ["count", "mean"])
@pytest.mark.parametrize("block_size", [1, 3])
def test_training_gradients_match_autograd_through_the_reference(block_size, scaling, table, monkeypatch):
    """An eager training forward runs a hand-written backward (TrainState: completed blocks in a cache
    outside autograd, every reader's gradient added to them in place, the completed blocks' scores in a
    table written when each completes). Its gradient for every parameter (queries, key norms, the base
    model's weights and embeddings) must be autograd's through the plain reference; and a second
    backward through the same graph (retain_graph) must add exactly as much again. Without the table
    (queries that are not whole tensors on one device, as under FSDP) every reader scores the blocks itself."""
    from attnres_convert.kernels.training import TrainState
    from attnres_convert.modeling import modeling_attnres

    if not table:
        monkeypatch.setattr(modeling_attnres, "_all_queries", lambda spec, like: None)
    model = convert_model(tiny_model("llama"), block_size=block_size, source_scaling=scaling).train()
    randomize_queries(model, 0.5, seed=11, key_norms=0.3)
    ids = token_ids(2, 24)
    states = []
    hook = model.model.layers[0].register_forward_hook(lambda module, args, output: states.append(output))
    got = _gradients(model, lambda: model(ids).logits, ids)
    hook.remove()
    assert [type(state) for state in states] == [TrainState]
    assert (states[0].cache.scores is not None) == table
    want = _gradients(model, lambda: reference_llama(model, ids, block_size, scaling), ids)
    assert got.keys() == want.keys() and any("_res_proj" in name for name in got)
    for name in want:
        scale = want[name].abs().max().item()
        assert scale > 0 or "layers.0.self_attention_res_" in name, (
            f"no gradient for {name}"
        )  # one source: nothing to route
        assert (got[name] - want[name]).abs().max().item() <= 1e-4 * max(scale, 1.0), name
    twice = _gradients(model, lambda: model(ids).logits, ids, backwards=2)
    for name in got:
        assert torch.allclose(twice[name], 2 * got[name], rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("length", [5, 70], ids=["few-tokens", "many-tokens"])
def test_hidden_states_are_the_originals_and_stay_so(length):
    """In a float32 model the plain stream lives in the inference buffer (one add updates it and the partial
    sum): the hidden states handed out must be copies, equal to the original model's bit for bit, and not
    changed by the layers that run after them."""
    from attnres_convert.modeling.modeling_attnres import SourceBuffer

    original = tiny_model("llama")
    model = convert_model(tiny_model("llama"), block_size=3).eval()
    ids = token_ids(1, length)
    states = []
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: states.append(args[0]))
    with torch.no_grad():
        got = model(ids, output_hidden_states=True).hidden_states
        want = original(ids, output_hidden_states=True).hidden_states
    hook.remove()
    assert isinstance(states[0], SourceBuffer) and states[0].shared_stream
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"hidden state {i}"
