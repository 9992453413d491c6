"""Block Attention Residuals: softmax attention over depth.

A PreNorm decoder feeds sublayer l the plain sum of every earlier output. AttnRes replaces that sum
with a per-token softmax over *sources* (the embedding, completed blocks, the running partial sum of
the current block), scored by a static pseudo-query against RMS-normalised keys:

    alpha_i = softmax_i( (w * g) . k_i / rms(k_i) )        h = n * sum_i alpha_i k_i

With w = 0 every source weighs 1/n, and the factor n (the number of sources) turns the mix back into
the exact residual sum, so a converted model reproduces its base model. Scores and softmax run in
float32 whatever the model dtype.

This file ships next to converted weights: it imports torch only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

SCALINGS = ("count", "mean")  # "count": h = n * mix (exact conversion); "mean": h = mix (from scratch)


class BlockState(NamedTuple):
    """What the residual stream carries between sublayers, instead of one tensor.

    blocks:  [m, B, T, D] the embedding and every completed block (model dtype).
    inv_rms: [m, B, T]    1 / rms of each completed block, float32. A completed block never changes, so
             its key statistics are computed once, when it completes, not once per reader.
    partial: [B, T, D]    running sum of the current block's outputs, or None right after a boundary.
    stream:  [B, T, D]    the plain residual stream: the sum of all sources, accumulated output by output
             exactly as the base model adds them (see `depth_mix` for why it is carried).

    It is an immutable value threaded through the layers' arguments and return values (never stored
    on a module), so gradient checkpointing replays see exactly the state of the forward pass.
    """

    blocks: torch.Tensor
    inv_rms: torch.Tensor
    partial: torch.Tensor | None
    stream: torch.Tensor


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def start_state(embeddings: torch.Tensor, eps: float) -> BlockState:
    """The embedding b_0 is always its own source."""
    return BlockState(embeddings.unsqueeze(0), inverse_rms(embeddings, eps).unsqueeze(0), None, embeddings)


def close_block(state: BlockState, eps: float) -> BlockState:
    """At a block boundary the partial sum becomes a completed block."""
    if state.partial is None:
        return state
    blocks = torch.cat([state.blocks, state.partial.unsqueeze(0)])
    inv_rms = torch.cat([state.inv_rms, inverse_rms(state.partial, eps).unsqueeze(0)])
    return BlockState(blocks, inv_rms, None, state.stream)


def add_output(state: BlockState, output: torch.Tensor) -> BlockState:
    partial = output if state.partial is None else state.partial + output
    return BlockState(state.blocks, state.inv_rms, partial, state.stream + output)


def depth_mix(
    state: BlockState,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float,
    scaling: str = "count",
) -> torch.Tensor:
    """The input of one sublayer (or of the final norm): attention over the state's sources.

    query: [1, D] or [D] pseudo-query w; key_norm_weight: [D] key RMSNorm weight g.

    With "count" scaling h = n * sum_i alpha_i k_i. Since the sources sum to the stream H, this equals
    H + sum_i (n alpha_i - 1) k_i, which is how it is computed: at zero queries n alpha_i - 1 is 0, so h
    is the base model's own residual stream bit for bit, with its own rounding (in bfloat16 a freshly
    summed mix would round differently from the base model's running sum and drift from it).
    """
    blocks, inv_rms, partial, stream = state
    # (w * g) . (k / rms(k)) == ((w * g) . k) * inv_rms(k): the key norm folds into the query.
    q = query.float().reshape(-1) * key_norm_weight.float()
    blocks32 = blocks.float()
    logits = torch.matmul(blocks32, q) * inv_rms  # [m, B, T]
    if partial is not None:
        partial32 = partial.float()
        partial_logit = torch.matmul(partial32, q) * inverse_rms(partial32, eps)
        logits = torch.cat([logits, partial_logit.unsqueeze(0)])
    weights = torch.softmax(logits, dim=0)
    if _RECORDERS:
        _RECORDERS[-1].append(weights.detach())
    if scaling == "count":
        weights = weights * logits.shape[0] - 1.0
    m = blocks.shape[0]
    mixed = torch.einsum("mbt,mbtd->btd", weights[:m], blocks32)
    if partial is not None:
        mixed = mixed + weights[m].unsqueeze(-1) * partial32
    if scaling == "count":
        mixed = stream.float() + mixed
    return mixed.to(blocks.dtype)


# Active recorders of depth-attention weights (a plain list, not a ContextVar: torch.compile traces it).
_RECORDERS: list[list[torch.Tensor]] = []


@contextlib.contextmanager
def record_depth_weights() -> Iterator[list[torch.Tensor]]:
    """Collect the softmax weights [n, B, T] of every depth_mix call (sublayers 1..L in order, then the
    output aggregation), for inspection and plots:

        with record_depth_weights() as weights:
            model(input_ids)
    """
    recorded: list[torch.Tensor] = []
    _RECORDERS.append(recorded)
    try:
        yield recorded
    finally:
        _RECORDERS.remove(recorded)


def depth_weights(state: BlockState, query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The softmax weights alpha over the state's sources, [n, B, T] (for inspection and plots)."""
    q = query.float().reshape(-1) * key_norm_weight.float()
    logits = torch.matmul(state.blocks.float(), q) * state.inv_rms
    if state.partial is not None:
        p = state.partial.float()
        logits = torch.cat([logits, (torch.matmul(p, q) * inverse_rms(p, eps)).unsqueeze(0)])
    return torch.softmax(logits, dim=0)


# ---------------------------------------------------------------------------------------------
# Block structure: which sources each sublayer reads. Sublayers are numbered 1..L in execution
# order and cut into consecutive blocks of S. Sublayer l at position i (1..S) of block n reads the
# embedding, completed blocks 1..n-1 and, if i >= 2, its own block's partial sum. The output
# aggregation reads the embedding, every completed block and the last partial sum.
# ---------------------------------------------------------------------------------------------


class SublayerPlan(NamedTuple):
    index: int  # 1-based position in execution order
    closes_block: bool  # the partial sum becomes a completed block just before this sublayer reads
    num_sources: int


def plan_sublayers(num_sublayers: int, block_size: int) -> list[SublayerPlan]:
    plans = []
    for l in range(1, num_sublayers + 1):
        position = (l - 1) % block_size + 1
        completed = (l - 1) // block_size
        plans.append(SublayerPlan(l, position == 1 and l > 1, 1 + completed + (1 if position >= 2 else 0)))
    return plans


def output_num_sources(num_sublayers: int, block_size: int) -> int:
    return 1 + -(-num_sublayers // block_size)


def source_ranges(num_sublayers: int, block_size: int) -> list[list[tuple[int, int]]]:
    """For each reader (sublayers 1..L, then the output aggregation), its sources as inclusive
    ranges (a, b) of sublayer outputs; (0, 0) is the embedding. Used by summaries and tests."""
    readers = []
    for l in list(range(1, num_sublayers + 1)) + [num_sublayers + 1]:
        sources = [(0, 0)]
        start = 1
        while start + block_size <= l:  # completed blocks strictly before l
            sources.append((start, start + block_size - 1))
            start += block_size
        if start <= l - 1:
            sources.append((start, l - 1))
        readers.append(sources)
    return readers


def default_block_size(num_sublayers: int, sublayers_per_layer: int, max_blocks: int = 8) -> int:
    """The smallest S that is a whole number of decoder layers and gives at most max_blocks blocks."""
    if max_blocks < 1:
        raise ValueError(f"the number of blocks must be >= 1, got {max_blocks}")
    layers = 1
    while -(-num_sublayers // (layers * sublayers_per_layer)) > max_blocks:
        layers += 1
    return layers * sublayers_per_layer
