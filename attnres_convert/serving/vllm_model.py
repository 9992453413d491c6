"""A converted folder as a vLLM model: the folder's own `AttnResForCausalLM` (its shipped code, loaded by
transformers exactly as `generate` loads it), with every attention module's softmax attention done by vLLM's
paged `Attention` layer, so vLLM's scheduler (continuous batching, chunked prefill, prefix caching) and KV cache
manager run the model unchanged.

Why this works without touching the depth attention: AttnRes mixes a token's own earlier sublayer outputs (its
depth), never other tokens, so the only operation that crosses tokens is the base model's attention, which is
where vLLM's KV cache lives. vLLM hands the forward all scheduled tokens of all requests flattened into one
sequence ([1, T]) with their positions and no attention mask; rotary embeddings read the positions, the depth
mix and every MLP act per token, and each attention module's call goes through transformers' attention
interface to vLLM's `Attention`, which knows each request's boundaries and cache from the forward context.

The model is built from the folder's own code with its weights on the meta device, its linear layers replaced
with vLLM's (sharded by the base model's tensor-parallel plan: vllm_parallel.py), and filled by vLLM's loader
from the checkpoint (vllm_weights.py): each process reads and holds only its shard, in vLLM's load formats and
quantization. Nothing in the forward keeps state between calls, so vLLM's compiled graphs capture it whole.

Loaded by vLLM through the plugin (vllm_plugin.py) in each of its processes; it imports vLLM, so nothing else
of the package imports it."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedConfig
from vllm.compilation.decorators import support_torch_compile
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.transformers.fusers.attention import interface_call
from vllm.model_executor.models.transformers.utils import (
    can_enable_torch_compile,
    init_on_device_without_buffers,
    replace_embedding_class,
    replace_linear_class,
)

from attnres_convert.modeling.modeling_attnres import ModelPlan, module_at
from attnres_convert.serving.vllm_parallel import (
    materialize,
    rank_bytes,
    rank_heads,
    shapes_only_linears,
    shard_model,
)
from attnres_convert.serving.vllm_support import ServingRefused, release, unservable_reason
from attnres_convert.serving.vllm_weights import load_checkpoint

logger = init_logger(__name__)

# The name under which transformers' attention interface reaches vLLM's paged attention for a converted model.
ATTENTION_IMPLEMENTATION = "attnres_vllm"
# The child of an attention module that holds its vLLM `Attention` (in the module tree, so vLLM's loader runs
# its `process_weights_after_loading` and `.to()` moves its buffers).
VLLM_ATTENTION = "vllm_attention"


def paged_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface ([1, heads, T, head_dim] each) served by the module's vLLM `Attention`
    (which takes and returns [T, heads * head_dim]). The mask, dropout, scaling and window transformers pass are the `Attention`'s own
    settings (made from the same module and config, see `_attach_attention`)."""
    attention = module._modules[VLLM_ATTENTION]
    tokens, head_dim_qk, head_dim_v = query.shape[-2], query.shape[-1], value.shape[-1]
    # contiguous: vLLM's kernels read each head's entries as adjacent (a key broadcast over heads is not)
    query, key, value = (x.transpose(1, 2).reshape(tokens, -1).contiguous() for x in (query, key, value))
    if head_dim_v < head_dim_qk:  # values narrower than queries and keys (latent attention expanded): padded
        value = F.pad(value.view(tokens, -1, head_dim_v), (0, head_dim_qk - head_dim_v)).reshape(tokens, -1)
    output = attention(query, key, value)
    if head_dim_v < head_dim_qk:
        output = output.view(tokens, -1, head_dim_qk)[..., :head_dim_v]
    # [batch 1, T, heads, head_dim], what transformers' own attention functions return: modules merge the last two
    # dimensions themselves, some as `reshape(*input_shape, -1)`, others (GPT-2) as `reshape(*shape[:-2], -1)`.
    return output.reshape(1, tokens, -1, head_dim_v), None


AttentionInterface.register(
    ATTENTION_IMPLEMENTATION, paged_attention
)  # transformers' public registry of attention functions

# The shapes each attention module hands over, recorded by one probe forward when the model is built: vLLM's model
# config describes the attention as vLLM's own implementation of the family runs it (DeepSeek's latent attention as
# one latent head, a multi-query model's heads as its config names them), while what reaches the cache here is what
# transformers' module computes, layer by layer (Gemma 4's global layers have heads of their own size).
PROBE_IMPLEMENTATION = "attnres_vllm_probe"
PROBE_TOKENS = 7  # a length no head count or head size of a real model shares (see probe_attention)
_SHAPES: dict[int, "AttentionShape"] = {}


class AttentionShape(NamedTuple):
    heads: int
    kv_heads: int
    head_size: int  # of queries and keys (narrower values are padded to it in paged_attention)
    call: dict  # the scalar settings the module passes with the call (scaling, sliding_window, softcap)
    data: tuple  # the names of tensors over pairs of tokens passed with the call (a position bias)


def probe_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Records the module's query, key and value shapes ([1, heads, T, head_dim]) and returns zeros of the output's."""
    call = {k: v for k, v in kwargs.items() if k in ("scaling", "sliding_window", "softcap")}
    # A tensor over pairs of tokens (a relative position bias: [.., T, T]) changes the attention scores, which vLLM's
    # attention cannot take; per-token inputs that a decoder layer's keyword arguments carry through the call (Gemma
    # 4's per_layer_input) are not read by it.
    tokens = query.shape[-2]
    data = tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and list(v.shape).count(tokens) >= 2)
    _SHAPES[id(module)] = AttentionShape(query.shape[1], key.shape[1], query.shape[-1], call, data)
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


AttentionInterface.register(PROBE_IMPLEMENTATION, probe_attention)


@support_torch_compile(
    # vLLM's flattened batch as a batch of one ([1, T], [1, T, hidden]): the token count varies between calls.
    dynamic_arg_dims={"input_ids": 1, "inputs_embeds": 1, "position_ids": 1},
    enable_if=can_enable_torch_compile,  # vLLM's own rule for transformers models (no dynamic rope scaling)
)
class CompiledBase(nn.Module):
    """The converted base model's forward as vLLM compiles a model's (torch.compile, then CUDA graphs on a GPU;
    `enforce_eager` turns both off). The base model is held outside the module tree, so that its weights stay
    registered once, under the serving class's `model`."""

    def __init__(self, *, vllm_config, prefix: str = "", base: nn.Module):
        super().__init__()
        self.__dict__["base"] = base

    def forward(self, input_ids, inputs_embeds, position_ids) -> torch.Tensor:
        return self.base(
            input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False
        ).last_hidden_state


class AttnResForCausalLMVllm(nn.Module):
    """vLLM's model class for the architecture `AttnResForCausalLM` (registered by vllm_plugin.py). It does not
    declare vLLM's `SupportsPP`, so vLLM refuses pipeline parallelism before building it: every sublayer's depth mix
    reads the outputs of all the blocks before it, which a stage would have to receive from every earlier stage."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        config = model_config.hf_config
        self.family = config.get_text_config().model_type
        try:
            shapes = self._build(vllm_config, fuse=True)
        except ServingRefused as error:
            if not self._fused:
                raise
            # vLLM's fusers rewrite the base modules' forwards from their source; where a rewrite does not run on
            # this model, the unfused layers do (slower, the same tokens).
            logger.warning(
                "%s; serving %s without vLLM's fused layers (%s)", error, self.family, ", ".join(self._fused)
            )
            shapes = self._build(vllm_config, fuse=False)
        self._attach_attention(vllm_config, prefix, shapes)
        self._use_attention(ATTENTION_IMPLEMENTATION)
        self.__dict__["compiled"] = CompiledBase(vllm_config=vllm_config, prefix=prefix, base=self.base)

    def _build(self, vllm_config, fuse: bool) -> dict[int, AttentionShape]:
        """The model with vLLM's layers (fused where FUSE), weights zero until the loader runs, and each attention
        module's shapes (the probe forward)."""
        model_config = vllm_config.model_config
        config = model_config.hf_config
        device = vllm_config.device_config.device
        self._fused: list[str] = []
        # The folder's own code, as `generate` runs it, built without weights: vLLM's loader fills them.
        with init_on_device_without_buffers("meta"):
            self.model = AutoModelForCausalLM.from_config(
                config, trust_remote_code=model_config.trust_remote_code, dtype=model_config.dtype
            ).eval()
        plan = getattr(self.model, "_attnres_plan", None)
        if plan is None or not all(hasattr(plan, name) for name in ("base_model", "layers", "lm_head")):
            raise ServingRefused(
                self.family, "its modeling code predates the plan vLLM serving reads", release=release()
            )
        self.plan = plan
        self._replace_vocabulary(config)
        reason = unservable_reason(self.model, interface_call)
        if reason is not None:
            raise ServingRefused(self.family, reason)
        text_config = config.get_text_config()
        self._stacked, self._fused = shard_model(self.model, plan, text_config, self.family, vllm_config, fuse=fuse)
        materialize(self.model, device)  # zeros until the loader runs: the probe below reads shapes only
        # Every config the modules read their attention implementation from (at each call).
        configs = [config, text_config]
        configs += [m.config for m in self.model.modules() if isinstance(getattr(m, "config", None), PreTrainedConfig)]
        self._configs = list({id(c): c for c in configs}.values())
        return self._probe_shapes(device)

    def _replace_vocabulary(self, config) -> None:
        """The input embedding as vLLM's `VocabParallelEmbedding` and the head as its `ParallelLMHead`, as vLLM's
        Transformers backend makes them: each rank holds its slice of the vocabulary (a tied head shares the
        embedding's) and vLLM's `LogitsProcessor` gathers the logits. A head whole on every rank computes all the
        vocabulary's logits on each, which at TP 2 costs a small model more than its whole depth mix. A head tied to
        an embedding of another kind or size stays whole, vLLM's replicated linear layer. Both are left unquantized, as
        vLLM's own models leave their heads."""
        owner_name, _, leaf = self.plan.lm_head.rpartition(".")
        owner = module_at(self.model, owner_name) if owner_name else self.model
        head, embedding = owner._modules[leaf], self.model.get_input_embeddings()
        if isinstance(embedding, nn.Embedding):
            name = next(n for n, m in self.model.named_modules() if m is embedding)
            parent, _, child = name.rpartition(".")
            embedding = replace_embedding_class(embedding, None, prefix=name)
            setattr(module_at(self.model, parent) if parent else self.model, child, embedding)
        tied = config.tie_word_embeddings
        vocab = getattr(head, "out_features", None)
        shares = isinstance(embedding, VocabParallelEmbedding) and embedding.num_embeddings == vocab
        self.logits_processor = None
        if type(head) is nn.Linear:  # exactly nn.Linear: a subclass may compute otherwise
            if shares or not tied:
                width, bias = head.in_features, head.bias is not None
                head = ParallelLMHead(vocab, width, bias=bias, params_dtype=head.weight.dtype, prefix=self.plan.lm_head)
                self.logits_processor = LogitsProcessor(vocab)
            else:
                head = replace_linear_class(head, "replicate", None, prefix=self.plan.lm_head)
        owner._modules[leaf] = head
        if tied:  # as from_pretrained ties it
            if self.logits_processor is not None:
                head.tie_weights(embedding)
            else:
                head.weight = embedding.weight

    def _use_attention(self, implementation: str) -> None:
        for each in self._configs:
            each._attn_implementation = implementation

    @torch.no_grad()
    def _probe_shapes(self, device) -> dict[int, AttentionShape]:
        """Each attention module's shapes, from one forward of a few tokens through the probe (see PROBE_IMPLEMENTATION)."""
        self._use_attention(PROBE_IMPLEMENTATION)
        _SHAPES.clear()
        tokens = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=device)
        with shapes_only_linears(self.model):  # before the weights are loaded
            self._run_base(dict(input_ids=tokens), torch.arange(PROBE_TOKENS, device=device))
        shapes = dict(_SHAPES)
        _SHAPES.clear()
        return shapes

    @property
    def base(self) -> nn.Module:
        """The base model inside the converted one (a property, not a second registration of the same module)."""
        return module_at(self.model, self.plan.base_model)

    def _run_base(self, tokens: dict, positions: torch.Tensor):
        """The base model on a flattened batch (TOKENS as a batch of one, POSITIONS [T]), as vLLM runs it. The
        first run is at engine start (the probe), so a model that cannot run this way is refused there, with the
        cause."""
        try:
            return self.base(**tokens, position_ids=positions[None], use_cache=False)
        except Exception as error:
            raise ServingRefused(
                self.family,
                (
                    "its forward fails on vLLM's batch (every request's tokens as one sequence with their positions, no "
                    f"attention mask): {type(error).__name__}: {error}. A module that reads other tokens itself instead "
                    "of through transformers' attention interface (a sparse-attention indexer, for one) cannot run on it"
                ),
            ) from error

    def _attach_attention(self, vllm_config, prefix: str, shapes: dict[int, AttentionShape]) -> None:
        """One vLLM `Attention` per decoder layer, for the module of that layer that calls transformers'
        attention interface: its heads, scale, window and soft cap as the module computes them."""
        text_config = vllm_config.model_config.hf_text_config
        # vLLM's `Attention` falls back to the config's model-wide window for a layer given none; here each layer's
        # window is what its module applies (Moshi's config names a window its attention never applies).
        cache_config = copy.copy(vllm_config.cache_config)
        cache_config.sliding_window = None
        layer_types = getattr(text_config, "layer_types", None)
        layers = module_at(self.base, self.plan.layers)
        layers_prefix = ".".join(filter(None, [prefix, self.plan.base_model, self.plan.layers]))
        for index, layer in enumerate(layers):
            name, module = next((n, m) for n, m in layer.named_modules() if interface_call(type(m).forward) is not None)
            if id(module) not in shapes:
                raise ServingRefused(
                    self.family,
                    f"the attention of layer {index} ({type(module).__name__}) was not "
                    "called through transformers' attention interface in a forward",
                )
            shape = shapes[id(module)]
            if shape.data:
                raise ServingRefused(
                    self.family,
                    f"the attention of layer {index} ({type(module).__name__}) passes "
                    f"{', '.join(f'`{k}`' for k in shape.data)} with the call, a tensor vLLM's "
                    "attention has no input for",
                )
            scale = shape.call.get("scaling", getattr(module, "scaling", None))
            if scale is None:
                raise ServingRefused(
                    self.family,
                    f"the attention of layer {index} ({type(module).__name__}) has no "
                    "`scaling` to give vLLM's attention",
                )
            if "sliding_window" in shape.call:  # what the module passes for its own layer
                window = shape.call["sliding_window"]
            else:
                sliding = (
                    layer_types is not None and index < len(layer_types) and layer_types[index] == "sliding_attention"
                )
                window = text_config.sliding_window if sliding else None
            module.add_module(
                VLLM_ATTENTION,
                Attention(
                    num_heads=shape.heads,
                    head_size=shape.head_size,
                    scale=float(scale),
                    num_kv_heads=shape.kv_heads,
                    cache_config=cache_config,
                    quant_config=vllm_config.quant_config,
                    logits_soft_cap=shape.call.get("softcap", getattr(text_config, "attn_logit_softcapping", None)),
                    per_layer_sliding_window=window,
                    prefix=f"{layers_prefix}.{index}.{name}.{VLLM_ATTENTION}",
                    # Learned attention sinks (GPT-OSS, Granite SWA: `s_aux` in the attention call), one per head:
                    # this rank's heads' (a view, so the loader's values reach vLLM's attention).
                    **(
                        {"sinks": rank_heads(module.sinks.detach(), shape.heads)}
                        if isinstance(getattr(module, "sinks", None), torch.Tensor)
                        else {}
                    ),
                ),
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.base.get_input_embeddings()(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        # vLLM's flattened tokens as a batch of one sequence, the layout transformers' modules expect. Every layer's
        # attention reaching vLLM's was checked once, by the probe at engine start (`_attach_attention`).
        if inputs_embeds is not None:
            return self.compiled(None, inputs_embeds[None], positions[None])[0]
        return self.compiled(input_ids[None], None, positions[None])[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The head and its scalars, applied as the converted model's own forward applies them."""
        head = module_at(self.model, self.plan.lm_head)
        if self.logits_processor is None:  # a head of its own kind, whole on every rank
            logits = head(hidden_states)
        else:  # this rank's slice of the vocabulary, gathered (None on the ranks the gather leaves out)
            logits = self.logits_processor(head, hidden_states, head.bias)
            if logits is None:
                return None
        # A folder's own plan; one of a release before ModelPlan.scale_logits has the same fields.
        return ModelPlan.scale_logits(self.plan, logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = {f"model.{name}" for name in load_checkpoint(self.model, weights, self._stacked)}
        # Before vLLM's CPU layers repack their weights out of sight.
        self.rank_bytes = rank_bytes(self.model, self.base)
        # vLLM's attention layers hold settings of their own (scales), not the checkpoint's: theirs to set.
        return loaded | {name for name, _ in self.named_parameters() if f".{VLLM_ATTENTION}." in name}
