"""The Triton kernels compiled and run on one CUDA GPU (`make test-gpu`, marker cuda; `make test` leaves them out):
the interpreter tests of tests/test_kernels.py on hardware, in float32, bfloat16 and float16. At zero queries the
logits, and the greedy tokens and every step's logits with the KV cache, equal the original model's bit for bit
(docs/kernels.md promises it); with random queries they match the eager path, and so do the gradients of every
parameter. No kernel variant may fail its first-use self-check (a RuntimeWarning is an error here)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from tiny_models import randomize_queries, tiny_model, token_ids
from tiny_models import with_kernels as _with

from attnres_convert import convert_model

pytestmark = pytest.mark.cuda
LAYERS = 2  # four sublayers: S = 3 leaves a partial block, S = 1 is Full AttnRes
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def on_a_gpu(monkeypatch):
    """A skip that names its reason (the module is deselected, not skipped, by `make test`)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (torch.cuda.is_available() is False): run `make test-gpu` on a machine with one")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 would interpret the kernels: `make test-gpu` sets TRITON_INTERPRET=0")
    pytest.importorskip("triton", reason="the GPU kernels need triton")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip(f"bfloat16 kernels need compute capability 8.0 or more ({torch.cuda.get_device_name()})")
    with warnings.catch_warnings():  # a variant that fails its self-check fails the test
        warnings.filterwarnings("error", message="attnres: the Triton kernel", category=RuntimeWarning)
        yield


def _model(block_size: int, dtype, random_queries: bool = True):
    model = convert_model(tiny_model("llama", num_hidden_layers=LAYERS), block_size=block_size).eval()
    if random_queries:
        randomize_queries(model, 0.5, seed=block_size, key_norms=0.3)
    return model.to("cuda", dtype)


def _original(dtype):
    return tiny_model("llama", num_hidden_layers=LAYERS).to("cuda", dtype)


def _close(got, want, dtype, what=""):
    got, want = got.float(), want.float()
    if dtype == torch.float32:
        assert (got - want).abs().max().item() <= 1e-4, what
    else:  # one rounding of a mix apart, amplified by two layers (as tests/test_kernels.py allows)
        assert (got - want).abs().max().item() <= 0.1 * want.abs().max().item(), what


def _ran_kernels(model, run):
    states = []
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: states.append(args[0]))
    try:
        result = run()
    finally:
        hook.remove()
    assert states and states[0].kernels is not None  # the kernels ran, not the eager path
    return result


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("block_size", [1, 3])
def test_prefill_bit_for_bit_at_zero_queries_and_close_to_eager(block_size, dtype, monkeypatch):
    ids = token_ids(2, 7).cuda()
    zero = _model(block_size, dtype, random_queries=False)
    with torch.no_grad():
        at_zero = _ran_kernels(zero, lambda: _with("triton", monkeypatch, lambda: zero(ids).logits))
        assert torch.equal(at_zero, _original(dtype)(ids).logits)
        model = _model(block_size, dtype)
        got = _ran_kernels(model, lambda: _with("triton", monkeypatch, lambda: model(ids).logits))
        eager = _with("eager", monkeypatch, lambda: model(ids).logits)
    _close(got, eager, dtype)
    assert not torch.equal(got, at_zero)  # random queries: the mix really routed


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_decoding_with_the_kv_cache(dtype, monkeypatch):
    ids = token_ids(2, 5).cuda()
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    zero = _model(3, dtype, random_queries=False)
    got = _with("triton", monkeypatch, lambda: zero.generate(ids, **kwargs))
    want = _original(dtype).generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    model = _model(3, dtype)
    got = _with("triton", monkeypatch, lambda: model.generate(ids, **kwargs))
    eager = _with("eager", monkeypatch, lambda: model.generate(ids, **kwargs))
    if dtype == torch.float32:
        assert torch.equal(got.sequences, eager.sequences)
    _close(got.logits[0], eager.logits[0], dtype, "the first step's logits")


def _gradients(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("block_size, table", [(1, True), (3, True), (3, False)], ids=["full", "S3", "S3-no-table"])
def test_training_gradients_match_the_eager_backward(block_size, table, dtype, monkeypatch):
    from attnres_convert.modeling import modeling_attnres

    if not table:  # every reader scores the completed blocks itself
        monkeypatch.setattr(modeling_attnres, "_all_queries", lambda spec, like: None)
    model = _model(block_size, dtype).train()
    ids = token_ids(2, 6).cuda()
    loss, got = _ran_kernels(model, lambda: _with("triton", monkeypatch, lambda: _gradients(model, ids)))
    want_loss, want = _with("eager", monkeypatch, lambda: _gradients(model, ids))
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert abs(loss.item() - want_loss.item()) <= tolerance * max(1.0, abs(want_loss.item()))
    assert got.keys() == want.keys() and any("_res_proj" in name for name in got)
    for name in want:
        scale = max(want[name].abs().max().item(), 1e-3)
        assert (got[name] - want[name]).abs().max().item() <= tolerance * scale, name


def test_every_variant_a_model_uses_passes_its_self_check(monkeypatch):
    """On this GPU, each compiled variant matches its PyTorch reference within the promise: none falls back."""
    from attnres_convert.kernels import triton_check as depth_triton_check

    monkeypatch.setattr(depth_triton_check, "_VERDICTS", {})
    for dtype in DTYPES.values():
        model = _model(3, dtype).train()
        ids = token_ids(2, 6).cuda()
        _with("triton", monkeypatch, lambda: model(ids, labels=ids).loss.backward())
        with torch.no_grad():
            _with("triton", monkeypatch, lambda: model.eval()(ids))
    verdicts = depth_triton_check._VERDICTS
    assert verdicts and all(verdicts.values())
    assert {key[0] for key in verdicts} == {"mix_kernel", "close_kernel", "mix_backward_kernel"}
    assert all(key[-1].startswith("cuda") for key in verdicts)
