"""The converted model is ready to train: gradients reach the pseudo-queries at zero init, and
gradient checkpointing (state threaded through layer arguments, never module attributes) changes
nothing."""

import pytest
import torch
from tiny_models import randomize_queries, tiny_model, token_ids

from attnres_convert.conversion.surgery import convert_model
from attnres_convert.modeling.modeling_attnres import plan_sublayers


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # same dropout masks in both runs (checkpointing replays with the saved RNG state)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "gpt_neox_parallel"])
def test_pseudo_queries_get_gradients_at_zero_init(family):
    model = convert_model(tiny_model(family), block_size=3).train()
    _, grads = _loss_and_grads(model, token_ids())
    queries = [n for n, _ in model.named_parameters() if n.endswith("_res_proj.weight")]
    assert len(queries) == len(plan_sublayers(len(queries) - 1, 3)) + 1
    # Sublayer 1 reads the embedding alone: a softmax over one source has nothing to route, so its
    # query's gradient is exactly zero. Every other reader must learn.
    first, readers = queries[0], queries[1:]
    assert grads[first].abs().sum().item() == 0
    for name in readers:
        assert grads[name].abs().sum().item() > 0, f"no gradient reaches {name}"


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox_parallel", "gemma3_text"])
def test_gradient_checkpointing_gives_identical_loss_and_gradients(family):
    model = convert_model(tiny_model(family), block_size=3).train()
    randomize_queries(model, 0.5)  # non-zero routing, so the state really matters in the recompute
    ids = token_ids()
    loss_plain, grads_plain = _loss_and_grads(model, ids)
    model.gradient_checkpointing_enable()
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers, "gradient checkpointing did not reach the decoder layers"
    loss_ckpt, grads_ckpt = _loss_and_grads(model, ids)
    assert abs(loss_plain.item() - loss_ckpt.item()) <= 1e-5
    assert grads_plain.keys() == grads_ckpt.keys()
    for name in grads_plain:
        assert torch.allclose(grads_plain[name], grads_ckpt[name], atol=1e-5, rtol=1e-4), name


def test_reentrant_checkpointing_is_refused_with_the_fix():
    """Reentrant checkpointing cannot differentiate through the state tuple a layer receives (it failed
    deep inside a layer with "'tuple' object has no attribute 'shape'"): refused when it is enabled."""
    model = convert_model(tiny_model("llama"), block_size=3).train()
    with pytest.raises(ValueError, match=r"non-reentrant.*'use_reentrant': False"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    ids = token_ids()
    model(ids, labels=ids).loss.backward()


def test_trains_under_bfloat16_autocast():
    """Accelerate's mixed precision runs the forward under autocast, the sublayers in bfloat16: training
    works through the hand-written backward (which turns autocast off inside, for the design's float32
    statistics), every reader's query gets a finite gradient and the weights stay float32."""
    from attnres_convert.depth_controls import record_depth_weights

    model = convert_model(tiny_model("llama"), block_size=3).train()
    randomize_queries(model, 0.5)
    ids = token_ids()
    loss32, _ = _loss_and_grads(model, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16), record_depth_weights(model) as weights:
        loss16, grads16 = _loss_and_grads(model, ids)
    assert abs(loss16.item() - loss32.item()) <= 0.05 * abs(loss32.item())
    assert weights and all(w.dtype == torch.float32 for w in weights)
    for name in (n for n in grads16 if "_res_proj" in n and not n.startswith("model.layers.0.self_attention")):
        assert torch.isfinite(grads16[name]).all() and grads16[name].abs().sum() > 0, name


def _train_state_loss(model, ids, states):
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: states.append(args[0]))
    try:
        return model(ids, labels=ids).loss
    finally:
        hook.remove()


def test_double_backward_through_the_depth_mix_raises():
    """The hand-written backwards are not themselves differentiable: a gradient of a gradient (gradient
    penalties, Hessian-vector products) must fail loudly instead of silently missing their terms."""
    model = convert_model(tiny_model("llama", num_hidden_layers=2), block_size=1).train()
    ids = token_ids(1, 6)
    states = []
    loss = _train_state_loss(model, ids, states)
    assert type(states[0]).__name__ == "TrainState"
    queries = [p for name, p in model.named_parameters() if name.endswith("_res_proj.weight")]
    grads = torch.autograd.grad(loss, queries, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        sum(g.square().sum() for g in grads).backward()


def test_activation_offloading_sees_the_block_cache():
    """What the backward reads of the training state's block cache goes through saved-tensor hooks, so
    activation offloading (torch.autograd.graph.save_on_cpu, or any pack/unpack pair) moves it: with
    hooks that pack copies, poisoning the cache after the forward changes no gradient."""
    model = convert_model(tiny_model("llama", num_hidden_layers=2), block_size=3).train()
    randomize_queries(model, 0.5)
    ids = token_ids(2, 6)
    _, want = _loss_and_grads(model, ids)

    def offloaded(poison: bool):
        model.zero_grad(set_to_none=True)
        states = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            loss = _train_state_loss(model, ids, states)
        cache = states[0].cache
        assert cache.scores is not None  # the score table is part of what is offloaded
        if poison:  # as if the offloaded originals were freed and reused
            for tensor in (cache.values, cache.inv_rms, cache.scores):
                tensor.fill_(float("nan"))
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for got in (offloaded(poison=True),):
        for name in want:
            assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7), name
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.save_on_cpu():
        model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        if name in want:
            assert torch.allclose(param.grad, want[name], rtol=1e-5, atol=1e-7), name
