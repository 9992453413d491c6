"""Ship a base model's own code (`auto_map`, --trust-remote-code) next to the converted model's, and the C++
source of the CPU kernels (transformers copies a model's .py files only).

transformers copies a remote-code module together with the files it imports relatively (and those files'
relative imports). So the converted folder holds the base model's configuration and modeling files, copied from
where the base classes were loaded, and a generated `base_code.py` that imports them relatively and registers
them with AutoConfig / AutoModelForCausalLM; configuration_attnres imports `base_code`, so loading the folder
with `trust_remote_code=True` brings the base code along, and saving a loaded model writes it out again.

This file ships next to converted weights: it imports transformers, the standard library and its siblings only.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

from .depth_kernels_cpu import SOURCE_NAME, source_text
from .transformers_compat import get_relative_import_files

GENERATED = "base_code.py"


def is_own_code(cls: type) -> bool:
    """A class defined by a model's own code, not by transformers."""
    return not cls.__module__.startswith("transformers.")


def _code_files(cls: type) -> list[Path]:
    path = Path(inspect.getfile(cls))
    return [path, *(Path(p) for p in get_relative_import_files(str(path)))]


def base_code_text(config_cls: type, model_cls: type, model_type: str) -> str:
    config_module, model_module = config_cls.__module__.split(".")[-1], model_cls.__module__.split(".")[-1]
    return (
        '"""The base model\'s own code, copied beside this file from its repository when the model was converted\n'
        'to Block AttnRes: registered with transformers\' Auto classes so that the AttnRes config and model build the\n'
        'base model where neither that repository nor attnres is installed. Written by attnres."""\n\n'
        "from transformers import AutoConfig, AutoModelForCausalLM\n\n"
        f"from .{config_module} import {config_cls.__name__}\n"
        f"from .{model_module} import {model_cls.__name__}\n\n"
        f"AutoConfig.register({model_type!r}, {config_cls.__name__}, exist_ok=True)\n"
        f"AutoModelForCausalLM.register({config_cls.__name__}, {model_cls.__name__}, exist_ok=True)\n"
        f"BASE_CLASSES: dict = {{{model_type!r}: ({config_cls.__name__}, {model_cls.__name__})}}\n"
    )


def base_code_files(config_cls: type, model_cls: type) -> dict[str, Path]:
    """The base model's code files by name (each class's module and what it imports relatively); none for a base
    model transformers ships."""
    if not (is_own_code(config_cls) or is_own_code(model_cls)):
        return {}
    return {path.name: path for cls in (config_cls, model_cls) for path in _code_files(cls)}


def ship_base_code(config_cls: type, model_cls: type, model_type: str, folder) -> list[str]:
    """Copy the base model's code files into FOLDER and write base_code.py importing them; nothing for a base
    model transformers ships. Returns the names of the copied files."""
    files = base_code_files(config_cls, model_cls)
    if not files:
        return []
    folder = Path(folder)
    for name, path in files.items():
        target = folder / name
        if not (target.exists() and target.resolve() == path.resolve()):
            shutil.copyfile(path, target)
    (folder / GENERATED).write_text(base_code_text(config_cls, model_cls, model_type))
    return sorted(files)


def ship_kernel_source(config, folder) -> None:
    """Write the C++ kernels' source (depth_kernels_cpu.cpp) into FOLDER: from the package, or, for a model loaded
    from a converted folder or the Hub, from where it was loaded (see `source_text`)."""
    target = Path(folder) / SOURCE_NAME
    here = Path(__file__).with_name(SOURCE_NAME)
    if target.exists() and here.exists() and target.resolve() == here.resolve():
        return
    target.write_text(source_text(config))
