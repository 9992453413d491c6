"""The transformers internals attnres uses, reached through this one module.

transformers' public API (`AutoConfig`, `PreTrainedModel`, `GenerationMixin`, `modeling_outputs`, `utils.logging`)
is imported where it is used. Everything else lives in modules transformers may move or rename in any release:
each such name is listed once in INTERNALS with the module it comes from and what attnres needs it for, and is
imported from here (`from .transformers_compat import PrefixChange`, resolved lazily on first use). When an
upgrade moves one, the import fails here, naming the internal, and tests/test_transformers_compat.py fails with
one test per internal. The few that older releases of the tested range lack are listed in SINCE: the code asks
`has(name)` and does what such a release needs instead, so a converted folder loads on every tested release.

This module is the package's only: the code shipped next to converted weights (modeling/configuration_attnres.py,
modeling_attnres.py) imports the few internals it needs directly, each of them listed in INTERNALS too (so a move
fails its test here), and does without what SINCE lists itself (`build_sub_config`, `causal_lm_class` there).
"""

from __future__ import annotations

# The transformers releases the suite runs on (pyproject.toml's range; `make test-lowest` and `make test-latest`
# test both ends). tests/test_transformers_compat.py checks that the two say the same.
TESTED_TRANSFORMERS = ">=5.16.1,<6"

# name: (module, what attnres needs it for)
INTERNALS: dict[str, tuple[str, str]] = {
    "SubConfigSpec": ("transformers.configuration_utils", "declaring the converted config's text_config sub-config"),
    "get_model_conversion_mapping": ("transformers.conversion_mapping", "the checkpoint renaming rules a save reverts"),
    "PrefixChange": ("transformers.core_model_loading", "telling prefix changes from renaming rules"),
    "revert_weight_conversion": ("transformers.core_model_loading", "the names a streamed save writes"),
    "WeightConverter": ("transformers.core_model_loading", "vLLM's loading: the checkpoint merges of a family"),
    "MergeModulelist": ("transformers.core_model_loading", "vLLM's loading: when a layer's experts are all read"),
    "WeightRenaming": ("transformers.core_model_loading", "vLLM's loading: the checkpoint renamings of a family"),
    "rename_source_key": ("transformers.core_model_loading", "vLLM's loading: a checkpoint name as the model's"),
    "dot_natural_key": ("transformers.core_model_loading", "vLLM's loading: merged tensors in their order"),
    "remove_tied_weights_from_state_dict": ("transformers.modeling_utils", "the tensors a streamed save writes"),
    "custom_object_save": ("transformers.dynamic_module_utils", "copying a base model's own code into the folder"),
    "get_relative_import_files": ("transformers.dynamic_module_utils", "the files a base model's own code imports"),
    "get_relative_imports": ("transformers.dynamic_module_utils", "the files base_code.py imports"),
    "get_class_from_dynamic_module": ("transformers.dynamic_module_utils", "registering a base model's own code"),
    "MODEL_FOR_CAUSAL_LM_MAPPING": (
        "transformers.models.auto.modeling_auto",
        "building the base model from its config",
    ),
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": (
        "transformers.models.auto.modeling_auto",
        "the model types the coverage walk checks",
    ),
    "CONFIG_MAPPING_NAMES": ("transformers.models.auto.configuration_auto", "the model types transformers ships"),
    "GgufHeader": ("transformers.integrations.gguf.reader", "reading a GGUF header without its vocabulary"),
    "load_gguf_state_dict": ("transformers.integrations.gguf.reader", "a GGUF's tensors as transformers reads them"),
    "is_gguf_arch_supported": ("transformers.integrations.gguf.utils", "which GGUF files transformers converts itself"),
    "TENSOR_PROCESSORS": ("transformers.modeling_gguf_pytorch_utils", "per-architecture GGUF tensor fixes"),
    "TensorProcessor": ("transformers.modeling_gguf_pytorch_utils", "the default GGUF tensor processing"),
    "guard_torch_init_functions": (
        "transformers.initialization",
        "initialising the buffers a checkpoint does not hold without touching loaded weights",
    ),
}


# The modules INTERNALS names, each imported by a static import statement: the shipped code imports nothing by a
# computed name (tests/test_security.py).
def _configuration_utils():
    from transformers import configuration_utils

    return configuration_utils


def _conversion_mapping():
    from transformers import conversion_mapping

    return conversion_mapping


def _core_model_loading():
    from transformers import core_model_loading

    return core_model_loading


def _modeling_utils():
    from transformers import modeling_utils

    return modeling_utils


def _dynamic_module_utils():
    from transformers import dynamic_module_utils

    return dynamic_module_utils


def _modeling_auto():
    from transformers.models.auto import modeling_auto

    return modeling_auto


def _configuration_auto():
    from transformers.models.auto import configuration_auto

    return configuration_auto


def _gguf_reader():
    from transformers.integrations.gguf import reader

    return reader


def _gguf_utils():
    from transformers.integrations.gguf import utils

    return utils


def _modeling_gguf_pytorch_utils():
    from transformers import modeling_gguf_pytorch_utils

    return modeling_gguf_pytorch_utils


def _initialization():
    from transformers import initialization

    return initialization


MODULES = {
    "transformers.configuration_utils": _configuration_utils,
    "transformers.conversion_mapping": _conversion_mapping,
    "transformers.core_model_loading": _core_model_loading,
    "transformers.modeling_utils": _modeling_utils,
    "transformers.dynamic_module_utils": _dynamic_module_utils,
    "transformers.models.auto.modeling_auto": _modeling_auto,
    "transformers.models.auto.configuration_auto": _configuration_auto,
    "transformers.integrations.gguf.reader": _gguf_reader,
    "transformers.integrations.gguf.utils": _gguf_utils,
    "transformers.modeling_gguf_pytorch_utils": _modeling_gguf_pytorch_utils,
    "transformers.initialization": _initialization,
}


# The internals that the older releases of the tested range lack: the first release that has each, and what
# attnres does before it (feature-detected with `has`, never by comparing versions). Every other internal is in
# every tested release.
SINCE: dict[str, tuple[str, str]] = {
    "SubConfigSpec": (
        "5.20",
        "the sub-config is named in `sub_configs` and built by the config itself (configuration_attnres.build_sub_config)",
    ),
    "GgufHeader": ("5.17", "the GGUF header is read with gguf's GGUFReader"),
    "load_gguf_state_dict": ("5.17", "the GGUF's tensors are read with gguf's GGUFReader"),
    "is_gguf_arch_supported": ("5.17", "no GGUF architecture has a weight-conversion pipeline: all stream"),
}


class MissingTransformersInternal(ImportError):
    """An internal of transformers that the installed release does not have where attnres looks for it."""


def internal(name: str):
    """The object INTERNALS names, imported from its module; MissingTransformersInternal naming it otherwise."""
    module_name, purpose = INTERNALS[name]
    try:
        return getattr(MODULES[module_name](), name)
    except (ImportError, AttributeError, KeyError) as error:
        import transformers

        raise MissingTransformersInternal(
            f"transformers {transformers.__version__} has no {module_name}.{name}, which attnres uses for {purpose}: "
            f"install a transformers release attnres was tested with (transformers{TESTED_TRANSFORMERS})"
        ) from error


def has(name: str) -> bool:
    """Whether the installed transformers has the internal NAME (one of SINCE's: the others are always there)."""
    try:
        internal(name)
    except MissingTransformersInternal:
        return False
    return True


def __getattr__(name: str):
    if name in INTERNALS:
        return internal(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
