"""Block sizes and the sources each reader reads, for conversion, summaries and tests (the forward's own block
plan is modeling_attnres.plan_sublayers)."""

from __future__ import annotations


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
