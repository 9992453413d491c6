import os
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# The Triton depth-mix kernels run on CPU in Triton's interpreter (tests/test_kernels.py). Triton reads this
# when a kernel is defined, and may have read it before a test module could set it: set before any import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

_plain_warn = warnings.warn
_MODULE_CALL_FILE = torch.nn.modules.module.__file__


def warn_as_the_module_caller(message, category=None, stacklevel=1, *args, **kwargs):
    """`warnings.warn` for the suite, attributing a deprecation or future warning that would land on torch's
    module-call machinery to the code that called the module. transformers' deprecate_kwarg warns with
    stacklevel=2, meaning "the caller"; on a decorated `nn.Module.forward` the frame two up is
    `Module._call_impl` in torch/nn/modules/module.py, so pyproject's filters on our modules would never see a
    deprecated keyword that our code passes to a transformers model. Every other warning is left as it is."""
    kind = category if category is not None else type(message) if isinstance(message, Warning) else UserWarning
    if not issubclass(kind, (DeprecationWarning, FutureWarning)):
        return _plain_warn(message, category, stacklevel + 1, *args, **kwargs)
    level = max(stacklevel, 1)
    try:
        frame = sys._getframe(level)  # the frame `stacklevel` names, counted from warn's caller as 1
        while frame.f_code.co_filename == _MODULE_CALL_FILE and frame.f_back is not None:
            frame, level = frame.f_back, level + 1
    except ValueError:  # a stacklevel past the outermost frame: warnings attributes it to sys itself
        pass
    return _plain_warn(message, category, level + 1, *args, **kwargs)


warnings.warn = warn_as_the_module_caller
# TorchScript compiles a `warnings.warn` call as its builtin op, found by the function's identity: a module that
# scripts a function at import (transformers 5.16.1's GPT-BigCode, through F.softmax) would otherwise try to
# compile this wrapper and fail on its *args.
torch.jit._builtins._register_builtin(warn_as_the_module_caller, "aten::warn")

# fla-core is installed for tests/test_fla.py (its depth-mix kernels, in Triton's interpreter). transformers binds a
# hybrid family's linear-attention functions (Qwen3-Next's gated delta rule, ...) to fla's whenever fla imports,
# and fla's Triton kernels need a GPU: on CPU the suite's base models keep transformers' own PyTorch functions.
# Set before any modeling module is imported (the decorator resolves the package at class definition).
if not torch.cuda.is_available():
    import transformers.integrations
    from transformers.integrations import hub_kernels

    _with_fallback = hub_kernels.use_kernel_func_from_hub_with_fallback

    def _without_fla(func_name, package, internal_path=None):
        return _with_fallback(func_name, "fla_not_on_cpu" if package == "fla" else package, internal_path)

    hub_kernels.use_kernel_func_from_hub_with_fallback = _without_fla
    transformers.integrations.use_kernel_func_from_hub_with_fallback = _without_fla

# Tiny models are dominated by per-operation overhead, where a second thread only adds contention;
# tests on the real model ask for two threads themselves (see `two_threads`).
torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """A test that needs the real SmolLM2 as a folder is slow wherever it stands: the first one dequantises
    the embedded GGUF (about 17 s on two cores), and `make test-fast` should never pay for it."""
    for item in items:
        if "smollm2_folder" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Every module starts with one thread, whatever a module before it left (restored afterwards): tiny
    matrices gain nothing from a second thread but synchronisation, and on a shared machine lose much more."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def two_threads():
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory) -> Path:
    """A tiny Llama (3 layers: 6 sublayers) saved by save_pretrained, once per test module. Tests read it;
    one that changes a model folder copies it first."""
    from reliability_helpers import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")


@pytest.fixture(scope="session")
def smollm2_path():
    from attnres_convert.errors import SourceError
    from attnres_convert.io.samples import default_model_path

    try:
        return default_model_path()
    except SourceError as error:
        pytest.skip(f"real-model test needs the embedded model: {error}")


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_path, tmp_path_factory):
    """The embedded SmolLM2 dequantised once per test session and saved as a plain HF folder
    (safetensors + tokenizer): later loads take a second instead of dequantising the GGUF again."""
    from attnres_convert.io.sources import load_model, load_tokenizer, resolve_source

    folder = tmp_path_factory.mktemp("smollm2-hf")
    source = resolve_source(str(smollm2_path))  # dequantised on load: plain float32 weights
    load_model(source).save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    return folder
