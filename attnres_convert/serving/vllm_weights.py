"""A converted checkpoint loaded through vLLM's weight iterator: each name as the checkpoint has it (the base
model's weights under their original names, the AttnRes parameters beside them) onto the module that holds it.

transformers' own conversion of the base family's checkpoint applies first, as `from_pretrained` applies it:
renamed keys (`WeightRenaming`) and merged ones (`WeightConverter`: a mixture of experts' per-expert matrices
stacked into the 3D weights its modules hold), read from the same mapping `from_pretrained` reads
(`get_model_conversion_mapping`). A merged target is converted and loaded as soon as the iterator has given all of
its tensors (a layer's experts: one per expert and source pattern), so a process holds one layer's experts at a time,
not the whole model's. A parameter vLLM made (a sharded linear layer, an expert slice) loads through its own
`weight_loader`, which keeps this rank's shard; any other is copied whole."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from attnres_convert.transformers_compat import (
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    get_model_conversion_mapping,
    rename_source_key,
)


def by_source_pattern(converters: list[WeightConverter]) -> dict[str, WeightConverter]:
    return {pattern: converter for converter in converters for pattern in converter.source_patterns}


def converted(model: nn.Module, pending: dict[str, torch.Tensor], renamings, converters) -> dict[str, torch.Tensor]:
    """The checkpoint tensors a `WeightConverter` merges, as the model's parameters (transformers' own operations,
    run as `transformers.core_model_loading.revert_weight_conversion` runs their reverse)."""
    by_pattern = by_source_pattern(converters)
    conversions: dict[str, WeightConverter] = {}
    for key in sorted(pending, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters)
        # one converter per target: it collects that target's tensors
        conversion = conversions.setdefault(target, copy.deepcopy(by_pattern[pattern]))
        conversion.add_tensor(target, key, pattern, pending[key])
    out = {}
    for target, conversion in conversions.items():
        for name, value in conversion.convert(target, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


def sources_needed(converter: WeightConverter, param: torch.Tensor | None) -> int | None:
    """How many checkpoint tensors CONVERTER merges into PARAM: one per source pattern, or one per expert and pattern
    where it stacks a module list (the experts counted along PARAM's dimension they are stacked on); None where PARAM
    is not a parameter of the model (a target split further), whose tensors are converted after the last is read."""
    if param is None:
        return None
    stacked = [op.dim for op in converter.operations if isinstance(op, MergeModulelist)]
    return len(converter.source_patterns) * (param.shape[stacked[0]] if stacked else 1)


def load_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], stacked: dict[str, tuple] | None = None
) -> set[str]:
    """Load WEIGHTS (checkpoint name, tensor) into MODEL; returns the names (as MODEL names its parameters, shared
    ones under every name) that were loaded. STACKED: the modules fused into one (`vllm_parallel.shard_model`),
    {module name: (fused module name, shard id)}: their weights load into the fused module's shard."""
    stacked = stacked or {}
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    by_pattern = by_source_pattern(converters)
    loaded: set[int] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}  # {target: {checkpoint name: tensor}}, until it has them all
    unexpected = []

    def load(name: str, tensor: torch.Tensor) -> None:
        module, _, leaf = name.rpartition(".")
        if module in stacked:  # a projection fused with its siblings (q, k, v into qkv_proj)
            fused, shard = stacked[module]
            param = params[f"{fused}.{leaf}"]
            param.weight_loader(param, tensor, shard)
            loaded.add(id(param))
        elif name in params:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(id(param))
        elif name in buffers:
            buffers[name].copy_(tensor)
        elif not any(p.search(name) for p in ignored):
            unexpected.append(name)

    def load_converted(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in converted(model, tensors, renamings, converters).items():
            load(name, tensor)

    for key, tensor in weights:
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            load(name, tensor)
            continue
        collected = pending.setdefault(name, {})
        collected[key] = tensor
        if len(collected) == sources_needed(by_pattern[pattern], params.get(name)):
            load_converted(pending.pop(name))
    for tensors in pending.values():  # targets whose count was not known
        load_converted(tensors)
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise ValueError(f"the checkpoint has weights the model does not: {shown}")
    return {name for name, param in params.items() if id(param) in loaded}
