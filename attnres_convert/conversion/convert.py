"""`attnres convert` as a library call: load, check, convert, verify, save.

Cheap checks (output path, architecture, block size) run before the weights are loaded, and nothing
is written until the converted model is complete (and verified, when asked).
"""

from __future__ import annotations

import contextlib
import json
import os
import textwrap
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..architectures import UnsupportedModelError, vocab_size_of
from ..errors import VerificationError, first_line
from ..io.card import conversion_card
from ..io.saving import atomic_folder, save_converted
from ..io.sources import ModelSource, load_config, load_model, load_tokenizer, processor_files
from ..modeling.modeling_attnres import AttnResForCausalLM
from .arguments import check_arguments
from .discovery import check_input_embeddings
from .memory_budget import plan_verification, verify_saved
from .options import ConvertOptions, options_doc, parse_size
from .streaming import BackgroundPlan, NotStreamable, largest_layer_bytes, stream_input, write_streamed
from .surgery import ConversionSummary, convert_model, resolve_block_size, structure_of, summarize
from .verify import VerificationReport, capture_reference, compare, fit_to_model, sample_input_ids

Stage = Callable[[str], contextlib.AbstractContextManager]
SEE_COVERAGE = "`attnres architectures` lists the model types that convert, and why the others do not."


def refusal(name: str, error: BaseException, action: str = "convert") -> str:
    """`cannot ACTION NAME: why.` and where the coverage is listed: the reason ends as a sentence whatever
    punctuation it came with, so it never runs into the next one."""
    reason = str(error).rstrip()
    if not reason.endswith((".", "!", "?")):
        reason += "."
    return f"cannot {action} {name}: {reason} {SEE_COVERAGE}"


# progress(description, total bytes) -> a context whose value is advance(bytes done)
Progress = Callable[[str, int], contextlib.AbstractContextManager[Callable[[int], None]]]


@contextlib.contextmanager
def _quiet_progress(name: str, total: int) -> Iterator[Callable[[int], None]]:
    yield lambda nbytes: None


@dataclass
class ConvertResult:
    source: str
    output: Path | None
    summary: ConversionSummary
    verification: VerificationReport | None
    model: AttnResForCausalLM | None = field(default=None, repr=False)
    tokenizer: object | None = field(default=None, repr=False)
    verification_budget: str | None = None  # how a streamed conversion's check kept to its memory budget
    budget_mattered: bool = False  # the check streamed layers from the files, or ran under a given --max-memory


def convert(
    source: str | None = None,
    out: str | os.PathLike | None = None,
    options: ConvertOptions | None = None,
    *,
    stage: Stage = contextlib.nullcontext,  # no display: a stage is a no-op block
    progress: Progress = _quiet_progress,
    keep_model: bool = False,
    **option_values,
) -> ConvertResult:
    """Convert SOURCE (hub id, folder, .gguf, None = embedded SmolLM2) to Block AttnRes and save to OUT.

    A safetensors checkpoint of a model type in the architecture table is converted file to file without
    loading the model (streaming.py); other inputs (GGUF, pickle, checkpoints with extra tensors, structures
    found on the loaded model), `stream=False` and `keep_model` go through memory.

    The options are the fields of ConvertOptions, given as keyword arguments (`block_size=4`) or as
    OPTIONS (keyword arguments override it). Raises OptionsError / SourceError / OutputError /
    UnsupportedModelError / BlockSizeError before any heavy work, and VerificationError (after
    conversion, before saving) when the check fails: nothing is written then.
    """
    opts = ConvertOptions.build(options, **option_values)
    block_size, num_blocks, full = opts.block_size, opts.num_blocks, opts.full
    model_source: ModelSource = check_arguments(source, out, opts)
    shard_bytes = parse_size(opts.max_shard_size, "--max-shard-size")
    with stage("Reading config"):
        config = load_config(model_source, opts.trust_remote_code)
        try:
            structure = structure_of(config)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(refusal(model_source.name, error)) from error
        if structure is not None:  # else the structure is found, and block sizes checked, on the loaded model
            resolve_block_size(structure, block_size, num_blocks, full)  # refuse before loading weights
    streamable = out is not None and opts.stream and not keep_model and structure is not None
    if streamable:
        conversion = dict(
            block_size=block_size, num_blocks=num_blocks, full=full, query_rank=opts.query_rank, additive=opts.additive
        )
        try:
            with stage("Reading the tensor list"):
                streamed = stream_input(model_source, config, opts.dtype, opts.trust_remote_code)
            if streamed is not None:
                return _convert_streamed(
                    *streamed, config, model_source, out, opts, shard_bytes, stage, progress, conversion
                )
        except NotStreamable as why:
            warnings.warn(f"{model_source.name} is converted in memory, not streamed: {why}", stacklevel=2)
    with stage("Loading model"):
        base = load_model(model_source, opts.dtype, opts.trust_remote_code)
        tokenizer = load_tokenizer(model_source, opts.trust_remote_code, warn_missing=True)
    reference = None
    if opts.verify:
        with stage("Running the original model"):
            try:
                check_input_embeddings(base)
                tokens, new_tokens = fit_to_model(base, opts.verify_tokens, opts.verify_new_tokens)
                ids = sample_input_ids(tokenizer, opts.verify_text, tokens, vocab_size_of(base))
                reference = capture_reference(base, ids, new_tokens)
            except UnsupportedModelError as error:
                raise UnsupportedModelError(refusal(model_source.name, error)) from error
            except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as error:
                # The model's own code fails on the verification's input, before anything is converted.
                raise UnsupportedModelError(
                    f"cannot convert {model_source.name}: the original model failed on the verification's input "
                    f"({first_line(error, with_type=True)}). {SEE_COVERAGE}"
                ) from error
    with stage("Converting"):  # finds and proves the layer structure, then converts
        try:
            model = convert_model(
                base,
                block_size=block_size,
                num_blocks=num_blocks,
                full=full,
                query_rank=opts.query_rank,
                additive=opts.additive,
            )
        except UnsupportedModelError as error:
            raise UnsupportedModelError(refusal(model_source.name, error)) from error
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError, KeyError, AssertionError) as error:
            # The model's own code failed on the structure probes or the proof (inputs it does not expect): a
            # refusal of this model, with nothing written, not a crash.
            raise UnsupportedModelError(
                f"cannot convert {model_source.name}: the model failed while it was being converted "
                f"({type(error).__name__}: {first_line(error)}). {SEE_COVERAGE}"
            ) from error
        del base
    report = None
    if reference is not None:
        with stage("Verifying against the original"):
            try:
                report = compare(reference, model)
            except (RuntimeError, ValueError, TypeError, IndexError, AttributeError, KeyError, AssertionError) as error:
                raise VerificationError(
                    f"the converted model failed on the verification's input ({first_line(error, with_type=True)}). "
                    "Nothing was saved; --no-verify saves it unchecked. Please report the model"
                ) from error
        _check_verified(report)
    summary = summarize(model)
    output = None
    if out is not None:
        with stage("Saving"):
            extra = _extra_files(model, summary, report, model_source)
            output = save_converted(
                model, out, tokenizer, overwrite=opts.overwrite, extra=extra, max_shard_size=shard_bytes
            )
    return ConvertResult(
        model_source.name, output, summary, report, model if keep_model else None, tokenizer if keep_model else None
    )


def _check_verified(report: VerificationReport) -> None:
    if not report.passed:
        raise VerificationError(
            "the converted model does not reproduce the original: "
            + "; ".join(report.failures())
            + ". Nothing was saved. Try --dtype float32, and report the model if it persists."
        )


def _extra_files(
    model, summary: ConversionSummary, report: VerificationReport | None, source: ModelSource
) -> dict[str, str]:
    """The model card and the conversion record saved beside the weights, and the source's processor files
    unchanged (written after the tokenizer, so the original's chat template wins)."""
    record = {
        "source": source.name,
        "summary": asdict(summary),
        "verification": report.to_dict() if report else None,
        "torch": torch.__version__,
    }
    return {
        **processor_files(source),
        "README.md": conversion_card(model, summary, report, source),
        "attnres_conversion.json": json.dumps(record, indent=2),
    }


def _convert_streamed(
    folder: Path,
    base: list,
    config,
    model_source: ModelSource,
    out: str | os.PathLike,
    opts: ConvertOptions,
    max_shard_size: int,
    stage: Stage,
    progress: Progress,
    conversion: dict,
) -> ConvertResult:
    """Write the converted folder from the input's files into a temporary folder, verify that folder against
    the original within the memory budget, and only then move it into place. The structure is proven on a
    thread while the base tensors are copied (they do not depend on it); NotStreamable when it cannot be
    streamed, with nothing written."""
    budget = None
    if opts.verify:  # refused before any work; the AttnRes tensors are a few vectors per layer, left out here
        budget = plan_verification(
            sum(t.nbytes for t in base),
            largest_layer_bytes(base),
            opts.max_memory,
            opts.verify_tokens,
            opts.verify_new_tokens,
        )
    planning = BackgroundPlan(
        lambda: load_tokenizer(model_source, opts.trust_remote_code, warn_missing=True),
        folder,
        config,
        opts.dtype,
        opts.trust_remote_code,
        base=base,
        **conversion,
    )
    result: dict = {}

    def write(tmp: Path) -> None:
        total, done = sum(t.nbytes for t in base), 0  # the bar counts the base tensors, not the small AttnRes shard
        with progress("Writing shards", total) as advance:

            def copied(nbytes: int) -> None:
                nonlocal done
                step = min(nbytes, total - done)
                done += step
                advance(step)
                planning.check()  # a structure that cannot stream stops the copy at once

            plan = write_streamed(tmp, base, lambda: planning.result()[0], max_shard_size, copied)
        tokenizer = planning.result()[1]
        report = None
        if budget is not None:
            with stage("Verifying against the original"):
                report = verify_saved(
                    model_source, tmp, budget, opts.dtype, tokenizer, opts.verify_text, opts.trust_remote_code
                )
            _check_verified(report)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        result.update(summary=summarize(plan.skeleton), report=report)
        for name, text in _extra_files(plan.skeleton, result["summary"], report, model_source).items():
            (tmp / name).write_text(text)

    # The display's order is the work's: written to a temporary folder, that folder verified, then moved into place.
    with stage("Writing to a temporary folder"):
        output = atomic_folder(Path(out), write, opts.overwrite)
    return ConvertResult(
        model_source.name,
        output,
        result["summary"],
        result["report"],
        verification_budget=budget.describe() if budget else None,
        budget_mattered=bool(budget and (budget.streamed or not budget.chosen)),
    )


convert.__doc__ += "\n" + textwrap.indent(options_doc(ConvertOptions), "    ")
