"""Training from scratch (`model.from_scratch`): a random initialisation of a model's config, resized by the
recipe (`model.layers`, `model.hidden`, `model.heads`, ...), instead of its weights.

The initialisation is seeded by `train.seed` alone, before anything else draws random numbers, so the A/B
baseline (the plain PreNorm model) and its AttnRes arms (that same model, converted: zero queries, key
norms at one) start from the same weights and give the same logits at step 0.

`model.tokenizer: bytes` reads text as UTF-8 bytes (ByT5's tokenizer, 259 ids, no files needed): a small
vocabulary keeps the embedding and the head cheap, which a narrow model trained on a CPU needs.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, ByT5Tokenizer, PretrainedConfig, PreTrainedModel

from ..errors import AttnResError
from ..io.sources import ModelSource, cached_config, load_config
from .recipe import ModelSection, RecipeError

SCRATCH_FIELDS = ("layers", "hidden", "heads", "kv_heads", "intermediate")
# The config attribute each resizing field sets (transformers maps GPT-2's n_layer etc. onto these names).
_CONFIG_NAMES = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "intermediate": "intermediate_size",
}


def byte_tokenizer() -> ByT5Tokenizer:
    """UTF-8 bytes as tokens: pad 0, EOS 1, unknown 2, byte b as b + 3 (259 ids)."""
    return ByT5Tokenizer(extra_ids=0)


def scratch_config(source: ModelSource, spec: ModelSection) -> PretrainedConfig:
    """The source's config with the recipe's sizes (a copy; the cached config is left as it is). A size that
    makes no model is a RecipeError naming the fields."""
    try:
        base = (
            cached_config(source, False, spec.trust_remote_code)
            if source.kind != "hub"
            else load_config(source, spec.trust_remote_code)
        )
    except AttnResError as error:
        raise RecipeError(f"model.source: {error}") from error
    config = base.__class__.from_dict(base.to_dict())
    old_hidden = getattr(config, "hidden_size", None)
    for field in SCRATCH_FIELDS:
        value = getattr(spec, field)
        if value is None:
            continue
        name = _CONFIG_NAMES[field]
        if not hasattr(config, name):
            raise RecipeError(f"model.{field}: the {config.model_type} config has no {name} to set; drop model.{field}")
        setattr(config, name, value)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if hidden is not None and heads:
        if hidden % heads:
            raise RecipeError(
                f"model.hidden: {hidden} is not divisible by the {heads} attention heads (model.heads); "
                "choose a hidden size that is a multiple of the head count"
            )
        if (
            spec.hidden is not None
            and spec.intermediate is None
            and getattr(base, "intermediate_size", None)
            and old_hidden
        ):
            # The MLP keeps the source's width ratio (SmolLM2: 1536 / 576), rounded to a multiple of 8.
            config.intermediate_size = max(8, round(base.intermediate_size * hidden / old_hidden / 8) * 8)
        if getattr(config, "head_dim", None) is not None and (spec.hidden is not None or spec.heads is not None):
            config.head_dim = hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:
        raise RecipeError(
            f"model.kv_heads: the {heads} attention heads are not a multiple of the {kv_heads} key-value heads; "
            "set model.kv_heads to a divisor of model.heads"
        )
    return config


def use_tokenizer(config: PretrainedConfig, tokenizer) -> None:
    """A config read with another tokenizer (model.tokenizer: bytes): its vocabulary and special ids."""
    config.vocab_size = len(tokenizer)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id


def init_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A random model of CONFIG in float32; the same seed gives the same weights, bit for bit."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - a config that builds no model is the recipe's to fix
        raise RecipeError(
            f"model.from_scratch: the {config.model_type} config with these sizes builds no model: {error}"
        ) from error
    finally:
        torch.random.set_rng_state(generator_state)
    return model
