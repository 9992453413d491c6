"""Where a model comes from: a hub id, a local HF folder, a GGUF file, or the embedded default.

Every failure becomes a SourceError naming the source and the fix; nothing here writes files.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel

from ..errors import SourceError, first_line
from .hub_access import hub_endpoint, hub_reachable
from .paths import ModelSource, resolve_source  # noqa: F401 - re-exported

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hub_error(source: ModelSource, error: Exception) -> SourceError:
    return SourceError(
        f"could not download {source.location!r} from the HuggingFace hub (is it reachable from here? "
        f"{first_line(error)}). The hub id must be public or you must be logged in; offline, download the model "
        "elsewhere and pass its local folder or a .gguf file instead."
    )


def _remote_code_error(source: ModelSource) -> SourceError:
    return SourceError(
        f"{source.name} needs custom code from its repository to load. attnres runs such code only when "
        "asked: rerun with --trust-remote-code if you trust that code."
    )


def _is_remote_code_refusal(error: Exception) -> bool:
    text = str(error)
    return "trust_remote_code" in text or "custom code" in text


def _check_hub(source: ModelSource) -> None:
    """A hub id loads from the local cache when it is there; otherwise the hub must answer."""
    if source.kind != "hub":
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(source.location, "config.json"), str):
        return
    if not hub_reachable():
        raise SourceError(
            f"{source.location!r} looks like a hub id, but the HuggingFace hub ({hub_endpoint()}) is unreachable "
            "from this machine and the model is not in the local cache. Pass a local model folder or a .gguf "
            "file instead (for example: attnres convert ./my-model -o out)."
        )


def load_config(source: ModelSource, trust_remote_code: bool = False) -> PreTrainedConfig:
    if source.kind == "folder":
        _check_local_config(source)
    _check_hub(source)
    try:
        return AutoConfig.from_pretrained(source.location, trust_remote_code=trust_remote_code, **source.load_kwargs())
    except Exception as error:  # noqa: BLE001 - every failure is reported with its source and a fix
        if _is_remote_code_refusal(error):
            raise _remote_code_error(source) from error
        if source.kind == "hub":
            raise hub_error(source, error) from error
        if "does not recognize this architecture" in str(error) or "Unrecognized model" in str(error):
            raise _unknown_type_error(source) from error
        if source.gguf_file:
            raise SourceError(
                f"could not read the GGUF file {source.name} ({first_line(error)}). The file is truncated, corrupt "
                "or not a GGUF model: re-download or re-export it."
            ) from error
        raise SourceError(f"could not read the model config of {source.name}: {first_line(error)}") from error


@functools.lru_cache(maxsize=16)
def cached_config(source: ModelSource, converted: bool, trust_remote_code: bool) -> PreTrainedConfig:
    """The (base) model config of a local source, read once per process: parsing a GGUF header takes
    seconds, and recipe validation and model loading both need it. Treat it as read-only."""
    if converted:
        from ..modeling.configuration_attnres import AttnResConfig

        return AttnResConfig.from_pretrained(source.location).text_config
    return load_config(source, trust_remote_code)


def _unknown_type_error(source: ModelSource) -> SourceError:
    import transformers

    model_type = None
    if source.kind == "folder":
        try:
            model_type = json.loads((Path(source.location) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            pass
    what = f"model type {model_type!r}" if model_type else "a model type"
    return SourceError(
        f"{source.name} has {what} that transformers {transformers.__version__} does not know, so it cannot be "
        "loaded or converted. `attnres architectures` lists the model types it can convert."
    )


WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


def _check_has_weights(source: ModelSource) -> None:
    if source.kind != "folder":
        return
    folder = Path(source.location)
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise SourceError(
            f"{source.name} has a config.json but no weights (no *.safetensors or *.bin file). Pass the complete "
            "folder written by save_pretrained, a .gguf file, or a hub id."
        )


def _check_local_config(source: ModelSource) -> None:
    path = Path(source.location) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SourceError(f"{path} is not valid JSON ({error}); the folder is not a usable model.") from error
    if data.get("model_type") == "attnres":
        raise SourceError(
            f"{source.name} is already an AttnRes model. Convert the original model, or load this one with "
            "attnres_convert.load_converted / from_pretrained(..., trust_remote_code=True)."
        )


def _warn_if_pickle_only(source: ModelSource) -> None:
    if source.kind != "folder":
        return
    folder = Path(source.location)
    if not any(folder.glob("*.safetensors")) and any(folder.glob("*.bin")):
        warnings.warn(
            f"{source.name} has only pickle (*.bin) weights; they are loaded with torch.load(weights_only=True). "
            "Prefer safetensors checkpoints.",
            stacklevel=3,
        )


def load_model(
    source: ModelSource, dtype: str = "auto", trust_remote_code: bool = False, **load_kwargs
) -> PreTrainedModel:
    """The base model; LOAD_KWARGS go to from_pretrained (a device map that keeps it inside a memory budget)."""
    if dtype not in DTYPES:
        raise SourceError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    _check_has_weights(source)
    _warn_if_pickle_only(source)
    kwargs = {**source.load_kwargs(), **load_kwargs}
    # GGUF weights are dequantised on load: float32 keeps them as stored.
    kwargs["dtype"] = torch.float32 if (source.gguf_file and dtype == "auto") else DTYPES[dtype]
    kwargs["weights_only"] = True  # a pickle checkpoint may hold tensors only, never code (explicit: no env override)
    try:
        model = AutoModelForCausalLM.from_pretrained(source.location, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as error:  # noqa: BLE001
        if _is_remote_code_refusal(error):
            raise _remote_code_error(source) from error
        if source.kind == "hub":
            raise hub_error(source, error) from error
        if _is_unsafe_pickle(error):
            raise _unsafe_pickle_error(source, error) from error
        raise SourceError(
            f"could not load the weights of {source.name}: {first_line(error)}. The file may be truncated or corrupt: "
            "re-download or re-export it."
        ) from error
    if source.gguf_file:  # dequantised on load: plain weights, so no trace of a quantisation may be saved
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return model.eval()


def _is_unsafe_pickle(error: BaseException | None) -> bool:
    for _ in range(10):  # the error and its causes
        if error is None:
            return False
        if "Weights only load failed" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _unsafe_pickle_error(source: ModelSource, error: Exception) -> SourceError:
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    what = f" ({found.group(1)})" if found else ""
    return SourceError(
        f"refused to load the pickle checkpoint of {source.name}: it contains Python objects other than tensors{what}, "
        "which could run code. attnres reads pickle weights only with torch.load(weights_only=True). Use a "
        "safetensors or GGUF copy of the model, or convert the checkpoint to safetensors where you trust it."
    )


# The files a saved tokenizer consists of: a folder with none of them has no tokenizer (a bare weights folder).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "special_tokens_map.json",
)


# The files of an image, video or audio processor and its chat template: an image-text model's folder keeps
# them so that `AutoProcessor.from_pretrained` on the converted folder builds the original processor.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def processor_files(source: ModelSource) -> dict[str, str]:
    """The processor files of a model folder or hub repo, by name, to copy unchanged beside the converted
    weights (a GGUF file has none)."""
    if source.kind == "folder":
        folder = Path(source.location)
        return {name: (folder / name).read_text() for name in PROCESSOR_FILES if (folder / name).is_file()}
    if source.kind == "hub":
        return _hub_processor_files(source.location)
    return {}


def _hub_processor_files(repo_id: str) -> dict[str, str]:
    """Loading the model fetched its config and weights, not these: each is fetched (or, offline, found in the
    HF cache) the way transformers' AutoProcessor would; a file the repo lacks is skipped."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    files = {}
    for name in PROCESSOR_FILES:
        try:
            files[name] = Path(hf_hub_download(repo_id, name)).read_text()
        except (EntryNotFoundError, LocalEntryNotFoundError):
            continue
    return files


def has_tokenizer_files(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def _hub_has_tokenizer_files(repo_id: str) -> bool:
    """Whether the HF cache holds a tokenizer file of REPO_ID: asked after a failed load, which downloads the
    files the repo has (or, offline, finds those cached), so none there means the repo has no tokenizer."""
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in TOKENIZER_FILES)


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False, warn_missing: bool = False):
    """The tokenizer, or None when the source has none (a bare weights folder; with WARN_MISSING a warning says
    so). A tokenizer that is there but does not load is a SourceError naming the source, the file and why."""
    if source.kind == "folder" and not has_tokenizer_files(source.location):
        return _no_tokenizer(source, warn_missing)
    try:
        return AutoTokenizer.from_pretrained(
            source.location, trust_remote_code=trust_remote_code, **source.load_kwargs()
        )
    except Exception as error:  # noqa: BLE001 - reported with the source and the reason
        if _is_remote_code_refusal(error):
            raise _remote_code_error(source) from error
        if source.kind == "hub" and not _hub_has_tokenizer_files(source.location):
            return _no_tokenizer(source, warn_missing)
        raise _tokenizer_error(source, error) from error


def _no_tokenizer(source: ModelSource, warn: bool) -> None:
    if warn:
        warnings.warn(
            f"{source.name} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}...), so the converted folder "
            "holds none. Save the tokenizer next to the weights "
            "(tokenizer.save_pretrained) to ship one.",
            stacklevel=3,
        )
    return None


def _tokenizer_error(source: ModelSource, error: Exception) -> SourceError:
    """Which file of the tokenizer failed, where that can be told: a JSON file that does not parse."""
    where = source.name
    if source.gguf_file:
        where = f"the GGUF file {source.name}"
    elif source.kind == "folder":
        broken = [
            name for name in TOKENIZER_FILES if name.endswith(".json") and not _parses(Path(source.location) / name)
        ]
        if broken:
            where = str(Path(source.location) / broken[0])
    return SourceError(
        f"could not load the tokenizer of {source.name} ({where}): {first_line(error)}. Re-save the tokenizer "
        "(tokenizer.save_pretrained), or remove its files to convert the model without one."
    )


def _parses(path: Path) -> bool:
    """False for a JSON file that is there and cannot be read; True for a good one or none."""
    if not path.is_file():
        return True
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True
