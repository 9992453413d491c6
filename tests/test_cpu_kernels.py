"""The C++ depth-mix kernels for CPU (modeling/depth_kernels_cpu.py, ATTNRES_KERNEL=cpu): against the original
model bit for bit at zero queries, against the eager path and the plain reference with random queries, on both
of their paths (a few-token forward's token-major buffer, and a prefill's source-major buffer with its score
table), greedy decoding with the KV cache, Full AttnRes and a block size that does not divide the depth; the
shipped folder; and the selection's errors. The first test in a fresh machine compiles them (about 25 s)."""

from __future__ import annotations

import copy
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from attnres_convert import convert_model, save_converted
from attnres_convert.modeling import depth_attention, depth_kernels_cpu
from test_structure import _randomize_depth_params, _reference_llama
from tiny_models import tiny_model, token_ids

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler (c++ or g++) to build the CPU kernels with", allow_module_level=True)
if not torch.utils.cpp_extension.is_ninja_available():
    pytest.skip("no ninja on the PATH, which torch's C++ extension builds need", allow_module_level=True)
if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
    pytest.skip("no Python headers (Python.h, python3-dev) to build the CPU kernels against", allow_module_level=True)

LAYERS = 3  # six sublayers: S = 4 leaves a partial block, S = 1 is Full AttnRes
FEW, MANY = 5, 40  # x 2 sequences: 10 tokens take the step path, 80 the source-major one (> SMALL_STEP_TOKENS)


@pytest.fixture(autouse=True)
def cpu_kernels(monkeypatch):
    depth_kernels_cpu.build()  # compiled once (disk cache), before any test times or asserts
    monkeypatch.setenv("ATTNRES_KERNEL", "cpu")


def _model(block_size: int, random_queries: bool = True, scaling: str = "count"):
    model = convert_model(tiny_model("llama", num_hidden_layers=LAYERS), block_size=block_size, source_scaling=scaling)
    if random_queries:
        _randomize_depth_params(model, seed=block_size)
    return model.eval()


def _eager(monkeypatch, fn):
    monkeypatch.setenv("ATTNRES_KERNEL", "eager")
    try:
        return fn()
    finally:
        monkeypatch.setenv("ATTNRES_KERNEL", "cpu")


def _final_state(model, run):
    """The run's result and the state the final norm received (what the readers ran on)."""
    states = []
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: states.append(args[0]))
    try:
        return run(), states[0]
    finally:
        hook.remove()


@pytest.mark.parametrize("tokens", [FEW, MANY], ids=["step", "prefill"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_bit_for_bit_at_zero_queries_and_close_to_eager_and_reference(block_size, tokens, monkeypatch):
    ids = token_ids(2, tokens)
    original = tiny_model("llama", num_hidden_layers=LAYERS)
    zero = _model(block_size, random_queries=False)
    model = _model(block_size)
    with torch.no_grad():
        got, state = _final_state(zero, lambda: zero(ids).logits)
        assert state.native is not None  # the kernels ran, not the eager path
        assert (state.step is not None) == (tokens == FEW)  # the path the tokens parameter names
        assert torch.equal(got, original(ids).logits)  # exactness: the stream's own bits
        got = model(ids).logits
        eager = _eager(monkeypatch, lambda: model(ids).logits)
    assert not torch.equal(got, original(ids).logits)  # random queries: the mix really routed
    assert (got - eager).abs().max().item() <= 1e-4
    assert (got - _reference_llama(model, ids, block_size)).abs().max().item() <= 1e-4


def test_mean_scaling_matches_eager(monkeypatch):
    model = _model(2, scaling="mean")
    for tokens in (FEW, MANY):
        ids = token_ids(2, tokens)
        with torch.no_grad():
            got = model(ids).logits
            eager = _eager(monkeypatch, lambda: model(ids).logits)
        assert (got - eager).abs().max().item() <= 1e-4
        assert (got - _reference_llama(model, ids, 2, scaling="mean")).abs().max().item() <= 1e-4


def test_greedy_decoding_with_kv_cache(monkeypatch):
    """At zero queries: the original's tokens and every step's logits bit for bit. With random queries: the
    eager path's tokens, every step's logits within float rounding."""
    ids = token_ids(2, 6)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    original = tiny_model("llama", num_hidden_layers=LAYERS)
    got, want = _model(4, random_queries=False).generate(ids, **kwargs), original.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    model = _model(4)
    got = model.generate(ids, **kwargs)
    eager = _eager(monkeypatch, lambda: model.generate(ids, **kwargs))
    assert torch.equal(got.sequences, eager.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, eager.logits)) <= 1e-4


def test_recorded_weights_and_training_take_the_eager_path(monkeypatch):
    """A depth-weights recorder gets the weights (the kernels keep theirs to themselves), and a forward with
    autograd trains on the eager path: its gradients are the eager run's."""
    model = _model(4)
    ids = token_ids(2, MANY)
    with torch.no_grad(), depth_attention.record_depth_weights() as weights:
        model(ids)
    assert len(weights) == 2 * LAYERS + 1 and all(torch.isfinite(w).all() for w in weights)

    def gradients():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    assert all(torch.equal(a, b) for a, b in zip(gradients(), _eager(monkeypatch, gradients)))


def test_converted_folder_ships_the_cpu_kernels(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model(4)
    folder = save_converted(copy.deepcopy(model), tmp_path / "converted")
    shipped = (folder / "depth_kernels_cpu.py").read_text()
    assert shipped == Path(depth_kernels_cpu.__file__).read_text()
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    ids = token_ids(2, MANY)
    with torch.no_grad():
        got, state = _final_state(loaded, lambda: loaded(ids).logits)
        assert state.native is not None
        assert (got - model(ids).logits).abs().max().item() <= 1e-5


def test_selection_errors(monkeypatch):
    """cpu never falls back silently: a model it cannot run, or a build that fails, raises what to do."""
    ids = token_ids(1, 4)
    bf16 = _model(4).to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"ATTNRES_KERNEL=cpu runs float32 models .*torch.bfloat16"):
        bf16(ids)
    rank = _eager(monkeypatch, lambda: convert_model(tiny_model("llama", num_hidden_layers=LAYERS), block_size=4, query_rank=2))
    with torch.no_grad(), pytest.raises(RuntimeError, match="ATTNRES_KERNEL=cpu: .*depend on each token"):
        rank(ids)
    monkeypatch.setenv("ATTNRES_KERNEL", "auto")
    assert depth_attention.cpu_kernels_for(torch.zeros(1, 1, 8)) is None  # auto never compiles anything

    def broken(*args, **kwargs):
        raise OSError("c++: command not found")

    monkeypatch.setenv("ATTNRES_KERNEL", "cpu")
    monkeypatch.setattr(depth_kernels_cpu, "_BUILT", [])
    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", broken)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"building the C\+\+ .*command not found.*unset ATTNRES_KERNEL"):
        _model(4)(ids)


def test_decoding_under_cpu_autocast_is_the_original_at_zero_queries():
    """Under bfloat16 autocast a float32 model's sublayers return bfloat16 outputs; the kernels' residual adds
    take them as the original's own adds do: at zero queries, its tokens and logits bit for bit."""
    ids = token_ids(2, 6)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    original, zero = tiny_model("llama", num_hidden_layers=LAYERS), _model(4, random_queries=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = zero.generate(ids, **kwargs), original.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


@pytest.mark.parametrize("tokens", [FEW, MANY], ids=["step", "prefill"])
def test_hidden_states_and_depth_gate_see_every_residual_add(tokens, monkeypatch):
    """The kernels make an output's residual adds inside the next reader's call (a layer's last one in the next
    layer's). Whatever reads the stream in between gets them made first: `output_hidden_states` (the original's
    hidden states bit for bit at zero queries, eager's with random queries) and a depth gate below 1."""
    from attnres_convert.modeling.modeling_attnres import set_depth_gate

    ids = token_ids(2, tokens)
    original, zero, model = tiny_model("llama", num_hidden_layers=LAYERS), _model(3, random_queries=False), _model(3)
    with torch.no_grad():
        got, want = zero(ids, output_hidden_states=True), original(ids, output_hidden_states=True)
        assert len(got.hidden_states) == len(want.hidden_states) == LAYERS + 1
        assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
        got = model(ids, output_hidden_states=True).hidden_states
        eager = _eager(monkeypatch, lambda: model(ids, output_hidden_states=True).hidden_states)
        assert max((a - b).abs().max().item() for a, b in zip(got, eager)) <= 1e-4
        set_depth_gate(model, 0.5)
        got, state = _final_state(model, lambda: model(ids).logits)
        assert state.native is not None
        eager = _eager(monkeypatch, lambda: model(ids).logits)
        assert (got - eager).abs().max().item() <= 1e-4
