"""Conversion without loading the model: the converted folder written straight from the input's files.

Conversion adds a few small tensors and renames nothing, so for a safetensors checkpoint the converted
weights are the input's tensors, copied file to file (shards.py), plus the AttnRes parameters in a shard of
their own. Which tensors the converted model saves, under which names and shapes, comes from the converted
model built on the meta device (no memory): if the checkpoint holds exactly those, it is streamed; anything
else (extra or missing tensors, other names) goes through the in-memory conversion, which handles it as
from_pretrained does.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedConfig
from transformers.dynamic_module_utils import custom_object_save

from ..errors import OutputError
from ..modeling import SHIPPED_CODE
from ..modeling.architectures import ModelPlan, family_for
from ..modeling.modeling_attnres import AttnResForCausalLM, AttnResKeyNorm, AttnResQuery
from .shards import DTYPES, OutputTensor, StoredTensor, checkpoint_files, checkpoint_tensors, plan_shards, write_sharded
from .sources import DTYPES as DTYPE_CHOICES
from .sources import ModelSource
from .discovery import find_plan
from .surgery import convert_model

Advance = Callable[[int], None]


@dataclass
class StreamPlan:
    """What a streamed conversion writes: the converted model's skeleton (meta tensors: config, code and
    structure) and every output tensor, base tensors first in the input's order, AttnRes ones last."""

    skeleton: AttnResForCausalLM
    base: list[OutputTensor]
    added: list[OutputTensor]
    source_folder: Path

    @property
    def total_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.base + self.added)

    def largest_layer_bytes(self) -> int:
        """Bytes of the largest decoder layer (or other top-level piece): what streamed verification loads at once."""
        sizes: dict[str, int] = {}
        for tensor in self.base + self.added:
            parts = tensor.name.split(".")
            key = ".".join(parts[:3]) if len(parts) > 3 and parts[2].isdigit() else ".".join(parts[:2])
            sizes[key] = sizes.get(key, 0) + tensor.nbytes
        return max(sizes.values(), default=0)


def source_folder(source: ModelSource) -> Path | None:
    """The local folder holding a safetensors checkpoint of SOURCE (a hub id: its snapshot in the HF cache,
    downloaded if needed), or None when the source is not a safetensors checkpoint (GGUF, pickle)."""
    if source.kind == "folder":
        folder = Path(source.location)
    elif source.kind == "hub":
        folder = _hub_snapshot(source)
    else:
        return None
    return folder if checkpoint_files(folder) else None


def _hub_snapshot(source: ModelSource) -> Path:
    from huggingface_hub import snapshot_download

    from .sources import _hub_error

    try:
        return Path(
            snapshot_download(
                source.location, allow_patterns=["*.safetensors", "*.safetensors.index.json", "*.json", "*.model", "*.txt"]
            )
        )
    except Exception as error:  # noqa: BLE001 - reported with the source and a fix
        raise _hub_error(source, error) from error


# A miniature of the model for proving its structure: same architecture code, same layer count and layer
# types, tiny widths. Only keys the config has are changed.
_MINIATURE = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "num_experts_per_tok": 2, "n_inner": 128,
}


def _miniature(config: PreTrainedConfig) -> PreTrainedConfig:
    small = copy.deepcopy(config)
    for key, value in _MINIATURE.items():
        if key in config.to_dict() or hasattr(type(config), "attribute_map") and key in config.attribute_map:
            setattr(small, key, value)
    return small


def proven_plan(config: PreTrainedConfig, trust_remote_code: bool = False) -> ModelPlan | str:
    """The structure plan of CONFIG's model, proven without its weights: the architecture table's plan,
    once it reproduces (layer by layer, as find_plan proves any model) a miniature of the model with random
    weights. Else the reason to convert in memory, where the structure is proven on the real weights."""
    family = family_for(config)
    try:
        miniature = AutoModelForCausalLM.from_config(_miniature(config), trust_remote_code=trust_remote_code, dtype=torch.float32)
        proven, _ = find_plan(miniature)
    except Exception as error:  # noqa: BLE001 - the in-memory path proves the structure on the model itself
        return f"its structure could not be proven on a miniature ({type(error).__name__}: {str(error)[:200]})"
    expected = dataclasses.replace(family.plan(miniature.config), tuple_output=proven.tuple_output)
    if proven != expected:
        return "the architecture table's structure does not reproduce a miniature of the model"
    return dataclasses.replace(family.plan(config), tuple_output=proven.tuple_output)


def _skeleton(config: PreTrainedConfig, plan: ModelPlan, dtype: torch.dtype, trust_remote_code: bool, **conversion) -> AttnResForCausalLM:
    """The converted model with every tensor on the meta device: structure, names, shapes, no memory."""
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        return convert_model(base, plan=plan, **conversion)


def _saved_base_shapes(model: AttnResForCausalLM, added: set[str]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the base tensors save_pretrained writes for MODEL (tied copies dropped, the
    checkpoint format's names restored, e.g. Mixtral's experts one by one), computed on meta tensors. The
    AttnRes tensors keep the contract's names: transformers' renaming patterns are not meant for them."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    state = revert_weight_conversion(model, {name: tensor for name, tensor in state.items() if name not in added})
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def _added_tensors(model: AttnResForCausalLM, dtype: torch.dtype) -> list[OutputTensor]:
    """The AttnRes parameters at their conversion values: zero queries, unit key norms (and, with query_rank,
    the input-dependent queries' projections)."""
    added = []
    for name, module in model.named_modules():
        if isinstance(module, (AttnResQuery, AttnResKeyNorm)):
            for param_name, value in module.initial_values().items():
                added.append(OutputTensor.new(f"{name}.{param_name}", value.to(dtype)))
    return added


def _embedding_dtype(model: AttnResForCausalLM, stored: dict[str, StoredTensor]) -> torch.dtype:
    """The dtype the checkpoint stores the input embedding in: the model's dtype when --dtype is auto."""
    embedding = model.get_input_embeddings().weight
    for name, param in model.named_parameters():
        if param is embedding and name in stored and DTYPES[stored[name].dtype].is_floating_point:
            return DTYPES[stored[name].dtype]
    floating = [DTYPES[t.dtype] for t in stored.values() if DTYPES[t.dtype].is_floating_point]
    return max(set(floating), key=floating.count) if floating else torch.float32


def plan_stream(
    folder: Path,
    config: PreTrainedConfig,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    **conversion,
) -> StreamPlan | str:
    """The streamed conversion of the checkpoint in FOLDER, or the reason it cannot be streamed."""
    stored = checkpoint_tensors(checkpoint_files(folder) or [])
    by_name = {tensor.name: tensor for tensor in stored}
    plan = proven_plan(config, trust_remote_code)
    if isinstance(plan, str):
        return plan
    skeleton = _skeleton(config, plan, torch.float32, trust_remote_code, **conversion)
    out_dtype = _embedding_dtype(skeleton, by_name) if dtype == "auto" else DTYPE_CHOICES[dtype]
    added = _added_tensors(skeleton, out_dtype)
    added_names = {tensor.name for tensor in added}
    try:
        expected = _saved_base_shapes(skeleton, added_names)
    except Exception as error:  # noqa: BLE001 - an unusual checkpoint format: the in-memory path handles it
        return f"its saved names could not be worked out ({type(error).__name__})"
    every_param = set(skeleton.state_dict())  # tied copies included: a checkpoint may store them too
    extra = [name for name in by_name if name not in expected and name not in every_param]
    missing = [name for name in expected if name not in by_name]
    if extra or missing:
        what = f"{len(extra)} tensors the model does not have" if extra else f"{len(missing)} tensors missing"
        return f"the checkpoint does not hold exactly the model's tensors ({what}, e.g. {(extra or missing)[0]})"
    for name, tensor in by_name.items():
        if name in expected and expected[name] != tensor.shape:
            return f"tensor {name} has shape {list(tensor.shape)} in the checkpoint, {list(expected[name])} in the model"
    skeleton.config.dtype = out_dtype
    skeleton.config.text_config.dtype = out_dtype
    base = [OutputTensor.stored(tensor, None if dtype == "auto" else out_dtype) for tensor in stored]
    return StreamPlan(skeleton, base, added, folder)


def _generation_config(plan: StreamPlan) -> GenerationConfig:
    """The input's generation_config.json when it has one (as from_pretrained would load it)."""
    if (plan.source_folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(plan.source_folder)
    return GenerationConfig.from_model_config(plan.skeleton.config.text_config)


def write_streamed(folder: Path, plan: StreamPlan, max_shard_size: int, advance: Advance = lambda nbytes: None) -> dict[str, str]:
    """Config, generation config and the self-contained modeling code (as save_pretrained writes them),
    then the weight shards and, last, the index. Returns the weight map."""
    model = plan.skeleton
    custom_object_save(model, folder, config=model.config)  # the shipped code, and auto_map in the config
    model.config.save_pretrained(folder)
    _generation_config(plan).save_pretrained(folder)
    missing = [name for name in SHIPPED_CODE if not (folder / name).is_file()]
    if missing:
        raise OutputError(f"internal error: the modeling code {missing} was not copied; the folder would not load")
    shards = plan_shards(plan.base, max_shard_size) + [plan.added]
    return write_sharded(folder, shards, advance)
