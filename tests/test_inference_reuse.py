"""A few-token forward without autograd keeps its buffer for the next forward (a decoding loop pays for making
it); the folded queries are made from the parameters at every forward. Nothing may be stale: a query changed
in place or replaced, another batch shape, another thread (tests/test_weight_changes.py: every way of changing
weights)."""

import threading

import torch
from tiny_models import randomize_queries, tiny_model, token_ids

from attnres_convert.conversion.surgery import convert_model


def _converted(seed: int = 0):
    """A tiny converted Llama with non-zero queries, as after fine-tuning (at zero queries every query
    gives the same mix, and a stale one would go unnoticed)."""
    return randomize_queries(convert_model(tiny_model("llama"), block_size=3).eval(), 1.0, seed=seed)


def _fresh_logits(model, ids) -> torch.Tensor:
    """The logits of a model that has kept nothing: a new conversion with the same weights."""
    fresh = convert_model(tiny_model("llama"), block_size=3).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        return fresh(ids).logits


def _queries(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if name.endswith("_res_proj.weight")]


def test_a_query_changed_in_place_is_read_again():
    model, ids = _converted(), token_ids(batch=1, length=5)
    with torch.no_grad():
        before = model(ids).logits
        for param in _queries(model):
            param.mul_(-2.0)  # what an optimizer step does: the same tensor, a new version
        after = model(ids).logits
    assert (after - before).abs().max() > 1e-3, "changing every query should change the logits"
    torch.testing.assert_close(after, _fresh_logits(model, ids), rtol=0, atol=0)


def test_a_replaced_query_tensor_is_read():
    model, ids = _converted(), token_ids(batch=1, length=5)
    with torch.no_grad():
        before = model(ids).logits
        for param in _queries(model):
            param.data = torch.flip(param.data, dims=[-1]).clone()
        after = model(ids).logits
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, _fresh_logits(model, ids), rtol=0, atol=0)


def test_forwards_of_other_shapes_in_turn_match_a_fresh_model():
    model = _converted()
    shapes = [(1, 1), (1, 1), (2, 1), (2, 1), (1, 1), (2, 7), (2, 7)]  # kept for the same shape, made anew for another
    inputs = [token_ids(batch=b, length=t, seed=seed) for seed, (b, t) in enumerate(shapes)]
    with torch.no_grad():
        for ids in inputs:  # a kept buffer's partial sums are zeroed: nothing is carried over
            torch.testing.assert_close(model(ids).logits, _fresh_logits(model, ids), rtol=0, atol=0)


def test_inference_mode_and_no_grad_forwards_in_turn():
    """A buffer made under torch.inference_mode is an inference tensor, which a forward outside it may not
    write in place: each mode keeps its own."""
    model, ids = _converted(), token_ids(batch=1, length=1)
    expected = _fresh_logits(model, ids)
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        with mode():
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


def test_concurrent_threads_never_share_a_buffer():
    model = _converted()
    inputs = [token_ids(batch=1, length=3, seed=seed) for seed in (5, 6)]
    expected = [_fresh_logits(model, ids) for ids in inputs]
    failures: list[str] = []

    def decode(index: int) -> None:
        with torch.no_grad():
            for _ in range(30):
                logits = model(inputs[index]).logits
                if not torch.equal(logits, expected[index]):
                    failures.append(f"thread {index}: max |delta| {(logits - expected[index]).abs().max():.2e}")

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


def test_the_buffers_of_ended_threads_go():
    """A model keeps one few-token buffer per live thread: a thread's entry goes once it has ended, when another
    thread keeps its first (so a server's many short-lived threads never pile up buffers)."""
    model, ids = _converted(), token_ids(batch=1, length=3)
    runtime = model.model.layers[0]._attnres_spec.runtime

    def forward() -> None:
        with torch.no_grad():
            model(ids)

    main = threading.get_ident()  # the conversion's own check ran a forward here
    for _ in range(5):
        thread = threading.Thread(target=forward)
        thread.start()
        thread.join()
        assert set(runtime.steps) - {main} == {thread.ident}


def test_depth_weights_are_recorded_for_the_model_asked():
    """A recorder belongs to one model: another model's forwards inside it are not recorded, and forwards after it
    record nothing."""
    from attnres_convert.depth_controls import record_depth_weights

    model, other, ids = _converted(), _converted(seed=1), token_ids(batch=1, length=5)
    with torch.no_grad():
        with record_depth_weights(model) as weights:
            other(ids)
            assert weights == []
            model(ids)
        count = len(weights)
        model(ids)
    assert count == len(model.model.layers) * 2 + 1 and len(weights) == count


def test_a_replaced_query_module_or_parameter_object_is_read():
    """What a module swap does (PEFT or a user putting new modules or parameters in place): the queries are
    read from the modules and parameters the model holds now, the output aggregation's too."""
    from attnres_convert.modeling.modeling_attnres import AttnResQuery

    model, ids = _converted(), token_ids(batch=1, length=5)
    layer, base = model.model.layers[1], model.model
    with torch.no_grad():
        before = model(ids).logits
        swapped = AttnResQuery(layer.mlp_res_proj.weight.shape[-1], reader=layer.mlp_res_proj.reader)
        swapped.weight.copy_(-3.0 * layer.mlp_res_proj.weight)
        layer.mlp_res_proj = swapped
        after_module = model(ids).logits
        base.output_attn_res_proj.weight = torch.nn.Parameter(torch.flip(base.output_attn_res_proj.weight, dims=[-1]))
        after_parameter = model(ids).logits
    assert (after_module - before).abs().max() > 1e-3 and (after_parameter - after_module).abs().max() > 1e-3
    torch.testing.assert_close(after_parameter, _fresh_logits(model, ids), rtol=0, atol=0)
