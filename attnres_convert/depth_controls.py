"""Controls over a converted model's depth mixes that training and inspection use: the depth gate of a training
schedule, and recording the depth-attention weights. Each acts on the model's own runtime (modeling_attnres's
ModelRuntime), which its layers share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .kernels.controls import Recorder
from .modeling.modeling_attnres import ModelRuntime


def _runtime_of(model: nn.Module) -> ModelRuntime | None:
    for module in model.modules():
        spec = module.__dict__.get("_attnres_spec")
        if spec is not None:
            return spec.runtime
    return None


def set_depth_gate(model: nn.Module, gate: float) -> bool:
    """Let every reader of a converted model (PEFT- or Accelerate-wrapped included) read
    stream + gate * (mix - stream) instead of its depth mix: 1 (the default) is AttnRes, 0 the base model's
    plain residual stream, whatever the queries. A training-time schedule (recipe `train.depth_gate_steps`)
    that lets the learned mix in gradually; it is not saved, and a loaded model reads the mix (gate 1).
    Returns False where the model has no AttnRes layers (nothing to gate)."""
    if not 0.0 <= gate <= 1.0:
        raise ValueError(f"the depth gate must be in [0, 1], got {gate}")
    runtime = _runtime_of(model)
    if runtime is None:
        return False
    runtime.gate = float(gate)
    return True


@contextlib.contextmanager
def record_depth_weights(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the softmax weights [n, B, T] of every depth mix of `model`'s forwards (sublayers 1..L in order,
    then the output aggregation), for inspection and plots:

        with record_depth_weights(model) as weights:
            model(input_ids)

    The recorder belongs to the model, so other models, and other threads' models, are not recorded."""
    runtime = _runtime_of(model)
    if runtime is None:
        raise ValueError(f"{type(model).__name__} has no AttnRes layers: there are no depth weights to record")
    recorder = Recorder()
    runtime.recorders.append(recorder)
    try:
        yield recorder
    finally:
        recorder.open = False
        del runtime.recorders[next(i for i, kept in enumerate(runtime.recorders) if kept is recorder)]  # by identity
