"""Every way a user changes a converted model's weights changes its outputs exactly as in a fresh model with the
same weights: nothing the forwards keep between calls (decoding buffers per thread, fused-norm verdicts) or make
from the weights (the folded queries) may be stale. Each way runs after forwards and a cached greedy generation
have made whatever is kept, and is compared, logits and greedy tokens, bit for bit (`torch.equal`) with a model
built anew and loaded with the changed model's state dict."""

from __future__ import annotations

import pytest
import torch
from tiny_models import randomize_queries, tiny_model, token_ids

from attnres_convert.conversion.surgery import convert_model

GENERATE = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


def _converted(seed: int = 0):
    """A tiny converted Llama with random queries and key norms, as after fine-tuning (at zero queries every
    query gives the same mix, and stale queries would go unnoticed)."""
    return randomize_queries(convert_model(tiny_model("llama"), block_size=3).eval(), 1.0, seed=seed, key_norms=0.3)


def _depth_params(model) -> list[torch.nn.Parameter]:
    """The pseudo-queries and key norms: what the folded queries are made from."""
    return [p for name, p in model.named_parameters() if "_res_proj" in name or "_res_norm" in name]


def _new_values(params, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator).to(p.dtype) for p in params]


def _outputs(model, ids, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prefill and a greedy generation with the KV cache (its one-token steps use the decoding
    buffers that the model keeps from one step to the next)."""
    with torch.no_grad():
        return model(ids).logits, model.generate(prompt, **GENERATE)


def _fresh(model):
    """A model that has kept nothing: a new conversion, in the changed model's dtype, loaded with its weights."""
    fresh = convert_model(tiny_model("llama"), block_size=3).eval().to(model.dtype)
    fresh.load_state_dict(model.state_dict())
    return fresh


def _data_copy(model):
    # What many training and merging tools do: a `.data` view has a version counter of its own.
    with torch.no_grad():
        for param, value in zip(_depth_params(model), _new_values(_depth_params(model), 1)):
            param.data.copy_(value)
    return model


def _data_assign(model):
    for param, value in zip(_depth_params(model), _new_values(_depth_params(model), 2)):
        param.data = value
    return model


def _load_state_dict(model):
    other = _converted(seed=3)
    model.load_state_dict(other.state_dict())
    return model


def _optimizer_step(model):
    params = _depth_params(model)
    optimizer = torch.optim.AdamW(params, lr=0.5)
    ids = token_ids(2, 12, seed=4)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model


def _peft_merge_and_unload(model):
    """LoRA on the attention projections, the depth modules (queries, key norms, the output aggregation's) as
    `modules_to_save`: the wrapped copies are changed (as training would), then merged into the base model."""
    from peft import LoraConfig, get_peft_model

    saved = [
        "self_attention_res_proj",
        "mlp_res_proj",
        "self_attention_res_norm",
        "mlp_res_norm",
        "output_attn_res_proj",
        "output_attn_res_norm",
    ]
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=saved,
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config).eval()
    ids = token_ids(2, 7, seed=5)
    with torch.no_grad():
        peft_model(ids)  # a forward through the wrappers before they change
        copies = [p for name, p in peft_model.named_parameters() if ".modules_to_save." in name]
        assert len(copies) == 4 * len(model.model.layers) + 2  # every depth module's weight has its copy
        for param, value in zip(copies, _new_values(copies, 6)):
            param.copy_(value)
    merged = peft_model.merge_and_unload()
    assert type(merged) is type(model)
    return merged


def _ema_swap(model):
    """An EMA's evaluation: its averaged tensors swapped in for the parameters', used, and swapped back out."""
    params = _depth_params(model)
    ema = _new_values(params, 7)
    for param, average in zip(params, ema):
        param.data, average.data = average.data, param.data
    ids = token_ids(1, 5, seed=8)
    swapped_in = _outputs(model, ids, ids[:, :3])
    fresh = _outputs(_fresh(model), ids, ids[:, :3])
    assert all(torch.equal(a, b) for a, b in zip(swapped_in, fresh))
    for param, average in zip(params, ema):
        param.data, average.data = average.data, param.data
    return model


def _to_bfloat16(model):
    return model.to(torch.bfloat16)


def _to_float64(model):
    return model.to(torch.float64)


WAYS = {
    "data_copy": _data_copy,
    "data_assign": _data_assign,
    "load_state_dict": _load_state_dict,
    "optimizer_step": _optimizer_step,
    "peft_merge_and_unload": _peft_merge_and_unload,
    "ema_swap": _ema_swap,
    "to_bfloat16": _to_bfloat16,
    "to_float64": _to_float64,
}


FLOAT32_ONLY = {"to_bfloat16", "to_float64"}  # the C++ kernels run float32 models only


def _cpu_kernels_or_skip() -> None:
    from attnres_convert.kernels import cpu as depth_kernels_cpu

    try:
        depth_kernels_cpu.build()  # compiled once per machine (about 25 s), before any forward
    except RuntimeError as error:  # no compiler, ninja or Python headers: test_cpu_kernels says which
        pytest.skip(str(error))


CASES = [(way, kernel) for kernel in ("eager", "cpu") for way in WAYS if not (kernel == "cpu" and way in FLOAT32_ONLY)]


@pytest.mark.parametrize(("way", "kernel"), CASES, ids=[f"{way}-{kernel}" for way, kernel in CASES])
def test_a_weight_change_gives_a_fresh_models_outputs(way, kernel, monkeypatch):
    """On the eager path and on the C++ kernels (whose buffers and fused-norm verdicts are kept too)."""
    if kernel == "cpu":
        _cpu_kernels_or_skip()
    monkeypatch.setenv("ATTNRES_KERNEL", kernel)
    model = _converted()
    ids, prompt = token_ids(2, 9, seed=9), token_ids(1, 4, seed=10)
    before = _outputs(model, ids, prompt)
    _outputs(model, ids, prompt)  # twice: the second forwards find what the first kept
    changed = WAYS[way](model)
    after = _outputs(changed, ids, prompt)
    fresh = _outputs(_fresh(changed), ids, prompt)
    if way != "ema_swap":  # swapped back out: the same weights as before
        assert not torch.equal(after[0].float(), before[0]), "the change should change the logits"
    else:
        assert torch.equal(after[0], before[0])
    assert torch.equal(after[0], fresh[0]), (after[0].float() - fresh[0].float()).abs().max()
    assert torch.equal(after[1], fresh[1])
