"""fla-core's fused AttnRes kernels (`fla.ops.attnres.fused_attnres`, Triton forward and backward) behind FlaState
(kernels/fla.py), run on CPU by Triton's interpreter, against the eager path (modeling_attnres.BlockState): the mix,
the recorded weights and the gradients of the query, the key norm's weight, every source and the partial sum, float32
and bfloat16, "count" and "mean" scaling. Tiny shapes (D = 64, B*T = 6): the interpreter runs each program in Python.

Two changes to fla, for these tests only (monkeypatched, undone after each test; see `interpreted_fla`):

- `fused_attnres_fwd` raises unless the sources are CUDA tensors (`if not residuals[0].is_cuda: raise`), even under
  TRITON_INTERPRET=1, where its kernels run on CPU tensors. That one check is removed from a copy of the function's
  own source (the test fails, not skips, if the check is not found verbatim, so an fla release that changes the
  function is noticed).
- Its kernels step through the sources with Python's `range(...)` and call `.to(tl.int64)` on the loop index. A
  compiled kernel's loop index is a Triton scalar; the interpreter's is a Python int, which has no `.to`. The fused
  module gets a `range` of its own that yields interpreter scalars (the fused module's host code does not call
  `range`). And each autotuned kernel gets one config (the interpreter cannot benchmark configs): BL = 4 sources per
  tile, so 5 sources make a full tile and a masked one.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it: the kernels run on CPU in the interpreter
    pytest.skip("TRITON_INTERPRET is not 1: no GPU kernels to run on CPU", allow_module_level=True)
pytest.importorskip("triton", reason="the kernel tests need triton (make test installs it)")
pytest.importorskip(
    "fla.ops.attnres", reason="fla-core is not installed (make install installs it: pip install 'attnres[cuda]')"
)

from attnres_convert.kernels.fla import FlaState, fla_fits, fla_mix_function  # noqa: E402
from attnres_convert.modeling.modeling_attnres import BlockState, depth_mix, inverse_rms  # noqa: E402

D, EPS = 64, 1e-5
CUDA_CHECK = '    if not residuals[0].is_cuda:\n        raise ValueError("Triton attnres requires CUDA tensors")\n'
_PATCHED: list = []


def _fwd_without_cuda_check(fused):
    if not _PATCHED:
        source = inspect.getsource(fused.fused_attnres_fwd)
        assert source.count(CUDA_CHECK) == 1, "fla's fused_attnres_fwd changed: update CUDA_CHECK"
        namespace = dict(fused.__dict__)
        exec(compile(source.replace(CUDA_CHECK, ""), fused.__file__, "exec"), namespace)
        _PATCHED.append(namespace["fused_attnres_fwd"])
    return _PATCHED[0]


@pytest.fixture
def interpreted_fla(monkeypatch):
    import fla.ops.attnres.fused as fused
    from triton.runtime.interpreter import interpreter_semantic

    def interpreter_range(*bounds):
        for index in range(*(int(bound) for bound in bounds)):
            yield interpreter_semantic.to_tensor(index, False)

    monkeypatch.setattr(fused, "fused_attnres_fwd", _fwd_without_cuda_check(fused))
    monkeypatch.setattr(fused, "range", interpreter_range, raising=False)
    for kernel, keep in (
        (fused.attnres_fwd_kernel, lambda c: c.kwargs["BL"] == 4),
        (fused.attnres_bwd_kernel_dv, lambda c: c.kwargs["BL"] == 4),
        (fused.attnres_bwd_kernel_dqdw, lambda c: True),
    ):
        monkeypatch.setattr(kernel, "configs", [next(c for c in kernel.configs if keep(c))])
        monkeypatch.setattr(kernel, "cache", {})


def _leaves(dtype, completed: int, partial: bool, seed: int):
    """The embedding and completed blocks (float32, holding values of `dtype` as a model's would), the partial sum
    (dtype) and a query and key norm weight (float32 parameters), all leaves."""
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0, as_dtype=torch.float32):
        value = torch.randn(*shape, generator=generator) * scale
        return value.to(dtype).to(as_dtype).requires_grad_()

    sources = [leaf(2, 3, D, scale=1.0 + i) for i in range(1 + completed)]  # magnitudes grow with depth
    part = leaf(2, 3, D, scale=2.0, as_dtype=dtype) if partial else None
    query = leaf(1, D, scale=0.5)  # as the model's [1, D] pseudo-query
    key_norm = (1.0 + leaf(D, scale=0.3).detach()).requires_grad_()
    return sources, part, query, key_norm


def _states(sources, partial, dtype):
    """A BlockState and a FlaState over the same leaves; the stream is their sum, in the model dtype (as a model
    carries it), so the count mix's gradient through the stream reaches the same leaves."""
    stream = sum(s.to(dtype) for s in sources)
    if partial is not None:
        stream = stream + partial
    blocks = torch.stack(sources, dim=-2)
    eager = BlockState(blocks, inverse_rms(blocks, EPS), partial, stream)
    return eager, FlaState(tuple(sources), partial, stream)


# (atol, rtol) of the mix in the model dtype, and of the float32 gradients. bfloat16: fla's mix is a float32 sum rounded
# once to bfloat16; the eager "count" mix is the bfloat16 stream (the sources summed in bfloat16, rounded at every
# add, as the base model does) plus a float32 correction, so the two differ by a few bfloat16 steps of the stream's
# size (atol scaled by the largest value), and fla's is within one step (2^-8 relative) of the float64 reference.
# The gradients are float32 on both sides from the same bfloat16 cotangent; the partial's is rounded to bfloat16.
TOLERANCE = {
    torch.float32: {"mix": (2e-5, 1e-5), "grad": (5e-5, 1e-4)},
    torch.bfloat16: {"mix": (2**-6, 2**-7), "grad": (1e-4, 1e-4), "partial": (1e-2, 2**-7)},
}


def _reference(sources, partial, query, key_norm, scaling):
    """The mix in float64 from the leaves: design section 2's formula."""
    keys = torch.stack(
        [s.detach().double() for s in sources] + ([partial.detach().double()] if partial is not None else [])
    )
    q = query.detach().double().reshape(-1) * key_norm.detach().double()
    scores = (keys @ q) * torch.rsqrt(keys.square().mean(-1) + EPS)
    mixed = (torch.softmax(scores, dim=0)[..., None] * keys).sum(0)
    return mixed * keys.shape[0] if scaling == "count" else mixed


@pytest.mark.parametrize("scaling", ["count", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("completed,partial", [(2, True), (4, False), (3, True)], ids=["3src", "5src", "5src-partial"])
def test_fla_mix_and_gradients_match_the_eager_path(interpreted_fla, dtype, scaling, completed, partial):
    sources, part, query, key_norm = _leaves(dtype, completed, partial, seed=completed + 10 * partial)
    eager, fla = _states(sources, part, dtype)
    leaves = [query, key_norm, *sources] + ([part] if part is not None else [])
    cotangent = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1)).to(dtype)

    results = []
    for state, q in ((eager, eager.fold(query, key_norm)), (fla, fla.fold(query, key_norm))):
        mixed = state.mix(q, EPS, scaling)
        assert mixed.dtype == dtype and mixed.shape == (2, 3, D)
        grads = torch.autograd.grad(mixed, leaves, cotangent)
        results.append((mixed.detach(), grads))
    (want, want_grads), (got, got_grads) = results

    atol, rtol = TOLERANCE[dtype]["mix"]
    torch.testing.assert_close(got, want, atol=atol * max(want.abs().max().item(), 1.0), rtol=rtol)
    reference = _reference(sources, part, query, key_norm, scaling)
    one_rounding = 2**-8 if dtype == torch.bfloat16 else 1e-6  # fla's float32 mix, rounded once to dtype
    torch.testing.assert_close(got.double(), reference, atol=1e-5, rtol=one_rounding)
    names = ["query", "key_norm"] + [f"source {i}" for i in range(len(sources))] + ["partial"] * (part is not None)
    for name, g, w in zip(names, got_grads, want_grads):
        atol, rtol = TOLERANCE[dtype]["partial" if name == "partial" and dtype != torch.float32 else "grad"]
        scale = w.abs().max().item()  # relative to the gradient's own size (the query's sums over tokens)
        torch.testing.assert_close(g, w, atol=atol * max(scale, 1.0), rtol=rtol, msg=lambda m: f"{name}: {m}")
        assert g.dtype == w.dtype


def test_fla_state_through_the_depth_attention_calls(interpreted_fla):
    """A forward of seven sublayers with block size 3 (design section 3's test vector) and the output aggregation,
    through start/close/depth_mix/add on both states: the same final hidden state, stream and gradients (float32,
    count scaling)."""
    generator = torch.Generator().manual_seed(3)
    embeddings = torch.randn(2, 3, D, generator=generator).requires_grad_()
    queries = [(torch.randn(1, D, generator=generator) * 0.5).requires_grad_() for _ in range(8)]
    key_norms = [(1.0 + 0.3 * torch.randn(D, generator=generator)).requires_grad_() for _ in range(8)]
    weights = [torch.randn(D, D, generator=generator) / D**0.5 for _ in range(7)]
    runs = []
    for start in (BlockState.start, FlaState.start):
        state = start(embeddings, EPS)
        for sublayer in range(7):
            if sublayer % 3 == 0:
                state = state.close(EPS)
            h = depth_mix(state, queries[sublayer], key_norms[sublayer], EPS, "count")
            state = state.add(torch.tanh(h @ weights[sublayer]))
        final = depth_mix(state, queries[7], key_norms[7], EPS, "count")
        grads = torch.autograd.grad(final.square().mean(), [embeddings, *queries, *key_norms])
        runs.append((final.detach(), grads, state.current_stream().detach()))
    (want, want_grads, want_stream), (got, got_grads, got_stream) = runs
    assert isinstance(state, FlaState)
    # Float32 rounding differences (n * mean against stream + correction, fla's summation order) compound over seven
    # sublayers: 1e-4 of values of a few units.
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_stream, want_stream, atol=1e-4, rtol=1e-4)  # the outputs' sum, both ways
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-4 * max(w.abs().max().item(), 1e-2), rtol=1e-3)


def test_fla_fits_names_what_it_cannot_run():
    assert fla_mix_function() is not None
    cpu = torch.zeros(1, 2, D)
    assert "CUDA" in fla_fits(cpu, 0)
    assert "query_rank" in fla_fits(cpu, 4)
    assert "query_rank" in fla_fits(torch.zeros(1, 2, D, device="meta"), 2)
