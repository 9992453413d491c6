"""`convert`'s options, declared once: `attnres_convert.convert(...)` takes them as keyword arguments
and the `attnres convert` command builds its flags and help text from the same fields (as mergekit's
MergeOptions does for its library and CLI).

A field becomes `--field-name` on the command line; a bool defaulting to True becomes
`--name/--no-name`. Fields marked `cli=False` are library-only. Range and combination checks stay in
`resolve_block_size` and the loaders, so the library and the command fail with the same messages.
"""

from __future__ import annotations

from typing import Annotated, Literal

from huggingface_hub.serialization._base import parse_size_to_int
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import AttnResError
from ..io.samples import SAMPLE_TEXT
from ..io.hub_access import DEFAULT_MAX_SHARD_SIZE


DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# The names people type for the same dtypes (PyTorch's, Accelerate's, llama.cpp's); matched case-insensitively.
DTYPE_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32", "torch.float32": "float32",
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16", "torch.float16": "float16",
}


def canonical_dtype(value, what: str = "dtype", allowed: tuple[str, ...] = DTYPE_NAMES) -> str:
    """VALUE as one of ALLOWED (float32, bfloat16, float16, auto), its usual aliases (fp32, bf16, fp16, half, ...)
    accepted; anything else is an AttnResError naming WHAT and the choices."""
    text = str(getattr(value, "value", value)).strip().lower()
    name = DTYPE_ALIASES.get(text, text)
    if name not in allowed:
        choices = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
        raise AttnResError(f"{what} {value!r} is not a data type we know: use {choices} (or bf16, fp16, fp32)")
    return name


def _canonical_dtype_field(value):
    # A pydantic before-validator: a ValueError becomes the field's error, worded by the messages above.
    try:
        return canonical_dtype(value, "")
    except AttnResError as error:
        raise ValueError(str(error).strip()) from None


# A dtype field (convert's --dtype, a recipe's model.dtype): aliases become the canonical name before the check.
DTypeName = Annotated[Literal["auto", "float32", "bfloat16", "float16"], BeforeValidator(_canonical_dtype_field)]


class OptionsError(AttnResError):
    """An unknown option or a value of the wrong type."""


class ConvertOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # block_size, num_blocks, full, query_rank and trust_remote_code are also a fine-tuning recipe's `model.*`
    # settings, which take these declarations (finetune.recipe.ModelSection).
    block_size: int | None = Field(
        None, ge=1, description="Sublayers per block S (give at most one of the block size, number of blocks, full)."
    )
    num_blocks: int | None = Field(
        None, ge=1, description="At most this many blocks, S in whole layers (default: 8)."
    )
    full: bool = Field(False, description="Full AttnRes (S = 1).")
    query_rank: int = Field(
        0,
        ge=0,
        description="Rank r of input-dependent queries, w + B A x per token (B zero at conversion: still exact; A and B "
        "train with the AttnRes parameters); 0: static queries. Runs the plain PyTorch depth mix.",
    )
    dtype: DTypeName = Field("auto", description="auto keeps the checkpoint's dtype; or float32, bfloat16, float16 (fp32, bf16, fp16).")
    verify: bool = Field(True, description="Check logits and greedy generation against the original.")
    verify_tokens: int = Field(256, ge=1, description="Tokens of the sample text the check runs on.")
    verify_new_tokens: int = Field(32, ge=1, description="Greedy tokens generated (with the KV cache) by the check.")
    verify_text: str = Field(
        SAMPLE_TEXT, description="Text the check runs on (default: a built-in sample).", json_schema_extra={"cli": False}
    )
    overwrite: bool = Field(False, description="Replace an existing output folder.")
    trust_remote_code: bool = Field(False, description="Allow the source model's own code (auto_map) to run.")
    stream: bool = Field(
        True,
        description="Write the converted folder from the input's files, tensor by tensor, without loading the model "
        "(safetensors copied, GGUF de-quantised); --no-stream loads it in memory (pickle checkpoints always are).",
    )
    max_shard_size: str = Field(
        DEFAULT_MAX_SHARD_SIZE, description="Largest weight file written, e.g. 5GB or 500MB (the hub refuses files over 50GB)."
    )
    max_memory: str | None = Field(
        None,
        description="Memory the verification may use, e.g. 16GB; a larger model is streamed layer by layer from its "
        "files (default: 80% of the free memory).",
    )

    @field_validator("max_shard_size", "max_memory", mode="before")
    @classmethod
    def _bytes_as_text(cls, value):
        # The library also takes a number of bytes; the flag is text ("5GB"), parsed where it is used.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _one_block_choice(self):
        chosen = [name for name in ("block_size", "num_blocks") if getattr(self, name) is not None] + (["full"] if self.full else [])
        if len(chosen) > 1:
            raise ValueError(f"give only one of block_size, num_blocks, full (got {', '.join(chosen)})")
        return self

    @classmethod
    def build(cls, options: ConvertOptions | None = None, **overrides) -> ConvertOptions:
        """OPTIONS (or the defaults) with OVERRIDES applied; a misspelt or mistyped option is an OptionsError."""
        try:
            if options is None:
                return cls(**overrides)
            return cls(**{**options.model_dump(), **overrides}) if overrides else options
        except ValidationError as error:
            problems = "; ".join(map(_problem, error.errors()))
            raise OptionsError(f"invalid convert option: {problems}") from None


def _problem(error: dict) -> str:
    """One pydantic error in words, named by its field (the command line turns names into --flags)."""
    if not error["loc"]:  # a check across fields
        return error["msg"].removeprefix("Value error, ")
    name = ".".join(map(str, error["loc"]))
    if error["type"] == "greater_than_equal":
        return f"{name} must be >= {error['ctx']['ge']}, got {error['input']!r}"
    if error["type"] == "value_error":  # our own validator's words, without pydantic's "Value error, "
        return f"{name} {error['ctx']['error']}"
    return f"{name}: {error['msg']} (got {error['input']!r})"


def parse_size(value: int | str, what: str) -> int:
    """'5GB', '500MB', '1.5GB' or a number of bytes, as save_pretrained's max_shard_size takes them."""
    try:
        text = str(value).strip().upper()
        size = value if isinstance(value, int) else int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError as error:
        raise AttnResError(f"{what} {value!r} is not a size: give a number of bytes or a value like 5GB or 500MB") from error
    if size <= 0:
        raise AttnResError(f"{what} {value!r} must be positive")
    return size


def options_doc(model: type[BaseModel]) -> str:
    """The fields of MODEL as a docstring section (name, default, description)."""
    lines = ["Options (keyword arguments):"]
    for name, field in model.model_fields.items():
        default = repr(field.default) if len(repr(field.default)) < 40 else "a built-in sample"
        lines.append(f"    {name} (default {default}): {field.description}")
    return "\n".join(lines)
