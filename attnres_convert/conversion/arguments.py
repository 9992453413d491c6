"""What `convert` checks before it reads a model, with the standard library only: a wrong path, a bad size
or a taken output folder is answered before torch and transformers are imported."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OutputError
from ..io.paths import ModelSource, check_output, resolve_source
from .options import ConvertOptions, parse_size


def check_arguments(
    source: str | os.PathLike | None, out: str | os.PathLike | None, options: ConvertOptions
) -> ModelSource:
    """What `convert` checks before reading anything (the source path, the sizes, the output folder), with the
    standard library only: a wrong path is answered before torch and transformers are imported."""
    model_source = resolve_source(None if source is None else os.fspath(source))
    parse_size(options.max_shard_size, "--max-shard-size")
    if options.max_memory is not None:
        parse_size(options.max_memory, "--max-memory")
    if out is not None:
        if (
            model_source.kind == "folder"
            and Path(os.path.abspath(Path(out).expanduser())).resolve() == Path(model_source.location).resolve()
        ):
            # Writing the output over the input folder would replace the model being read.
            raise OutputError(
                f"output {out} is the input model folder {model_source.name}. Choose another output path."
            )
        check_output(out, options.overwrite)
    return model_source
