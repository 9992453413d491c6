"""Block Attention Residuals behind one contract: the state a decoder layer threads through its sublayers.

    state = start_state(embeddings, eps, capacity, queries, ...)  # the embedding is the first source
    state = state.close(eps, first)                               # at a block boundary
    h = depth_mix(state, query, key_norm_weight, eps, scaling)    # a sublayer's (or the final norm's) input
    state = state.add(sublayer(h))                                # the output joins the partial sum and stream
    state.current_stream()                                        # the base model's residual stream

Every state answers `DepthState`'s calls. Which one a forward gets depends on what it pays for:

    autograd (training), torch.compile, input-dependent queries   BlockState
    no autograd (inference, generation)                           SourceBuffer

Where the attnres package is installed, its kernels take the forwards they are faster for (`installed_kernels`):
a token-major buffer for decoding steps, C++ kernels on CPU (ATTNRES_KERNEL=cpu), Triton kernels and fla-core's
on CUDA, and a training state with a hand-written backward.
ATTNRES_KERNEL picks a backend explicitly: auto (the default), eager, cpu, triton or fla; an explicit choice that
cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from .depth_buffers import SourceBuffer
from .depth_math import BlockState

KERNEL_ENV = "ATTNRES_KERNEL"
KERNEL_CHOICES = ("auto", "eager", "cpu", "triton", "fla")
KERNEL_API = 1  # the contract with the attnres package's kernels: a package with another is not used


class DepthState(Protocol):
    """What a decoder layer and the final norm call on the state they receive (see the table above)."""

    queries: torch.Tensor | None  # every reader's folded query [R, D] where the state keeps them, else None

    def close(self, eps: float, first: int = 0) -> DepthState: ...  # the partial sum becomes a completed source
    def query(self, reader: int) -> torch.Tensor: ...  # reader `reader`'s row of `queries`
    def fold(self, query: torch.Tensor, key_norm_weight: torch.Tensor | None): ...  # w and g as `mix` takes them
    def mix(self, q, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()) -> torch.Tensor: ...
    def add(self, output: torch.Tensor) -> DepthState: ...  # the output joins the partial sum and the stream
    def current_stream(self) -> torch.Tensor: ...  # the base model's residual stream


def is_state(value) -> bool:
    """Whether a decoder layer received a depth-attention state (any backend's) rather than the embeddings."""
    return not isinstance(value, torch.Tensor) and hasattr(value, "current_stream")


def kernel_mode() -> str:
    mode = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if mode not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={mode!r} is not a kernel choice: use one of {', '.join(KERNEL_CHOICES)}")
    return mode


# Process-wide on purpose: the package is importable or not for every model; a failed import is not retried.
_INSTALLED: list = []


def installed_kernels():
    """The attnres package's kernels, where it is installed and follows KERNEL_API; else None."""
    if not _INSTALLED:
        try:
            from attnres_convert import kernels
        except ImportError:
            kernels = None
        _INSTALLED.append(kernels if getattr(kernels, "KERNEL_API", None) == KERNEL_API else None)
    return _INSTALLED[0]


def wants_queries() -> bool:  # whether start_state would use all readers' folded queries (the caller gathers them)
    return not (torch.is_grad_enabled() and torch.compiler.is_compiling())


def start_state(embeddings, eps: float, capacity=None, queries=None, plain=False, runtime=None) -> DepthState:
    """A forward's state, the embedding its first source; `capacity`: the most sources of a reader; `queries`: every
    reader's folded query [R, D] (the score table); `plain`: input-dependent queries or additive (BlockState only)."""
    mode = kernel_mode()  # read once: a decoding step pays for every lookup
    state = _state_for(embeddings, eps, capacity, queries, plain, runtime, mode)
    if runtime is not None and (runtime.recorders or runtime.gate != 1.0):  # set by attnres's training or inspection
        state = installed_kernels().controlled_state(state, embeddings, eps, runtime)
    return state


def _state_for(embeddings, eps: float, capacity, queries, plain: bool, runtime, mode: str) -> DepthState:
    kernels = installed_kernels() if mode != "eager" else None
    if mode in ("cpu", "triton", "fla") and kernels is None:
        raise RuntimeError(
            f"{KERNEL_ENV}={mode}: these kernels come with the attnres package, which is not installed here (or is "
            f"a release with other kernels). Install it (pip install attnres), or unset {KERNEL_ENV} for the built-in "
            "path."
        )
    if plain and mode not in ("auto", "eager"):
        raise RuntimeError(
            f"{KERNEL_ENV}={mode}: the kernels take one static query per reader; this model has input-dependent "
            f"queries (query_rank > 0) or an additive mix, which the built-in path runs. Unset {KERNEL_ENV}."
        )
    if plain or capacity is None:
        return BlockState.start(embeddings, eps)
    if torch.compiler.is_compiling():  # one graph for every token count (vLLM compiles once for all of them)
        if mode not in ("auto", "eager"):
            raise RuntimeError(f"{KERNEL_ENV}={mode}: the kernels do not run under torch.compile; unset {KERNEL_ENV}")
        # plain tensor operations the compiler fuses; without autograd, one buffer written in place and a score table
        return BlockState.start(embeddings, eps, *(() if torch.is_grad_enabled() else (capacity, queries)))
    if not torch.is_grad_enabled():
        if mode == "fla":
            raise RuntimeError(f"{KERNEL_ENV}=fla: fla-core's depth mix runs forwards with autograd (training) only")
        state = kernels.inference_state(embeddings, eps, capacity, queries, runtime, mode) if kernels else None
        return state if state is not None else SourceBuffer.start(embeddings, eps, capacity, queries)
    state = kernels.training_state(embeddings, eps, capacity, queries, mode) if kernels else None
    return state if state is not None else BlockState.start(embeddings, eps)


def depth_mix(state, query, key_norm_weight, eps, scaling="count", reader=None, projection=None, norm=(), gate=None):
    """A sublayer's (or the final norm's) input: attention over the state's sources with w and g (g None: folded),
    or the reader's row of the state's queries; `projection` (A, B) of an input-dependent query; `norm`: `fuse_norm`;
    `gate`: an additive reader's."""
    if gate is not None:  # a BlockState's (start_state with plain)
        return state.additive_mix_and_weights(query, key_norm_weight, projection, gate, eps)[0]
    if projection is not None:  # a BlockState's (start_state with plain)
        return state.mix_token_queries(query, key_norm_weight, projection, eps, scaling)
    folded = reader is not None and state.queries is not None
    return state.mix(state.query(reader) if folded else state.fold(query, key_norm_weight), eps, scaling, reader, norm)


class ModelRuntime:
    """What a model's layers share beside parameters: its config, attnres's depth gate and recorders, kernel buffers."""

    def __init__(self, config):
        self.config = config
        self.gate = 1.0
        self.recorders: list = []
        self.steps: dict = {}
