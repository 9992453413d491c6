"""Tiny random configs of every supported family (hidden 64, 3 layers), as the transformers tests do."""

from __future__ import annotations

import torch
import transformers as T

_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=128, max_position_embeddings=256)
_DECODER = dict(_IDS, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
_NEOX = dict(_IDS, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)

CONFIGS = {
    "llama": lambda: T.LlamaConfig(**_DECODER),
    "mistral": lambda: T.MistralConfig(**_DECODER, sliding_window=None),
    "mixtral": lambda: T.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": lambda: T.Qwen2Config(**_DECODER),
    "qwen3": lambda: T.Qwen3Config(**_DECODER, head_dim=16),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(**_DECODER, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma": lambda: T.GemmaConfig(**_DECODER, head_dim=16),
    "gemma2": lambda: T.Gemma2Config(**_DECODER, head_dim=16, sliding_window=8),
    "gemma3_text": lambda: T.Gemma3TextConfig(**_DECODER, head_dim=16, sliding_window=8),
    "phi3": lambda: T.Phi3Config(**_DECODER),
    "gpt2": lambda: T.GPT2Config(**_IDS | {"max_position_embeddings": 256}, n_embd=64, n_layer=3, n_head=4, n_positions=256),
    "gpt_neox_parallel": lambda: T.GPTNeoXConfig(**_NEOX, use_parallel_residual=True),
    "gpt_neox_sequential": lambda: T.GPTNeoXConfig(**_NEOX, use_parallel_residual=False),
    "phi": lambda: T.PhiConfig(**_NEOX),
}


def tiny_model(name: str, seed: int = 0, **overrides) -> T.PreTrainedModel:
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    # A larger init than the default 0.02 makes the residual stream and its norms matter, so an inexact
    # conversion shows up in the logits instead of hiding under tiny activations.
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
    return model


def token_ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
