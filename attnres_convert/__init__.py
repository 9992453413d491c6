"""attnres: convert pretrained PreNorm causal LMs to Block Attention Residuals, exactly."""

from .modeling.architectures import FAMILIES, UnsupportedModelError, supported_model_types
from .modeling.configuration_attnres import AttnResConfig
from .conversion.convert import ConvertResult, convert
from .errors import AttnResError, OutputError, SourceError, VerificationError
from .modeling.modeling_attnres import AttnResForCausalLM
from .conversion.saving import load_converted, save_converted
from .conversion.surgery import BlockSizeError, convert_model, resolve_block_size, summarize

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "AttnResConfig",
    "AttnResError",
    "AttnResForCausalLM",
    "BlockSizeError",
    "ConvertResult",
    "OutputError",
    "SourceError",
    "UnsupportedModelError",
    "VerificationError",
    "convert",
    "convert_model",
    "load_converted",
    "resolve_block_size",
    "save_converted",
    "summarize",
    "supported_model_types",
]
