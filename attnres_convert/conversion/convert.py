"""`attnres convert` as a library call: load, check, convert, verify, save.

Cheap checks (output path, architecture, block size) run before the weights are loaded, and nothing
is written until the converted model is complete (and verified, when asked).
"""

from __future__ import annotations

import contextlib
import json
import os
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .card import conversion_card
from ..modeling.architectures import UnsupportedModelError
from ..errors import OutputError, VerificationError
from ..modeling.modeling_attnres import AttnResForCausalLM
from .options import ConvertOptions, options_doc
from .saving import check_output, save_converted
from .sources import ModelSource, load_config, load_model, load_tokenizer, resolve_source
from .surgery import ConversionSummary, convert_model, resolve_block_size, structure_of, summarize
from .verify import VerificationReport, capture_reference, compare, sample_input_ids

Stage = Callable[[str], contextlib.AbstractContextManager]
SEE_COVERAGE = "`attnres architectures` lists the model types that convert, and why the others do not."


@contextlib.contextmanager
def _quiet_stage(name: str) -> Iterator[None]:
    yield


@dataclass
class ConvertResult:
    source: str
    output: Path | None
    summary: ConversionSummary
    verification: VerificationReport | None
    model: AttnResForCausalLM | None = field(default=None, repr=False)
    tokenizer: object | None = field(default=None, repr=False)


def _check_not_source(source: ModelSource, out: str | os.PathLike) -> None:
    """Writing the output over the input folder would replace the model being read."""
    if source.kind != "folder":
        return
    if Path(os.path.abspath(Path(out).expanduser())).resolve() == Path(source.location).resolve():
        raise OutputError(f"output {out} is the input model folder {source.name}. Choose another output path.")


def convert(
    source: str | None = None,
    out: str | os.PathLike | None = None,
    options: ConvertOptions | None = None,
    *,
    stage: Stage = _quiet_stage,
    keep_model: bool = False,
    **option_values,
) -> ConvertResult:
    """Convert SOURCE (hub id, folder, .gguf, None = embedded SmolLM2) to Block AttnRes and save to OUT.

    The options are the fields of ConvertOptions, given as keyword arguments (`block_size=4`) or as
    OPTIONS (keyword arguments override it). Raises OptionsError / SourceError / OutputError /
    UnsupportedModelError / BlockSizeError before any heavy work, and VerificationError (after
    conversion, before saving) when the check fails: nothing is written then.
    """
    opts = ConvertOptions.build(options, **option_values)
    block_size, num_blocks, full = opts.block_size, opts.num_blocks, opts.full
    model_source: ModelSource = resolve_source(source)
    if out is not None:
        _check_not_source(model_source, out)
        check_output(out, opts.overwrite)
    with stage("Reading config"):
        config = load_config(model_source, opts.trust_remote_code)
        try:
            structure = structure_of(config)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(f"cannot convert {model_source.name}: {error} {SEE_COVERAGE}") from error
        if structure is not None:  # else the structure is found, and block sizes checked, on the loaded model
            resolve_block_size(structure, block_size, num_blocks, full)  # refuse before loading weights
    with stage("Loading model"):
        base = load_model(model_source, opts.dtype, opts.trust_remote_code)
        tokenizer = load_tokenizer(model_source, opts.trust_remote_code)
    reference = None
    if opts.verify:
        with stage("Running the original model"):
            ids = sample_input_ids(tokenizer, opts.verify_text, opts.verify_tokens, base.config.vocab_size)
            reference = capture_reference(base, ids, opts.verify_new_tokens)
    with stage("Finding and proving the layer structure, converting"):
        try:
            model = convert_model(base, block_size=block_size, num_blocks=num_blocks, full=full)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(f"cannot convert {model_source.name}: {error} {SEE_COVERAGE}") from error
        del base
    report = None
    if reference is not None:
        with stage("Verifying against the original"):
            report = compare(reference, model)
        if not report.passed:
            raise VerificationError(
                "the converted model does not reproduce the original: " + "; ".join(report.failures())
                + ". Nothing was saved. Try --dtype float32, and report the model if it persists."
            )
    summary = summarize(model)
    output = None
    if out is not None:
        with stage("Saving"):
            extra = {
                "README.md": conversion_card(model, summary, report, model_source),
                "attnres_conversion.json": json.dumps(
                    {
                        "source": model_source.name,
                        "summary": asdict(summary),
                        "verification": report.to_dict() if report else None,
                        "torch": torch.__version__,
                    },
                    indent=2,
                ),
            }
            output = save_converted(model, out, tokenizer, overwrite=opts.overwrite, extra=extra)
    return ConvertResult(
        model_source.name, output, summary, report, model if keep_model else None, tokenizer if keep_model else None
    )


convert.__doc__ += "\n" + textwrap.indent(options_doc(ConvertOptions), "    ")
