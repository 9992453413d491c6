"""The transformers internals the model uses, each imported where it is used by a static import statement.

transformers' public API is imported as usual. Internals may move in any release: where one is missing, the error
names it and the releases this code was tested with, instead of a bare ImportError deep in a load.
"""

from __future__ import annotations

# The transformers releases this code was tested with (attnres's `make test-lowest` and `make test-latest`).
TESTED_TRANSFORMERS = ">=5.16.1,<6"

# Attributes of transformers' base models that make their own loop act on the hidden states between decoder layers,
# as an optimisation only, and the value that turns it off: a converted layer hands the next one a depth-attention
# state, not a tensor. Gemma 4 slices the stream to the positions whose logits are kept before its first KV-shared
# layer (this attribute's index; with none, it never slices, and computes the same logits at those positions).
BETWEEN_LAYER_SHORTCUTS: dict[str, object] = {"first_kv_shared_layer_idx": None}


class MissingTransformersInternal(ImportError):
    """An internal of transformers that the installed release does not have where this code looks for it."""


def missing_internal(name: str, purpose: str) -> MissingTransformersInternal:
    import transformers

    return MissingTransformersInternal(
        f"transformers {transformers.__version__} has no transformers.{name}, which AttnRes uses for {purpose}: "
        f"install a transformers release it was tested with (transformers{TESTED_TRANSFORMERS})"
    )


def causal_lm_class(config, model_type: str):
    """The causal-LM class transformers builds for CONFIG (of MODEL_TYPE). Releases before 5.2x map the causal LM
    of some image-text families' text model (Emu3's, Mllama's) only under the composite config's type (`emu3`), so
    where CONFIG's class has no entry, the class of an entry whose type MODEL_TYPE starts with and whose
    `config_class` is CONFIG's class ('emu3_text_model' -> Emu3ForCausalLM under `emu3`)."""
    import transformers

    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING,
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        )
    except ImportError as error:
        raise missing_internal(
            "models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING", "building the base model"
        ) from error
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    for key, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        candidate = getattr(transformers, class_name, None) if model_type.startswith(key) else None
        if candidate is not None and getattr(candidate, "config_class", None) is type(config):
            return candidate
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the mapping's own KeyError


def guard_torch_init_functions():
    """transformers' context in which torch.nn.init calls respect `_is_hf_initialized` (loaded tensors), as its own
    init does; a no-op context where the installed release has none."""
    try:
        from transformers.initialization import guard_torch_init_functions as guard
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return guard()
