"""The C++ depth-mix kernels for CPU (kernels/cpu.py, ATTNRES_KERNEL=cpu): against the original
model bit for bit at zero queries, against the eager path and the plain reference with random queries, on both
of their paths (a few-token forward's token-major buffer, and a prefill's source-major buffer with its score
table), greedy decoding with the KV cache, Full AttnRes and a block size that does not divide the depth; the
sublayers' norms they fuse (the module's bits, or not fused); every tiny family; a converted folder (which ships
no kernels: it runs the installed package's, and refuses ATTNRES_KERNEL=cpu without it); and the selection's errors. The first test in a fresh machine compiles them (about 25 s)."""

from __future__ import annotations

import copy
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension
from design_reference import reference_llama
from tiny_models import CONFIGS, randomize_queries, tiny_model, token_ids

from attnres_convert import convert_model, save_converted
from attnres_convert import kernels as depth_backends
from attnres_convert.depth_controls import record_depth_weights
from attnres_convert.kernels import cpu as depth_kernels_cpu
from attnres_convert.kernels.step import StepBuffer

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler (c++ or g++) to build the CPU kernels with", allow_module_level=True)
if not torch.utils.cpp_extension.is_ninja_available():
    pytest.skip("no ninja on the PATH, which torch's C++ extension builds need", allow_module_level=True)
if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
    pytest.skip("no Python headers (Python.h, python3-dev) to build the CPU kernels against", allow_module_level=True)

LAYERS = 3  # six sublayers: S = 4 leaves a partial block, S = 1 is Full AttnRes
FEW, MANY = 5, 40  # x 2 sequences: 10 tokens take the step path, 80 the source-major one (> SMALL_STEP_TOKENS)
# Against the eager path and the reference with random queries: float32 sums in another order, through three
# layers of sharp depth softmaxes, differ by a few 1e-5 of the logits' scale (about 4.5 here).
TOLERANCE = 2e-4


@pytest.fixture(autouse=True)
def cpu_kernels(monkeypatch):
    depth_kernels_cpu.build()  # compiled once (disk cache), before any test times or asserts
    monkeypatch.setenv("ATTNRES_KERNEL", "cpu")


def _model(block_size: int, random_queries: bool = True, scaling: str = "count"):
    model = convert_model(tiny_model("llama", num_hidden_layers=LAYERS), block_size=block_size, source_scaling=scaling)
    if random_queries:
        randomize_queries(model, 0.5, seed=block_size, key_norms=0.3)
    return model.eval()


def _with_mode(monkeypatch, mode: str, fn, then: str = "cpu"):
    """FN's result under ATTNRES_KERNEL=MODE, then back to THEN (the module's tests run under cpu)."""
    monkeypatch.setenv("ATTNRES_KERNEL", mode)
    try:
        return fn()
    finally:
        monkeypatch.setenv("ATTNRES_KERNEL", then)


def _eager(monkeypatch, fn):
    return _with_mode(monkeypatch, "eager", fn)


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
        assert isinstance(state, StepBuffer) == (tokens == FEW)  # the path the tokens parameter names
        assert torch.equal(got, original(ids).logits)  # exactness: the stream's own bits
        got = model(ids).logits
        eager = _eager(monkeypatch, lambda: model(ids).logits)
    assert not torch.equal(got, original(ids).logits)  # random queries: the mix really routed
    assert (got - eager).abs().max().item() <= TOLERANCE
    assert (got - reference_llama(model, ids, block_size)).abs().max().item() <= TOLERANCE


def test_mean_scaling_matches_eager(monkeypatch):
    model = _model(2, scaling="mean")
    for tokens in (FEW, MANY):
        ids = token_ids(2, tokens)
        with torch.no_grad():
            got = model(ids).logits
            eager = _eager(monkeypatch, lambda: model(ids).logits)
        assert (got - eager).abs().max().item() <= TOLERANCE
        assert (got - reference_llama(model, ids, 2, scaling="mean")).abs().max().item() <= TOLERANCE


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
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, eager.logits)) <= TOLERANCE


def test_recorded_weights_and_training_take_the_eager_path(monkeypatch):
    """A depth-weights recorder gets the weights (the kernels keep theirs to themselves), and a forward with
    autograd trains on the eager path: its gradients are the eager run's."""
    model = _model(4)
    ids = token_ids(2, MANY)
    with torch.no_grad(), record_depth_weights(model) as weights:
        model(ids)
    assert len(weights) == 2 * LAYERS + 1 and all(torch.isfinite(w).all() for w in weights)

    def gradients():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    assert all(torch.equal(a, b) for a, b in zip(gradients(), _eager(monkeypatch, gradients)))


def test_a_converted_folder_runs_the_installed_cpu_kernels(tmp_path):
    """A folder ships its two code files and no kernels (no C++ source, no kernel module): loaded with
    trust_remote_code where attnres is installed, it runs the package's C++ kernels."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    model = _model(4)
    folder = save_converted(copy.deepcopy(model), tmp_path / "converted")
    assert not list(folder.glob("*.cpp"))
    assert sorted(path.name for path in folder.glob("*.py")) == ["configuration_attnres.py", "modeling_attnres.py"]
    # The folder's own classes (AutoModelForCausalLM would pick the package's, registered in this process).
    loaded = (
        get_class_from_dynamic_module("modeling_attnres.AttnResForCausalLM", str(folder))
        .from_pretrained(folder, dtype=torch.float32)
        .eval()
    )
    assert "transformers_modules" in type(loaded).__module__, type(loaded).__module__
    ids = token_ids(2, MANY)
    with torch.no_grad():
        got, state = _final_state(loaded, lambda: loaded(ids).logits)
        assert type(state).__name__ == "CpuBuffer" and state.native is not None
        assert (got - model(ids).logits).abs().max().item() <= 1e-5


def test_a_folder_loaded_without_this_package_refuses_the_cpu_kernels_naming_the_package(tmp_path, monkeypatch):
    """Without attnres installed, ATTNRES_KERNEL=cpu fails with a message that names the package (never a silent
    fallback); unset, the folder runs its built-in buffer, whose logits are the package's eager path's."""
    from isolated import run_isolated

    model = _model(4)
    folder = save_converted(copy.deepcopy(model), tmp_path / "converted")
    ids = token_ids(2, MANY)
    with torch.no_grad():
        eager = _eager(monkeypatch, lambda: model(ids).logits)
    torch.save({"ids": ids, "logits": eager}, tmp_path / "expected.pt")
    result = run_isolated(f"""
        import os
        os.environ["ATTNRES_KERNEL"] = "cpu"
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float32).eval()
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        try:
            with torch.no_grad():
                model(expected["ids"])
        except RuntimeError as error:
            message = str(error)
        else:
            raise AssertionError("ATTNRES_KERNEL=cpu ran without the attnres package")
        assert "ATTNRES_KERNEL=cpu" in message and "pip install attnres" in message, message
        del os.environ["ATTNRES_KERNEL"]
        states = []
        model.model.norm.register_forward_pre_hook(lambda module, args: states.append(type(args[0]).__name__))
        with torch.no_grad():
            got = model(expected["ids"]).logits
        assert states == ["SourceBuffer"], states
        assert torch.equal(got, expected["logits"]), (got - expected["logits"]).abs().max().item()
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_the_source_ships_in_the_package():
    """The C++ source is the package's own file beside kernels/cpu.py (nothing is downloaded), and the build
    compiles exactly it."""
    source = Path(depth_kernels_cpu.__file__).with_name(depth_kernels_cpu.SOURCE_NAME)
    assert source.is_file() and depth_kernels_cpu.source_text() == source.read_text()
    kernels = depth_kernels_cpu.build()
    for name in ("step_mix", "buffer_mix", "rms_norm", "close_source"):
        assert f'module.def("{name}"' in source.read_text() and callable(getattr(kernels, name)), name


def test_selection_errors(monkeypatch):
    """cpu never falls back silently: a model it cannot run, or a build that fails, raises what to do."""
    ids = token_ids(1, 4)
    bf16 = _model(4).to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"ATTNRES_KERNEL=cpu runs float32 models .*torch.bfloat16"):
        bf16(ids)
    rank = _eager(
        monkeypatch, lambda: convert_model(tiny_model("llama", num_hidden_layers=LAYERS), block_size=4, query_rank=2)
    )
    with torch.no_grad(), pytest.raises(RuntimeError, match="ATTNRES_KERNEL=cpu: .*input-dependent queries"):
        rank(ids)

    def broken(*args, **kwargs):
        raise OSError("c++: command not found")

    monkeypatch.setenv("ATTNRES_KERNEL", "cpu")
    monkeypatch.setattr(depth_kernels_cpu, "_BUILT", [])
    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", broken)
    with (
        torch.no_grad(),
        pytest.raises(RuntimeError, match=r"building the C\+\+ .*command not found.*unset ATTNRES_KERNEL"),
    ):
        _model(4)(ids)


def test_auto_runs_the_kernels_where_this_machine_built_them_and_compiles_nothing(tmp_path, monkeypatch):
    """The default path: the C++ kernels for float32 inference on CPU once they are built (`attnres kernels build`),
    the eager path where they are not, which auto never builds (nor creates a folder for)."""
    built = depth_kernels_cpu.build()
    monkeypatch.setenv("ATTNRES_KERNEL", "auto")
    monkeypatch.setattr(depth_kernels_cpu, "_PREBUILT", [])
    monkeypatch.setattr(depth_kernels_cpu, "_BUILT", [])
    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", lambda *a, **k: pytest.fail("auto compiled"))
    loaded = depth_backends.cpu_kernels_for(torch.zeros(1, 1, 8))  # the build's library itself, no ninja
    assert loaded is not None and Path(loaded.__file__) == Path(built.__file__)
    assert depth_backends.cpu_kernels_for(torch.zeros(1, 1, 8, dtype=torch.bfloat16)) is None
    ids = token_ids(2, MANY)
    model = _model(4)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, _with_mode(monkeypatch, "cpu", lambda: model(ids).logits, then="auto"))
    empty = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(empty))
    monkeypatch.setattr(depth_kernels_cpu, "_PREBUILT", [])
    monkeypatch.setattr(depth_kernels_cpu, "_BUILT", [])
    assert depth_backends.cpu_kernels_for(torch.zeros(1, 1, 8)) is None
    assert not empty.exists()
    with torch.no_grad():
        eager = _with_mode(monkeypatch, "eager", lambda: model(ids).logits, then="auto")
        assert torch.equal(model(ids).logits, eager)


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
    from attnres_convert.depth_controls import set_depth_gate

    ids = token_ids(2, tokens)
    original, zero, model = tiny_model("llama", num_hidden_layers=LAYERS), _model(3, random_queries=False), _model(3)
    with torch.no_grad():
        got, want = zero(ids, output_hidden_states=True), original(ids, output_hidden_states=True)
        assert len(got.hidden_states) == len(want.hidden_states) == LAYERS + 1
        assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
        got = model(ids, output_hidden_states=True).hidden_states
        eager = _eager(monkeypatch, lambda: model(ids, output_hidden_states=True).hidden_states)
        assert max((a - b).abs().max().item() for a, b in zip(got, eager)) <= TOLERANCE
        set_depth_gate(model, 0.5)
        got, state = _final_state(model, lambda: model(ids).logits)
        assert type(state).__name__ == "ControlledState" and state.gate == 0.5  # the gate wraps the kernels' state
        assert state.inner.native is not None
        eager = _eager(monkeypatch, lambda: model(ids).logits)
        assert (got - eager).abs().max().item() <= TOLERANCE


def _norm_verdicts(model) -> dict:
    """What `fused_norm` decided per norm module class: (eps, lanes) where fused, None where called (the verdict
    it keeps on each module it checked)."""
    verdicts = (module.__dict__.get(depth_kernels_cpu._VERDICT) for module in model.modules())
    return {entry[0][0].__name__: entry[1] for entry in verdicts if entry is not None}


@pytest.mark.parametrize("tokens", [FEW, MANY], ids=["step", "prefill"])
def test_fused_norms_give_the_modules_bits(tokens, monkeypatch):
    """Where a sublayer's norm (and the final norm) is an RMSNorm the kernels reproduce, they return it with the
    mix. It gives the module's bits: at zero queries the original's logits exactly; with random queries the same
    logits, bit for bit, as when every norm module is called (a global forward hook turns the fusion off, since
    hooks must see their calls). Greedy decoding with the KV cache is the original's, token for token."""
    ids = token_ids(2, tokens)
    original, zero, model = tiny_model("llama", num_hidden_layers=LAYERS), _model(4, random_queries=False), _model(4)
    with torch.no_grad():
        assert torch.equal(zero(ids).logits, original(ids).logits)
        verdicts = _norm_verdicts(zero)
        assert set(verdicts) == {"LlamaRMSNorm", "AttnResLlamaRMSNorm"} and None not in verdicts.values()
        fused = model(ids).logits
        calls = []
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, output: calls.append(module) if "RMSNorm" in type(module).__name__ else None
        )
        try:
            called = model(ids).logits
        finally:
            hook.remove()
    assert len(calls) == 2 * LAYERS + 1  # every norm module ran: the hooked forward took the unfused path
    assert not torch.equal(fused, original(ids).logits)
    assert torch.equal(fused, called)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(zero.generate(ids, **kwargs), original.generate(ids, **kwargs))


def _changed_norms(model, what: str) -> None:
    """Every sublayer norm and the final norm changed after the model's forwards: new weights written through
    `.data` (which bumps no version of the parameter), or a new eps."""
    norms = [m for m in model.modules() if "RMSNorm" in type(m).__name__]
    generator = torch.Generator().manual_seed(11)
    for norm in norms:
        if what == "weight":
            norm.weight.data.copy_(torch.randn(norm.weight.shape, generator=generator))
        else:
            norm.variance_epsilon = 0.5  # large enough to change every row's scale


@pytest.mark.parametrize("tokens", [FEW, MANY], ids=["step", "prefill"])
@pytest.mark.parametrize("what", ["weight", "eps"])
def test_a_norm_changed_after_its_fusion_gives_a_fresh_models_bits(what, tokens):
    """The fused-norm verdict made by earlier forwards is never stale: after a norm's weight or eps changes, the
    kernels' logits and greedy tokens are those of a fresh model with the same weights and eps, bit for bit."""
    ids, kwargs = token_ids(2, tokens), dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    model = _model(4)
    with torch.no_grad():
        before = model(ids).logits
        model.generate(ids, **kwargs)
        assert None not in _norm_verdicts(model).values()  # fused before the change
        _changed_norms(model, what)
        after, tokens_after = model(ids).logits, model.generate(ids, **kwargs)
        fresh = _model(4)
        fresh.load_state_dict(model.state_dict())
        if what == "eps":  # not in the state dict
            _changed_norms(fresh, what)
        assert not torch.equal(after, before)
        assert torch.equal(after, fresh(ids).logits)
        assert torch.equal(tokens_after, fresh.generate(ids, **kwargs))


def test_a_hooked_norm_is_called():
    """A forward hook on one norm module sees that norm's call (its module runs), and the result is unchanged."""
    ids = token_ids(2, MANY)
    model = _model(4)
    norm = model.model.layers[1].post_attention_layernorm
    seen = []
    with torch.no_grad():
        want = model(ids).logits
        hook = norm.register_forward_hook(lambda module, args, output: seen.append(output.shape))
        try:
            got = model(ids).logits
        finally:
            hook.remove()
    assert seen == [torch.Size([2, MANY, 64])]
    assert torch.equal(got, want)


@pytest.mark.parametrize("d", [64, 576, 4096])
def test_rms_norm_replays_torchs_reduction(d):
    """The kernels' RMSNorm sums the squares in torch's own order: LlamaRMSNorm's bits on one row, a few rows
    and rows a threaded reduction spreads, at hidden sizes that take the cascade's different levels. Norms it
    does not reproduce (a LayerNorm, Gemma's 1 + weight) are not fused."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kernels = depth_kernels_cpu.build()
    norm = LlamaRMSNorm(d, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    eps, lanes = depth_kernels_cpu._verified(kernels, norm)
    assert eps == 1e-6
    generator = torch.Generator().manual_seed(d)
    for rows in (1, 3, 200):
        x = torch.randn(rows, d, generator=generator) * 40
        with torch.no_grad():
            assert torch.equal(kernels.rms_norm(x, norm.weight, eps, lanes), norm(x))
    gemma, layer_norm = GemmaRMSNorm(d), torch.nn.LayerNorm(d)
    torch.nn.init.normal_(gemma.weight, 0.0, 0.3)
    assert depth_kernels_cpu.fused_norm(kernels, gemma) == ()
    assert depth_kernels_cpu.fused_norm(kernels, layer_norm) == ()


def test_a_layer_norm_family_at_zero_queries():
    """GPT-2's LayerNorms are not fused: they are called, and the converted model is the original bit for bit."""
    ids = token_ids(2, MANY)
    original = tiny_model("gpt2")
    zero = convert_model(tiny_model("gpt2"), block_size=2).eval()
    with torch.no_grad():
        assert torch.equal(zero(ids).logits, original(ids).logits)
    verdicts = _norm_verdicts(zero)  # made by the kernels' path only
    assert set(verdicts) == {"LayerNorm", "AttnResLayerNorm"} and set(verdicts.values()) == {None}


# Norms the C++ readers fuse: the Llama-style RMSNorms. Not fused: Gemma's (1 + weight) and the LayerNorms.
FUSED_NORMS = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "granite",
    "glm4",
    "gemma4_text",
    "gemma4_moe",
    "deepseek_v3",
    "mamba",
    "jamba",
    "falcon_h1",
    "xlstm",
}
# transformers' RWKV decodes a batch of several sequences wrongly itself (tests/test_hybrids.py): one sequence.
ONE_SEQUENCE = {"rwkv"}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_tiny_family_matches_the_eager_path_bit_for_bit_at_zero_queries(family, monkeypatch):
    """Each family of tiny_models.py, converted, on the C++ path at zero queries: a prefill's logits and a greedy
    decoding with the KV cache give the eager path's bits (which are the original's, or within 1e-6 where the base
    forward orders its residual adds differently, as Cohere's does); its norms are fused exactly where they are
    Llama-style RMSNorms."""
    ids = token_ids(1, 2 * MANY) if family in ONE_SEQUENCE else token_ids(2, MANY)  # as many tokens either way
    zero = convert_model(tiny_model(family)).eval()
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        got, steps = zero(ids).logits, zero.generate(ids[:, :FEW], **kwargs)
        want, eager_steps = _eager(monkeypatch, lambda: (zero(ids).logits, zero.generate(ids[:, :FEW], **kwargs)))
    assert torch.equal(got, want)
    assert torch.equal(steps.sequences, eager_steps.sequences)
    assert all(torch.equal(a, b) for a, b in zip(steps.logits, eager_steps.logits))
    verdicts = _norm_verdicts(zero)
    assert verdicts and all((verdict is not None) == (family in FUSED_NORMS) for verdict in verdicts.values()), verdicts
