"""The transformers internals the model uses beyond its public API, imported where they are used (a release that
moved one fails there with transformers' own ImportError, naming it)."""

from __future__ import annotations

# Attributes that make a base model's loop act on the hidden states between layers as an optimisation only, and the
# value that turns it off (a converted layer hands on a state, not a tensor): Gemma 4's slicing before KV sharing.
BETWEEN_LAYER_SHORTCUTS: dict[str, object] = {"first_kv_shared_layer_idx": None}


def causal_lm_class(config, model_type: str):
    """The causal-LM class transformers builds for CONFIG (of MODEL_TYPE). Releases before 5.2x map some image-text
    families' text causal LM (Emu3's, Mllama's) only under the composite's type: the entry MODEL_TYPE starts with."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    for key, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        candidate = getattr(transformers, class_name, None) if model_type.startswith(key) else None
        if candidate is not None and getattr(candidate, "config_class", None) is type(config):
            return candidate
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the mapping's own KeyError
