"""Block Attention Residuals: softmax attention over depth, behind five calls.

A decoder layer (modeling_attnres.py) threads a *state* through its sublayers instead of one tensor:

    state = start_state(embeddings, eps, capacity, queries)       # the embedding is the first source
    state = close_block(state, eps, reader)                       # at a block boundary
    h = depth_mix(state, query, key_norm_weight, eps, scaling)    # a sublayer's (or the final norm's) input
    state = add_output(state, sublayer(h))                        # the output joins the partial sum and stream
    current_stream(state)                                         # the base model's residual stream

The math is depth_core.py's (with `BlockState`, its plain-tensor form); the block structure depth_plan.py's. Which
state a forward gets depends on what it pays for, and each is a backend behind the same calls (`close`, `query`,
`fold`, `mix`, `add`, `current_stream`):

    autograd, torch.compile, input-dependent queries   BlockState     depth_core.py
    autograd (eager training)                          TrainState     depth_training.py (eager or Triton)
    no autograd, many tokens (prefill)                 SourceBuffer   depth_eager.py
    no autograd, few tokens (a decoding step)          StepBuffer     depth_eager.py
    ... with ATTNRES_KERNEL=cpu                        CpuBuffer, CpuStepBuffer   depth_cpu.py
    ... with the Triton kernels (CUDA)                 TritonBuffer   depth_triton.py

This file ships next to converted weights: it imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .depth_backends import KERNEL_ENV, cpu_kernels_for, kernel_mode, kernels_for
from .depth_core import BlockState, Recorder, inverse_rms, pseudo_query, source_scores, table_scores, token_queries
from .depth_cpu import CpuBuffer, CpuStepBuffer
from .depth_eager import SMALL_STEP_TOKENS, SourceBuffer, StepBuffer, StepViews, few_tokens, pad_query, step_mix
from .depth_plan import SublayerPlan, default_block_size, output_num_sources, plan_sublayers, source_ranges
from .depth_training import BlockCache, TrainState

STATE_TYPES = (BlockState, SourceBuffer, TrainState)

__all__ = [
    "KERNEL_ENV", "SMALL_STEP_TOKENS", "STATE_TYPES", "BlockCache", "BlockState", "SourceBuffer", "StepBuffer",
    "StepViews", "SublayerPlan", "TrainState", "add_output", "close_block", "cpu_kernels_for", "current_stream",
    "default_block_size", "depth_mix", "inverse_rms", "kernel_mode", "kernels_for", "output_num_sources",
    "pad_query", "plan_sublayers", "pseudo_query", "record_depth_weights", "source_ranges", "source_scores",
    "start_state", "step_mix", "table_scores", "token_queries", "wants_queries",
]


def wants_queries() -> bool:
    """Whether start_state would use all sublayers' folded queries (for a score table, or for a decoding
    step's readers), so whether the caller should gather them."""
    return not (torch.is_grad_enabled() and torch.compiler.is_compiling())


def start_state(
    embeddings: torch.Tensor,
    eps: float,
    capacity: int | None = None,
    queries: torch.Tensor | None = None,
    token_queries: bool = False,
    runtime: dict | None = None,
) -> BlockState | SourceBuffer | TrainState:
    """The embedding b_0 is always its own source. With a capacity (the most sources any reader has)
    the state is a SourceBuffer without autograd and a TrainState with it; a BlockState under
    torch.compile or without a capacity. `queries`, all the sublayers' folded pseudo-queries [R, D],
    where given, make the score table (or, for few tokens, the readers' query views).

    token_queries: the readers' queries depend on their input (a model with query_rank > 0), which the
    static-query fast paths (score tables, folded query views, the TrainState's hand-written backward, the
    Triton kernels) do not cover: the state is then the plain-tensor BlockState, differentiated by autograd.

    runtime: the model's own dict (one per converted model, shared by its layers): where a few-token forward keeps
    its buffer and views for the next one of the same shape and queries (a decoding loop, per thread; see
    depth_eager.step_buffer), the open recorder (`record_depth_weights`) and the config (where the C++ source is
    looked for)."""
    mode = kernel_mode()  # read once: a decoding step pays for every lookup
    recorders = runtime.get("recorders") if runtime is not None else None
    recorder = recorders[-1] if recorders else None
    if token_queries:
        if mode in ("triton", "cpu"):
            raise RuntimeError(
                f"{KERNEL_ENV}={mode}: the depth-mix kernels score one static query per reader, and this "
                f"model's queries depend on each token's input (query_rank > 0), which runs on the eager path. "
                f"Unset {KERNEL_ENV} (auto) or set it to eager."
            )
        capacity = None
    kernels = kernels_for(embeddings, mode) if capacity is not None else None
    if capacity is not None and not torch.is_grad_enabled():
        if kernels is not None:
            return kernels.buffer.start(embeddings, eps, capacity, queries, recorder, kernels)
        # A recorder needs the eager path's weights.
        config = runtime.get("config") if runtime is not None else None
        native = None if recorder is not None else cpu_kernels_for(embeddings, mode, config)
        if few_tokens(embeddings):
            if native is not None:
                return CpuStepBuffer.start(embeddings, eps, capacity, queries, native, runtime)
            return StepBuffer.start(embeddings, eps, capacity, queries, recorder, runtime)
        if native is not None:
            return CpuBuffer.start(embeddings, eps, capacity, queries, native)
        return SourceBuffer.start(embeddings, eps, capacity, queries, recorder)
    if capacity is not None and not torch.compiler.is_compiling():
        # Eager training. Under torch.compile the BlockState below is traced instead: plain tensor
        # operations, which the compiler fuses, where the custom autograd functions would break the graph.
        return TrainState.start(embeddings, eps, capacity, queries, kernels, recorder)
    return BlockState.start(embeddings, eps, recorder)


def close_block(state, eps: float, first: int = 0):
    """At a block boundary the partial sum becomes a completed block (the only copy of the blocks). `first`: the
    first reader after the boundary; a score table gets the new source's scores for it and the readers after."""
    return state.close(eps, first)


def depth_mix(
    state,
    query: torch.Tensor | None,
    key_norm_weight: torch.Tensor | None,
    eps: float,
    scaling: str = "count",
    reader: int | None = None,
    projection: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm: tuple = (),
) -> torch.Tensor:
    """The input of one sublayer (or of the final norm): attention over the state's sources.

    query: the pseudo-query w ([1, D] or [D]) and key_norm_weight g ([D]); or, with key_norm_weight None,
    the folded `pseudo_query` already. reader: the sublayer's 0-based index, to read its column of the
    state's score table and its row of the queries stacked for it (folded once per forward, not again here).
    projection: (A [r, D], B [D, r]) of a reader whose query depends on its input (see `token_queries`);
    the state is then a BlockState (start_state with token_queries).
    norm: the sublayer's norm as `fused_norm` gives it, for a state on the C++ kernels: the result is then that
    norm of the mix, made in the same pass.

    With "count" scaling h = n * sum_i alpha_i k_i, computed as H + sum_i (n alpha_i - 1) k_i (see
    depth_core.mix_blocks): at zero queries, the base model's own residual stream bit for bit.
    """
    if projection is not None:
        if not isinstance(state, BlockState):
            raise TypeError("input-dependent queries need the BlockState (start_state with token_queries=True)")
        return state.mix_token_queries(query, key_norm_weight, projection, eps, scaling)
    if reader is not None and state.queries is not None:  # folded once per forward
        q = state.query(reader)
    else:
        q = state.fold(query, key_norm_weight)
    return state.mix(q, eps, scaling, reader, norm)


def add_output(state, output: torch.Tensor):
    """A sublayer's output joins the partial sum of its block and the residual stream."""
    return state.add(output)


def current_stream(state) -> torch.Tensor:
    """The plain residual stream a state stands for (with kernels, once its last output is applied)."""
    return state.current_stream()


def _runtime_of(model: torch.nn.Module) -> dict:
    for module in model.modules():
        spec = module.__dict__.get("_attnres_spec")
        if spec is not None:
            return spec.runtime
    raise ValueError(f"{type(model).__name__} has no AttnRes layers: there are no depth weights to record")


@contextlib.contextmanager
def record_depth_weights(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the softmax weights [n, B, T] of every depth mix of `model`'s forwards (sublayers 1..L in order,
    then the output aggregation), for inspection and plots:

        with record_depth_weights(model) as weights:
            model(input_ids)

    The recorder belongs to the model (and its forwards' states), so other models, and other threads' models,
    are not recorded."""
    recorders = _runtime_of(model).setdefault("recorders", [])
    recorder = Recorder()
    recorders.append(recorder)
    try:
        yield recorder
    finally:
        recorder.open = False
        del recorders[next(i for i, kept in enumerate(recorders) if kept is recorder)]  # by identity, not ==
