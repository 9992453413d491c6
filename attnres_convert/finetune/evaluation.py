"""Held-out evaluation during a run, over every process of a launch."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..io.text import Sequences, token_loss


def heldout_loss_across_processes(model, sequences: Sequences, accelerator, batch_size: int) -> tuple[float, int]:
    """Held-out loss (mean nats per predicted token) and the number of predictions, each process scoring
    its share of SEQUENCES. Every process runs the same number of forward passes (a process short of data
    repeats one batch and discards it): DDP buffer syncs and FSDP all-gathers need every process in every
    forward."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = np.arange(len(sequences))[rank::world]
    passes = math.ceil(math.ceil(len(sequences) / world) / batch_size)
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for index in range(passes):
            chunk = mine[index * batch_size : (index + 1) * batch_size]
            real = len(chunk) > 0
            batch = sequences.batch(chunk if real else np.arange(1))
            loss, count = token_loss(model, batch, accelerator.device)
            if real:
                totals += torch.stack([loss.double(), torch.tensor(float(count), dtype=torch.float64, device=loss.device)])
    totals = accelerator.reduce(totals, "sum")
    model.train(was_training)
    return float(totals[0] / totals[1]), int(totals[1])
