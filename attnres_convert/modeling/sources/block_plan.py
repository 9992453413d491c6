"""The block structure of Block Attention Residuals: which sources each reader reads.

Sublayers are numbered 1..L in execution order and cut into consecutive blocks of S. Sublayer l at position
i (1..S) of block n reads the embedding, completed blocks 1..n-1 and, if i >= 2, its own block's partial sum.
The output aggregation reads the embedding, every completed block and the last partial sum.
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
