"""Small causal LMs with their own code, shaped as remote-code models on the hub often are: the decoder stack sits in
a plain `torch.nn.Module` trunk (not a PreTrainedModel) whose forward takes the token ids alone, under its own name,
and keeps no KV cache; the blocks are PreNorm (`x = x + attn(norm1(x)); x = x + mlp(norm2(x))`, RMS norms with a
gain); only the outer PreTrainedModel has `get_input_embeddings`. The outer classes differ in how they are called:

* TinyNoCacheForCausalLM: `forward(input_ids, labels=None)`, no mask, no cache (generate refuses its mask);
* TinyIgnoredCacheForCausalLM: takes `past_key_values` and ignores it (generate fails building a cache from a
  config without `num_hidden_layers`);
* TinyOwnArgsForCausalLM: `forward(tokens, targets=None)` returning `(logits, loss)` (nanoGPT-style), no generate;
* TinyGeneratingForCausalLM: a trunk that has `get_input_embeddings`, a forward that takes a mask and `**kwargs`,
  and a class that tells generate it keeps no cache: generate works, running the whole sequence at every step.

TinyNoAccessorsForCausalLM names its token embedding nowhere (no get_input_embeddings), and with `post_norm` in
the config the blocks are post-norm, `x = norm1(x + attn(x))`: not convertible.
"""

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny_trunk import TinyTrunkConfig


def causal_mask(length):
    return torch.ones(length, length, dtype=torch.bool).tril()


class RMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=False)
        self.proj = nn.Linear(config.width, config.width, bias=False)
        # Not saved: transformers 5 fills it through _init_weights when it loads the model.
        self.register_buffer("causal", causal_mask(config.context), persistent=False)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.causal[:length, :length])
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.width, 2 * config.width)
        self.out = nn.Linear(2 * config.width, config.width)

    def forward(self, x):
        return self.out(nn.functional.silu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.post_norm = config.post_norm
        self.norm1 = RMSNorm(config.width)
        self.attn = SelfAttention(config)
        self.norm2 = RMSNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x):
        if self.post_norm:
            x = self.norm1(x + self.attn(x))
            return self.norm2(x + self.mlp(x))
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Trunk(nn.Module):
    """The decoder stack: a plain module, called with the token ids only."""

    def __init__(self, config):
        super().__init__()
        self.tok = nn.Embedding(config.vocab, config.width)
        self.pos = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm = RMSNorm(config.width)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class TrunkWithAccessors(Trunk):
    def get_input_embeddings(self):
        return self.tok


class TinyTrunkPreTrainedModel(PreTrainedModel):
    config_class = TinyTrunkConfig
    base_model_prefix = "trunk"
    _no_split_modules = ["Block"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, SelfAttention):
            init.copy_(module.causal, causal_mask(module.causal.shape[0]))


class _TinyBase(TinyTrunkPreTrainedModel):
    trunk_class = Trunk

    def __init__(self, config):
        super().__init__(config)
        self.trunk = self.trunk_class(config)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.trunk.tok

    def set_input_embeddings(self, value):
        self.trunk.tok = value

    def get_output_embeddings(self):
        return self.head

    def _loss(self, logits, labels):
        if labels is None:
            return None
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class TinyNoCacheForCausalLM(_TinyBase, GenerationMixin):
    def forward(self, input_ids, labels=None):
        logits = self.head(self.trunk(input_ids))
        return CausalLMOutput(loss=self._loss(logits, labels), logits=logits)


class TinyIgnoredCacheForCausalLM(_TinyBase, GenerationMixin):
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, labels=None, **kwargs):
        logits = self.head(self.trunk(input_ids))
        return CausalLMOutput(loss=self._loss(logits, labels), logits=logits)


class TinyOwnArgsForCausalLM(_TinyBase):
    def forward(self, tokens, targets=None):
        logits = self.head(self.trunk(tokens))
        return logits, self._loss(logits, targets)


class TinyGeneratingForCausalLM(_TinyBase, GenerationMixin):
    trunk_class = TrunkWithAccessors

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # no cache: generate runs the whole sequence at every step

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        logits = self.head(self.trunk(input_ids))
        return CausalLMOutput(loss=self._loss(logits, labels), logits=logits)


class TinyNoAccessorsForCausalLM(TinyNoCacheForCausalLM):
    """Defines get_input_embeddings nowhere (transformers' default finds no `embed_tokens`): not convertible, the
    token embedding is not named."""

    get_input_embeddings = PreTrainedModel.get_input_embeddings
