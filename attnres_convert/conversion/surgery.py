"""Model surgery: turn a loaded base causal LM into an AttnResForCausalLM, in place.

The base model's modules are adopted, not copied, so converting costs no second copy of the weights.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn
from transformers import PreTrainedModel

from ..architectures import (
    FAMILIES,
    ModelPlan,
    UnsupportedModelError,
    config_refusal,
    family_for,
    module_at,
    plan_to_dict,
)
from ..block_sizes import default_block_size
from ..io.base_code import BASE_CODE, base_code_files, is_own_code
from ..io.saving import register_auto_classes
from ..modeling import SHIPPED_CODE
from ..modeling.configuration_attnres import AttnResConfig
from ..modeling.modeling_attnres import (
    AttnResForCausalLM,
    AttnResKeyNorm,
    AttnResQuery,
    cache_keyword,
    output_num_sources,
    plan_sublayers,
)
from . import stream_settings
from .discovery import find_plan
from .proof import check_converted

DEFAULT_NUM_BLOCKS = 8


class BlockSizeError(ValueError):
    """An impossible or conflicting block size / block count."""


@dataclass(frozen=True)
class Structure:
    """The sublayer layout of a base model, as the conversion sees it."""

    model_type: str
    num_layers: int
    sublayers_per_layer: int  # of the first layer (layers of one model may differ)
    num_sublayers: int

    @classmethod
    def of_plan(cls, model_type: str, plan: ModelPlan) -> Structure:
        return cls(model_type, plan.num_layers, len(plan.sublayers(0)), plan.num_sublayers)


def structure_of(config) -> Structure | None:
    """The sublayer layout from the config alone where the architecture table knows the model type (block
    sizes are then checked before any weights are read); None where it takes the loaded model to find it.
    UnsupportedModelError where the config alone says the model cannot be converted."""
    refusal = config_refusal(config)
    if refusal:
        raise UnsupportedModelError(f"{refusal}.")
    if not any(config.model_type in family.model_types for family in FAMILIES):
        return None
    per_layer, layers = len(family_for(config).sublayers(config)), int(config.num_hidden_layers)
    return Structure(config.model_type, layers, per_layer, per_layer * layers)


def structure_of_model(model: PreTrainedModel) -> Structure:
    """The sublayer layout of a loaded base model: its proven structure plan."""
    plan, _ = find_plan(model)
    return Structure.of_plan(model.config.model_type, plan)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BlockSizeError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise BlockSizeError(f"{name} must be >= 1, got {value}")
    return value


def resolve_block_size(
    structure: Structure, block_size: int | None = None, num_blocks: int | None = None, full: bool = False
) -> int:
    """S from at most one of: an explicit S, a block count (smallest whole-layer S giving at most that
    many blocks), or Full AttnRes (S = 1). Default: at most 8 blocks."""
    chosen = [name for name, value in (("--block-size", block_size), ("--num-blocks", num_blocks)) if value is not None]
    if full:
        chosen.append("--full")
    if len(chosen) > 1:
        raise BlockSizeError(f"give only one of --block-size, --num-blocks, --full (got {', '.join(chosen)})")
    total = structure.num_sublayers
    if full:
        return 1
    if block_size is not None:
        block_size = _positive_int("block size", block_size)
        if block_size > total:
            raise BlockSizeError(
                f"block size {block_size} is larger than the model's {total} sublayers "
                f"({structure.num_layers} layers x {structure.sublayers_per_layer}); use at most {total} (one block)"
            )
        return block_size
    if num_blocks is None:
        num_blocks = DEFAULT_NUM_BLOCKS
    elif _positive_int("number of blocks", num_blocks) > total:
        raise BlockSizeError(f"{num_blocks} blocks is more than the model's {total} sublayers; use at most {total}")
    return default_block_size(total, structure.sublayers_per_layer, num_blocks)


def check_query_rank(query_rank) -> int:
    """The rank of the input-dependent queries: a whole number >= 0 (0: static queries)."""
    if isinstance(query_rank, bool) or not isinstance(query_rank, int) or query_rank < 0:
        raise ValueError(
            f"query rank {query_rank!r} is not valid: give a whole number >= 0 (0, the default, keeps static queries; "
            "4 or 8 adds a small input-dependent part to every query)"
        )
    return query_rank


def _mark_initialized(model: nn.Module) -> None:
    # post_init of the new model must not re-initialise weights that are already trained.
    for tensor in list(model.parameters()) + list(model.buffers()):
        tensor._is_hf_initialized = True
    for module in model.modules():
        module._is_hf_initialized = True


def convert_model(
    base_model: PreTrainedModel,
    block_size: int | None = None,
    num_blocks: int | None = None,
    full: bool = False,
    source_scaling: str = "count",
    plan: ModelPlan | None = None,
    query_rank: int = 0,
    additive: bool = False,
) -> AttnResForCausalLM:
    """Wrap a loaded base causal LM as Block AttnRes. Zero queries: the result reproduces the base.

    The base model object is consumed: its modules now belong to the returned model. PLAN, a structure
    proven on another instance of the same architecture, is for a model without weights (meta tensors,
    streaming.py); by default the structure is found and proven on this model. QUERY_RANK > 0 makes the
    queries input-dependent (AttnResConfig.query_rank), ADDITIVE mixes Delta-style (AttnResConfig.additive): both still
    exact at conversion.
    """
    if isinstance(base_model, AttnResForCausalLM):
        raise UnsupportedModelError("this model is already an AttnRes model; convert the base model instead")
    config = base_model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{config.model_type} is an encoder-decoder; only decoder-only PreNorm causal LMs are supported"
        )
    refusal = config_refusal(config)
    if refusal:
        raise UnsupportedModelError(f"{refusal}.")
    _check_base_code(base_model)
    stream_settings.settle(base_model)
    trace = None
    if plan is None:
        plan, trace = find_plan(base_model)  # proven layer by layer on this very model, or refused
    size = resolve_block_size(Structure.of_plan(config.model_type, plan), block_size, num_blocks, full)
    query_rank = check_query_rank(query_rank)
    # A composite config resets its sub-config's attention and MoE-experts implementations: keep the base model's
    # (another experts kernel rounds differently in half precision, and a reload would pick the base model's).
    attn_implementation, dtype = config._attn_implementation, config.dtype
    experts_implementation = getattr(config, "_experts_implementation", None)
    attn_config = AttnResConfig(
        text_config=config,
        block_size=size,
        source_scaling=source_scaling,
        structure=plan_to_dict(plan),
        query_rank=query_rank,
        additive=bool(additive),
        stream_width=_stream_width(base_model, plan, trace),
    )
    if runs_outer_forward(base_model, plan, trace):
        attn_config.outer_forward = True
    attn_config._attn_implementation = attn_implementation
    if experts_implementation is not None:
        attn_config.text_config._experts_implementation = experts_implementation
    attn_config.dtype = dtype
    _mark_initialized(base_model)
    register_auto_classes()  # so that model.save_pretrained writes a folder that loads anywhere
    model = AttnResForCausalLM(attn_config, base_model=base_model)
    if getattr(base_model, "generation_config", None) is not None:  # none where the class cannot generate
        model.generation_config = base_model.generation_config
    model.name_or_path = base_model.name_or_path
    model.train(base_model.training)
    if trace is not None and source_scaling == "count":  # "mean" is meant to differ (models trained from scratch)
        check_converted(model, trace)
    return model


# What the converted model passes the base model (modeling_attnres.AttnResForCausalLM.forward), besides its cache.
BASE_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "use_cache")


def runs_outer_forward(base_model: PreTrainedModel, plan: ModelPlan, trace) -> bool:
    """Whether the converted model must run the base causal LM's own forward on its modules (config
    `outer_forward`) instead of calling the base model itself: a model with its own code whose base model (a plain
    module, often) does not take the inputs transformers' base models take (`forward(idx)`: no mask, no cache, its
    own names) or returns its hidden states bare, not as a model output. The outer forward calls it its own way."""
    if trace is None or not is_own_code(type(base_model)):  # transformers' models: the call the shipped code makes
        return False
    base = module_at(base_model, plan.base_model)
    try:
        parameters = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return True
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    wanted = (*BASE_MODEL_INPUTS, cache_keyword(base.forward))
    return not trace.base_output or not (takes_all or all(name in parameters for name in wanted))


def _stream_width(base_model: PreTrainedModel, plan: ModelPlan, trace) -> int:
    """d, the residual stream's width: what the first decoder layer received in the traced forward, else (a plan
    given for a model without weights) the config's hidden size, else the width of the stack's first norm."""
    if trace is not None:
        return int(trace.calls[0].hidden.shape[-1])
    hidden = getattr(base_model.config.get_text_config(), "hidden_size", None)
    if isinstance(hidden, int):
        return hidden
    layer = module_at(module_at(base_model, plan.base_model), plan.layers)[0]
    return int(module_at(layer, plan.sublayers(0)[0].branches[0].norm).weight.shape[-1])


def _check_base_code(base_model: PreTrainedModel) -> None:
    """A base model's own code is shipped beside the converted model's (remote_code.py) and registered under its
    model type: no file may share a name with ours, and the type must not be one transformers ships (the folder
    would then build transformers' implementation, not the model's own)."""
    from ..transformers_compat import CONFIG_MAPPING_NAMES

    files = base_code_files(type(base_model.config), type(base_model))
    model_type = base_model.config.model_type
    if files and model_type in CONFIG_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"the model's own code (auto_map) declares model_type {model_type!r}, which transformers also ships: a "
            "converted folder cannot load that code instead of transformers' own. Convert without "
            "--trust-remote-code to use transformers' implementation of the model type"
        )
    clashes = sorted(set(files) & {*SHIPPED_CODE, BASE_CODE})
    if clashes:
        raise UnsupportedModelError(
            f"the model's own code has files named like the converted model's code ({', '.join(clashes)}), and both "
            "must ship in one folder: rename them in the model's folder (and its config.json auto_map), then convert again"
        )


@dataclass
class ConversionSummary:
    model_type: str
    num_layers: int
    num_sublayers: int
    block_size: int
    num_blocks: int
    sources_per_sublayer: list[int]
    output_sources: int
    params_added: int
    params_total: int
    query_rank: int = 0
    additive: bool = False


def summarize(model: AttnResForCausalLM) -> ConversionSummary:
    config = model.config
    structure = Structure.of_plan(config.text_config.model_type, model._attnres_plan)
    total = structure.num_sublayers
    added = sum(
        p.numel() for m in model.modules() if isinstance(m, (AttnResQuery, AttnResKeyNorm)) for p in m.parameters()
    )
    return ConversionSummary(
        model_type=structure.model_type,
        num_layers=structure.num_layers,
        num_sublayers=total,
        block_size=config.block_size,
        num_blocks=-(-total // config.block_size),
        sources_per_sublayer=[p.num_sources for p in plan_sublayers(total, config.block_size)],
        output_sources=output_num_sources(total, config.block_size),
        params_added=added,
        params_total=sum(p.numel() for p in model.parameters()),
        query_rank=config.query_rank,
        additive=config.additive,
    )
