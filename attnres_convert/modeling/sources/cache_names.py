"""The name of the KV cache, as the installed transformers spells it (renamed from `past_key_values` to `cache`).

transformers 5.0 passes and returns the cache as `past_key_values`; later releases call it `cache` and
deprecate the old name (a FutureWarning per call, then an error once it is removed). Before that rename the
recurrent families (Mamba, Mamba2, FalconMamba, xLSTM) took and returned their state as `cache_params`, and
`generate` named it by the model's class. This code ships inside converted checkpoints and runs on whatever
release loads them, so it never hard-codes a name: it asks the forward it calls which keyword it takes, and an
output class which field it declares.
"""

from __future__ import annotations

import dataclasses
import inspect

from transformers.modeling_outputs import CausalLMOutputWithPast

CURRENT = "cache"
LEGACY = "past_key_values"
RECURRENT = "cache_params"  # a recurrent family's own name before the rename (transformers < 5.24)
# Where generate reads a recurrent state from an output before the rename (Mamba's cache_params, RWKV's state).
RECURRENT_STATES = (RECURRENT, "state")

# The installed transformers' name: the field its causal-LM output declares.
INSTALLED = CURRENT if CURRENT in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)} else LEGACY


def cache_keyword(forward) -> str:
    """The keyword `forward` takes its cache under: the one its signature names (the current name where it names
    several), else (only `**kwargs`) the installed transformers' name. Costs tens of microseconds: once per model."""
    parameters = inspect.signature(forward).parameters  # follows functools.wraps (transformers' deprecate_kwarg)
    for name in (CURRENT, LEGACY, RECURRENT):
        if name in parameters:
            return name
    return INSTALLED


def cache_of(output) -> object | None:
    """The cache a model output carries, read under the field its class declares (reading the other name
    works on a renaming release, but logs a deprecation). None where the output carries none."""
    fields = getattr(type(output), "__dataclass_fields__", {})  # dict lookups: cheap enough for every step
    return next((getattr(output, name) for name in (CURRENT, LEGACY) if name in fields), None)
