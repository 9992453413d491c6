"""`convert`'s options, declared once: `attnres_convert.convert(...)` takes them as keyword arguments
and the `attnres convert` command builds its flags and help text from the same fields (as mergekit's
MergeOptions does for its library and CLI).

A field becomes `--field-name` on the command line; a bool defaulting to True becomes
`--name/--no-name`. Fields marked `cli=False` are library-only. Range and combination checks stay in
`resolve_block_size` and the loaders, so the library and the command fail with the same messages.

A frozen dataclass checked by hand rather than a pydantic model: `attnres convert` and `attnres bench` run
where pydantic is not installed (optional.py). `model_fields` describes the fields as pydantic's does
(annotation, default, description, json_schema_extra), for the command line and the recipe's model section.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

from huggingface_hub.serialization._base import parse_size_to_int  # noqa: PLC2701 - its one size parser

from ..errors import AttnResError
from ..io.hub_access import DEFAULT_MAX_SHARD_SIZE
from ..io.samples import SAMPLE_TEXT

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# The names people type for the same dtypes (PyTorch's, Accelerate's, llama.cpp's); matched case-insensitively.
DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "torch.float16": "float16",
}
# A dtype field (convert's --dtype, a recipe's model.dtype, which also takes the aliases: finetune.recipe).
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]


def canonical_dtype(value, what: str = "dtype", allowed: tuple[str, ...] = DTYPE_NAMES) -> str:
    """VALUE as one of ALLOWED (float32, bfloat16, float16, auto), its usual aliases (fp32, bf16, fp16, half, ...)
    accepted; anything else is an AttnResError naming WHAT and the choices."""
    text = str(getattr(value, "value", value)).strip().lower()
    name = DTYPE_ALIASES.get(text, text)
    if name not in allowed:
        choices = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
        raise AttnResError(f"{what} {value!r} is not a data type we know: use {choices} (or bf16, fp16, fp32)")
    return name


class OptionsError(AttnResError):
    """An unknown option or a value of the wrong type."""


@dataclass(frozen=True)
class OptionField:
    """One option's declaration: its type, default, help text, lower bound, and whether it is a flag."""

    annotation: object
    default: object
    description: str
    ge: int | None = None
    cli: bool = True
    aliases: bool = False  # the value may be an alias the options turn into a choice (a dtype: bf16 for bfloat16)

    @property
    def json_schema_extra(self) -> dict | None:  # pydantic's spelling, read by the command line
        return None if self.cli else {"cli": False}


def _option(default, description: str, *, ge: int | None = None, cli: bool = True, aliases: bool = False):
    return dataclasses.field(
        default=default, metadata={"description": description, "ge": ge, "cli": cli, "aliases": aliases}
    )


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    # block_size, num_blocks, full, query_rank, additive and trust_remote_code are also a fine-tuning recipe's `model.*`
    # settings, which take these declarations (finetune.recipe.ModelSection).
    block_size: int | None = _option(
        None, "Sublayers per block S (give at most one of the block size, number of blocks, full).", ge=1
    )
    num_blocks: int | None = _option(None, "At most this many blocks, S in whole layers (default: 8).", ge=1)
    full: bool = _option(False, "Full AttnRes (S = 1).")
    query_rank: int = _option(
        0,
        "Rank r of input-dependent queries, w + B A x per token (B zero at conversion: still exact; A and B "
        "train with the AttnRes parameters); 0: static queries. Runs the plain PyTorch depth mix.",
        ge=0,
    )
    additive: bool = _option(
        False,
        "Delta-style additive mix: a reader reads the residual stream plus a learned gate (zero at conversion: still "
        "exact) times the mix of the embedding and completed blocks. Runs the plain PyTorch depth mix.",
    )
    dtype: DTypeName = _option(
        "auto", "auto keeps the checkpoint's dtype; or float32, bfloat16, float16 (fp32, bf16, fp16).", aliases=True
    )
    verify: bool = _option(True, "Check logits and greedy generation against the original.")
    verify_tokens: int = _option(256, "Tokens of the sample text the check runs on.", ge=1)
    verify_new_tokens: int = _option(32, "Greedy tokens generated (with the KV cache) by the check.", ge=1)
    verify_text: str = _option(SAMPLE_TEXT, "Text the check runs on (default: a built-in sample).", cli=False)
    overwrite: bool = _option(False, "Replace an existing output folder.")
    trust_remote_code: bool = _option(False, "Allow the source model's own code (auto_map) to run.")
    stream: bool = _option(
        True,
        "Write the converted folder from the input's files, tensor by tensor, without loading the model "
        "(safetensors copied, GGUF de-quantised); --no-stream loads it in memory (pickle checkpoints always are).",
    )
    max_shard_size: str = _option(
        DEFAULT_MAX_SHARD_SIZE, "Largest weight file written, e.g. 5GB or 500MB (the hub refuses files over 50GB)."
    )
    max_memory: str | None = _option(
        None,
        "Memory the verification may use, e.g. 16GB; a larger model is streamed layer by layer from its "
        "files (default: 80% of the free memory).",
    )

    model_fields: ClassVar[dict[str, OptionField]]

    def __post_init__(self):
        problems = []
        for name, field in self.model_fields.items():
            value = getattr(self, name)
            if name in ("max_shard_size", "max_memory") and isinstance(value, int) and not isinstance(value, bool):
                # The library also takes a number of bytes; the flag is text ("5GB"), parsed where it is used.
                object.__setattr__(self, name, value := str(value))
            if (
                name == "dtype"
            ):  # an alias (bf16, fp32, ...) becomes the canonical name; anything else is said in our words
                try:
                    object.__setattr__(self, name, value := canonical_dtype(value, name))
                except AttnResError as error:
                    problems.append(str(error))
                    continue
            problem = _type_problem(field.annotation, value)
            if problem is None and field.ge is not None and value is not None and value < field.ge:
                problem = f"{name} must be >= {field.ge}, got {value!r}"
            elif problem is not None:
                problem = f"{name}: {problem} (got {value!r})"
            if problem:
                problems.append(problem)
        if not problems:
            chosen = [n for n in ("block_size", "num_blocks") if getattr(self, n) is not None] + (
                ["full"] if self.full else []
            )
            if len(chosen) > 1:
                problems.append(f"give only one of block_size, num_blocks, full (got {', '.join(chosen)})")
        if problems:
            raise OptionsError(f"invalid convert option: {'; '.join(problems)}")

    @classmethod
    def build(cls, options: ConvertOptions | None = None, **overrides) -> ConvertOptions:
        """OPTIONS (or the defaults) with OVERRIDES applied; a misspelt or mistyped option is an OptionsError."""
        unknown = [name for name in overrides if name not in cls.model_fields]
        if unknown:
            raise OptionsError(
                f"invalid convert option: unknown option {', '.join(unknown)} (known: {', '.join(cls.model_fields)})"
            )
        if options is None:
            return cls(**overrides)
        return dataclasses.replace(options, **overrides) if overrides else options

    def model_dump(self) -> dict:
        return dataclasses.asdict(self)


def _type_problem(annotation, value) -> str | None:
    """What is wrong with VALUE for ANNOTATION (int, bool, str, a Literal, or one of them | None), or None."""
    choices = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return None if value in choices else f"must be one of {', '.join(map(repr, choices))}"
    if choices:  # X | None
        return None if value is None else _type_problem(next(c for c in choices if c is not type(None)), value)
    if annotation is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    return None if isinstance(value, annotation) else f"must be a {annotation.__name__}"


_HINTS = typing.get_type_hints(ConvertOptions)
ConvertOptions.model_fields = {
    f.name: OptionField(_HINTS[f.name], f.default, **f.metadata) for f in dataclasses.fields(ConvertOptions)
}


def parse_size(value: int | str, what: str) -> int:
    """'5GB', '500MB', '1.5GB' or a number of bytes, as save_pretrained's max_shard_size takes them."""
    try:
        text = str(value).strip().upper()
        size = value if isinstance(value, int) else int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError as error:
        raise AttnResError(
            f"{what} {value!r} is not a size: give a number of bytes or a value like 5GB or 500MB"
        ) from error
    if size <= 0:
        raise AttnResError(f"{what} {value!r} must be positive")
    return size


def options_doc(model: type) -> str:
    """The fields of MODEL as a docstring section (name, default, description)."""
    lines = ["Options (keyword arguments):"]
    for name, field in model.model_fields.items():
        default = repr(field.default) if len(repr(field.default)) < 40 else "a built-in sample"
        lines.append(f"    {name} (default {default}): {field.description}")
    return "\n".join(lines)
