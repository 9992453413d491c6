"""A base model's own code (`auto_map`, --trust-remote-code) in a converted folder.

transformers copies a remote-code module together with the files it imports relatively. So the converted folder
holds the base model's configuration and modeling files, copied from where the base classes were loaded, and a
`base_code.py` that imports them relatively and registers them with AutoConfig / AutoModelForCausalLM; the folder's
configuration_attnres.py imports `base_code`, so loading the folder with `trust_remote_code=True` brings the base
code along, and saving a model loaded that way writes it out again (transformers copies what the code imports).
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

BASE_CODE = "base_code.py"  # where a converted folder registers its base model's own code
CONFIG_IMPORT = (
    "\nfrom .base_code import BASE_CLASSES  # noqa: E402,F401 - registers the base model's own code beside this file\n"
)


def is_own_code(cls: type) -> bool:
    """A class defined by a model's own code (a repository with `auto_map`), not by transformers."""
    return not cls.__module__.startswith("transformers.")


def base_code_files(config_cls: type, model_cls: type) -> dict[str, Path]:
    """The base model's code files by name (each class's module and what it imports relatively); none for a base
    model transformers ships."""
    if not (is_own_code(config_cls) or is_own_code(model_cls)):
        return {}
    from ..transformers_compat import get_relative_import_files

    files = {}
    for cls in (config_cls, model_cls):
        path = Path(inspect.getfile(cls))
        for found in [path, *(Path(p) for p in get_relative_import_files(str(path)))]:
            files[found.name] = found
    return files


def base_code_text(config_cls: type, model_cls: type, model_type: str) -> str:
    config_module, model_module = config_cls.__module__.split(".")[-1], model_cls.__module__.split(".")[-1]
    return (
        '"""The base model\'s own code, copied beside this file from its repository when the model was converted\n'
        "to Block AttnRes: registered with transformers' Auto classes so that the AttnRes config and model build the\n"
        'base model where neither that repository nor attnres is installed. Written by attnres."""\n\n'
        "from transformers import AutoConfig, AutoModelForCausalLM\n\n"
        f"from .{config_module} import {config_cls.__name__}\n"
        f"from .{model_module} import {model_cls.__name__}\n\n"
        f"AutoConfig.register({model_type!r}, {config_cls.__name__}, exist_ok=True)\n"
        f"AutoModelForCausalLM.register({config_cls.__name__}, {model_cls.__name__}, exist_ok=True)\n"
        f"BASE_CLASSES: dict = {{{model_type!r}: ({config_cls.__name__}, {model_cls.__name__})}}\n"
    )


def ship_base_code(config_cls: type, model_cls: type, model_type: str, folder) -> list[str]:
    """Copy a base model's own code files into FOLDER, write base_code.py registering them, and make the folder's
    configuration_attnres.py import it (so loading the folder with trust_remote_code brings the base code along);
    nothing for a base model transformers ships. Returns the names of the copied files."""
    files = base_code_files(config_cls, model_cls)
    if not files:
        return []
    folder = Path(folder)
    for name, path in files.items():
        target = folder / name
        if not (target.exists() and target.resolve() == path.resolve()):
            shutil.copyfile(path, target)
    (folder / BASE_CODE).write_text(base_code_text(config_cls, model_cls, model_type))
    configuration = folder / "configuration_attnres.py"
    if configuration.is_file() and CONFIG_IMPORT not in configuration.read_text():
        with configuration.open("a") as file:
            file.write(CONFIG_IMPORT)
    return sorted(files)


def ship_model_code(model, folder) -> list[str]:
    """After `model.save_pretrained(folder)` of a converted model this package built: its base model's own code, if
    any, goes along (a model loaded from a folder with trust_remote_code has transformers copy it itself)."""
    base_class = getattr(model, "_attnres_base_class", None)
    if base_class is None:
        return []
    text_config = model.config.text_config
    return ship_base_code(type(text_config), base_class, text_config.model_type, folder)
