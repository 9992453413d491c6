"""Held-out evaluation during a run, over every process of a launch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..io.text import Sequences, token_loss_by_sequence


@dataclass
class Heldout:
    """One held-out evaluation: the mean loss (nats per predicted token), the number of predictions, the loss's
    standard error (None with fewer than two sequences) and every sequence's loss sum and prediction count, in
    the held-out order: two runs scored on the same sequences are compared sequence by sequence (a paired
    standard error, `paired_difference_se`)."""

    loss: float
    predictions: int
    se: float | None
    sequence_sums: list[float]
    sequence_counts: list[int]


def heldout_loss_across_processes(model, sequences: Sequences, accelerator, batch_size: int) -> Heldout:
    """The held-out loss of MODEL on SEQUENCES, each process scoring its share. Every process runs the same
    number of forward passes (a process short of data repeats one batch and discards it): DDP buffer syncs and
    FSDP all-gathers need every process in every forward.

    The standard error treats the sequences as the independent draws (tokens within one are not): the ratio
    estimator's sqrt(n / (n - 1) x sum_i (s_i - L c_i)^2) / sum_i c_i, s_i and c_i a sequence's loss sum and
    prediction count, L the loss."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = np.arange(len(sequences))[rank::world]
    passes = math.ceil(math.ceil(len(sequences) / world) / batch_size)
    # Row 0: each sequence's loss sum, row 1: its predictions; a process fills its own columns, the sum gathers
    # them. The last column holds the batches' loss sums: the mean as `token_loss` sums it, bit for bit.
    table = torch.zeros(2, len(sequences) + 1, dtype=torch.float64, device=accelerator.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for index in range(passes):
            chunk = mine[index * batch_size : (index + 1) * batch_size]
            real = len(chunk) > 0
            batch = sequences.batch(chunk if real else np.arange(1))
            loss, _, sums, counts = token_loss_by_sequence(model, batch, accelerator.device)
            if real:
                table[0, -1] += loss.double().to(table.device)
                columns = torch.as_tensor(chunk, device=table.device)
                table[0, columns] = sums.double().to(table.device)
                table[1, columns] = counts.double().to(table.device)
    table = accelerator.reduce(table, "sum")
    model.train(was_training)
    s, c = table[0, :-1].cpu().tolist(), table[1, :-1].cpu().tolist()
    mean = float(table[0, -1]) / sum(c)
    return Heldout(mean, int(sum(c)), ratio_se(s, c), s, [int(x) for x in c])


def ratio_se(sums: list[float], counts: list[float]) -> float | None:
    """The standard error of sum(sums) / sum(counts) with the sequences as the draws; None below two."""
    n = len(sums)
    if n < 2:
        return None
    total = sum(counts)
    mean = sum(sums) / total
    spread = sum((s - mean * c) ** 2 for s, c in zip(sums, counts))
    return math.sqrt(n / (n - 1) * spread) / total


def paired_difference_se(sums_a: list[float], sums_b: list[float], counts: list[float]) -> float | None:
    """The standard error of loss_a - loss_b when both runs scored the same sequences (same COUNTS): the ratio
    estimator of the per-sequence differences. Sequences hard for one run are hard for the other, so this is far
    below the two errors combined as if independent."""
    return ratio_se([a - b for a, b in zip(sums_a, sums_b)], counts)
