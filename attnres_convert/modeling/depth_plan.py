"""The block structure of Block Attention Residuals: which sources each reader reads.

Sublayers are numbered 1..L in execution order and cut into consecutive blocks of S. Sublayer l at position
i (1..S) of block n reads the embedding, completed blocks 1..n-1 and, if i >= 2, its own block's partial sum.
The output aggregation reads the embedding, every completed block and the last partial sum.

This file ships next to converted weights: it imports the standard library only.
"""

from __future__ import annotations

from typing import NamedTuple


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
