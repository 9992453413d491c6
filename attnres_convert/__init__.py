"""attnres: convert pretrained PreNorm causal LMs to Block Attention Residuals, exactly.

The public names load on first use, so `attnres --help` and the option declarations the command line
reads (conversion.options) do not import torch and transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_EXPORTS = {
    "FAMILIES": ".modeling.architectures",
    "UnsupportedModelError": ".modeling.architectures",
    "supported_model_types": ".modeling.architectures",
    "AttnResConfig": ".modeling.configuration_attnres",
    "AttnResForCausalLM": ".modeling.modeling_attnres",
    "set_depth_gate": ".depth_controls",
    "record_depth_weights": ".depth_controls",
    "ConvertOptions": ".conversion.options",
    "OptionsError": ".conversion.options",
    "ConvertResult": ".conversion.convert",
    "convert": ".conversion.convert",
    "load_converted": ".io.saving",
    "save_converted": ".io.saving",
    "register_auto_classes": ".io.saving",
    "BlockSizeError": ".conversion.surgery",
    "convert_model": ".conversion.surgery",
    "resolve_block_size": ".conversion.surgery",
    "summarize": ".conversion.surgery",
    "AttnResError": ".errors",
    "OutputError": ".errors",
    "SourceError": ".errors",
    "VerificationError": ".errors",
    "DataError": ".errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
