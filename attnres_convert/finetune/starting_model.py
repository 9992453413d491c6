"""The model a fine-tuning run starts from: the original model, converted as the recipe says (or not,
for the baseline), or an already converted AttnRes folder whose learned routing training continues."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from ..architectures import UnsupportedModelError
from ..conversion.surgery import ConversionSummary, convert_model, resolve_block_size, structure_of, summarize
from ..errors import SourceError
from ..io.saving import is_converted_folder, load_converted
from ..io.sources import DTYPES, ModelSource, cached_config, load_config, load_model, load_tokenizer, resolve_source
from .recipe import Recipe, RecipeError
from .scratch import byte_tokenizer, init_model, scratch_config, use_tokenizer


@dataclass
class StartingModel:
    model: PreTrainedModel
    tokenizer: object
    source: ModelSource
    converted: bool  # an AttnRes model (converted now or loaded converted)
    summary: ConversionSummary | None


def load_starting_model(recipe: Recipe) -> StartingModel:
    spec = recipe.model
    source = resolve_source(None if spec.is_default else spec.source)
    if spec.from_scratch:
        return _scratch_model(recipe, source)
    tokenizer = load_tokenizer(source, spec.trust_remote_code)
    if tokenizer is None:
        raise RecipeError(
            f"model.source: {source.name} has no tokenizer, and training needs one to read the text. "
            "Save the tokenizer next to the weights (tokenizer.save_pretrained)."
        )
    if source.kind == "folder" and is_converted_folder(source.location):
        dtype = DTYPES[spec.dtype]
        try:
            model = load_converted(source.location, spec.trust_remote_code, dtype=dtype)
        except SourceError:
            raise
        except Exception as error:  # noqa: BLE001
            raise SourceError(f"could not load the AttnRes model in {source.name}: {error}") from error
        summary = summarize(model)
        asked = spec.block_size or (1 if spec.full else None)
        if asked is not None and asked != summary.block_size:
            raise RecipeError(
                f"model.block_size: {source.name} is already converted with block size {summary.block_size}; "
                f"it cannot be trained as {asked}. Drop the block setting, or start from the original model"
            )
        if spec.query_rank and spec.query_rank != summary.query_rank:
            raise RecipeError(
                f"model.query_rank: {source.name} is already converted with query rank {summary.query_rank}; "
                f"it cannot be trained as {spec.query_rank}. Drop model.query_rank, or start from the original model"
            )
        if spec.additive and not summary.additive:
            raise RecipeError(
                f"model.additive: {source.name} is already converted without the additive mix; it cannot be trained "
                "with it. Drop model.additive, or start from the original model"
            )
        return StartingModel(model, tokenizer, source, True, summary)
    if spec.convert:
        # Refuse an impossible block size before loading any weights.
        try:
            config = (
                cached_config(source, False, spec.trust_remote_code)
                if source.kind != "hub"
                else load_config(source, spec.trust_remote_code)
            )
            structure = structure_of(config)
            if structure is not None:  # else checked once the loaded model's structure is found
                resolve_block_size(structure, spec.block_size, spec.num_blocks, spec.full)
        except ValueError as error:
            raise RecipeError(f"model.block_size: {error}") from error
    model = load_model(source, spec.dtype, spec.trust_remote_code)
    if not spec.convert:
        return StartingModel(model, tokenizer, source, False, None)
    model = convert_model(model, **conversion_settings(spec))
    return StartingModel(model, tokenizer, source, True, summarize(model))


def conversion_settings(spec) -> dict:
    """The recipe's `model.*` conversion settings, as convert_model takes them."""
    return dict(
        block_size=spec.block_size,
        num_blocks=spec.num_blocks,
        full=spec.full,
        query_rank=spec.query_rank,
        additive=spec.additive,
    )


def _scratch_model(recipe: Recipe, source: ModelSource) -> StartingModel:
    """A random initialisation of the source's config (seeded by train.seed), converted if the recipe says so:
    the plain model and its conversion start from the same weights."""
    spec = recipe.model
    if source.kind == "folder" and is_converted_folder(source.location):
        raise RecipeError(
            f"model.from_scratch: {source.name} is an AttnRes model; give the original model (or its config) as the source"
        )
    tokenizer = byte_tokenizer() if spec.tokenizer == "bytes" else load_tokenizer(source, spec.trust_remote_code)
    if tokenizer is None:
        raise RecipeError(f"model.tokenizer: {source.name} has no tokenizer; use model.tokenizer: bytes")
    config = scratch_config(source, spec)
    if spec.tokenizer == "bytes":
        use_tokenizer(config, tokenizer)
    model = init_model(config, recipe.train.seed)
    if not spec.convert:
        return StartingModel(model, tokenizer, source, False, None)
    try:
        model = convert_model(model, **conversion_settings(spec))
    except UnsupportedModelError as error:
        raise RecipeError(
            f"model.source: the {config.model_type} config of {source.name} is not a PreNorm model AttnRes can convert, "
            f"so it has no AttnRes arm: {error}"
        ) from error
    except ValueError as error:  # a block size the model does not have
        raise RecipeError(f"model.block_size: {error}") from error
    return StartingModel(model, tokenizer, source, True, summarize(model))
