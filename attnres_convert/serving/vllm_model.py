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

Loaded by vLLM through the plugin (vllm_plugin.py) in each of its processes; it imports vLLM, so nothing else
of the package imports it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.transformers.fusers.attention import interface_call

from attnres_convert.serving.vllm_support import ServingRefused, module_path, release, unservable_reason

# The name under which transformers' attention interface reaches vLLM's paged attention for a converted model.
ATTENTION_IMPLEMENTATION = "attnres_vllm"
# The child of an attention module that holds its vLLM `Attention` (in the module tree, so vLLM's loader runs
# its `process_weights_after_loading` and `.to()` moves its buffers).
VLLM_ATTENTION = "vllm_attention"
_CALLS = [0]  # attention calls in the running forward: each decoder layer's must reach vLLM (see `forward`)


def paged_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface ([1, heads, T, head_dim] each) served by the module's vLLM `Attention`
    (which takes and returns [T, heads * head_dim]). The mask, dropout, scaling and window transformers pass are the `Attention`'s own
    settings (made from the same module and config, see `_attach_attention`)."""
    attention = module._modules[VLLM_ATTENTION]
    _CALLS[0] += 1
    tokens, head_dim_qk, head_dim_v = query.shape[-2], query.shape[-1], value.shape[-1]
    query, key, value = (x.transpose(1, 2).reshape(tokens, -1) for x in (query, key, value))
    if head_dim_v < head_dim_qk:  # values narrower than queries and keys (latent attention expanded): padded
        value = F.pad(value.view(tokens, -1, head_dim_v), (0, head_dim_qk - head_dim_v)).reshape(tokens, -1)
    output = attention(query, key, value)
    if head_dim_v < head_dim_qk:
        output = output.view(tokens, -1, head_dim_qk)[..., :head_dim_v]
    # [batch 1, T, heads, head_dim], what transformers' own attention functions return: modules merge the last two
    # dimensions themselves, some as `reshape(*input_shape, -1)`, others (GPT-2) as `reshape(*shape[:-2], -1)`.
    return output.reshape(1, tokens, -1, head_dim_v), None


AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention)  # transformers' public registry of attention functions


class AttnResForCausalLMVllm(nn.Module):
    """vLLM's model class for the architecture `AttnResForCausalLM` (registered by vllm_plugin.py)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        config = model_config.hf_config
        self.family = config.get_text_config().model_type
        if vllm_config.parallel_config.tensor_parallel_size > 1 or vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ServingRefused(self.family, "tensor and pipeline parallelism are not supported (the converted "
                                 "model runs whole on one device)")
        device = vllm_config.device_config.device
        # The folder's own code and transformers' own loading, as `generate` runs them: the weights are what
        # transformers makes of the checkpoint (renamed and fused the base model's way), whatever vLLM would.
        self.model = AutoModelForCausalLM.from_pretrained(
            model_config.model, config=config, revision=model_config.revision,
            trust_remote_code=model_config.trust_remote_code, dtype=model_config.dtype, device_map={"": device},
        ).eval()
        plan = getattr(self.model, "_attnres_plan", None)
        if plan is None or not all(hasattr(plan, name) for name in ("base_model", "layers", "lm_head")):
            raise ServingRefused(self.family, "its modeling code predates the plan vLLM serving reads", release=release())
        self.plan = plan
        reason = unservable_reason(self.model, interface_call)
        if reason is not None:
            raise ServingRefused(self.family, reason)
        self.attention_layers = self._attach_attention(vllm_config, prefix)
        # Every config the modules read their attention implementation from (at each call) names vLLM's.
        configs = [config, config.get_text_config()]
        configs += [m.config for m in self.model.modules() if isinstance(getattr(m, "config", None), PreTrainedConfig)]
        for each in {id(c): c for c in configs}.values():
            each._attn_implementation = ATTENTION_IMPLEMENTATION

    @property
    def base(self) -> nn.Module:
        """The base model inside the converted one (a property, not a second registration of the same module)."""
        return module_path(self.model, self.plan.base_model)

    def _attach_attention(self, vllm_config, prefix: str) -> int:
        """One vLLM `Attention` per decoder layer, for the module of that layer that calls transformers'
        attention interface: its heads, scale, window and soft cap as the module computes them."""
        model_config, parallel_config = vllm_config.model_config, vllm_config.parallel_config
        text_config = model_config.hf_text_config
        layer_types = getattr(text_config, "layer_types", None)
        layers = module_path(self.base, self.plan.layers)
        layers_prefix = ".".join(filter(None, [prefix, self.plan.base_model, self.plan.layers]))
        for index, layer in enumerate(layers):
            name, module = next((n, m) for n, m in layer.named_modules() if interface_call(type(m).forward) is not None)
            scale = getattr(module, "scaling", None)
            if scale is None:
                raise ServingRefused(self.family, f"the attention of layer {index} ({type(module).__name__}) has no "
                                     "`scaling` to give vLLM's attention")
            sliding = layer_types is not None and index < len(layer_types) and layer_types[index] == "sliding_attention"
            module.add_module(VLLM_ATTENTION, Attention(
                num_heads=model_config.get_num_attention_heads(parallel_config),
                head_size=model_config.get_head_size(),
                scale=float(scale),
                num_kv_heads=model_config.get_num_kv_heads(parallel_config),
                cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config,
                logits_soft_cap=getattr(text_config, "attn_logit_softcapping", None),
                per_layer_sliding_window=text_config.sliding_window if sliding else None,
                prefix=f"{layers_prefix}.{index}.{name}.{VLLM_ATTENTION}",
            ))
        return len(layers)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.base.get_input_embeddings()(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        # vLLM's flattened tokens as a batch of one sequence, the layout transformers' modules expect.
        tokens = dict(inputs_embeds=inputs_embeds[None]) if inputs_embeds is not None else dict(input_ids=input_ids[None])
        _CALLS[0] = 0
        outputs = self.base(**tokens, position_ids=positions[None], use_cache=False)
        if _CALLS[0] != self.attention_layers:
            # An attention that did not reach vLLM ran transformers' own over all requests' tokens as one sequence.
            raise RuntimeError(
                f"{self.family}: {_CALLS[0]} of {self.attention_layers} attention calls reached vLLM's paged attention; "
                "the others ignored the attention implementation, so the output would mix requests"
            )
        return outputs.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The head and its scalars, applied as the converted model's own forward applies them."""
        plan = self.plan
        logits = module_path(self.model, plan.lm_head)(hidden_states)
        if getattr(plan, "logit_scale", None) is not None:
            logits = logits * plan.logit_scale
        if getattr(plan, "logit_divisor", None) is not None:
            logits = logits / plan.logit_divisor
        if getattr(plan, "logit_softcap", None) is not None:
            logits = torch.tanh(logits / plan.logit_softcap) * plan.logit_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Loaded in __init__ by transformers (see there); vLLM's iterator is left unread.
        return {name for name, _ in self.named_parameters()}
