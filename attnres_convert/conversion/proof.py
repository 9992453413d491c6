"""Proving a structure plan exact: every decoder layer, and the whole converted model, against the original.

A candidate plan, discovered or from the table in architectures.py, is accepted only when every decoder
layer, run on random hidden states with its real arguments (trace.py), gives the same output through the
rewritten sublayers (`run_sublayer`, the function the converted model runs) as through its own forward,
both as a plain sum and as a depth-attention mix with zero queries: fp32 bit-equal or within 1e-6
relative. A failing candidate is never used; when none passes, the refusal names the layer, the sublayer
and the difference. `check_converted` then runs the whole converted model on the probe tokens, prefill
and one decoding step, against the original's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..architectures import ModelPlan, Sublayer, UnsupportedModelError, describe, module_at
from ..errors import first_line
from ..modeling.modeling_attnres import depth_mix, run_sublayer, start_state
from .trace import (
    LayerCall,
    ModelTrace,
    evaluating,
    first_tensor,
    one_more_token_logits,
    probe_hidden,
    probe_ids,
    run_probes,
)

RELATIVE_TOLERANCE = 1e-6  # fp32: bit-equal, or this close where the base forward orders its adds differently
HALF_RELATIVE_TOLERANCE = 1e-2  # bf16 / fp16: a reordered add rounds at the format's precision (2^-8)
LOGIT_TOLERANCE = 1e-4  # fp32, the whole converted model on the probe tokens


class StructureError(UnsupportedModelError):
    """No candidate structure reproduces the model's decoder layers; the message names where and by how much."""


def tolerance(dtype: torch.dtype) -> float:
    """How close the rewritten layer must come to the original's output, relative, at this precision."""
    return RELATIVE_TOLERANCE if dtype in (torch.float32, torch.float64) else HALF_RELATIVE_TOLERANCE


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference, and that difference relative to WANT's largest magnitude."""
    diff = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    return diff, diff / scale if scale > 0 else diff


@dataclass(frozen=True)
class LayerFailure:
    """Where and by how much a plan fails to reproduce a decoder layer: the refusal's words."""

    layer: int
    sublayer: int | None  # 1-based inside the layer; None: the structure itself could not be found
    description: str
    difference: float | None = None
    relative: float | None = None
    tolerance: float = RELATIVE_TOLERANCE

    def __str__(self) -> str:
        if self.sublayer is None:
            return f"decoder layer {self.layer}: {self.description}"
        if self.difference is None:
            return f"decoder layer {self.layer}, sublayer {self.sublayer}: {self.description}"
        return (
            f"decoder layer {self.layer}, sublayer {self.sublayer} ({self.description}): the rewritten layer differs "
            f"from the original by {self.difference:.2e} (relative {self.relative:.1e} > {self.tolerance:.0e})"
        )


@torch.no_grad()
def prove_layer(
    layer: nn.Module,
    index: int,
    sublayers: tuple[Sublayer, ...],
    call: LayerCall,
    eps: float,
    stream_start: str | None = None,
    scalar: float = 1.0,
) -> LayerFailure | None:
    """Run the layer's own forward and the rewritten sublayers on the same random hidden states and real
    arguments: as a plain residual sum (locates the sublayer that differs), and as the depth-attention mix
    with zero queries, every output its own source (what the converted layer computes), with what the layer
    returns after the stream (a recurrent state). STREAM_START: the module that makes the first stream from the
    layer's input (ModelPlan.stream_start, the first layer only). SCALAR: the factor the layer multiplies its
    stream by before returning it (ModelPlan.layer_scalars), applied to the rewritten layer's last stream."""
    h0 = probe_hidden(call, seed=1000 + index)
    args, kwargs = call.fresh()
    want, inputs, output = _run_recording_inputs(layer, sublayers, h0, args, kwargs)
    args, kwargs = call.fresh()
    call_kwargs = call.call_kwargs(args, kwargs)
    limit = tolerance(h0.dtype)
    if stream_start is not None:
        h0 = module_at(layer, stream_start)(h0)
    h = h0
    for sub_index, sublayer in enumerate(sublayers):
        try:
            h = h + run_sublayer(layer, sublayer, h, call_kwargs)
        except Exception as error:  # noqa: BLE001 - a candidate that cannot even run is a failed candidate
            return LayerFailure(
                index, sub_index + 1, f"the rewritten {describe(sublayer)} raised {first_line(error, with_type=True)}"
            )
        # The original's stream where the next sublayer reads it, else (last sublayer) the layer's output.
        last = sub_index + 1 == len(sublayers)
        reference = want if last else inputs.get(sub_index + 1)
        if reference is not None and reference.shape == h.shape:
            difference, relative = relative_difference(h * scalar if last else h, reference)
            if not relative <= limit:
                return LayerFailure(index, sub_index + 1, describe(sublayer), difference, relative, limit)
    difference, relative = relative_difference(h * scalar, want)
    if not relative <= limit:
        return LayerFailure(index, len(sublayers), describe(sublayers[-1]), difference, relative, limit)
    args, kwargs = call.fresh()
    call_kwargs = call.call_kwargs(args, kwargs)
    hidden = h0.shape[-1]
    query, key_norm = h0.new_zeros(1, hidden), h0.new_ones(hidden)
    state = start_state(h0, eps)
    returned: dict[int, object] = {}
    for sublayer in sublayers:
        state = state.close(eps)
        mix = depth_mix(state, query, key_norm, eps, "count")
        state = state.add(run_sublayer(layer, sublayer, mix, call_kwargs, returned=returned))
    mixed = depth_mix(state.close(eps), query, key_norm, eps, "count") * scalar
    difference, relative = relative_difference(mixed, want)
    if not relative <= limit:
        return LayerFailure(
            index,
            len(sublayers),
            "depth mix with zero queries: " + describe(sublayers[-1]),
            difference,
            relative,
            limit,
        )
    for position, value in returned.items():
        expected = output[position] if isinstance(output, tuple) and position < len(output) else None
        if not _same_values(value, expected, limit):
            return LayerFailure(
                index,
                len(sublayers),
                f"the value the layer returns at position {position} (a state it "
                "hands the base model) differs from the original's",
            )
    return None


def _same_values(got, want, limit: float) -> bool:
    """Whether two layer outputs hold the same tensors (nested in lists, tuples and dicts), within LIMIT relative."""
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and relative_difference(got, want)[1] <= limit
    if isinstance(want, (list, tuple)):
        return (
            isinstance(got, (list, tuple))
            and len(got) == len(want)
            and all(_same_values(g, w, limit) for g, w in zip(got, want))
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same_values(got[k], want[k], limit) for k in want)
        )
    return got is want or got == want


def _run_recording_inputs(layer, sublayers, h0, args, kwargs) -> tuple[torch.Tensor, dict[int, torch.Tensor], object]:
    """The layer's own output stream, and the stream each sublayer after the first reads in the original
    forward (the input of its first norm), to name the sublayer where the rewritten layer departs from it; and
    the layer's output as it returns it."""
    inputs: dict[int, torch.Tensor] = {}
    hooks = []
    for position, sublayer in enumerate(sublayers[1:], start=1):

        def hook(module, hook_args, position=position):
            if position not in inputs and hook_args and isinstance(hook_args[0], torch.Tensor):
                inputs[position] = hook_args[0].detach().clone()

        first = sublayer.branches[0]  # its norm reads the stream, or its module where it reads the raw stream
        hooks.append(module_at(layer, first.norm or first.module).register_forward_pre_hook(hook))
    try:
        output = layer(h0, *args, **kwargs)
        return first_tensor(output), inputs, output
    finally:
        for handle in hooks:
            handle.remove()


def prove(model: nn.Module, plan: ModelPlan, trace: ModelTrace) -> LayerFailure | None:
    """The first decoder layer the plan does not reproduce, or None when it reproduces them all."""
    layers = module_at(module_at(model, plan.base_model), plan.layers)
    for index, (layer, call) in enumerate(zip(layers, trace.calls)):
        scalar = plan.layer_scalars[index] if plan.layer_scalars else 1.0
        failure = prove_layer(
            layer, index, plan.sublayers(index), call, plan.eps, plan.stream_start if index == 0 else None, scalar
        )
        if failure is not None:
            return failure
    return None


def check_converted(converted: nn.Module, trace: ModelTrace) -> None:
    """The converted model on the probe tokens gives the original's logits (fp32): what the per-layer proof
    cannot see, such as a base model that touches the hidden states between its layers."""
    if next(converted.parameters()).dtype != torch.float32:
        return  # half precision: `attnres convert`'s verification judges the distribution instead
    with evaluating(converted):
        logits, step = run_probes(converted, _probe_logits, converted, trace.step_logits is not None)
    difference = relative_difference(logits, trace.logits)[0]
    if step is not None and step.shape == trace.step_logits.shape:
        step_difference = relative_difference(step, trace.step_logits)[0]
        if not step_difference <= LOGIT_TOLERANCE:
            raise StructureError(
                f"{converted.config.base_model_type}: every decoder layer is reproduced, but a decoding step with the "
                f"KV cache differs from the original's by {step_difference:.2e} in the logits (> {LOGIT_TOLERANCE:.0e}): "
                "a module outside the plan's arguments keeps state in the cache"
            )
    if not difference <= LOGIT_TOLERANCE:
        raise StructureError(
            f"{converted.config.base_model_type}: every decoder layer is reproduced, but the whole converted model "
            f"differs from the original by {difference:.2e} in the logits (> {LOGIT_TOLERANCE:.0e}): the base model "
            "does more between its layers than pass the hidden states on"
        )


@torch.no_grad()
def _probe_logits(model: nn.Module, with_step: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's logits on the probe tokens and, WITH_STEP, those of one more token through its cache."""
    prefill = model(input_ids=probe_ids(model), use_cache=with_step)
    return prefill.logits.float(), one_more_token_logits(model, prefill) if with_step else None
