"""Open any model a user can name for reading: a converted AttnRes folder, or a plain source (hub id,
HF folder, .gguf, the embedded default). Used by `attnres eval` and `attnres inspect`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SourceError, first_line
from ..modeling.modeling_attnres import AttnResForCausalLM
from .saving import is_converted_folder, load_converted
from .sources import DTYPES, ModelSource, load_config, load_model, load_tokenizer, resolve_source


@dataclass
class LoadedModel:
    model: object = field(repr=False)
    tokenizer: object | None = field(repr=False)
    name: str
    converted: bool  # an AttnResForCausalLM (converted or fine-tuned), not the plain base model


def _folder_tokenizer(folder: Path, trust_remote_code: bool):
    """The converted folder's tokenizer (its model type is registered by load_converted, so reading the config
    asks nothing); None for a folder saved without one, a SourceError for one that does not load."""
    return load_tokenizer(ModelSource("folder", str(folder), given=str(folder)), trust_remote_code)


def load_any(model: str | os.PathLike | None, dtype: str = "auto", trust_remote_code: bool = False) -> LoadedModel:
    """MODEL is a converted folder (loaded with this package's classes, no remote code), or anything
    `attnres convert` accepts as a source (None = the embedded SmolLM2)."""
    if model is not None and Path(model).expanduser().is_dir() and is_converted_folder(Path(model).expanduser()):
        folder = Path(model).expanduser()
        if dtype not in DTYPES:
            raise SourceError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        try:
            loaded = load_converted(folder, trust_remote_code, dtype=DTYPES[dtype])
        except Exception as error:  # noqa: BLE001 - a corrupt folder is the user's to fix
            raise SourceError(f"could not load the AttnRes folder {model}: {first_line(error)}") from error
        return LoadedModel(loaded.eval(), _folder_tokenizer(folder, trust_remote_code), str(model), True)
    source = resolve_source(None if model is None else str(model))
    load_config(source, trust_remote_code)  # clear errors (unreachable hub, refused code) before loading weights
    loaded = load_model(source, dtype, trust_remote_code)
    return LoadedModel(
        loaded.eval(), load_tokenizer(source, trust_remote_code), source.name, isinstance(loaded, AttnResForCausalLM)
    )
