"""The attnres package's depth-mix kernels, which a converted model's code uses where attnres is installed
(modeling_attnres.start_state asks `inference_state` and `training_state`; a model whose code follows another
KERNEL_API does not ask).

ATTNRES_KERNEL picks the backend. auto (the default): the Triton kernels (triton.py) for CUDA tensors where triton
is importable; on CPU for float32 inference the C++ kernels (cpu.py) where this machine has built them (`attnres
kernels build`, which `make install` runs), else the token-major step buffer (step.py) for decoding steps and the
eager source buffer for many tokens; for training, fla-core's fused depth mix (fla.py) on CUDA where fla-core is
installed, else the hand-written backward (training.py). triton: the Triton kernels or an error, never a silent
fallback (CPU tensors run under Triton's interpreter, TRITON_INTERPRET=1). cpu: the C++ kernels (cpu.py, compiled
on first use) for float32 inference on CPU, or an error. fla: fla-core's kernels for training, or an error. eager:
none of these (modeling_attnres's own paths). Neither auto nor eager compiles anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from ..modeling.modeling_attnres import KERNEL_ENV, ModelRuntime, kernel_mode
from .controls import controlled_state  # noqa: F401 - called by modeling_attnres.start_state
from .cpu import build, prebuilt
from .cpu_buffers import CpuBuffer, CpuStepBuffer
from .fla import FlaState, fla_fits
from .step import StepBuffer, few_tokens
from .training import TrainState

# The contract with modeling_attnres (its KERNEL_API): the calls below and the states they return.
KERNEL_API = 1

# Process-wide on purpose: the outcome of importing triton (and compiling nothing) is the same for every model in
# the process, and a failed import is not retried at every forward.
_KERNELS: list = []  # the Kernels, or the ImportError of importing them


def inference_state(
    embeddings: torch.Tensor, eps: float, capacity: int, queries, runtime: ModelRuntime | None, mode: str
):
    """The state of a forward without autograd on these kernels, or None where modeling_attnres's own
    SourceBuffer serves it (many tokens on CPU without the C++ kernels)."""
    if mode == "fla":
        return None
    triton = triton_kernels_for(embeddings, mode)
    if triton is not None:
        return triton.buffer.start(embeddings, eps, capacity, queries, triton)
    native = cpu_kernels_for(embeddings, mode)
    if few_tokens(embeddings):
        if native is not None:
            return CpuStepBuffer.start(embeddings, eps, capacity, queries, native, runtime)
        return StepBuffer.start(embeddings, eps, capacity, queries, runtime)
    if native is not None:
        return CpuBuffer.start(embeddings, eps, capacity, queries, native)
    return None


def training_state(embeddings: torch.Tensor, eps: float, capacity: int, queries, mode: str):
    """The state of an eager forward with autograd: fla-core's kernels on CUDA where it is installed (auto, fla),
    else the hand-written backward (training.py), on the Triton kernels where they are selected."""
    if mode == "cpu":
        return None  # the C++ kernels have no backward: autograd's path (BlockState)
    if mode in ("auto", "fla"):
        refusal = fla_fits(embeddings)
        if refusal is None:
            return FlaState.start(embeddings, eps)
        if mode == "fla":
            raise RuntimeError(f"{KERNEL_ENV}=fla: {refusal}; unset {KERNEL_ENV} for the default path")
    return TrainState.start(embeddings, eps, capacity, queries, triton_kernels_for(embeddings, mode))


class Kernels(NamedTuple):
    """The Triton backend (triton.py): its inference buffer and its launchers."""

    buffer: type
    mix: Callable
    close: Callable
    mix_backward: Callable


def _import_kernels():
    if not _KERNELS:
        try:
            from .triton import TritonBuffer, close, mix, mix_backward
        except ImportError as error:  # triton not installed (or not importable here)
            _KERNELS.append(error)
        else:
            _KERNELS.append(Kernels(TritonBuffer, mix, close, mix_backward))
    return _KERNELS[0]


def triton_kernels_for(like: torch.Tensor, mode: str | None = None):
    """The Triton kernels (`Kernels`) if selected (by `mode`, ATTNRES_KERNEL by default) for tensors
    like `like`, else None (the eager path)."""
    mode = mode or kernel_mode()
    if mode in ("eager", "cpu", "fla"):
        return None
    forced = mode == "triton"
    if torch.compiler.is_compiling():
        if forced:
            raise RuntimeError(
                f"{KERNEL_ENV}=triton: the Triton depth-mix kernels do not run under torch.compile, which "
                f"fuses the eager depth mix itself; unset {KERNEL_ENV} (auto) or set it to eager."
            )
        return None
    on_gpu = like.device.type == "cuda"
    if not forced and not on_gpu:
        return None
    kernels = _import_kernels()
    if isinstance(kernels, ImportError):
        if forced:
            raise RuntimeError(
                f"{KERNEL_ENV}=triton but Triton cannot be imported ({kernels}). Install it (pip install triton) "
                f"or set {KERNEL_ENV}=auto to use the eager path where Triton is missing."
            ) from kernels
        return None
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{KERNEL_ENV}=triton needs CUDA tensors (these are on {like.device.type}); to run the kernels on "
            f"CPU in Triton's interpreter (slow, for tests) set TRITON_INTERPRET=1 before Python starts."
        )
    return kernels


# Set by `code_paths_only`: auto as it runs where no C++ kernels are built (a context variable: per thread and task).
_CODE_PATHS_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("attnres_code_paths_only", default=False)


@contextlib.contextmanager
def code_paths_only() -> Iterator[None]:
    """auto without the C++ kernels a machine has built, for comparing one model code with another bit for bit
    (`attnres upgrade`: a folder's earlier code against this release's, which the kernels' float32 sums in another
    order would differ from by rounding)."""
    token = _CODE_PATHS_ONLY.set(True)
    try:
        yield
    finally:
        _CODE_PATHS_ONLY.reset(token)


def cpu_kernels_for(like: torch.Tensor, mode: str | None = None):
    """The compiled C++ kernels for a forward without autograd of tensors like `like` (CPU, float32): where
    ATTNRES_KERNEL=cpu (or `mode`) selects them, built on first use, and under auto where this machine has built them
    already (`prebuilt`: auto compiles nothing); else None. Raises where cpu selects them and they cannot run: never
    a silent fallback (their speed against the eager paths: docs/performance.md)."""
    mode = mode or kernel_mode()
    if mode == "auto":
        fits = like.device.type == "cpu" and like.dtype == torch.float32 and not torch.compiler.is_compiling()
        fits = fits and not _CODE_PATHS_ONLY.get()
        return prebuilt() if fits else None
    if mode != "cpu":
        return None
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{KERNEL_ENV}=cpu: the C++ depth-mix kernels do not run under torch.compile, which fuses the eager "
            f"depth mix itself; unset {KERNEL_ENV} (auto) or set it to eager."
        )
    if like.device.type != "cpu" or like.dtype != torch.float32:
        raise RuntimeError(
            f"{KERNEL_ENV}=cpu runs float32 models on CPU; this forward is {like.dtype} on {like.device.type}. "
            f"Load the model with dtype=torch.float32 on CPU, or unset {KERNEL_ENV} (auto: Triton on CUDA)."
        )
    return build()
