"""Block Attention Residuals around a pretrained PreNorm causal LM.

`AttnResForCausalLM` holds the base model's own modules under their original names (`model.layers.3.mlp...`)
and runs the base model's own forward (embeddings, masks, rotary, cache). Only two things change:

* each decoder layer runs its sublayers (the config's plan, `ModelPlan`) on a depth-attention mix of the earlier
  sources instead of the residual sum, and passes a state (`DepthState`) to the next layer instead of one tensor;
* the final norm first aggregates the sources with one more pseudo-query (the output aggregation).

New parameters, per decoder layer: `self_attention_res_proj.weight` [1, d] (pseudo-query, zero init),
`self_attention_res_norm.weight` [d] (key norm, one init), the same with `mlp_` (absent for a parallel
residual layer); on the base model module: `output_attn_res_proj.weight`, `output_attn_res_norm.weight`.
With `query_rank` r > 0 each query module also holds `down` [r, d] (A, random) and `up` [d, r] (B, zero):
the query becomes input-dependent, w + B A x / rms(x) per token (see `token_queries`). With `additive`, `gate` [1]
(zero): the reader reads the stream plus the gated mix (`additive_mix_and_weights`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .block_plan import SublayerPlan, output_num_sources, plan_sublayers
from .cache_names import CURRENT, INSTALLED, LEGACY, RECURRENT, RECURRENT_STATES, cache_keyword, cache_of
from .compat import BETWEEN_LAYER_SHORTCUTS, causal_lm_class
from .configuration_attnres import AttnResConfig
from .depth_math import pseudo_query
from .depth_modules import AttnResKeyNorm, AttnResQuery, depth_params, init_depth_module, placed
from .depth_state import ModelRuntime, depth_mix, is_state, start_state, wants_queries
from .structure import ModelPlan, Sublayer, module_at, output_of, times_argument
from .weight_names import default_save_conversions, guard_all


@dataclass(frozen=True)
class LayerSpec:
    """What a converted decoder layer's forward reads, set once at conversion (`attach_depth_attention`)."""

    sublayers: tuple[Sublayer, ...]
    plans: tuple[SublayerPlan, ...]
    eps: float
    scaling: str
    argnames: tuple[str, ...]  # the base layer's positional parameters after hidden_states
    capacity: int  # the most sources any reader has (the size of the inference buffers)
    owner: nn.Module  # the base model (a plain reference), whose layers hold every sublayer's query
    layers: str  # the attribute path, from the owner, of the decoder layers
    param_names: tuple[tuple[str, str], ...]  # per sublayer: its query and key-norm modules' names
    tuple_output: int  # > 0: return (state, None, ...) of this length, as the base model unpacks a layer's output
    plain: bool  # input-dependent queries or an additive mix: the plain BlockState path (see start_state)
    stream_start: str | None  # the first layer's: its module that makes the first source (ModelPlan.stream_start)
    returns: bool  # a branch's module output is returned after the stream (Branch.returns)
    stream_scale: float  # P_k (ModelPlan.stream_scales): the base model's stream is P_k times the sources' sum
    runtime: ModelRuntime  # one per model, shared by its layers and final norm


@dataclass(frozen=True)
class OutputSpec:
    """What the converted final norm reads: the output aggregation's settings."""

    owner: nn.Module  # the base model (a plain reference), which holds the output aggregation's parameters
    eps: float
    scaling: str
    runtime: ModelRuntime
    stream_scale: float  # every layer's scalar (ModelPlan.stream_scales)


class AttnResDecoderLayerMixin:
    """Mixed in before a base decoder layer class; its forward receives the embeddings (the first layer) or the state
    its predecessor returned, and the base model calls the layer exactly as before."""

    def forward(self, hidden_states, *args, **kwargs):
        spec: LayerSpec = self._attnres_spec
        # Base models pass some arguments positionally (GPT-2 passes the cache and mask that way).
        call_kwargs = dict(zip(spec.argnames, args), **kwargs) if args else kwargs
        if isinstance(hidden_states, tuple) and len(hidden_states) == 1 and is_state(hidden_states[0]):
            hidden_states = hidden_states[0]  # passed on as returned
        if is_state(hidden_states):
            received = getattr(hidden_states, "received", None)  # a state that copies views it was handed (FSDP2)
            state = hidden_states if received is None else received()
        else:
            if spec.stream_start:
                hidden_states = module_at(self, spec.stream_start)(hidden_states)
            queries = _all_queries(spec, hidden_states) if wants_queries() and not spec.plain else None
            state = start_state(hidden_states, spec.eps, spec.capacity, queries, plain=spec.plain, runtime=spec.runtime)
        # Readers take their query from the state where it holds them all, folded once per forward.
        folded = state.queries is not None
        scale = spec.stream_scale
        # A kernel backend may hand a reader's mix out already normed by its sublayer's norm (`fuse_norm`).
        fuse = getattr(state, "fuse_norm", None) if scale == 1.0 else None
        returned = {} if spec.returns else None
        for sublayer, plan, names in zip(spec.sublayers, spec.plans, spec.param_names):
            if plan.closes_block:
                state = state.close(spec.eps, plan.index - 1)
            params = (None, None) if folded else depth_params(self, names)
            projection, gate = self._modules[names[0]].plain_inputs() if spec.plain else (None, None)
            # the state's form of a one-branch sublayer's norm, which it applies to the reader's mix, or ()
            single = fuse is not None and len(sublayer.branches) == 1
            norm = self._modules.get(sublayer.branches[0].norm) if single else None
            norm = () if norm is None else fuse(norm)
            h = depth_mix(state, *params, spec.eps, spec.scaling, plan.index - 1, projection, norm, gate)
            if scale != 1.0:  # the earlier layers' scalars: the stream the base model's sublayer read (stream_scales)
                h = h * scale
            output = run_sublayer(self, sublayer, h, call_kwargs, normed=bool(norm), returned=returned)
            state = state.add(output if scale == 1.0 else output / scale)
        if not spec.tuple_output:
            return state
        output = [state] + [None] * (int(spec.tuple_output) - 1)  # (hidden, attention weights) where unpacked
        for position, value in (returned or {}).items():
            output[position] = value  # a recurrent state the base model keeps
        return tuple(output)


def run_sublayer(
    layer: nn.Module, sublayer: Sublayer, h, call_kwargs: dict, normed=False, returned=None
) -> torch.Tensor:
    """What one sublayer adds to the stream read as `h`: the sum of its branches' `scale * post(module(norm(h)))`
    (`normed`: `h` is normed already); RETURNED gets the outputs the layer returns too. The conversion proves it."""
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
            x = (module_at(layer, branch.norm) if norm is None else norm)(
                h.reshape(-1, h.shape[-1]) if branch.flat else h
            )
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
                    f"`{branch.module}` ({type(module).__name__}) returned {tuple(y.shape)} for an input of "
                    f"{tuple(h.shape)}: the base model's own module mixes up this batch (transformers' RWKV does so "
                    "when it decodes several sequences at once); run one sequence at a time"
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
    """The converted decoder layer inside the wrappers of activation checkpointing or FSDP1."""
    while not isinstance(module, AttnResDecoderLayerMixin):
        inner = next((module._modules[name] for name in _WRAPPED if name in module._modules), None)
        if inner is None:
            break
        module = inner
    return module


OUTPUT_NAMES = ("output_attn_res_proj", "output_attn_res_norm")  # on the base model


def _all_queries(spec: LayerSpec, like: torch.Tensor) -> torch.Tensor | None:
    """Every reader's folded pseudo-query in execution order, the output aggregation's last: [R + 1, D], for the
    score table; None where the parameters are not whole tensors on one device (sharded, spread over devices).
    Folded at every forward from the parameters as they are: nothing is kept that a changed weight could stale."""
    found = _query_parameters(spec, like)
    if found is None:
        return None
    queries, key_norms = found
    return pseudo_query(torch.stack(queries), torch.stack(key_norms))


def _query_parameters(spec: LayerSpec, like: torch.Tensor):
    """(queries, key norms) of every reader, found through the layers' wrappers; None where they are not whole
    tensors on `like`'s device."""
    queries, key_norms = [], []
    layers = module_at(spec.owner, spec.layers)
    readers = [(layer, names) for layer in map(_decoder_layer, layers) for names in layer._attnres_spec.param_names]
    for layer, names in readers + [(spec.owner, OUTPUT_NAMES)]:
        query, key_norm = depth_params(layer, names)
        whole = query.numel() == key_norm.numel() == like.shape[-1]  # not FSDP1's flattened shard
        if type(query) is not nn.Parameter or not whole or query.device != like.device:  # a subclass: FSDP2's DTensor
            return None
        queries.append(query)
        key_norms.append(key_norm)
    return queries, key_norms


class AttnResFinalNormMixin:
    """Mixed in before the base model's final norm: the output aggregation, then the norm itself."""

    def forward(self, hidden_states, *args, **kwargs):
        if is_state(hidden_states):
            spec: OutputSpec = self._attnres_output
            owner, eps, scaling, scale = spec.owner, spec.eps, spec.scaling, spec.stream_scale
            state, like = hidden_states, hidden_states.stream
            if state.queries is not None:  # folded with the sublayers' (see `_all_queries`)
                fuse = getattr(state, "fuse_norm", None) if scale == 1.0 else None
                norm = () if fuse is None else fuse(self)
                hidden_states = depth_mix(state, None, None, eps, scaling, reader=-1, norm=norm)
                if norm:
                    return hidden_states  # this norm's output, made with the mix
            else:
                # Looked up at every call: a wrapper put in their place (PEFT's modules_to_save, FSDP) is used.
                query, key_norm = owner.output_attn_res_proj, owner.output_attn_res_norm
                projection, gate = query.plain_inputs(like) if isinstance(query, AttnResQuery) else (None, None)
                weights = placed(query, like), placed(key_norm, like)
                hidden_states = depth_mix(state, *weights, eps, scaling, projection=projection, gate=gate)
            if scale != 1.0:  # every layer's scalar (ModelPlan.stream_scales)
                hidden_states = hidden_states * scale
        return super().forward(hidden_states, *args, **kwargs)


def _attnres_class(mixin: type, base_cls: type) -> type:
    """`AttnRes<Base>`: a subclass of the base module class whose forward is the mixin's, registered here so that it
    pickles (and still an instance of the base class, for tools that find layers by type)."""
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
    """The plain residual stream a state stands for: the base model's hidden state (`output_hidden_states`)."""
    if isinstance(state, tuple) and state and is_state(state[0]):
        state = state[0]  # from a layer whose base model takes element 0 of what it returns
    return state.current_stream() if is_state(state) else state


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
    reference = causal_lm.get_input_embeddings().weight  # the causal LM's: a plain-module base may have none
    factory = {"device": reference.device, "dtype": reference.dtype}
    # Recorded at conversion, read from the layers; else the config's (a composite's: its language model's).
    hidden = config.stream_width or text_config.get_text_config().hidden_size
    rank = config.query_rank
    runtime = ModelRuntime(config)  # one per model (see LayerSpec.runtime)
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
            layer.add_module(query_name, AttnResQuery(hidden, rank, reader, additive=config.additive, **factory))
            layer.add_module(key_norm_name, AttnResKeyNorm(hidden, eps, **factory))
        layer._attnres_spec = LayerSpec(
            sublayers=sublayers,
            plans=tuple(plans[first : first + len(sublayers)]),
            eps=eps,
            scaling=config.source_scaling,
            argnames=argnames,
            capacity=capacity,
            owner=base,
            layers=plan.layers,
            param_names=param_names,
            tuple_output=plan.tuple_output,
            plain=rank > 0 or config.additive,
            stream_start=plan.stream_start if index == 0 else None,
            returns=any(branch.returns for sublayer in sublayers for branch in sublayer.branches),
            stream_scale=scales[index],
            runtime=runtime,
        )
        first += len(sublayers)
    setattr(base, OUTPUT_NAMES[0], AttnResQuery(hidden, rank, plan.num_sublayers, additive=config.additive, **factory))
    setattr(base, OUTPUT_NAMES[1], AttnResKeyNorm(hidden, eps, **factory))
    norm = module_at(base, plan.final_norm)
    if not isinstance(norm, AttnResFinalNormMixin):
        norm.__class__ = _attnres_class(AttnResFinalNormMixin, type(norm))
    # A plain reference to the owner, which holds the parameters (the checkpoint contract); the norm only reads them.
    norm._attnres_output = OutputSpec(base, eps, config.source_scaling, runtime, output_scale)


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
        # Reentrant checkpointing differentiates only through tensor arguments, and a layer receives a state (tensors
        # in a tuple), which it would pass through as a constant: refused here, not deep inside a layer.
        if enable and getattr(gradient_checkpointing_func, "keywords", {}).get("use_reentrant"):
            raise ValueError(
                "AttnRes models need non-reentrant activation checkpointing: the state passed between decoder layers "
                "is a tuple of tensors, which reentrant checkpointing cannot differentiate through. Enable it without "
                "use_reentrant, or with gradient_checkpointing_kwargs={'use_reentrant': False} (the default)."
            )
        super()._set_gradient_checkpointing(enable, gradient_checkpointing_func, **kwargs)

    # The base model's checkpoint renaming rules, which saving reads here, guarded: the AttnRes names come through.
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

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, (AttnResQuery, AttnResKeyNorm)):
            init_depth_module(module)
        else:
            super()._init_weights(module)

    def initialize_weights(self):
        super().initialize_weights()
        # The base model's init does not know the AttnRes modules: zero queries, and never over a loaded value.
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (AttnResQuery, AttnResKeyNorm)):
                    init_depth_module(module, skip_loaded=True)
            fill_unsaved_buffers(self)


def fill_unsaved_buffers(model: nn.Module) -> None:
    """The base model's own init of each module holding a non-persistent buffer (Falcon-H1's `mup_vector`), which a
    checkpoint does not hold and transformers skips in custom code; loaded tensors are left alone."""
    plan = model.__dict__.get("_attnres_plan")
    base = module_at(model, plan.base_model) if plan is not None else None
    # A base model that is a plain module (a model's own code): its causal LM class's init, on the converted model
    owner = base if isinstance(base, PreTrainedModel) else model._base_view() if base is not None else None
    if owner is None:
        return
    from transformers.initialization import guard_torch_init_functions

    with guard_torch_init_functions():  # torch.nn.init calls respect `_is_hf_initialized` too
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
        if not config.structure:
            raise ValueError(
                "this AttnRes config records no `structure` (the plan of each decoder layer): it was converted by an "
                "attnres release that kept the plan in its own code. Re-save the folder with the installed attnres "
                "(`attnres upgrade FOLDER`), which reads the plan from its architecture table."
            )
        plan = ModelPlan.from_dict(config.structure)
        self._attnres_plan = plan
        self._attnres_base_class = type(base_model)  # its own code, if any, is saved with the model
        self._is_stateful = getattr(type(base_model), "_is_stateful", False)  # no assisted decoding (RWKV, Mamba)
        # A base class that carries its state between generation steps under its own name (RWKV's `state`).
        own = getattr(type(base_model), "_update_model_kwargs_for_generation", None)
        self._attnres_own_state = own is not None and own is not GenerationMixin._update_model_kwargs_for_generation
        self.base_model_prefix = plan.base_model
        self._tied_weights_keys = getattr(type(base_model), "_tied_weights_keys", None)
        for name, child in base_model.named_children():
            self.add_module(name, child)
        for module in self.modules():  # BETWEEN_LAYER_SHORTCUTS off: a depth-attention state cannot undergo them
            for attribute in BETWEEN_LAYER_SHORTCUTS.keys() & module.__dict__.keys():
                setattr(module, attribute, BETWEEN_LAYER_SHORTCUTS[attribute])
        attach_depth_attention(self, config, plan)
        # device_map="auto" keeps each converted layer (AttnRes<Base>) whole: its depth-attention parameters are
        # read with its sublayers.
        layer_classes = [type(layer).__name__ for layer in module_at(module_at(self, plan.base_model), plan.layers)]
        self._no_split_modules = list(dict.fromkeys([*(base_model._no_split_modules or []), *layer_classes]))
        # The keyword the base model takes its KV cache under, read once: forward passes the cache on under it.
        self._attnres_cache_keyword = cache_keyword(module_at(self, plan.base_model).forward)
        self.post_init()

    def _prepare_cache_for_generation(self, *args, **kwargs):
        # Mamba's `cache_params` (transformers < 5.24): generate makes it by the model's class, so the base class asks.
        if self._attnres_cache_keyword == RECURRENT:
            return self._base_call("_prepare_cache_for_generation", *args, **kwargs)
        return super()._prepare_cache_for_generation(*args, **kwargs)

    def get_input_embeddings(self):
        own = getattr(module_at(self, self._attnres_plan.base_model), "get_input_embeddings", None)
        return own() if own is not None else self._base_call("get_input_embeddings")  # a plain-module base: the class's

    def set_input_embeddings(self, value):
        own = getattr(module_at(self, self._attnres_plan.base_model), "set_input_embeddings", None)
        own(value) if own is not None else self._base_call("set_input_embeddings", value)

    def _base_call(self, name: str, *args, **kwargs):
        return getattr(self._attnres_base_class, name)(self._base_view(), *args, **kwargs)

    def get_output_embeddings(self):
        return module_at(self, self._attnres_plan.lm_head)

    def set_output_embeddings(self, value):
        parent, _, name = self._attnres_plan.lm_head.rpartition(".")  # a head nested in a module of its own
        setattr(module_at(self, parent), name, value)

    def _base_view(self) -> PreTrainedModel:
        """This model as an instance of the base causal-LM class (the same modules, the base config), for the base
        class's generation methods (which inputs only the prefill takes, masks made its own way): they call
        `super()`, which needs an instance of their class."""
        view = self._attnres_base_class.__new__(self._attnres_base_class)
        view.__dict__.update(self.__dict__)  # shares the module and parameter tables, copies nothing
        view.__dict__["config"] = self.config.text_config
        return view

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self._base_call("prepare_inputs_for_generation", *args, **kwargs)

    def _update_model_kwargs_for_generation(self, *args, **kwargs):
        # A base model that keeps its state under its own name (RWKV's `state`) carries it from step to step here.
        if self._attnres_own_state:
            return self._base_call("_update_model_kwargs_for_generation", *args, **kwargs)
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
        """`cache` is the KV cache; `past_key_values`, its name before transformers renamed it, is accepted too, and a
        recurrent family's `cache_params` where generate of a release before the rename passes it."""
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
            inputs = dict(kwargs, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds)
            inputs.update(use_cache=use_cache, **{self._attnres_cache_keyword: cache})
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
        logits = plan.scale_logits(self.get_output_embeddings()(hidden[:, slice_indices, :]))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **kwargs)
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
        """The base causal LM's own forward on these modules (config `outer_forward`): a base model of its own code
        called its own way (no mask or cache, its own argument names), the logits read from whatever it returns."""
        forward = self._attnres_base_class.forward
        parameters = inspect.signature(forward).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        given = {k: v for k, v in inputs.items() if v is not None and (takes_all or k in parameters)}
        ids = {"input_ids": input_ids} if "input_ids" in parameters else {}
        outputs = forward(self._base_view(), *(() if ids else (input_ids,)), **ids, **given)
        logits = outputs if isinstance(outputs, torch.Tensor) else getattr(outputs, "logits", None)
        if logits is None:  # a tuple: (logits, loss)
            logits = next(v for v in outputs if isinstance(v, torch.Tensor) and v.dim() == 3)
        if logits_to_keep:
            logits = logits[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep]
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{INSTALLED: cache_of(outputs)})

    def _record_streams(self, base) -> tuple[list, list]:
        """Hidden states as the base model defines them (embeddings, each layer's output stream, final normed state)."""
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
        hooks += [
            layer.register_forward_hook(functools.partial(after, scale=scale))
            for layer, scale in zip(layers[:-1], scales[1:])
        ]
        return hooks, recorded


__all__ = ["AttnResForCausalLM", "AttnResPreTrainedModel", "run_sublayer"]
