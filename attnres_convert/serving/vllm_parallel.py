"""Tensor parallelism for a converted model under vLLM: the base model's own plan (`base_model_tp_plan`, which
transformers and vLLM's Transformers backend shard by) applied to the base model's modules.

Each `nn.Linear` becomes the vLLM layer of its planned style (`colwise`: output rows sharded; `rowwise`: input
columns sharded, the outputs all-reduced; unplanned: replicated), so each rank holds its shard and vLLM's loader
and quantization see the weights. A mixture of experts' 3D weights are sliced along the experts' hidden width
(`packed_colwise`: the gate and up halves each; `rowwise`: the down projection's input) and the experts' output
all-reduced (`moe_tp_experts`). Attention heads follow from the sharded projections: transformers' modules
reshape to (..., -1, head_dim), so each rank computes its own heads.

vLLM's Transformers-backend fusers merge what they recognise in the base model's own modules as they do for any
transformers model (q, k and v into one layer, a GLU's gate and up, RMSNorms into vLLM's: `fusions`); the
checkpoint's separate weights load into the fused layer's shards.

The depth mix needs nothing: it reads whole hidden vectors (sublayer outputs after a row-parallel all-reduce,
embeddings, norms), which every rank holds, so it runs replicated on each rank as it is."""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import ColumnParallelLinear, LinearBase
from vllm.model_executor.models.transformers.utils import replace_linear_class

try:  # vLLM's Transformers backend's fusers (vLLM 0.32 and later); without them the layers are replaced one by one
    from vllm.model_executor.models.transformers.fuser import get_fusers
    from vllm.model_executor.models.transformers.fusers import AttentionFuser
except ImportError:
    get_fusers = AttentionFuser = None

from attnres_convert.modeling.modeling_attnres import ModelPlan, module_at
from attnres_convert.serving.vllm_support import ServingRefused

logger = init_logger(__name__)

# Styles `shard_model` leaves as they are: norms, whole on every rank, and the embedding, which the serving class
# has made vLLM's vocabulary-parallel one already (`AttnResForCausalLMVllm._replace_vocabulary`).
WHOLE_STYLES = {"replicated_with_grad_allreduce", "embedding_rowwise", "replicate", "gather"}
EXPERTS_STYLE = "moe_tp_experts"
# The dimension of an experts' 3D weight each style slices, and whether it holds two halves (gate, up) to slice
# each: [experts, out, in] weights are planned packed_colwise / rowwise, transposed ones ([experts, in, out],
# Llama 4) packed_rowwise / colwise, and in both the slice falls on the experts' hidden width.
EXPERT_PARAMETER_STYLES = {
    "packed_colwise": (1, True),
    "rowwise": (2, False),
    "packed_rowwise": (2, True),
    "colwise": (1, False),
}


def plan_patterns(tp_plan: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    """'layers.*.self_attn.q_proj' -> a pattern matching 'layers.3.self_attn.q_proj' whole."""
    return [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in tp_plan.items()]


def style_of(patterns: list[tuple[re.Pattern, str]], name: str) -> str | None:
    return next((style for pattern, style in patterns if pattern.fullmatch(name)), None)


def check_divisible(family: str, text_config, tp: int) -> None:
    """Heads, key-value heads: each rank must hold whole heads of each."""
    for field in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(text_config, field, None)
        if isinstance(count, int) and count % tp:
            raise ServingRefused(
                family,
                f"tensor parallelism {tp} needs {field} ({count}) divisible by it, so that each rank holds whole heads; "
                f"choose a --tensor-parallel-size that divides {count}",
            )


def expert_loader(dim: int, packed: bool, rank: int, tp: int):
    """A weight loader taking the whole [experts, out, in] tensor and keeping this rank's slice along DIM (with
    PACKED, the slice of each half: the gate's and the up projection's)."""

    def load(param: torch.Tensor, whole: torch.Tensor) -> None:
        halves = whole.chunk(2, dim) if packed else (whole,)
        piece = torch.cat([half.chunk(tp, dim)[rank] for half in halves], dim)
        if piece.shape != param.shape:
            raise ValueError(f"expert weight {tuple(whole.shape)} does not shard into {tuple(param.shape)}")
        param.data.copy_(piece)

    return load


def _all_reduce_output(module, inputs, output):
    return tensor_model_parallel_all_reduce(output)


def shard_experts(family: str, qual: str, experts: nn.Module, patterns, rank: int, tp: int) -> None:
    for name, param in list(experts.named_parameters(recurse=False)):
        style = style_of(patterns, f"{qual}.{name}")
        dim, packed = EXPERT_PARAMETER_STYLES.get(style, (None, False))
        if dim is None or param.dim() != 3 or param.shape[dim] % (2 * tp if packed else tp):
            raise ServingRefused(
                family,
                f"its experts' parameter {qual}.{name} {tuple(param.shape)} has tensor-parallel style {style!r}, "
                f"which the converted model's serving does not shard (it shards 3D expert weights planned "
                f"{', '.join(EXPERT_PARAMETER_STYLES)}, evenly)",
            )
        shape = list(param.shape)
        shape[dim] //= tp
        sharded = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device), requires_grad=False)
        sharded.weight_loader = expert_loader(dim, packed, rank, tp)
        setattr(experts, name, sharded)
    experts.register_forward_hook(_all_reduce_output)  # each rank's experts add their part of every output


def fusions(module: nn.Module, vllm_config) -> list:
    """vLLM's Transformers-backend fusions that apply to MODULE, in the order that backend applies them: q, k and v
    into one `QKVParallelLinear`, a GLU's gate and up into one `MergedColumnParallelLinear` with vLLM's activation,
    an RMSNorm into vLLM's. Not the attention fuser (the serving class attaches its own attention), and nothing on
    the converted layers and final norm, whose forwards are the depth mix's."""
    if get_fusers is None or hasattr(module, "_attnres_spec") or hasattr(module, "_attnres_output"):
        return []
    chosen, redefined = [], False
    for fuser in get_fusers(module):
        if isinstance(fuser, AttentionFuser) or (fuser.redefines_forward and redefined):
            continue
        if fuser.validate(module, vllm_config):
            redefined = redefined or fuser.redefines_forward
            chosen.append(fuser)
    return chosen


def shard_model(
    model: nn.Module, plan: ModelPlan, text_config, family: str, vllm_config, fuse: bool = True
) -> tuple[dict, list[str]]:
    """Replace the base model's linear layers with vLLM's (sharded by the plan where TP > 1), fusing them as vLLM's
    Transformers backend does where FUSE (`fusions`). Returns where the checkpoint's fused weights go, {module name:
    (fused module name, shard id)}, e.g. `model.layers.0.self_attn.q_proj` -> (`...self_attn.qkv_proj`, "q"), and
    the names of the modules fused.
    The model is still on the meta device: the new layers allocate their (sharded) weights, vLLM's loader fills
    them (`vllm_weights.load_checkpoint`)."""
    quant_config = vllm_config.quant_config
    tp = get_tensor_model_parallel_world_size()
    tp_plan = dict(getattr(text_config, "base_model_tp_plan", None) or {})
    if tp > 1:
        if not tp_plan:
            raise ServingRefused(
                family,
                f"tensor parallelism needs the base model's tensor-parallel plan (`base_model_tp_plan` in its config), "
                f"which transformers' {type(text_config).__name__} does not define; serve it with --tensor-parallel-size 1",
            )
        check_divisible(family, text_config, tp)
    patterns = plan_patterns(tp_plan)
    rank = get_tensor_model_parallel_rank()
    # The language model the plan describes: the base model, or inside an image-text one, the module holding its
    # decoder layers (Gemma 3's `language_model`); a vision tower, unused when serving text, is left as it is.
    base, language_model = module_at(model, plan.base_model), plan.layers.rpartition(".")[0]
    root = module_at(base, language_model) if language_model else base
    prefix = ".".join(filter(None, [plan.base_model, language_model]))  # the root's name in the model
    stacked: dict[str, tuple[str, str | int]] = {}
    fused: list[str] = []
    # Parents before children: a module fused in place is visited afterwards with its fused children.
    for owner_name, owner in list(root.named_modules()):
        for child_name, child in list(owner.named_children()):
            qual = f"{owner_name}.{child_name}" if owner_name else child_name
            name = f"{prefix}.{qual}" if prefix else qual
            style = style_of(patterns, qual) if tp > 1 else None
            if type(child) is nn.Linear:  # exactly: a subclass may compute otherwise
                # vLLM's styles: colwise, rowwise, their gather variants; an unplanned layer is replicated.
                new = replace_linear_class(child, style or "replicate", quant_config, prefix=name)
                setattr(owner, child_name, new)
            elif isinstance(child, LinearBase):  # made by its parent's fusion (o_proj beside qkv_proj, a GLU's down)
                continue
            elif style == EXPERTS_STYLE:
                shard_experts(family, qual, child, patterns, rank, tp)
            elif style is not None and style not in WHOLE_STYLES:
                raise ServingRefused(
                    family,
                    f"its tensor-parallel plan gives {qual} ({type(child).__name__}) the style {style!r}, which the "
                    "converted model's serving does not apply; serve it with --tensor-parallel-size 1",
                )
            else:
                new = child
                for fuser in fusions(child, vllm_config) if fuse else ():
                    new = fuser.fuse(new, name, vllm_config)
                    logger.info_once(fuser.info(child_name))  # as vLLM's Transformers backend logs each kind
                    stacked.update(fuser.orig_to_new_stacked(name))
                    if quant_config is not None:  # which checkpoint layers a fused one quantizes as
                        quant_config.packed_modules_mapping.update(fuser.packed_modules_mapping)
                    fused.append(name)
                if new is not child:
                    setattr(owner, child_name, new)
    return stacked, fused


def materialize(model: nn.Module, device) -> None:
    """Every parameter still on the meta device made real (zeros) on DEVICE, shared ones (a tied head) kept shared."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.device.type != "meta":
                continue
            if id(param) not in made:
                made[id(param)] = real = nn.Parameter(
                    torch.zeros(param.shape, dtype=param.dtype, device=device), requires_grad=False
                )
                real.__dict__.update(param.__dict__)  # its weight_loader, where it has one
            setattr(module, name, made[id(param)])


@contextmanager
def shapes_only_linears(model: nn.Module):
    """vLLM's linear layers answering with zeros of their output's shape: the probe forward at engine start (which
    reads the attention's shapes) runs before the loader, and vLLM's CPU layers compute only once it has run
    (their `process_weights_after_loading` prepares the weights)."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]

    def zeros(layer):
        sharded = isinstance(layer, ColumnParallelLinear) and not layer.gather_output
        width = layer.output_size_per_partition if sharded else layer.output_size
        return lambda x: x.new_zeros(*x.shape[:-1], width)

    for layer in layers:
        layer.forward = zeros(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def rank_bytes(model: nn.Module, base: nn.Module) -> dict[str, int]:
    """The bytes of this rank's weights: all, and those of the base model's vLLM linear layers (its shards)."""
    linear = {id(p) for m in base.modules() if isinstance(m, LinearBase) for p in m.parameters(recurse=False)}
    params = {id(p): p for p in model.parameters()}
    size = {key: p.numel() * p.element_size() for key, p in params.items()}
    return {"all": sum(size.values()), "linear": sum(v for key, v in size.items() if key in linear)}


def rank_heads(per_head: torch.Tensor, heads: int) -> torch.Tensor:
    """This rank's HEADS entries of a tensor over all the model's heads (a view), or the tensor where it holds
    those already (TP 1, or heads kept whole by the plan)."""
    if per_head.shape[0] == heads:
        return per_head
    return per_head.narrow(0, get_tensor_model_parallel_rank() * heads, heads)
