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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedConfig

from ..architectures import ModelPlan, family_for
from ..errors import OutputError
from ..io.shards import (
    DTYPES,
    NotStreamable,
    OutputTensor,
    checkpoint_files,
    checkpoint_tensors,
    plan_shards,
    write_sharded,
)
from ..io.sources import DTYPES as DTYPE_CHOICES
from ..io.sources import ModelSource
from ..modeling import SHIPPED_CODE
from ..modeling.modeling_attnres import AttnResForCausalLM, AttnResKeyNorm, AttnResQuery
from ..transformers_compat import custom_object_save
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
        return largest_layer_bytes(self.base + self.added)


def largest_layer_bytes(tensors: list[OutputTensor]) -> int:
    """Bytes of the largest decoder layer (or other top-level piece): what streamed verification loads at once."""
    sizes: dict[str, int] = {}
    for tensor in tensors:
        parts = tensor.name.split(".")
        key = ".".join(parts[:3]) if len(parts) > 3 and parts[2].isdigit() else ".".join(parts[:2])
        sizes[key] = sizes.get(key, 0) + tensor.nbytes
    return max(sizes.values(), default=0)


def stream_input(
    source: ModelSource, config: PreTrainedConfig, dtype: str, trust_remote_code: bool
) -> tuple[Path, list[OutputTensor]] | None:
    """The folder of a streamable SOURCE and its tensors as the converted folder writes them (safetensors:
    copied; GGUF: dequantised one by one); None for a pickle checkpoint. NotStreamable says why a GGUF is not."""
    if source.gguf_file:
        from ..io.gguf_stream import gguf_base_tensors

        return Path(source.location), gguf_base_tensors(
            Path(source.location) / source.gguf_file, config, dtype, trust_remote_code
        )
    folder = source_folder(source)
    return None if folder is None else (folder, base_tensors(folder, dtype))


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

    from ..io.sources import hub_error

    try:
        return Path(
            snapshot_download(
                source.location,
                allow_patterns=["*.safetensors", "*.safetensors.index.json", "*.json", "*.model", "*.txt"],
            )
        )
    except Exception as error:  # noqa: BLE001 - reported with the source and a fix
        raise hub_error(source, error) from error


# A miniature of the model for proving its structure: same architecture code and layer types, tiny widths.
# Only keys the config has are changed.
_MINIATURE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_inner": 128,
}
MINIATURE_MIN_LAYERS = 2  # a repeated layer kind is proven on two layers: the first layer is not the general case


def _narrow(config: PreTrainedConfig) -> PreTrainedConfig:
    small = copy.deepcopy(config)
    for key, value in _MINIATURE.items():
        if key in config.to_dict() or hasattr(type(config), "attribute_map") and key in config.attribute_map:
            setattr(small, key, value)
    return small


def _per_layer_settings(config: PreTrainedConfig) -> dict[str, list]:
    """Config entries that hold one value per decoder layer (layer_types, no_rope_layers...)."""
    count = config.num_hidden_layers
    return {
        key: value
        for key, value in vars(config).items()
        if isinstance(value, (list, tuple)) and len(value) == count and count > 1
    }


_PLAIN = (bool, int, float, str, type(None))


def _layer_signature(layer: torch.nn.Module) -> tuple:
    """What can make one decoder layer compute unlike another of the same model: its module tree (names,
    classes, parameter and buffer shapes) and the plain settings its modules hold (a sliding window, RoPE on
    or off, dense or mixture-of-experts MLP...), its index aside."""
    parts = []
    for name, module in layer.named_modules():
        settings = sorted(
            (key, value)
            for key, value in vars(module).items()
            if not key.startswith("_") and key != "training" and "idx" not in key and isinstance(value, _PLAIN)
        )
        tensors = [
            (key, tuple(t.shape))
            for key, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        ]
        parts.append((name, type(module).__name__, tuple(settings), tuple(tensors)))
    return tuple(parts)


def _miniature(config: PreTrainedConfig, trust_remote_code: bool = False) -> PreTrainedConfig:
    """The smallest faithful miniature of CONFIG's model: tiny widths, and the first decoder layers up to the
    last that starts a kind of layer not seen before (at least two). Layer kinds are told apart on the
    narrow model with every layer, built on the meta device; per-layer config entries are cut to match."""
    small = _narrow(config)
    per_layer = _per_layer_settings(small)
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(small, trust_remote_code=trust_remote_code)
    layers = next(
        module
        for _, module in full.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == small.num_hidden_layers
    )
    first_of_kind: dict[tuple, int] = {}
    for index, layer in enumerate(layers):
        kind = (_layer_signature(layer), tuple(repr(values[index]) for values in per_layer.values()))
        first_of_kind.setdefault(kind, index)
    count = min(small.num_hidden_layers, max(MINIATURE_MIN_LAYERS, max(first_of_kind.values()) + 1))
    for key, values in per_layer.items():
        setattr(small, key, type(values)(values[:count]))
    small.num_hidden_layers = count
    return small


def proven_plan(config: PreTrainedConfig, trust_remote_code: bool = False) -> ModelPlan | str:
    """The structure plan of CONFIG's model, proven without its weights: the architecture table's plan,
    once it reproduces (layer by layer, as find_plan proves any model) a miniature of the model with random
    weights. Else the reason to convert in memory, where the structure is proven on the real weights."""
    family = family_for(config)
    try:
        miniature = AutoModelForCausalLM.from_config(
            _miniature(config, trust_remote_code), trust_remote_code=trust_remote_code, dtype=torch.float32
        )
        proven, _ = find_plan(miniature)
        expected = dataclasses.replace(family.plan(miniature.config, miniature), tuple_output=proven.tuple_output)
    except Exception as error:  # noqa: BLE001 - the in-memory path proves the structure on the model itself
        return f"its structure could not be proven on a miniature ({type(error).__name__}: {str(error)[:200]})"
    if proven != expected:
        return "the architecture table's structure does not reproduce a miniature of the model"
    # The table's layers are all alike: the full model's plan is the miniature's, with all its layers.
    return dataclasses.replace(expected, layer_kinds=(0,) * int(config.num_hidden_layers))


def _skeleton(
    config: PreTrainedConfig, plan: ModelPlan, dtype: torch.dtype, trust_remote_code: bool, **conversion
) -> AttnResForCausalLM:
    """The converted model with every tensor on the meta device: structure, names, shapes, no memory."""
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        return convert_model(base, plan=plan, **conversion)


def _saved_base_shapes(model: AttnResForCausalLM, added: set[str]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the base tensors save_pretrained writes for MODEL (tied copies dropped, the
    checkpoint format's names restored, e.g. Mixtral's experts one by one), computed on meta tensors. The
    AttnRes tensors keep the contract's names: transformers' renaming patterns are not meant for them."""
    from ..transformers_compat import remove_tied_weights_from_state_dict, revert_weight_conversion

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


def _embedding_dtype(model: AttnResForCausalLM, written: dict[str, OutputTensor]) -> torch.dtype:
    """The dtype the input embedding is written in: the model's dtype when --dtype is auto."""
    embedding = model.get_input_embeddings().weight
    for name, param in model.named_parameters():
        if param is embedding and name in written and DTYPES[written[name].dtype].is_floating_point:
            return DTYPES[written[name].dtype]
    floating = [DTYPES[t.dtype] for t in written.values() if DTYPES[t.dtype].is_floating_point]
    return max(set(floating), key=floating.count) if floating else torch.float32


def base_tensors(folder: Path, dtype: str = "auto") -> list[OutputTensor]:
    """The input's tensors as the converted folder stores them (file by file, in data order), known from the
    safetensors headers alone: what can be copied before the converted model's structure is proven."""
    out_dtype = None if dtype == "auto" else DTYPE_CHOICES[dtype]
    return [OutputTensor.stored(tensor, out_dtype) for tensor in checkpoint_tensors(checkpoint_files(folder) or [])]


def plan_stream(
    folder: Path,
    config: PreTrainedConfig,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    base: list[OutputTensor] | None = None,
    **conversion,
) -> StreamPlan | str:
    """The streamed conversion of the checkpoint in FOLDER, whose tensors BASE gives (default: its safetensors
    files' base_tensors), or the reason it cannot be streamed."""
    base = base_tensors(folder, dtype) if base is None else base
    by_name = {tensor.name: tensor for tensor in base}
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
            return (
                f"tensor {name} has shape {list(tensor.shape)} in the checkpoint, {list(expected[name])} in the model"
            )
    skeleton.config.dtype = out_dtype
    skeleton.config.text_config.dtype = out_dtype
    return StreamPlan(skeleton, base, added, folder)


class BackgroundPlan:
    """plan_stream (and the tokenizer) on a thread, started before the base tensors are copied: the structure
    proof and the meta model cost about a second, which the copy hides. Nothing is published before result()
    returns, so a conversion is still accepted only once its structure is proven."""

    def __init__(self, load_tokenizer: Callable[[], object], *plan_args, **plan_kwargs):
        self._done = threading.Event()
        self._outcome: tuple = ()
        self._thread = threading.Thread(
            target=self._run, args=(load_tokenizer, plan_args, plan_kwargs), name="attnres-plan", daemon=True
        )
        self._thread.start()

    def _run(self, load_tokenizer, plan_args, plan_kwargs) -> None:
        try:
            plan = plan_stream(*plan_args, **plan_kwargs)
            self._outcome = (plan, None if isinstance(plan, str) else load_tokenizer(), None)
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread by result()
            self._outcome = (None, None, error)
        finally:
            self._done.set()

    def check(self) -> None:
        """Raise NotStreamable at once if the plan has failed, so a copy that would be thrown away stops early."""
        if self._done.is_set():
            plan, _, error = self._outcome
            if error is not None or isinstance(plan, str):
                self.result()

    def result(self) -> tuple[StreamPlan, object]:
        """The proven plan and the tokenizer, waiting for them; NotStreamable when the plan failed."""
        self._done.wait()
        plan, tokenizer, error = self._outcome
        if error is not None:
            raise error
        if isinstance(plan, str):
            raise NotStreamable(plan)
        return plan, tokenizer


def _generation_config(plan: StreamPlan) -> GenerationConfig:
    """The input's generation_config.json when it has one (as from_pretrained would load it)."""
    if (plan.source_folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(plan.source_folder)
    return GenerationConfig.from_model_config(plan.skeleton.config.text_config)


def _write_metadata(folder: Path, plan: StreamPlan) -> None:
    """Config, generation config and the self-contained modeling code, as save_pretrained writes them."""
    model = plan.skeleton
    custom_object_save(model, folder, config=model.config)  # the shipped code, and auto_map in the config
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    model.config.save_pretrained(folder)
    _generation_config(plan).save_pretrained(folder)
    missing = [name for name in SHIPPED_CODE if not (folder / name).is_file()]
    if missing:
        raise OutputError(f"internal error: the modeling code {missing} was not copied; the folder would not load")


def write_streamed(
    folder: Path,
    base: list[OutputTensor],
    planning: Callable[[], StreamPlan],
    max_shard_size: int,
    advance: Advance = lambda nbytes: None,
) -> StreamPlan:
    """The base tensors' shards first (while PLANNING, e.g. BackgroundPlan's result, may still be proving the
    structure), then the AttnRes shard, the config and code, and, last, the index. Returns the plan."""
    done: list[StreamPlan] = []

    def attnres_shard() -> list[OutputTensor]:
        done.append(planning())
        _write_metadata(folder, done[0])
        return done[0].added

    write_sharded(folder, plan_shards(base, max_shard_size), advance, last=attnres_shard)
    return done[0]
