"""A small PreNorm decoder written outside transformers, with names of its own (blocks, attn_norm, ffn_norm,
final_norm) and a KV cache: what a repository with `auto_map` and its own modeling file looks like."""

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_tiny_prenorm import TinyPreNormConfig


class TinyRMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TinyAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.heads, self.layer_idx = config.num_attention_heads, layer_idx
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x, attention_mask=None, past_key_values=None, **kwargs):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class TinyFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


class TinyBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn_norm = TinyRMSNorm(config.hidden_size, config.norm_eps)
        self.attn = TinyAttention(config, layer_idx)
        self.ffn_norm = TinyRMSNorm(config.hidden_size, config.norm_eps)
        self.ffn = TinyFeedForward(config)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        hidden_states = hidden_states + self.attn(self.attn_norm(hidden_states), attention_mask, past_key_values)
        return hidden_states + self.ffn(self.ffn_norm(hidden_states))


class TinyPreNormPreTrainedModel(PreTrainedModel):
    config_class = TinyPreNormConfig
    base_model_prefix = "model"
    _no_split_modules = ["TinyBlock"]


class TinyPreNormModel(TinyPreNormPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = nn.Embedding(config.max_positions, config.hidden_size)
        self.blocks = nn.ModuleList(TinyBlock(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = TinyRMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        length = hidden.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=hidden.device)[None]
        hidden = hidden + self.positions(position_ids)
        # True where a query may attend: causal, padding hidden.
        mask = torch.ones(length, past + length, dtype=torch.bool, device=hidden.device).tril(past)[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, : past + length].bool()
        for block in self.blocks:
            hidden = block(hidden, attention_mask=mask, past_key_values=past_key_values if use_cache else None)
        return BaseModelOutputWithPast(
            last_hidden_state=self.final_norm(hidden), past_key_values=past_key_values if use_cache else None
        )


class TinyPreNormForCausalLM(TinyPreNormPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {}

    def __init__(self, config):
        super().__init__(config)
        self.model = TinyPreNormModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        cache=None,
        **kwargs,
    ):
        # generate() passes the cache as `cache` since transformers renamed it (as `past_key_values` before): a
        # repository's code that still took only the old name would decode without its cache. The base model
        # below keeps the old name only, as much remote code does.
        past_key_values = cache if cache is not None else past_key_values
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = outputs.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return CausalLMOutputWithPast(logits=logits, past_key_values=outputs.past_key_values)
