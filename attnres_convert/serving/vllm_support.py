"""What vLLM can serve of a converted model, and the refusal that says so: the family, the reason, the fallback.
Imports no engine: the checks take vLLM's own test of an attention module as an argument."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from torch import nn

from ..modeling.modeling_attnres import module_at


class ServingRefused(ValueError):
    """A converted model vLLM cannot serve, with the reason and what serves it instead."""

    def __init__(self, family: str, reason: str, release: str | None = None):
        self.family, self.reason = family, reason
        if release is not None:
            fix = (
                f"re-save it with attnres >= {release}'s code (`attnres upgrade FOLDER --trust-remote-code`, checked "
                "exactly against the folder's own code), whose modeling code vLLM serves; transformers' `generate` "
                "serves this folder as it is"
            )
        else:
            fix = (
                "serve it with transformers' `generate` (AutoModelForCausalLM.from_pretrained(folder, "
                "trust_remote_code=True)), which runs every family attnres converts"
            )
        super().__init__(f"vLLM cannot serve this AttnRes model (base family {family!r}): {reason}. Fallback: {fix}.")


def release() -> str:
    """The installed attnres release (the first that serves with vLLM is the one whose plugin is installed)."""
    return importlib.metadata.version("attnres")


# Families the serving sweep (benchmarks/vllm_sweep.py) found served with tokens other than `generate`'s, whose
# cause is not known: refused rather than served wrong.
INEXACT = {
    "moshi": "vLLM's greedy tokens differed from transformers' `generate` on the same folder in the serving sweep"
}


def unservable_reason(model: nn.Module, interface_call: Callable) -> str | None:
    """Why vLLM's paged attention cannot run this converted model, or None where it can: every decoder layer must
    have exactly one module whose forward calls transformers' attention interface (`interface_call(forward)`,
    vLLM's own test, is not None), since that call is the one place the model reads other tokens. An attention that
    computes its softmax in its own code (older transformers models: Bloom, GPT-J, Falcon...) cannot be taken over,
    and a Mamba or linear-attention mixer reads other tokens through a recurrent state, which vLLM's paged KV cache
    does not hold."""
    family = model.config.get_text_config().model_type
    if family in INEXACT:
        return INEXACT[family]
    plan = model._attnres_plan
    layers = module_at(module_at(model, plan.base_model), plan.layers)
    for index, layer in enumerate(layers):
        found = [name for name, module in layer.named_modules() if interface_call(type(module).forward) is not None]
        if len(found) == 1:
            continue
        if not found:
            return (
                f"decoder layer {index} ({type(layer).__name__}) has no module that calls transformers' attention "
                "interface, where vLLM's paged attention takes over: its attention is computed in the model's own "
                "code, or its tokens are mixed through a recurrent state (Mamba, linear attention), which vLLM's "
                "paged KV cache does not hold"
            )
        return (
            f"decoder layer {index} ({type(layer).__name__}) calls attention from several modules ({', '.join(found)})"
        )
    if getattr(model, "_is_stateful", False):
        return "its base model carries a recurrent state from token to token, which vLLM's paged KV cache does not hold"
    return None
