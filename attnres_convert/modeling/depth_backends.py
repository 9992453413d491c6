"""Which backend runs the depth mix. ATTNRES_KERNEL=auto (default): the Triton kernels (depth_triton.py) for CUDA
tensors when triton is importable, the eager path otherwise; triton: the kernels or an error, never a silent
fallback (CPU tensors run under Triton's interpreter, TRITON_INTERPRET=1); cpu: the C++ kernels
(depth_kernels_cpu.py, compiled on first use) for float32 inference on CPU, or an error; eager: never. Neither
auto nor eager compiles anything.

This file ships next to converted weights: it imports torch and the standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from .depth_kernels_cpu import build

KERNEL_ENV = "ATTNRES_KERNEL"

# Process-wide on purpose: the outcome of importing triton (and compiling nothing) is the same for every model in
# the process, and a failed import is not retried at every forward.
_KERNELS: list = []  # the Kernels, or the ImportError of importing them


class Kernels(NamedTuple):
    """The Triton backend (depth_triton.py): its inference buffer and its launchers."""

    buffer: type
    mix: Callable
    close: Callable
    mix_backward: Callable


def _import_kernels():
    if not _KERNELS:
        try:
            from .depth_triton import TritonBuffer, close, mix, mix_backward
        except ImportError as error:  # triton not installed (or not importable here)
            _KERNELS.append(error)
        else:
            _KERNELS.append(Kernels(TritonBuffer, mix, close, mix_backward))
    return _KERNELS[0]


def kernel_mode() -> str:
    """ATTNRES_KERNEL: auto, triton, cpu or eager."""
    mode = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "triton", "cpu", "eager"):
        raise ValueError(
            f"{KERNEL_ENV}={mode!r} is not a kernel choice: use auto (the default), triton, cpu or eager"
        )
    return mode


def kernels_for(like: torch.Tensor, mode: str | None = None):
    """The Triton kernels (`Kernels`) if selected (by `mode`, ATTNRES_KERNEL by default) for tensors
    like `like`, else None (the eager path)."""
    mode = mode or kernel_mode()
    if mode in ("eager", "cpu"):
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


def cpu_kernels_for(like: torch.Tensor, mode: str | None = None, config=None):
    """The compiled C++ kernels where ATTNRES_KERNEL=cpu (or `mode`) selects them, for a forward without
    autograd of tensors like `like` (CPU, float32); None where it does not. Raises where it selects them and they
    cannot run: never a silent fallback. `config`: the model's, where its C++ source is looked for (see
    depth_kernels_cpu.source_text)."""
    if (mode or kernel_mode()) != "cpu":
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
    return build(config)
