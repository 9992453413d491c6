"""Block Attention Residuals around a pretrained PreNorm causal LM.

`AttnResForCausalLM` holds the base model's own modules under their original names (`model.layers.3.mlp...`)
and runs the base model's own forward (embeddings, masks, rotary, cache). Only two things change:

* each decoder layer runs its sublayers (the config's plan, architectures.py) on a depth-attention mix of the earlier
  sources instead of the residual sum, and passes a state (depth_attention.py) to the next layer instead
  of one tensor;
* the final norm first aggregates the sources with one more pseudo-query (the output aggregation).

New parameters, per decoder layer: `self_attention_res_proj.weight` [1, d] (pseudo-query, zero init),
`self_attention_res_norm.weight` [d] (key norm, one init), the same with `mlp_` (absent for a parallel
residual layer); on the base model module: `output_attn_res_proj.weight`, `output_attn_res_norm.weight`.
With `query_rank` r > 0 each query module also holds `down` [r, d] (A, random) and `up` [d, r] (B, zero):
the query becomes input-dependent, w + B A x / rms(x) per token (see `token_queries`).

This file ships next to converted weights and is self-contained: relative imports, torch and
transformers only. Load with `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .architectures import ModelPlan, Sublayer, module_at, output_of, plan_for, times_argument
from .cache_names import CURRENT, INSTALLED, LEGACY, RECURRENT, RECURRENT_STATES, cache_keyword, cache_of
from .configuration_attnres import AttnResConfig
from .depth_attention import STATE_TYPES, TrainState, add_output, close_block, current_stream, depth_mix, start_state, wants_queries
from .depth_core import pseudo_query
from .depth_kernels_cpu import fused_norm
from .depth_modules import AttnResKeyNorm, AttnResQuery, depth_params, init_depth_module, placed
from .depth_plan import SublayerPlan, output_num_sources, plan_sublayers
from .transformers_compat import BETWEEN_LAYER_SHORTCUTS, MissingTransformersInternal, causal_lm_class, internal
from .remote_code import ship_base_code
from .weight_names import default_save_conversions, guard_all


class _LayerSpec(NamedTuple):
    sublayers: tuple[Sublayer, ...]
    plans: tuple[SublayerPlan, ...]
    eps: float
    scaling: str
    argnames: tuple[str, ...]  # the base layer's positional parameters after hidden_states
    capacity: int  # the most sources any reader has (size of the inference SourceBuffer)
    owner: nn.Module  # the base model (a plain reference), whose layers hold every sublayer's query
    layers: str  # the attribute path, from the owner, of the decoder layers
    param_names: tuple[tuple[str, str], ...]  # per sublayer: its query and key-norm modules' names
    tuple_output: int  # > 0: return (state, None, ...) of this length, as the base model unpacks a layer's output
    query_rank: int  # > 0: input-dependent queries (the plain BlockState path, see start_state)
    stream_start: str | None  # the first layer's: its module that makes the first source (ModelPlan.stream_start)
    returns: bool  # a branch's module output is returned after the stream (Branch.returns)
    # P_k (ModelPlan.stream_scales): the base model's stream here is this times the sum of the sources (layer scalars)
    stream_scale: float
    # One per model, shared by its layers and final norm: the decoding buffers a forward without autograd keeps
    # for the next (see start_state), the open recorders (`record_depth_weights`), the training-time depth
    # gate (see `set_depth_gate`) and the config (where the C++ kernels' source is looked for).
    runtime: dict


class AttnResDecoderLayerMixin:
    """Mixed in before a base decoder layer class (see `_attnres_class`); replaces its forward only.

    The base model calls the layer exactly as before; the first layer receives the embeddings, every
    later one the state returned by its predecessor.
    """

    def forward(self, hidden_states, *args, **kwargs):
        spec: _LayerSpec = self._attnres_spec
        # Base models pass some arguments positionally (GPT-2 passes the cache and mask that way).
        call_kwargs = dict(zip(spec.argnames, args), **kwargs) if args else kwargs
        if isinstance(hidden_states, tuple) and len(hidden_states) == 1 and isinstance(hidden_states[0], STATE_TYPES):
            hidden_states = hidden_states[0]  # passed on as returned
        if isinstance(hidden_states, TrainState):
            state = hidden_states.received()  # no views of the layer's inputs handed on (FSDP2)
        elif isinstance(hidden_states, STATE_TYPES):
            state = hidden_states
        else:
            if spec.stream_start:
                hidden_states = module_at(self, spec.stream_start)(hidden_states)
            queries = _all_queries(spec, hidden_states) if wants_queries() and not spec.query_rank else None
            state = start_state(
                hidden_states, spec.eps, spec.capacity, queries, token_queries=spec.query_rank > 0, runtime=spec.runtime
            )
        # Readers take their query from the state where it holds them all, folded once per forward.
        folded = state.queries is not None
        gate = spec.runtime.get("gate", 1.0)
        scale = spec.stream_scale
        # With the C++ kernels a reader's mix can come out normed by its sublayer's norm (see `fused_norm`), where
        # the mix is the norm's whole input.
        native = getattr(state, "native", None) if gate == 1.0 and scale == 1.0 else None
        returned = {} if spec.returns else None
        for sublayer, plan, names in zip(spec.sublayers, spec.plans, spec.param_names):
            if plan.closes_block:
                state = close_block(state, spec.eps, plan.index - 1)
            params = (None, None) if folded else depth_params(self, names)
            projection = self._modules[names[0]].projection() if spec.query_rank else None
            norm = () if native is None else _sublayer_norm(self, sublayer, native)
            h = depth_mix(state, *params, spec.eps, spec.scaling, reader=plan.index - 1, projection=projection, norm=norm)
            if gate != 1.0:
                h = gated(state, h, gate)
            if scale != 1.0:  # the earlier layers' scalars: the stream the base model's sublayer read (stream_scales)
                h = h * scale
            output = run_sublayer(self, sublayer, h, call_kwargs, normed=bool(norm), returned=returned)
            state = add_output(state, output if scale == 1.0 else output / scale)
        if not spec.tuple_output:
            return state
        output = [state] + [None] * (int(spec.tuple_output) - 1)  # (hidden, attention weights) where unpacked
        for position, value in (returned or {}).items():
            output[position] = value  # a recurrent state the base model keeps
        return tuple(output)


def _sublayer_norm(layer: nn.Module, sublayer: Sublayer, native) -> tuple:
    """The norm of a one-branch sublayer for the C++ kernels to apply to its reader's mix (`fused_norm`), or ()."""
    if len(sublayer.branches) != 1:
        return ()
    norm = layer._modules.get(sublayer.branches[0].norm)
    if norm is None:
        return ()
    return fused_norm(native, norm)


def run_sublayer(
    layer: nn.Module, sublayer: Sublayer, h: torch.Tensor, call_kwargs: dict, normed: bool = False, returned: dict | None = None
) -> torch.Tensor:
    """What one sublayer adds to the residual stream read as `h`: the sum of its branches'
    `scale * post(module(norm(h)))` (`normed`: `h` is its one branch's norm(h) already). RETURNED, where given,
    receives the module outputs the layer returns after the stream (Branch.returns), by position. The
    conversion's per-layer proof runs this same function."""
    total, children = None, layer._modules
    if sublayer.side:  # modules whose outputs the branches' modules take as arguments (Gemma 4's router)
        call_kwargs = dict(call_kwargs)
        for name, flat in sublayer.side:
            out = module_at(layer, name)(h.reshape(-1, h.shape[-1]) if flat else h)
            for index, value in enumerate(out if isinstance(out, tuple) else (out,)):
                call_kwargs[output_of(name, index)] = value
    for branch in sublayer.branches:
        # A plain child name is looked up in place (a decoding step pays for every call), a dotted path by module_at.
        module = children.get(branch.module)
        module = module_at(layer, branch.module) if module is None else module
        if normed or not branch.norm:  # normed by the kernel already, or a module that reads the raw stream
            x = h
        else:
            norm = children.get(branch.norm)
            x = (module_at(layer, branch.norm) if norm is None else norm)(h.reshape(-1, h.shape[-1]) if branch.flat else h)
        if branch.flat and x.dim() != 2:
            x = x.reshape(-1, x.shape[-1])
        y = module(x, **branch.call_kwargs(call_kwargs, x)) if branch.attention else module(x)
        if isinstance(y, tuple):  # attention returns (output, weights); some MoE blocks (output, router)
            if returned is not None:
                returned.update((position, y[index]) for position, index in branch.returns)
            y = y[0] if not branch.output_bias or y[branch.output_bias] is None else y[0] + y[branch.output_bias]
        for post in branch.post:
            argument = times_argument(post)
            if argument is not None:  # the branch's value times a layer argument (Gemma 4's per-layer input)
                y = y * call_kwargs[argument]
                continue
            extra = branch.post_kwargs(post, call_kwargs, y) if branch.post_arguments else None
            y = module_at(layer, post)(y) if extra is None else module_at(layer, post)(y, **extra)
            if isinstance(y, tuple):
                y = y[0]
        if y.shape != h.shape:  # a branch that returns its tokens flattened (Llama-4's MoE)
            if y.numel() != h.numel():
                raise ValueError(
                    f"`{branch.module}` ({type(module).__name__}) returned {tuple(y.shape)} for an input of {tuple(h.shape)}: "
                    "the base model's own module mixes up this batch (transformers' RWKV does so when it decodes several "
                    "sequences at once); run one sequence at a time"
                )
            y = y.view(h.shape)
        if branch.scale is not None:
            y = y * branch.scale
        total = y if total is None else total + y
    for post in sublayer.post:  # applied to the sum of the branches (Gemma 4's MoE block)
        total = module_at(layer, post)(total)
        if isinstance(total, tuple):
            total = total[0]
    return total


# Where wrappers keep the module they wrap: activation checkpointing's CheckpointWrapper, FSDP1, DDP-style.
_WRAPPED = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module")


def _decoder_layer(module: nn.Module) -> nn.Module:
    """The converted decoder layer inside the wrappers that activation checkpointing or FSDP1 put in its place
    in the model's layer list."""
    while not isinstance(module, AttnResDecoderLayerMixin):
        inner = next((module._modules[name] for name in _WRAPPED if name in module._modules), None)
        if inner is None:
            break
        module = inner
    return module


OUTPUT_NAMES = ("output_attn_res_proj", "output_attn_res_norm")  # on the base model


def _all_queries(spec: _LayerSpec, like: torch.Tensor) -> torch.Tensor | None:
    """Every sublayer's folded pseudo-query in execution order, then the output aggregation's: [R + 1, D], for
    the score table (inference and eager training) or a decoding step, from which each reader takes its own
    row (the final norm the last); None where the parameters are not whole tensors on one device (sharded or
    spread over devices). Folded in one operation, not one per reader, from the parameters the model holds at
    this call: nothing is kept for the next forward, so no way of changing a weight (in place, through `.data`,
    by swapping modules or tensors, by loading or casting) can leave a stale copy. Keeping them did not pay
    measurably: a SmolLM2 decoding step (~41 ms) took 0.2-0.3 ms longer without them, within its spread between
    runs, and a check that would catch a `.data` update has to read the values, which costs what folding does."""
    found = _query_parameters(spec, like)
    if found is None:
        return None
    queries, key_norms = found
    return pseudo_query(torch.stack(queries), torch.stack(key_norms))


def _query_parameters(spec: _LayerSpec, like: torch.Tensor):
    """(queries, key norms): every sublayer's query and key-norm weights, then the output aggregation's, found
    through the wrappers the layers may have; None where they are not whole tensors on `like`'s device."""
    queries, key_norms = [], []
    layers = module_at(spec.owner, spec.layers)
    readers = [(layer, names) for layer in map(_decoder_layer, layers) for names in layer._attnres_spec.param_names]
    for layer, names in readers + [(spec.owner, OUTPUT_NAMES)]:
        query, key_norm = depth_params(layer, names)
        if (
            type(query) is not nn.Parameter  # a tensor subclass: FSDP2's sharded DTensor
            or query.numel() != like.shape[-1]  # FSDP1's flattened shard
            or key_norm.numel() != like.shape[-1]
            or query.device != like.device
        ):
            return None
        queries.append(query)
        key_norms.append(key_norm)
    return queries, key_norms


class AttnResFinalNormMixin:
    """Mixed in before the base model's final norm: the output aggregation, then the norm itself."""

    def forward(self, hidden_states, *args, **kwargs):
        if isinstance(hidden_states, STATE_TYPES):
            owner, eps, scaling, runtime, scale = self._attnres_output
            state, like = hidden_states, hidden_states.stream
            if getattr(state, "queries", None) is not None:  # folded with the sublayers' (see `_all_queries`)
                native = getattr(state, "native", None) if runtime.get("gate", 1.0) == 1.0 and scale == 1.0 else None
                norm = () if native is None else fused_norm(native, self)
                hidden_states = depth_mix(state, None, None, eps, scaling, reader=-1, norm=norm)
                if norm:
                    return hidden_states  # this norm's output, made with the mix
            else:
                # Looked up on the owner at every call, so a wrapper put in their place (PEFT's
                # modules_to_save, FSDP) is the one used.
                query, key_norm = owner.output_attn_res_proj, owner.output_attn_res_norm
                hidden_states = depth_mix(
                    state, placed(query, like), placed(key_norm, like), eps, scaling,
                    projection=query.projection(like) if isinstance(query, AttnResQuery) else None,
                )
            gate = runtime.get("gate", 1.0)
            if gate != 1.0:
                hidden_states = gated(state, hidden_states, gate)
            if scale != 1.0:  # every layer's scalar (ModelPlan.stream_scales)
                hidden_states = hidden_states * scale
        return super().forward(hidden_states, *args, **kwargs)


def gated(state, mix: torch.Tensor, gate: float) -> torch.Tensor:
    """stream + gate * (mix - stream): a reader's input with its depth mix let in by `gate`, in one operation.
    At gate 0 it is the plain residual stream exactly (0 times a finite difference adds nothing)."""
    return torch.lerp(current_stream(state), mix, gate)


def set_depth_gate(model: nn.Module, gate: float) -> bool:
    """Let every reader of a converted model (PEFT- or Accelerate-wrapped included) read
    stream + gate * (mix - stream) instead of its depth mix: 1 (the default) is AttnRes, 0 the base model's
    plain residual stream, whatever the queries. A training-time schedule (recipe `train.depth_gate_steps`)
    that lets the learned mix in gradually; it is not saved, and a loaded model reads the mix (gate 1).
    Returns False where the model has no AttnRes layers (nothing to gate)."""
    if not 0.0 <= gate <= 1.0:
        raise ValueError(f"the depth gate must be in [0, 1], got {gate}")
    layer = next((m for m in model.modules() if isinstance(m, AttnResDecoderLayerMixin)), None)
    if layer is None:
        return False
    layer._attnres_spec.runtime["gate"] = float(gate)
    return True


def _attnres_class(mixin: type, base_cls: type) -> type:
    """`AttnRes<Base>`: a subclass of the base module class whose forward is the mixin's. Registered in
    this module's namespace so that it pickles, and still an instance of the base class for tools that
    look layers up by type (FSDP wrapping, output capture)."""
    name = f"AttnRes{base_cls.__name__}"
    cls = globals().get(name)
    if cls is None or base_cls not in cls.__mro__:
        cls = type(name, (mixin, base_cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls
    return cls


def positional_argnames(layer_cls: type) -> tuple[str, ...]:
    forward = inspect.unwrap(layer_cls.forward)
    params = list(inspect.signature(forward).parameters.values())[2:]  # self, hidden_states
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def stream_state(state) -> torch.Tensor:
    """The plain residual stream a depth-attention state stands for (sum of all sources): what the base model's
    hidden state would be. Used for `output_hidden_states` and for inspection."""
    if isinstance(state, tuple) and state and isinstance(state[0], STATE_TYPES):
        state = state[0]  # from a layer whose base model takes element 0 of what it returns
    return current_stream(state) if isinstance(state, STATE_TYPES) else state


def attach_depth_attention(causal_lm: nn.Module, config: AttnResConfig, plan: ModelPlan) -> None:
    """Add the AttnRes parameters and forwards to a base causal LM's modules, in place."""
    text_config = config.text_config
    base = module_at(causal_lm, plan.base_model)
    layers = module_at(base, plan.layers)
    if len(layers) != plan.num_layers:
        raise ValueError(f"the structure plan has {plan.num_layers} decoder layers, the model {len(layers)}")
    plans = plan_sublayers(plan.num_sublayers, config.block_size)
    capacity = output_num_sources(plan.num_sublayers, config.block_size)
    eps = plan.eps
    reference = causal_lm.get_input_embeddings().weight  # the causal LM's: a plain-module base model may have none
    factory = {"device": reference.device, "dtype": reference.dtype}
    # Recorded at conversion, read from the layers; else the config's (a composite's: its language model's).
    hidden = config.stream_width or text_config.get_text_config().hidden_size
    rank = config.query_rank
    # One per model: what its forwards keep (see _LayerSpec.runtime); the config says where the model was loaded from.
    runtime = {"config": config}
    first = 0
    scales, output_scale = plan.stream_scales()
    for index, layer in enumerate(layers):
        sublayers = plan.sublayers(index)
        param_names = tuple((f"{sublayer.name}_res_proj", f"{sublayer.name}_res_norm") for sublayer in sublayers)
        base_cls = type(layer)
        if not isinstance(layer, AttnResDecoderLayerMixin):
            layer.__class__ = _attnres_class(AttnResDecoderLayerMixin, base_cls)
            argnames = positional_argnames(base_cls)
        else:
            argnames = layer._attnres_spec.argnames
        for reader, (query_name, key_norm_name) in enumerate(param_names, first):
            layer.add_module(query_name, AttnResQuery(hidden, rank, reader, **factory))
            layer.add_module(key_norm_name, AttnResKeyNorm(hidden, eps, **factory))
        layer._attnres_spec = _LayerSpec(
            sublayers,
            tuple(plans[first : first + len(sublayers)]),
            eps,
            config.source_scaling,
            argnames,
            capacity,
            base,
            plan.layers,
            param_names,
            plan.tuple_output,
            rank,
            plan.stream_start if index == 0 else None,
            any(branch.returns for sublayer in sublayers for branch in sublayer.branches),
            scales[index],
            runtime,
        )
        first += len(sublayers)
    setattr(base, OUTPUT_NAMES[0], AttnResQuery(hidden, rank, plan.num_sublayers, **factory))
    setattr(base, OUTPUT_NAMES[1], AttnResKeyNorm(hidden, eps, **factory))
    norm = module_at(base, plan.final_norm)
    if not isinstance(norm, AttnResFinalNormMixin):
        norm.__class__ = _attnres_class(AttnResFinalNormMixin, type(norm))
    # A plain (unregistered) reference to the owner: the parameters belong to the base model module,
    # where the checkpoint contract puts them; the norm only reads them.
    norm._attnres_output = (base, eps, config.source_scaling, runtime, output_scale)


class AttnResPreTrainedModel(PreTrainedModel):
    config: AttnResConfig
    config_class = AttnResConfig
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=checkpoint, **kwargs):
        # Reentrant checkpointing differentiates only through tensor arguments; the depth-attention state a
        # layer receives is a tuple of tensors, which it would pass through as a constant. Refused here,
        # where transformers hands every entry point's settings over, instead of failing inside a layer.
        if enable and getattr(gradient_checkpointing_func, "keywords", {}).get("use_reentrant"):
            raise ValueError(
                "AttnRes models need non-reentrant activation checkpointing: the depth-attention state passed "
                "between decoder layers is a tuple of tensors, which reentrant checkpointing cannot "
                "differentiate through. Enable it without use_reentrant, or with "
                "gradient_checkpointing_kwargs={'use_reentrant': False} (transformers' default)."
            )
        super()._set_gradient_checkpointing(enable=enable, gradient_checkpointing_func=gradient_checkpointing_func, **kwargs)

    # transformers renames checkpoint keys by the base model's rules when it loads and saves; the AttnRes tensors'
    # own names must come through both untouched (weight_names.py). Saving reads the rules from here.
    @property
    def _weight_conversions(self):
        conversions = self.__dict__.get("_attnres_weight_conversions")
        return guard_all(conversions if conversions is not None else default_save_conversions(self))

    @_weight_conversions.setter
    def _weight_conversions(self, value):
        self.__dict__["_attnres_weight_conversions"] = value

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        guard_all(getattr(load_config, "weight_mapping", None))  # in place: the loading rules
        return PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True) and hasattr(self, "_attnres_base_class"):
            # A base model with its own code (auto_map): that code goes along, imported by base_code.py.
            text_config = self.config.text_config
            ship_base_code(type(text_config), self._attnres_base_class, text_config.model_type, save_directory)

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, (AttnResQuery, AttnResKeyNorm)):
            init_depth_module(module)
        else:
            super()._init_weights(module)

    def initialize_weights(self):
        super().initialize_weights()
        # The base model's own init dispatch does not know the AttnRes modules: queries must start at
        # zero (exactness) and a loaded value must never be overwritten.
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (AttnResQuery, AttnResKeyNorm)):
                    init_depth_module(module, skip_loaded=True)
            fill_unsaved_buffers(self)


def _turn_off_between_layer_shortcuts(model: nn.Module) -> None:
    """Turn off what a base model's loop would do to the hidden states between its layers as an optimisation only
    (BETWEEN_LAYER_SHORTCUTS: Gemma 4's slicing before its KV-shared layers), which a depth-attention state cannot
    undergo; the same function is computed without it."""
    for module in model.modules():
        for attribute, off in BETWEEN_LAYER_SHORTCUTS.items():
            if attribute in module.__dict__:
                setattr(module, attribute, off)


def fill_unsaved_buffers(model: nn.Module) -> None:
    """Runs the base model's own init on itself and on each module holding a non-persistent buffer: a checkpoint
    does not hold those (Falcon-H1's `mup_vector`), and transformers skips a module of custom code (this class)
    whose parameters all loaded, leaving them as uninitialised memory. Loaded tensors carry `_is_hf_initialized`,
    which transformers' init functions respect."""
    plan = model.__dict__.get("_attnres_plan")
    base = module_at(model, plan.base_model) if plan is not None else None
    # A base model that is a plain module (a model's own code): its causal LM class's init, on the converted model
    owner = base if isinstance(base, PreTrainedModel) else model._base_view() if base is not None else None
    if owner is None:
        return
    try:  # torch.nn.init calls made to respect `_is_hf_initialized` too, as transformers' own init does
        guard_torch_init_functions = internal("guard_torch_init_functions")
    except MissingTransformersInternal:
        guard_torch_init_functions = contextlib.nullcontext
    with guard_torch_init_functions():
        for module in base.modules():
            if module is base or getattr(module, "_non_persistent_buffers_set", None):
                owner._init_weights(module)


# What a base model's output holds that the causal-LM output already carries its own way.
_BASE_OUTPUT_FIELDS = frozenset({"last_hidden_state", "hidden_states", "attentions", CURRENT, LEGACY})


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    def __init__(self, config: AttnResConfig, base_model: PreTrainedModel | None = None):
        super().__init__(config)
        if base_model is None:
            base_model = causal_lm_class(config.text_config, config.base_model_type)(config.text_config)
        plan = plan_for(config.text_config, config.structure, base_model)
        self._attnres_plan = plan
        self._attnres_base_class = type(base_model)  # its own code, if any, is saved with the model
        self._is_stateful = getattr(type(base_model), "_is_stateful", False)  # no assisted decoding (RWKV, Mamba)
        # A base class that carries its state between generation steps itself, under its own name (RWKV's `state`):
        # the forward hands that state on in its output.
        own = getattr(type(base_model), "_update_model_kwargs_for_generation", None)
        self._attnres_own_state = own is not None and own is not GenerationMixin._update_model_kwargs_for_generation
        self.base_model_prefix = plan.base_model
        self._tied_weights_keys = getattr(type(base_model), "_tied_weights_keys", None)
        for name, child in base_model.named_children():
            self.add_module(name, child)
        _turn_off_between_layer_shortcuts(self)
        attach_depth_attention(self, config, plan)
        # device_map="auto" must keep each decoder layer whole: its depth-attention parameters are read with
        # its sublayers. The converted layers' classes are AttnRes<Base>; the base names stay for tools
        # that read them off the base model.
        layer_classes = [type(layer).__name__ for layer in module_at(module_at(self, plan.base_model), plan.layers)]
        self._no_split_modules = list(dict.fromkeys([*(base_model._no_split_modules or []), *layer_classes]))
        # The keyword the base model takes its KV cache under (`cache`, or `past_key_values` before
        # transformers renamed it), read once: forward passes the cache on under it, whatever name it came in.
        self._attnres_cache_keyword = cache_keyword(module_at(self, plan.base_model).forward)
        self.post_init()

    def _prepare_cache_for_generation(self, *args, **kwargs):
        # A base model taking its cache under its family's own name (Mamba's `cache_params`, transformers < 5.24):
        # generate names and makes that cache by the model's class, so the base class's view of this model asks.
        if self._attnres_cache_keyword == RECURRENT:
            return self._attnres_base_class._prepare_cache_for_generation(self._base_view(), *args, **kwargs)
        return super()._prepare_cache_for_generation(*args, **kwargs)

    def get_input_embeddings(self):
        base = module_at(self, self._attnres_plan.base_model)
        if hasattr(base, "get_input_embeddings"):
            return base.get_input_embeddings()
        return self._attnres_base_class.get_input_embeddings(self._base_view())  # a plain-module base model

    def set_input_embeddings(self, value):
        base = module_at(self, self._attnres_plan.base_model)
        if hasattr(base, "set_input_embeddings"):
            return base.set_input_embeddings(value)
        return self._attnres_base_class.set_input_embeddings(self._base_view(), value)

    def get_output_embeddings(self):
        return module_at(self, self._attnres_plan.lm_head)

    def set_output_embeddings(self, value):
        parent, _, name = self._attnres_plan.lm_head.rpartition(".")  # a head nested in a module of its own
        setattr(module_at(self, parent), name, value)

    def _base_view(self) -> PreTrainedModel:
        """This model seen as an instance of the base causal-LM class: the same modules and parameters, the
        base model's own config. `generate` asks the base class how to feed its forward (which inputs only the
        prefill takes, e.g. `pixel_values`; a mask made its own way, e.g. Gemma 3's bidirectional image blocks);
        its methods call `super()`, which needs an instance of their class."""
        view = self._attnres_base_class.__new__(self._attnres_base_class)
        view.__dict__.update(self.__dict__)  # shares the module and parameter tables, copies nothing
        view.__dict__["config"] = self.config.text_config
        return view

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self._attnres_base_class.prepare_inputs_for_generation(self._base_view(), *args, **kwargs)

    def _update_model_kwargs_for_generation(self, *args, **kwargs):
        # A base model that keeps its state under its own name (RWKV's `state`) carries it from step to step here.
        if self._attnres_own_state:
            return self._attnres_base_class._update_model_kwargs_for_generation(self._base_view(), *args, **kwargs)
        return super()._update_model_kwargs_for_generation(*args, **kwargs)

    def _supports_default_dynamic_cache(self) -> bool:
        # generate asks this of the instance; the base class answers by its name (RWKV and xLSTM keep their own state).
        return self._attnres_base_class._supports_default_dynamic_cache()

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        # Inputs the base forward takes (pixel values, token type ids, ...) reach it through **kwargs.
        accepted = set(inspect.signature(self._attnres_base_class.forward).parameters)
        super()._validate_model_kwargs({key: value for key, value in model_kwargs.items() if key not in accepted})

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """`cache` is the KV cache under its current name; `past_key_values`, its name before transformers
        renamed it, is accepted too (older callers, and `generate` of a release before the rename)."""
        # generate of a release before the rename passes a recurrent family's cache under its own name (see
        # _prepare_cache_for_generation)
        recurrent = kwargs.pop(RECURRENT, None) if self._attnres_cache_keyword == RECURRENT else None
        for older in (past_key_values, recurrent):
            if older is not None:
                if cache is not None and cache is not older:
                    raise ValueError(
                        "Pass the KV cache once: as `cache` (current), `past_key_values` (older name) or, for a "
                        "recurrent family before transformers renamed it, `cache_params`."
                    )
                cache = older
        if getattr(self.config, "outer_forward", False):  # see _outer_forward
            inputs = dict(kwargs, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
                          use_cache=use_cache, **{self._attnres_cache_keyword: cache})
            return self._outer_forward(input_ids, labels, logits_to_keep, inputs)
        output_hidden_states = kwargs.pop("output_hidden_states", None) or self.config.output_hidden_states
        kwargs.pop("return_dict", None)
        plan = self._attnres_plan
        base = module_at(self, plan.base_model)
        hooks, hidden_states = self._record_streams(base) if output_hidden_states else ([], None)
        try:
            outputs = base(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **{self._attnres_cache_keyword: cache},
                **kwargs,
            )
        finally:
            for hook in hooks:
                hook.remove()
        hidden = outputs.last_hidden_state
        if hidden_states is not None:
            hidden_states.append(hidden)
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.get_output_embeddings()(hidden[:, slice_indices, :])
        # The head's own scalars, applied as the base causal LM applies them.
        if plan.logit_scale is not None:
            logits = logits * plan.logit_scale
        if plan.logit_divisor is not None:
            logits = logits / plan.logit_divisor
        if plan.logit_softcap is not None:
            logits = torch.tanh(logits / plan.logit_softcap) * plan.logit_softcap
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=logits.shape[-1], **kwargs
            )
        result = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{INSTALLED: cache_of(outputs)},
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
            attentions=getattr(outputs, "attentions", None),
        )
        if self._attnres_own_state:  # a state the base model returns under its own name (RWKV's `state`)
            for name, value in outputs.items():
                if name not in _BASE_OUTPUT_FIELDS and value is not None:
                    result[name] = value
        elif self._is_stateful:  # where generate reads it by that name (transformers < 5.24), handed on too
            for name in RECURRENT_STATES:
                if outputs.get(name) is not None:
                    result[name] = outputs[name]
        return result

    def _outer_forward(self, input_ids, labels, logits_to_keep, inputs: dict) -> CausalLMOutputWithPast:
        """The base causal LM's own forward, on these modules (config `outer_forward`, set at conversion): its base
        model, of its own code, is called its own way (`self.trunk(idx)`: no mask or cache, its own argument names,
        hidden states returned bare). The token ids go under `input_ids` where that forward names it, else first;
        INPUTS only where it takes them; its logits are read from its output (a model output, a tensor, a tuple)."""
        forward = self._attnres_base_class.forward
        parameters = inspect.signature(forward).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        given = {k: v for k, v in inputs.items() if v is not None and (takes_all or k in parameters)}
        view = self._base_view()
        outputs = forward(view, input_ids=input_ids, **given) if "input_ids" in parameters else forward(view, input_ids, **given)
        logits = outputs if isinstance(outputs, torch.Tensor) else getattr(outputs, "logits", None)
        if logits is None:  # a tuple: (logits, loss)
            logits = next(v for v in outputs if isinstance(v, torch.Tensor) and v.dim() == 3)
        if logits_to_keep:
            logits = logits[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep]
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{INSTALLED: cache_of(outputs)})

    def _record_streams(self, base) -> tuple[list, list]:
        """Hidden states as the base model defines them (embeddings, each layer's output stream, final
        normed state), so `output_hidden_states=True` means what it means for the base model."""
        recorded: list[torch.Tensor] = []
        layers = module_at(base, self._attnres_plan.layers)

        def first(module, args):
            if not recorded:
                recorded.append(args[0])

        scales = self._attnres_plan.stream_scales()[0]  # the stream after layer k is P_(k+1) times the sources' sum

        def after(module, args, output, scale=1.0):
            stream = stream_state(output)
            recorded.append(stream if scale == 1.0 else stream * scale)

        hooks = [layers[0].register_forward_pre_hook(first)]
        hooks += [layer.register_forward_hook(functools.partial(after, scale=scale))
                  for layer, scale in zip(layers[:-1], scales[1:])]
        return hooks, recorded


__all__ = ["AttnResForCausalLM", "AttnResPreTrainedModel", "run_sublayer"]
