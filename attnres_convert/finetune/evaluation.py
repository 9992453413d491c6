"""Held-out evaluation during a run, over every process of a launch."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..io.text import Sequences, token_loss


def heldout_loss_across_processes(model, sequences: Sequences, accelerator, batch_size: int) -> tuple[float, int, float | None]:
    """Held-out loss (mean nats per predicted token), the number of predictions and the loss's standard error
    (None from fewer than two batches), each process scoring its share of SEQUENCES. Every process runs the
    same number of forward passes (a process short of data repeats one batch and discards it): DDP buffer
    syncs and FSDP all-gathers need every process in every forward.

    The standard error is that of the mean over batches (their losses per token, sample standard deviation /
    sqrt(batches)): tokens within a sequence are not independent, batches of different text are nearly so.
    It says how much the held-out loss would move on other text of the same kind; a difference between two
    runs smaller than it is not shown by this evaluation (finetune/ab.py)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = np.arange(len(sequences))[rank::world]
    passes = math.ceil(math.ceil(len(sequences) / world) / batch_size)
    # loss sum, predictions, batches, sum and sum of squares of the batch means
    totals = torch.zeros(5, dtype=torch.float64, device=accelerator.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for index in range(passes):
            chunk = mine[index * batch_size : (index + 1) * batch_size]
            real = len(chunk) > 0
            batch = sequences.batch(chunk if real else np.arange(1))
            loss, count = token_loss(model, batch, accelerator.device)
            if real:
                mean = loss.double() / count
                one = torch.ones((), dtype=torch.float64, device=loss.device)
                totals += torch.stack([loss.double(), one * count, one, mean, mean * mean])
    totals = accelerator.reduce(totals, "sum")
    model.train(was_training)
    batches = float(totals[2])
    stderr = None
    if batches >= 2:
        variance = max(float(totals[4] - totals[3] ** 2 / batches) / (batches - 1), 0.0)
        stderr = math.sqrt(variance / batches)
    return float(totals[0] / totals[1]), int(totals[1]), stderr
