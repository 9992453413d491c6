"""The Triton kernels' first-use self-check (kernels/triton_check.py), in Triton's interpreter on CPU tensors:
a kernel variant that differs from its PyTorch reference, or fails to compile, runs the reference instead, with one
warning that names the kernel, the device and the difference; the model's results stay the eager path's."""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it: the kernels run on CPU in the interpreter
    pytest.skip("TRITON_INTERPRET is not 1: no GPU kernels to run on CPU", allow_module_level=True)
pytest.importorskip("triton", reason="the kernel tests need triton (make test installs it)")

from tiny_models import randomize_queries, tiny_model, token_ids  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from attnres_convert import convert_model  # noqa: E402
from attnres_convert.kernels import triton as depth_triton  # noqa: E402
from attnres_convert.kernels import triton_check as depth_triton_check  # noqa: E402
from attnres_convert.kernels import triton_reference as depth_triton_reference  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """Each test starts as a new process would: no variant checked yet."""
    monkeypatch.setattr(depth_triton_check, "_VERDICTS", {})


def _faulty_mix(monkeypatch, error: float = 1e-2):
    """A mix kernel whose output is off by `error`, as a miscompiled program's might be."""
    real = depth_triton.launch_mix

    def faulty(*args, **kwargs):
        out, *rest = real(*args, **kwargs)
        return (out + error, *rest)

    monkeypatch.setattr(depth_triton, "launch_mix", faulty)


def _failing_close(monkeypatch):
    """A close kernel that does not compile for this device: what Triton raises for a program over its limits."""

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(300000, 232448, "shared memory")

            return launch

    monkeypatch.setattr(depth_triton, "close_kernel", Failing())


def _logits(model, ids, mode, monkeypatch):
    monkeypatch.setenv("ATTNRES_KERNEL", mode)
    with torch.no_grad():
        return model(ids).logits


def _model(random_queries: bool):
    model = convert_model(tiny_model("llama", num_hidden_layers=2), block_size=3).eval()
    if random_queries:
        randomize_queries(model, 0.5, seed=3, key_norms=0.3)
    return model


def _mix_inputs(d=8, m=2, tokens=2):
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(m, tokens, d, generator=generator)
    inv = torch.rsqrt(keys.pow(2).mean(-1) + 1e-6)
    return dict(
        keys=keys,
        m=m,
        q=torch.randn(d, generator=generator),
        stream=torch.randn(tokens, d, generator=generator),
        eps=1e-6,
        count=True,
        inv_rms=inv,
    )


def test_a_faulty_kernel_falls_back_to_the_reference_with_one_warning(monkeypatch):
    _faulty_mix(monkeypatch)
    inputs = _mix_inputs()
    with pytest.warns(RuntimeWarning) as caught:
        got = depth_triton.mix(**inputs)[0]
        again = depth_triton.mix(**inputs)[0]  # the same variant: its verdict stands, no second check or warning
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "the Triton kernel mix_kernel" in message and "cpu (Triton's interpreter)" in message, message
    assert re.search(r"out differs by 0\.01 \(allowed 0\.000\d+\)\. This variant runs the reference", message), message
    assert "(BLOCK_D=1024, BLOCK_N=256, num_warps=4; flags: count; dtypes: float32)" in message, message
    want = depth_triton_reference.mix(**inputs)[0]
    assert torch.equal(got, want) and torch.equal(again, want)


def test_a_model_with_a_faulty_kernel_computes_what_eager_computes(monkeypatch):
    _faulty_mix(monkeypatch)
    ids = token_ids(2, 5)
    original = tiny_model("llama", num_hidden_layers=2)
    zero, model = _model(random_queries=False), _model(random_queries=True)
    with pytest.warns(RuntimeWarning, match="mix_kernel") as caught:
        at_zero = _logits(zero, ids, "triton", monkeypatch)
        got = _logits(model, ids, "triton", monkeypatch)
    variants = len(caught)
    assert variants >= 2 and all("mix_kernel" in str(w.message) for w in caught)  # once per mix variant
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every variant was checked: no more warnings
        assert torch.equal(_logits(model, ids, "triton", monkeypatch), got)
    assert torch.equal(at_zero, original(ids).logits)  # exact, as the eager path is
    eager = _logits(model, ids, "eager", monkeypatch)
    assert (got - eager).abs().max().item() <= 1e-4


def test_a_kernel_that_does_not_compile_falls_back_with_one_warning(monkeypatch):
    _failing_close(monkeypatch)
    ids = token_ids(2, 5)
    model = _model(random_queries=True)
    with pytest.warns(RuntimeWarning) as caught:
        got = _logits(model, ids, "triton", monkeypatch)
    closes = [str(w.message) for w in caught if "close_kernel" in str(w.message)]
    assert closes and len(closes) == len(set(closes))
    assert "failed to compile or run (OutOfResources: out of resource: shared memory, Required: 300000" in closes[0]
    assert "cpu (Triton's interpreter)" in closes[0]
    eager = _logits(model, ids, "eager", monkeypatch)
    assert (got - eager).abs().max().item() <= 1e-4


def test_inputs_over_the_kernels_limits_run_the_reference(monkeypatch):
    inputs = _mix_inputs(m=depth_triton.MAX_SOURCES + 4, tokens=1)
    with pytest.warns(RuntimeWarning, match=r"mix_kernel \(more sources than the kernels' limit of 256; flags: count"):
        got = depth_triton.mix(**inputs)[0]
    assert torch.equal(got, depth_triton_reference.mix(**inputs)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # another number of sources over the limit: the same variant, no warning
        depth_triton.mix(**_mix_inputs(m=depth_triton.MAX_SOURCES + 5, tokens=1))


def test_the_references_match_the_kernels(monkeypatch):
    """The fallback is sound: each reference against its kernel in the interpreter, through the self-check's own
    probes (no warning: every variant a model uses passes)."""
    model = _model(random_queries=True).train()
    ids = token_ids(2, 4)
    monkeypatch.setenv("ATTNRES_KERNEL", "triton")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model(ids, labels=ids).loss.backward()
        with torch.no_grad():
            model.eval()(ids)
    kernels = {key[0] for key, ok in depth_triton_check._VERDICTS.items() if ok}
    assert kernels == {"mix_kernel", "close_kernel", "mix_backward_kernel"}
