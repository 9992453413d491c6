"""Fine-tuning recipes: a typed schema (pydantic, unknown keys rejected), YAML loading and
torchtune-style `key.path=value` overrides.

A recipe is validated in two passes, both before anything is written:

1. `parse_recipe` (here) checks types, ranges and combinations: no file system access, and this module
   imports nothing of the package but its errors and convert's option declarations;
2. `preflight.check_recipe` checks what the file system can tell: data files exist and are not empty, the
   model source resolves, `data.seq_len` fits the model's positions when the config is readable offline.

Every problem is reported as `field.path: what is wrong` in one RecipeError (exit code 2 in the CLI).
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Annotated, Literal

import yaml

from ..optional import require

require("pydantic", "a fine-tuning recipe (attnres finetune, ab and recipes)")  # the schema below is pydantic's
# The imports below come after pydantic's check on purpose (it names the missing package and how to install it).
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator  # noqa: E402, I001

from ..conversion.options import ConvertOptions, DTypeName, canonical_dtype, parse_size  # noqa: E402
from ..errors import AttnResError  # noqa: E402
from ..io.hub_access import DEFAULT_MAX_SHARD_SIZE  # noqa: E402

DEFAULT_SOURCES = (None, "", "default")
_PRECISION_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "no", "fp32": "no"}


class RecipeError(AttnResError):
    """An invalid recipe, override or referenced file. The message lists `field: problem` lines."""


class _Section(BaseModel):
    # mergekit style: a typo in a key is an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _canonical_dtype_field(value):
    # A before-validator: a ValueError becomes the field's error, worded by canonical_dtype.
    try:
        return canonical_dtype(value, "")
    except AttnResError as error:
        raise ValueError(str(error).strip()) from None


# model.dtype: convert's dtype names, the usual aliases (bf16, fp32, ...) turned into them before the check.
DTypeField = Annotated[DTypeName, BeforeValidator(_canonical_dtype_field)]


def _convert_option(name: str):
    """`attnres convert`'s declaration of option NAME (conversion.options) as this schema's field."""
    option = ConvertOptions.model_fields[name]
    return Field(option.default, description=option.description, **({"ge": option.ge} if option.ge is not None else {}))


class ModelSection(_Section):
    """The model to start from and how it is converted."""

    source: str | None = Field(
        None,
        description="Hub id, local HF folder, .gguf file, an already converted AttnRes folder, or "
        "null/'default' for the embedded SmolLM2-135M-Instruct.",
    )
    convert: bool = Field(True, description="false: train the original model with the same recipe (the baseline).")
    # The conversion settings are `attnres convert`'s own options, declared once (conversion.options).
    block_size: int | None = _convert_option("block_size")
    num_blocks: int | None = _convert_option("num_blocks")
    full: bool = _convert_option("full")
    query_rank: int = _convert_option("query_rank")
    additive: bool = _convert_option("additive")
    # Not convert's default (auto): training keeps float32 weights, bf16 compute is train.mixed_precision.
    dtype: DTypeField = Field(
        "float32", description="Weights dtype; keep float32 and use train.mixed_precision for bf16 compute."
    )
    trust_remote_code: bool = _convert_option("trust_remote_code")
    # Training from scratch (finetune/scratch.py): the source's config, resized, with random weights.
    from_scratch: bool = Field(
        False,
        description="Start from a random initialisation of the source's config (seeded by train.seed: the same in every "
        "A/B arm) instead of its weights; the AttnRes arm is that initialisation converted. Needs train.trainable: full.",
    )
    layers: int | None = Field(None, ge=1, description="from_scratch: decoder layers (default: the source config's).")
    hidden: int | None = Field(
        None, ge=8, description="from_scratch: hidden size (the MLP keeps the source's width ratio)."
    )
    heads: int | None = Field(None, ge=1, description="from_scratch: attention heads; hidden must be a multiple of it.")
    kv_heads: int | None = Field(None, ge=1, description="from_scratch: key-value heads, a divisor of heads.")
    intermediate: int | None = Field(
        None, ge=1, description="from_scratch: MLP width (default: the source's ratio to hidden)."
    )
    tokenizer: Literal["source", "bytes"] = Field(
        "source",
        description="from_scratch: the source's tokenizer, or UTF-8 bytes (259 ids: a cheap embedding and head).",
    )

    @model_validator(mode="after")
    def _scratch_settings(self):
        if self.from_scratch:
            if self.hidden is not None and self.heads is not None and self.hidden % self.heads:
                raise ValueError(
                    f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}): each head gets hidden / heads dimensions"
                )
            if self.heads is not None and self.kv_heads is not None and self.heads % self.kv_heads:
                raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
            return self
        given = [
            f"model.{n}"
            for n in ("layers", "hidden", "heads", "kv_heads", "intermediate")
            if getattr(self, n) is not None
        ]
        if self.tokenizer != "source":
            given.append("model.tokenizer")
        if given:
            raise ValueError(
                f"{', '.join(given)} resize a model trained from scratch: set model.from_scratch: true, or drop them"
            )
        return self

    @model_validator(mode="after")
    def _one_block_setting(self):
        chosen = [n for n, v in (("block_size", self.block_size), ("num_blocks", self.num_blocks)) if v is not None]
        if self.full:
            chosen.append("full")
        if len(chosen) > 1:
            raise ValueError(f"give at most one of block_size, num_blocks, full (got {', '.join(chosen)})")
        return self

    @property
    def is_default(self) -> bool:
        return self.source in DEFAULT_SOURCES

    def describe(self, default: str = "embedded SmolLM2") -> str:
        """The model in a few words: the source (DEFAULT for the embedded one), or for from_scratch the random
        model it builds from the source's config ('random 24-layer d=128 model (config: embedded SmolLM2), bytes tokenizer')."""
        source = default if self.is_default else self.source
        if not self.from_scratch:
            return source
        shape = " ".join(
            filter(None, (f"{self.layers}-layer" if self.layers else None, f"d={self.hidden}" if self.hidden else None))
        )
        tokenizer = ", bytes tokenizer" if self.tokenizer == "bytes" else ""
        return f"random {shape + ' ' if shape else ''}model (config: {source}){tokenizer}"


class TextSource(_Section):
    """Where text comes from: local files (or the embedded Shakespeare), or a `datasets` dataset."""

    files: list[str] | None = Field(
        None,
        description="Text (.txt/.md), .jsonl/.json or .parquet files or globs, relative to the working directory; "
        "'shakespeare:GLOB' names plays of the embedded corpus (e.g. 'shakespeare:*', 'shakespeare:hamlet').",
    )
    dataset: str | None = Field(
        None, description="A `datasets` name (hub id, or a builder like 'json' with data_files)."
    )
    name: str | None = Field(None, description="The dataset's configuration name (e.g. 'sample-10BT').")
    data_files: list[str] | None = Field(
        None, description="Passed to datasets.load_dataset (for builders like 'json')."
    )
    split: str = Field("train", description="The dataset split to read.")
    text_field: str = Field("text", description="The field holding the text (jsonl, parquet, datasets).")
    streaming: bool = Field(True, description="Stream the dataset instead of downloading it whole.")
    max_documents: int | None = Field(None, ge=1, description="Read at most this many documents.")


class HeldOutSource(TextSource):
    """Held-out text, never trained on: files, a dataset, or a fraction of the training documents."""

    fraction: float | None = Field(
        None, gt=0, lt=1, description="Hold out this fraction of the training documents (whole documents)."
    )

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [n for n in ("files", "dataset", "fraction") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of files, dataset, fraction (got {', '.join(given) or 'none'})")
        return self


class DataSection(_Section):
    """Training and held-out text, and how it is cut into sequences."""

    train: TextSource = Field(..., description="Training text: exactly one of files, dataset.")
    eval: HeldOutSource = Field(
        default_factory=lambda: HeldOutSource(fraction=0.05),
        description="Held-out text: exactly one of files, dataset, fraction.",
    )
    seq_len: int = Field(256, ge=8, description="Tokens per training sequence.")
    packing: bool = Field(
        True,
        description="Concatenate documents (EOS between) and cut seq_len blocks; false: one document per sequence, padded.",
    )
    add_eos: bool = Field(True, description="Append the tokenizer's EOS token to every document.")
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokenise at most this many training tokens (default for datasets: what the run consumes).",
    )
    start_step: int = Field(
        0,
        ge=0,
        description="Read the training stream from where step N of a run with the same data, seed and batch left "
        "off (continued pretraining on unseen text; `attnres ab --retrofit-after` sets it).",
    )

    @model_validator(mode="after")
    def _train_source(self):
        given = [n for n in ("files", "dataset") if getattr(self.train, n) is not None]
        if len(given) != 1:
            raise ValueError(f"train: give exactly one of files, dataset (got {', '.join(given) or 'none'})")
        return self


class TrainSection(_Section):
    """What trains, for how long, and the optimiser (AdamW) and schedule."""

    trainable: Literal["attnres", "lora", "full"] = Field(
        "attnres",
        description="attnres: only the AttnRes queries and key norms; lora: LoRA adapters + AttnRes; full: everything.",
    )
    steps: int = Field(..., ge=1, description="Optimizer steps.")
    micro_batch: int = Field(4, ge=1, description="Sequences per forward pass, per process.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step, per process.")
    lr: float = Field(..., gt=0, description="Peak learning rate of the base (or LoRA) parameters.")
    attnres_lr: float | None = Field(
        None,
        gt=0,
        description="Peak learning rate of the AttnRes parameters (default: lr). With Adam a query step moves the "
        "scores by about attnres_lr x hidden size: keep it near 1e-4 at d=576 and scale it as 1/d for wider models.",
    )
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW decay of matrices; never applied to AttnRes params, norms, biases."
    )
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    schedule: Literal["cosine", "wsd", "constant"] = Field(
        "cosine", description="After warmup: cosine decay to min_lr_ratio, warmup-stable-decay, or constant."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Linear warmup steps from 0 to the peak learning rates (fewer than steps)."
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd: the last fraction of steps that decays to min_lr_ratio."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of the peak.")
    max_grad_norm: float | None = Field(
        1.0,
        gt=0,
        description="Clip the gradient norm of the base (or LoRA) parameters; null: no clipping. The AttnRes "
        "parameters are clipped on their own (attnres_max_grad_norm), so their large early gradients never scale the base update.",
    )
    attnres_max_grad_norm: float | None = Field(
        None,
        gt=0,
        description="Clip the gradient norm of the AttnRes parameters, on their own; null: no clipping (Adam "
        "normalises their step anyway).",
    )
    kl_weight: float = Field(
        0.0,
        ge=0,
        description="Add kl_weight x KL(starting model || model) per predicted token to the loss: keeps the "
        "predictions near the original's (for a fresh conversion the starting model is the original, exactly). Costs a "
        "frozen copy of the model and one more forward pass per micro-batch; metrics.jsonl records `kl`.",
    )
    depth_gate_steps: int = Field(
        0,
        ge=0,
        description="Let the depth mix in gradually: each sublayer reads stream + g (mix - stream), with g rising "
        "linearly from 0 to 1 over this many steps (a scheduled gate, as in reskip's retrofit); 0: off. The saved model is "
        "plain AttnRes (g = 1). No effect without AttnRes (the A/B baseline).",
    )
    attnres_first_steps: int = Field(
        0,
        ge=0,
        description="A routing-first phase: for this many steps only the AttnRes parameters move (the base's learning "
        "rate is held at 0), then the base trains too, with its warmup and schedule over the remaining steps; 0: off.",
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no",
        description="Accelerate's mixed precision for the compute (bfloat16 and float16 are taken as bf16 and fp16).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass (non-reentrant) to save memory."
    )
    seed: int = Field(0, description="Seeds the data order, LoRA initialisation and dropout.")
    log_every: int = Field(1, ge=1, description="Write metrics.jsonl every N steps.")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _precision_by_dtype_name(cls, value):
        # A dtype's usual names mean the same precision here: bfloat16 is bf16, float16 fp16, float32 no.
        if isinstance(value, str):
            return _PRECISION_ALIASES.get(value.strip().lower(), value)
        return value

    @model_validator(mode="after")
    def _warmup_fits(self):
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than steps ({self.steps})")
        if self.depth_gate_steps >= self.steps:
            raise ValueError(
                f"depth_gate_steps ({self.depth_gate_steps}) must be smaller than steps ({self.steps}), so that the model "
                "trains and is saved with the whole depth mix (gate 1)"
            )
        if self.attnres_first_steps and self.attnres_first_steps + self.warmup_steps >= self.steps:
            raise ValueError(
                f"attnres_first_steps ({self.attnres_first_steps}) + warmup_steps ({self.warmup_steps}) must be smaller "
                f"than steps ({self.steps}), so that the base trains after the routing-first phase"
            )
        for beta in self.betas:
            if not 0 <= beta < 1:
                raise ValueError(f"betas must be in [0, 1), got {list(self.betas)}")
        return self

    @property
    def peak_attnres_lr(self) -> float:
        return self.attnres_lr if self.attnres_lr is not None else self.lr


class LoraSection(_Section):
    """PEFT LoRA adapters, used when train.trainable is lora."""

    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="Module names to adapt (e.g. [q_proj, v_proj]) or 'all-linear' (every Linear but the head).",
    )
    merge: bool = Field(
        True, description="Merge the adapter into the saved model; false keeps it in OUT/model/adapter."
    )

    @field_validator("target_modules")
    @classmethod
    def _known_shortcut(cls, value):
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f"must be a list of module names or 'all-linear' (got {value!r})")
        if isinstance(value, list) and not value:
            raise ValueError("must name at least one module (or be 'all-linear')")
        return value


class EvalSection(_Section):
    """Held-out loss and perplexity during training."""

    every: int = Field(50, ge=0, description="Held-out evaluation every N steps (0: only before and after training).")
    max_sequences: int | None = Field(
        64, ge=1, description="Evaluate on at most this many held-out sequences (evenly spaced)."
    )
    batch_size: int | None = Field(None, ge=1, description="Default: train.micro_batch.")
    at_start: bool = Field(True, description="Evaluate before the first step (the converted model = the original).")


class CheckpointSection(_Section):
    """Resumable checkpoints (trainable weights, optimizer, scheduler, RNG states, data position)."""

    every: int = Field(
        100, ge=0, description="Save a resumable checkpoint every N steps (0: only on Ctrl-C / SIGTERM)."
    )
    keep_last: int = Field(2, ge=1, description="Keep this many of the newest checkpoints.")


class RetrofitSection(_Section):
    """`attnres ab --retrofit-after N`: the continued phase after N pretraining steps; a field left null keeps train's."""

    steps: int | None = Field(
        None, ge=1, description="Continued steps from each pretrained checkpoint (required by --retrofit-after)."
    )
    lr: float | None = Field(None, gt=0, description="Peak learning rate of the continued phase (default: train.lr).")
    attnres_lr: float | None = Field(
        None, gt=0, description="Peak learning rate of the AttnRes parameters (default: train.attnres_lr)."
    )
    warmup_steps: int | None = Field(
        None, ge=0, description="Warmup of the continued phase (default: train.warmup_steps)."
    )
    schedule: Literal["cosine", "wsd", "constant"] | None = Field(
        None,
        description="Learning-rate schedule of the continued phase (default: train.schedule). With wsd or constant, "
        "--reuse extends shorter continued runs to a larger retrofit.steps instead of training them again.",
    )
    trainable: Literal["lora", "full"] = Field(
        "full", description="What trains in the continued phase (lora: the recipe's lora section)."
    )

    @model_validator(mode="after")
    def _warmup_fits(self):
        if self.steps is not None and self.warmup_steps is not None and self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than steps ({self.steps})")
        return self


class OutputSection(_Section):
    """The run folder and where the result goes."""

    dir: str = Field(..., min_length=1, description="Run folder: recipe, metrics, checkpoints/, model/.")
    overwrite: bool = Field(
        False,
        description="Replace an earlier run folder, kept until the new run has finished (otherwise use --resume).",
    )
    save_model: bool = Field(True, description="Write the final model to OUT/model (the A/B benchmark turns it off).")
    max_shard_size: str = Field(
        DEFAULT_MAX_SHARD_SIZE,
        description="Largest weight file of OUT/model, e.g. 5GB (the hub refuses files over 50GB).",
    )
    push_to_hub: str | None = Field(
        None, description="Hub repo id to upload OUT/model to at the end (token: HF_TOKEN or `hf auth login`)."
    )
    private: bool = Field(False, description="Create the hub repo as private.")

    @field_validator("max_shard_size")
    @classmethod
    def _a_size(cls, value: str) -> str:
        try:  # refused before training, not at the save after it
            parse_size(value, "size")
        except AttnResError as error:
            raise ValueError(str(error)) from None
        return value


class Recipe(_Section):
    """A fine-tuning run."""

    description: str | None = Field(None, description="What this run is for (shown by `attnres recipes list`).")
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection
    train: TrainSection
    lora: LoraSection = Field(default_factory=LoraSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    output: OutputSection
    retrofit: RetrofitSection = Field(default_factory=RetrofitSection)

    @model_validator(mode="after")
    def _something_trains(self):
        if not self.model.convert and self.train.trainable == "attnres":
            raise ValueError(
                "train.trainable: 'attnres' trains only the AttnRes parameters, but model.convert is false "
                "(the original model has none); use lora or full for a baseline"
            )
        if self.model.from_scratch:
            # Fields that only mean something for a pretrained model: a from-scratch recipe mixing them is a mistake.
            retrofit = [
                f"{name} ({why})"
                for name, why, given in (
                    (
                        "train.trainable",
                        f"{self.train.trainable}; a random model trains every weight: use full",
                        self.train.trainable != "full",
                    ),
                    ("train.kl_weight", "a KL term to a random model", self.train.kl_weight > 0),
                    (
                        "train.depth_gate_steps",
                        "a gate that protects pretrained sublayers",
                        self.train.depth_gate_steps > 0,
                    ),
                )
                if given
            ]
            if retrofit:
                raise ValueError(
                    "model.from_scratch: these fields belong to a retrofit of a pretrained model, not to training from "
                    "scratch: " + "; ".join(retrofit)
                )
        return self

    def headline(self) -> str:
        """The fields that matter, in one line: model, data, steps, what trains, output."""
        model = self.model.describe("the embedded SmolLM2-135M-Instruct")
        train = self.data.train
        data = ", ".join(train.files) if train.files else (train.dataset or "?")
        return (
            f"Fine-tuning {model}{'' if self.model.convert else ' (original, not converted)'} on {data}: "
            f"{self.train.steps} steps of {self.train.micro_batch * self.train.grad_accum} x {self.data.seq_len} tokens, "
            f"trains {self.train.trainable}, output {self.output.dir}"
        )

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# --- errors ---------------------------------------------------------------------------------------

_MESSAGES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "missing": "required",
    "string_too_short": "must not be empty",
}


def _field_path(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif item in ("list[str]", "str") or str(item).startswith("function-"):
            continue  # pydantic's name for a union member, not a field
        else:
            parts.append(str(item))
    return ".".join(parts)


def _message(error: dict, model: type[BaseModel]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        parent = _section_at(model, [p for p in error["loc"][:-1] if isinstance(p, str)])
        if not parent:
            return "unknown key"
        close = difflib.get_close_matches(str(error["loc"][-1]), list(parent.model_fields), n=2)
        if close:
            return f"unknown key; did you mean {' or '.join(close)}? (`attnres recipes show quickstart-cpu` shows a commented recipe)"
        return f"unknown key (known keys: {', '.join(parent.model_fields)})"
    if kind == "literal_error":
        return f"must be one of {error['ctx']['expected']} (got {error['input']!r})"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    template = _MESSAGES.get(kind)
    if template:
        return template.format(**{k: _number(v) for k, v in error.get("ctx", {}).items()})
    return f"{error['msg'][0].lower()}{error['msg'][1:]} (got {error['input']!r})"


def _number(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _section_at(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    for name in path:
        field = model.model_fields.get(name)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def format_validation_error(error: ValidationError, model: type[BaseModel] = Recipe) -> str:
    lines = []
    for item in error.errors():
        if item["type"] == "string_type" and isinstance(item["input"], (list, dict)) and "str" in item["loc"]:
            continue  # the `str` member of a `list[str] | str` union: the list member's error says more
        path = _field_path(item["loc"])
        lines.append(f"{path}: {_message(item, model)}" if path else _message(item, model))
    return "\n".join(dict.fromkeys(lines))


# --- loading and overrides ------------------------------------------------------------------------


def recipes_dir() -> Path:
    """The shipped recipes: $ATTNRES_RECIPES, else the package's `recipes/` (package data of a wheel, see
    setup.py), else, in a checkout, the repository's `recipes/` beside the package."""
    env = os.environ.get("ATTNRES_RECIPES")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parents[1]
    installed = package / "recipes"
    return installed if installed.is_dir() else package.parent / "recipes"


def shipped_recipes() -> dict[str, Path]:
    folder = recipes_dir()
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


def find_recipe(name_or_path: str | os.PathLike) -> Path:
    """A recipe file path, or the name of a shipped recipe (`quickstart-cpu`)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = shipped_recipes()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    if path.suffix in (".yaml", ".yml") or path.parent != Path("."):
        raise RecipeError(f"recipe file {name_or_path} does not exist")
    names = ", ".join(shipped) or "none found"
    raise RecipeError(f"{name_or_path} is neither a recipe file nor a shipped recipe (shipped: {names})")


def read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise RecipeError(f"{path} is not valid YAML: {error}") from error
    except OSError as error:
        raise RecipeError(f"cannot read recipe {path}: {error}") from error
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping (model:, data:, train:, ...), got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`key.path=value` (torchtune style); the value is parsed as YAML (`3e-4`, `null`, `[q_proj, v_proj]`)."""
    data = copy.deepcopy(data)
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"{item}: an override is key.path=value (e.g. train.lr=1e-4)")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as error:
            problems.append(f"{key}: cannot parse value {raw!r} ({error.__class__.__name__})")
            continue
        node = data
        parts = key.split(".")
        for index, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"{'.'.join(parts[: index + 1])}: is a value, not a section; cannot set {key}")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise RecipeError("\n".join(problems))
    return data


def parse_recipe(data: dict) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        raise RecipeError(format_validation_error(error)) from None


def load_recipe(name_or_path: str | os.PathLike, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate (schema only; see `preflight.check_recipe` for the file system checks)."""
    data = read_yaml(find_recipe(name_or_path))
    return parse_recipe(apply_overrides(data, list(overrides or [])))
