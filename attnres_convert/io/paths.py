"""Paths a command is given, checked before anything heavy is imported: where a model comes from, whether an
output folder can be written, whether a folder holds an attnres model. Standard library only, so that
`attnres` answers a wrong path or a taken output folder in well under a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError, SourceError
from .samples import default_model_path


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "default" | "gguf" | "folder" | "hub"
    location: str  # a folder (default, gguf, folder) or a hub repo id
    gguf_file: str | None = None
    given: str | None = None  # what the user typed, for messages

    @property
    def name(self) -> str:
        if self.kind == "default":
            return f"SmolLM2-135M-Instruct (embedded, {self.gguf_file})"
        return self.given or self.location

    @property
    def short_name(self) -> str:
        """A short model name for titles: the hub id's name, the folder's name, or the embedded model's."""
        if self.kind == "default":
            return "SmolLM2-135M-Instruct"
        return self.location.split("/")[-1] if self.kind == "hub" else Path(self.location).name

    def load_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~")) or text.endswith(".gguf") or text.count("/") > 1 or "\\" in text


def resolve_source(source: str | None) -> ModelSource:
    """Decide what SOURCE is, without loading anything."""
    if source is None or source == "":
        path = default_model_path()
        _require_gguf(f"the embedded default model ({path.name})")
        return ModelSource("default", str(path.parent), path.name)
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            _require_gguf(f"reading {source} (a GGUF file)")
            return ModelSource("gguf", str(path.parent.resolve()), path.name, given=source)
        raise SourceError(
            f"{source} is a file but not a .gguf file. Pass a model folder (with config.json and "
            "*.safetensors), a .gguf file, or a hub id."
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"{source} is not a model folder: it has no config.json. {_what_to_pass(path, source)}")
        return ModelSource("folder", str(path.resolve()), given=source)
    if _looks_like_path(source):
        raise SourceError(
            f"no such file or folder: {source}. Check the path, or pass a hub id like HuggingFaceTB/SmolLM2-135M."
        )
    return ModelSource("hub", source, given=source)


def _require_gguf(needed_for: str) -> None:
    """transformers reads a GGUF file with the `gguf` package: a missing one is said before any work starts."""
    from ..optional import require

    require("gguf", needed_for)


def _what_to_pass(folder: Path, source: str) -> str:
    """The fix for a folder that is not a model: the model inside an attnres run folder, or what a model is."""
    given = source.rstrip("/" + os.sep)
    if (folder / "recipe.yaml").is_file() or (folder / "metrics.jsonl").is_file():  # `attnres finetune`'s run folder
        if (folder / "model" / "config.json").is_file():
            return f"It is a fine-tuning run folder: its model is {given}/model. Pass that."
        return "It is a fine-tuning run folder without a saved model (output.save_model was false, or the run did not finish)."
    if (folder / "ab.json").is_file():  # `attnres ab`'s output: the arms train with output.save_model=false
        return "It is an A/B output (ab.json, ab.md, ab.png); its arms save no model."
    return "Pass a folder written by save_pretrained (config.json + *.safetensors), a .gguf file, or a hub id."


def check_output(out: str | os.PathLike, overwrite: bool = False, owned: bool = False) -> Path:
    """Fail early, before any work, if the output cannot be written. Writes and leaves nothing.

    Returns the output as an absolute path. With `overwrite`, only an empty folder or an earlier attnres
    output is replaced: a typo such as `-o ~ --overwrite` must never delete a user's folder. `owned`: the
    caller made OUT itself (a fine-tune's OUT/model, possibly a plain baseline model): replace it whatever it holds.
    """
    path = Path(os.path.abspath(Path(out).expanduser()))
    if not path.name:
        raise OutputError(f"output {out} is not a folder name. Pass a new folder, for example -o ./my-model-attnres.")
    if path.is_symlink():
        raise OutputError(f"output {out} is a symbolic link. Pass the real folder path, or choose another path.")
    if path.exists() and not path.is_dir():
        raise OutputError(f"output {out} is a file, not a folder. Choose another output path.")
    if path.is_dir() and _has_entries(path) and not owned:
        if not overwrite:
            raise OutputError(
                f"output folder {out} already exists. Pass --overwrite to replace it, or choose another path."
            )
        if not is_attnres_output(path):
            raise OutputError(
                f"output folder {out} exists and is not an attnres model folder (no config.json with model_type "
                "'attnres'); --overwrite only replaces earlier attnres outputs. Choose another path, or remove it yourself."
            )
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"cannot create {out}: {existing} is a file, not a folder. Choose another output path.")
    _probe_writable(existing, out)
    return path


def write_problem(path: str | os.PathLike) -> str | None:
    """Why the folder PATH (to be created, or written into) cannot be written, or None. Creates and removes
    a probe entry in PATH or its nearest existing parent; permission bits alone say nothing for root."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        _probe_writable(existing, path)
    except OutputError as error:
        reason = getattr(error.__cause__, "strerror", None) or "refused"
        return f"{existing} is not writable ({reason}; read-only, immutable or not yours)"
    return None


def _has_entries(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError as error:
        raise OutputError(
            f"cannot read output folder {folder} ({error.strerror}). Choose another output path."
        ) from error


def _probe_writable(folder: Path, out) -> None:
    """Really create (and remove) an entry: permission bits alone say nothing for root, read-only mounts,
    immutable folders or /proc and /sys."""
    probe = folder / f".attnres-write-test-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(probe, 0o700)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise OutputError(
            f"cannot write {out}: {folder} is not writable ({reason}; read-only, immutable or not yours). "
            "Choose an output path you can write to."
        ) from error
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(probe)


def is_attnres_output(path: str | os.PathLike) -> bool:
    """An empty folder or a folder attnres wrote (config.json with model_type 'attnres')."""
    path = Path(path)
    return path.is_dir() and (not any(path.iterdir()) or is_converted_folder(path))


def is_converted_folder(path: str | os.PathLike) -> bool:
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") == "attnres"
    except (OSError, ValueError):
        return False


def max_positions(source: ModelSource) -> int | None:
    """The longest sequence a local SOURCE takes, read from its config.json or GGUF header without
    transformers; None when neither says (the caller may ask transformers)."""
    if source.kind == "hub":
        return None
    if source.gguf_file:
        return _gguf_context_length(Path(source.location) / source.gguf_file)
    config = json.loads((Path(source.location) / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings") or section.get("n_positions")
        if isinstance(value, int):
            return value
    return None


# GGUF metadata value types (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): struct format per scalar.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_context_length(path: Path) -> int | None:
    """`{architecture}.context_length` from a GGUF header, reading the key-value section only (the gguf
    package parses every tensor's description first, seconds for a small model)."""
    import struct

    with open(path, "rb") as file:

        def read(fmt: str):
            return struct.unpack("<" + fmt, file.read(struct.calcsize("<" + fmt)))[0]

        def value(kind: int):
            if kind == _GGUF_STRING:
                return file.read(read("Q")).decode("utf-8", "replace")
            if kind == _GGUF_ARRAY:
                item, count = read("I"), read("Q")
                if item in _GGUF_SCALARS:  # skipped whole: vocabularies are arrays
                    file.seek(count * struct.calcsize("<" + _GGUF_SCALARS[item]), os.SEEK_CUR)
                    return None
                return [value(item) for _ in range(count)]
            return read(_GGUF_SCALARS[kind])

        if file.read(4) != b"GGUF":
            return None
        _version, _tensors, entries = read("I"), read("Q"), read("Q")
        architecture = None
        for _ in range(entries):
            key = value(_GGUF_STRING)
            found = value(read("I"))
            if key == "general.architecture":
                architecture = found
            elif architecture and key == f"{architecture}.context_length":
                return int(found)
    return None
