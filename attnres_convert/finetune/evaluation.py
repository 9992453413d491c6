"""Held-out evaluation during a run, over every process of a launch."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..io.text import Sequences, token_loss_by_sequence


def heldout_loss_across_processes(
    model, sequences: Sequences, accelerator, batch_size: int
) -> tuple[float, int, float | None]:
    """Held-out loss (mean nats per predicted token), the number of predictions and the loss's standard error,
    each process scoring its share of SEQUENCES. Every process runs the same number of forward passes (a
    process short of data repeats one batch and discards it): DDP buffer syncs and FSDP all-gathers need
    every process in every forward.

    The standard error treats the sequences as the independent draws (tokens within one are not): the ratio
    estimator's sqrt(n / (n - 1) x sum_i (s_i - L c_i)^2) / sum_i c_i, s_i and c_i a sequence's loss sum and
    prediction count, L the loss; None with fewer than two sequences."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = np.arange(len(sequences))[rank::world]
    passes = math.ceil(math.ceil(len(sequences) / world) / batch_size)
    # loss sum, predictions, sequences, and the sums of s^2, s c and c^2 the standard error is made of
    totals = torch.zeros(6, dtype=torch.float64, device=accelerator.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for index in range(passes):
            chunk = mine[index * batch_size : (index + 1) * batch_size]
            real = len(chunk) > 0
            batch = sequences.batch(chunk if real else np.arange(1))
            loss, count, sums, counts = token_loss_by_sequence(model, batch, accelerator.device)
            if real:
                s, c = sums.double(), counts.double()
                totals += torch.stack(
                    [
                        loss.double(),
                        torch.tensor(float(count), dtype=torch.float64, device=loss.device),
                        torch.tensor(float(len(chunk)), dtype=torch.float64, device=loss.device),
                        (s * s).sum(),
                        (s * c).sum(),
                        (c * c).sum(),
                    ]
                )
    totals = accelerator.reduce(totals, "sum")
    model.train(was_training)
    loss_sum, predictions, n, ss, sc, cc = (float(x) for x in totals)
    mean = loss_sum / predictions
    se = None
    if n > 1:
        spread = max(ss - 2 * mean * sc + mean * mean * cc, 0.0)  # sum_i (s_i - L c_i)^2, never below 0 by rounding
        se = math.sqrt(n / (n - 1) * spread) / predictions
    return mean, int(predictions), se
