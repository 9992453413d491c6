"""The Triton depth-mix kernels (kernels/triton.py, triton_kernels.py), run on CPU by Triton's interpreter: against the
eager path, the plain reference and the original model, forward and backward, float32 and bfloat16,
prefill, decoding with the KV cache and training, Full AttnRes and a block size that does not divide
the depth; and the ATTNRES_KERNEL selection. The interpreter runs each program in Python: tiny shapes."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it: the kernels run on CPU in the interpreter
    pytest.skip("TRITON_INTERPRET is not 1: no GPU kernels to run on CPU", allow_module_level=True)
pytest.importorskip("triton", reason="the kernel tests need triton (make test installs it)")

from design_reference import reference_llama  # noqa: E402
from tiny_models import randomize_queries, tiny_model, token_ids
from tiny_models import with_kernels as _with  # noqa: E402

from attnres_convert import convert_model, save_converted  # noqa: E402
from attnres_convert import kernels as depth_backends  # noqa: E402
from attnres_convert.modeling import modeling_attnres as depth_attention  # noqa: E402

LAYERS = 2  # four sublayers: S = 3 leaves a partial block, S = 1 is Full AttnRes


def _model(block_size: int, dtype=torch.float32, random_queries: bool = True):
    model = convert_model(tiny_model("llama", num_hidden_layers=LAYERS), block_size=block_size).eval()
    if random_queries:
        randomize_queries(model, 0.5, seed=block_size, key_norms=0.3)
    return model.to(dtype)


def _state_types(model, run) -> list:
    """The state the final norm receives (what the readers ran on), and the run's result."""
    states = []
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: states.append(args[0]))
    try:
        return run(), states
    finally:
        hook.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 3])
def test_prefill_matches_eager_reference_and_original_bit_for_bit_at_zero_queries(block_size, dtype, monkeypatch):
    ids = token_ids(2, 5)
    original = tiny_model("llama", num_hidden_layers=LAYERS).to(dtype)
    zero = _model(block_size, dtype, random_queries=False)
    with torch.no_grad():
        (got, states) = _state_types(zero, lambda: _with("triton", monkeypatch, lambda: zero(ids).logits))
        assert states[0].kernels is not None  # the kernels ran, not the eager path
        assert torch.equal(got, original(ids).logits)  # exactness: the plain stream's own bits
        at_zero = got
        model = _model(block_size, dtype)
        got = _with("triton", monkeypatch, lambda: model(ids).logits)
        eager = _with("eager", monkeypatch, lambda: model(ids).logits)
    if dtype == torch.float32:
        assert (got - eager).abs().max().item() <= 1e-4
        assert (got - reference_llama(model, ids, block_size)).abs().max().item() <= 1e-4
    else:  # one bfloat16 rounding of a mix apart, amplified by two layers
        assert (got.float() - eager.float()).abs().max().item() <= 0.1 * eager.float().abs().max().item()
    assert not torch.equal(got, at_zero)  # random queries: the mix really routed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decoding_with_kv_cache(dtype, monkeypatch):
    """Greedy decoding: at zero queries the tokens and every step's logits are the original's bit for bit;
    with random queries the kernels pick the eager path's tokens."""
    ids = token_ids(1, 4)
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    original = tiny_model("llama", num_hidden_layers=LAYERS).to(dtype)
    zero = _model(3, dtype, random_queries=False)
    got = _with("triton", monkeypatch, lambda: zero.generate(ids, **kwargs))
    want = original.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    if dtype == torch.float32:
        model = _model(3)
        got = _with("triton", monkeypatch, lambda: model.generate(ids, **kwargs))
        eager = _with("eager", monkeypatch, lambda: model.generate(ids, **kwargs))
        assert torch.equal(got.sequences, eager.sequences)
        assert max((a - b).abs().max().item() for a, b in zip(got.logits, eager.logits)) <= 1e-4


def _gradients(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "block_size, dtype, table",
    [(1, torch.float32, True), (3, torch.float32, False), (3, torch.bfloat16, True)],
    ids=["full-fp32", "S3-fp32-no-table", "S3-bf16"],
)
def test_training_gradients_match_the_eager_backward(block_size, dtype, table, monkeypatch):
    """The forward and backward kernels against the eager path's hand-written backward (itself checked
    against autograd through the plain reference in design_reference.py), for every parameter."""
    from attnres_convert.modeling import modeling_attnres

    if not table:  # every reader scores the completed blocks itself (the queries are not gathered)
        monkeypatch.setattr(modeling_attnres, "_all_queries", lambda spec, like: None)
    model = _model(block_size, dtype).train()
    ids = token_ids(2, 4)
    (loss, got), states = _state_types(model, lambda: _with("triton", monkeypatch, lambda: _gradients(model, ids)))
    assert type(states[0]).__name__ == "TrainState" and states[0].kernels is not None
    want_loss, want = _with("eager", monkeypatch, lambda: _gradients(model, ids))
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert abs(loss.item() - want_loss.item()) <= tolerance
    assert got.keys() == want.keys() and any("_res_proj" in name for name in got)
    for name in want:
        scale = max(want[name].abs().max().item(), 1e-3)
        assert (got[name] - want[name]).abs().max().item() <= tolerance * scale, name


def test_a_converted_folder_runs_the_installed_kernels(tmp_path, monkeypatch):
    """The kernels stay in the attnres package (a folder ships only its two code files): a
    from_pretrained(trust_remote_code=True) model runs them where attnres is installed."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    model = _model(3)
    folder = save_converted(copy.deepcopy(model), tmp_path / "converted")
    assert sorted(path.name for path in folder.glob("*.py")) == ["configuration_attnres.py", "modeling_attnres.py"]
    assert (folder / "modeling_attnres.py").read_text() == Path(depth_attention.__file__).read_text()
    # The folder's own classes (AutoModelForCausalLM would pick the package's, registered in this process).
    loaded = (
        get_class_from_dynamic_module("modeling_attnres.AttnResForCausalLM", str(folder))
        .from_pretrained(folder, dtype=torch.float32)
        .eval()
    )
    assert "transformers_modules" in type(loaded).__module__, type(loaded).__module__
    ids = token_ids(1, 3)
    with torch.no_grad():
        (got, states), want = (
            _state_types(loaded, lambda: _with("triton", monkeypatch, lambda: loaded(ids).logits)),
            model(ids).logits,
        )
    assert type(states[0]).__name__ == "TritonBuffer" and states[0].kernels is not None
    assert (got - want).abs().max().item() <= 1e-4


def test_selection(monkeypatch):
    x = torch.zeros(1, 1, 8)
    monkeypatch.setenv("ATTNRES_KERNEL", "eager")
    assert depth_backends.triton_kernels_for(x) is None
    monkeypatch.setenv("ATTNRES_KERNEL", "auto")
    assert depth_backends.triton_kernels_for(x) is None  # auto: CPU tensors take the eager path
    monkeypatch.delenv("ATTNRES_KERNEL")
    assert depth_backends.triton_kernels_for(x) is None  # auto is the default
    monkeypatch.setenv("ATTNRES_KERNEL", "triton")
    assert depth_backends.triton_kernels_for(x) is not None  # CPU tensors in the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors .* TRITON_INTERPRET=1"):
        depth_backends.triton_kernels_for(x)
    monkeypatch.setattr(depth_backends, "_KERNELS", [ImportError("No module named 'triton'")])
    with pytest.raises(RuntimeError, match=r"ATTNRES_KERNEL=triton but Triton cannot be imported .*pip install triton"):
        depth_backends.triton_kernels_for(x)
    monkeypatch.setenv("ATTNRES_KERNEL", "auto")
    assert depth_backends.triton_kernels_for(x) is None  # auto without triton: eager, no error
    monkeypatch.setenv("ATTNRES_KERNEL", "fast")
    with pytest.raises(ValueError, match="'fast' is not a kernel choice: use one of auto, eager, cpu, triton, fla"):
        depth_backends.triton_kernels_for(x)
