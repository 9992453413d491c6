"""A small PreNorm decoder with its own code and its own names everywhere: config sizes (d_model, n_vocab,
n_layer), modules (`transformer.wte`, `transformer.h`, `transformer.ln_f`) and a head, `unembed`, that is a plain
Linear which `get_output_embeddings` does not return (the class keeps no `lm_head`)."""

import dataclasses

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_own_names import OwnNamesConfig

# The output field the installed transformers declares for the cache (`cache`, `past_key_values` before the rename),
# as a repository's own code written for that release names it.
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


class OwnLayerNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class OwnAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.heads, self.layer_idx = config.n_head, layer_idx
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model)
        self.c_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x, mask=None, cache=None):
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


class OwnMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, config.d_ff)
        self.c_proj = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x):
        return self.c_proj(nn.functional.silu(self.c_fc(x)))


class OwnBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = OwnLayerNorm(config.d_model, config.ln_eps)
        self.attn = OwnAttention(config, layer_idx)
        self.ln_2 = OwnLayerNorm(config.d_model, config.ln_eps)
        self.mlp = OwnMLP(config)

    def forward(self, x, mask=None, cache=None):
        x = x + self.attn(self.ln_1(x), mask, cache)
        return x + self.mlp(self.ln_2(x))


class OwnNamesPreTrainedModel(PreTrainedModel):
    config_class = OwnNamesConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["OwnBlock"]


class OwnNamesModel(OwnNamesPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.n_vocab, config.d_model)
        self.wpe = nn.Embedding(config.n_ctx, config.d_model)
        self.h = nn.ModuleList(OwnBlock(config, i) for i in range(config.n_layer))
        self.ln_f = OwnLayerNorm(config.d_model, config.ln_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        hidden = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        length = hidden.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=hidden.device)[None]
        hidden = hidden + self.wpe(position_ids)
        mask = torch.ones(length, past + length, dtype=torch.bool, device=hidden.device).tril(past)[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, : past + length].bool()
        for block in self.h:
            hidden = block(hidden, mask, cache if use_cache else None)
        return BaseModelOutputWithPast(
            last_hidden_state=self.ln_f(hidden), **{CACHE_FIELD: cache if use_cache else None}
        )


class OwnNamesForCausalLM(OwnNamesPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {}

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # transformers' own cache is built from `num_hidden_layers`, which this config does not have: the model makes
        # its cache itself (in the base model's forward) and generate hands it back at every step.
        return False

    def __init__(self, config):
        super().__init__(config)
        self.transformer = OwnNamesModel(config)
        self.unembed = nn.Linear(config.d_model, config.n_vocab, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        outputs = self.transformer(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = outputs.last_hidden_state
        logits = self.unembed(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)})
