"""set_depth_gate: every reader reads stream + g (mix - stream). At g = 0 the converted model is its base
model exactly, whatever its queries, on every path (training, inference, decoding with the KV cache)."""

import copy

import pytest
import torch
from tiny_models import randomize_queries, tiny_model, token_ids

from attnres_convert.conversion.surgery import convert_model
from attnres_convert.depth_controls import set_depth_gate


def _trained_pair():
    base = tiny_model("llama").eval()
    model = randomize_queries(convert_model(copy.deepcopy(base), block_size=3).eval(), 1.0, seed=0)
    return base, model


def test_gate_zero_is_the_base_model_on_every_path():
    base, model = _trained_pair()
    ids = token_ids(batch=2, length=20)
    with torch.no_grad():
        reference, mixed = base(ids).logits, model(ids).logits
    assert (mixed - reference).abs().max() > 1e-3  # the queries matter at gate 1
    set_depth_gate(model, 0.0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(ids).logits.detach(), reference, rtol=1e-5, atol=1e-5)  # with autograd
    prompt = token_ids(batch=1, length=8, seed=1)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), base.generate(prompt, **kwargs))


def test_gate_scales_between_the_stream_and_the_mix_and_the_query_gradient():
    _, model = _trained_pair()
    ids = token_ids(batch=1, length=12)
    losses, grads = {}, {}
    for gate in (0.0, 0.5, 1.0):
        set_depth_gate(model, gate)
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses[gate] = loss.item()
        grads[gate] = model.model.layers[1].mlp_res_proj.weight.grad.norm().item()
    assert grads[0.0] == 0.0 and grads[0.5] > 0 and grads[1.0] > 0
    assert len({round(v, 6) for v in losses.values()}) == 3
    set_depth_gate(model, 1.0)
    fresh = convert_model(tiny_model("llama"), block_size=3).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():  # gate 1 is the plain AttnRes model
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, rtol=0, atol=0)


def test_gate_is_refused_outside_zero_one_and_ignored_without_attnres():
    base, model = _trained_pair()
    with pytest.raises(ValueError, match=r"the depth gate must be in \[0, 1\], got 1.5"):
        set_depth_gate(model, 1.5)
    assert set_depth_gate(base, 0.5) is False
