"""Which causal-LM model types of the installed transformers convert exactly: the coverage walk.

For every model type of transformers' causal-LM mapping (and a few non-default config variants), build a
tiny random model (hidden 64, 2 layers of different kinds where the model mixes kinds, small vocabulary; image-text
models with their towers shrunk too: tiny_configs.py), convert it with `convert_model` (structure
discovery and the per-layer proof) and check the result against the original: logits within 1e-4, greedy
generation identical to the original's with the KV cache and without it, logits within 1e-4 on a left-padded batch. Each
row is one of

* converted: the conversion is exact (also on a left-padded batch, where the original takes one);
* refused:   the conversion refuses, with its reason (also when the whole-model check fails);
* not built: transformers could not build or run a tiny model from the type's tiny config.

`attnres architectures` prints the walk; tests/test_coverage.py runs it and keeps docs/architectures.md's
table current. Nothing is downloaded: configs come from transformers' defaults.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..architectures import UnsupportedModelError, config_refusal, describe
from ..errors import first_line
from .single_thread import run_single_threaded
from .tiny_configs import tiny_config

STATUSES = ("converted", "refused", "not built")
MAX_PARAMETERS = 8_000_000  # a tiny config that still has more did not shrink: not worth building
LOGIT_TOLERANCE = 1e-4
PROMPT_TOKENS = 8
LEFT_PADDING = 3
NEW_TOKENS = 4

# Non-default settings worth their own row: (model type, label, overrides).
VARIANTS: tuple[tuple[str, str, dict], ...] = (
    ("gpt_neox", "sequential residual", {"use_parallel_residual": False}),
    ("gptj", "untied head", {"tie_word_embeddings": False}),
    ("falcon", "new decoder architecture", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    ("falcon", "sequential residual", {"parallel_attn": False}),
    ("qwen2", "tied embeddings", {"tie_word_embeddings": True}),
    ("qwen3", "untied head, no sliding window", {"tie_word_embeddings": False, "use_sliding_window": False}),
    ("mistral", "no sliding window", {"sliding_window": None}),
    ("qwen2_moe", "shared expert", {"shared_expert_intermediate_size": 64}),
    ("stablelm", "parallel residual, qk-norm", {"use_parallel_residual": True, "qk_layernorm": True}),
    ("persimmon", "qk-norm", {"qk_layernorm": True}),
    ("cohere", "qk-norm", {"use_qk_norm": True}),
    ("opt", "post-norm (do_layer_norm_before=False)", {"do_layer_norm_before": False}),
    ("gemma2", "no soft caps", {"final_logit_softcapping": None, "attn_logit_softcapping": None}),
    (
        "granite",
        "residual and embedding multipliers",
        {"residual_multiplier": 0.22, "embedding_multiplier": 12.0, "logits_scaling": 8.0},
    ),
    (
        "deepseek_v3",
        "dense first layer, then MoE with a shared expert",
        {"first_k_dense_replace": 1, "n_shared_experts": 1},
    ),
    (
        "lfm2",
        "short-convolution and attention layers",
        {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    ),
    ("qwen3_next", "dense MLPs", {"mlp_only_layers": [0, 1]}),
    ("jamba", "MoE in every layer", {"expert_layer_period": 1, "expert_layer_offset": 0}),
    ("gemma4_text", "no per-layer inputs", {"hidden_size_per_layer_input": 0}),
    (
        "gemma4_text",
        "MoE block",
        {
            "hidden_size_per_layer_input": 0,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        },
    ),
    (
        "nemotron_h",
        "Mamba-2 and attention layers",
        {"num_hidden_layers": 2, "layers_block_type": ["linear_attention", "full_attention"]},
    ),
)


@dataclass
class CoverageRow:
    model_type: str
    variant: str
    status: str
    detail: str
    seconds: float = 0.0
    model_class: str = ""

    @property
    def label(self) -> str:
        return self.model_type if not self.variant else f"{self.model_type} ({self.variant})"


@dataclass
class CoverageReport:
    rows: list[CoverageRow]
    transformers_version: str
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self.counts = {status: sum(1 for row in self.rows if row.status == status) for status in STATUSES}

    def defaults(self) -> list[CoverageRow]:
        return [row for row in self.rows if not row.variant]

    def summary(self) -> str:
        """The counts as the README states them: model types (each type's default config), then the config
        variants apart, so that the rows of both are never added up into one number."""
        types = self.defaults()
        count = {status: sum(1 for row in types if row.status == status) for status in STATUSES}
        line = (
            f"{len(types)} model types: {count['converted']} converted, {count['refused']} refused, "
            f"{count['not built']} not built"
        )
        variants = [row for row in self.rows if row.variant]
        if variants:
            converted = sum(1 for row in variants if row.status == "converted")
            line += f"; {len(variants)} config variants: {converted} converted"
        return line

    def converted_types(self) -> list[str]:
        return sorted(row.model_type for row in self.defaults() if row.status == "converted")


def causal_lm_model_types() -> list[str]:
    from ..transformers_compat import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def short_error(error: BaseException) -> str:
    """`Type: first line` of an error, cut to a table cell's length."""
    return first_line(error, with_type=True)[:300]


def _build(model_type: str, overrides: dict):
    return random_model(tiny_config(model_type, **overrides))


def random_model(config):
    """A random causal LM of the tiny CONFIG, initialised so that an inexact conversion shows (see below)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    size = sum(p.numel() for p in skeleton.parameters())
    if size > MAX_PARAMETERS:
        raise RuntimeError(f"the shrunk default config still has {size / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    # A larger init than the usual 0.02 makes the residual stream and its norms matter, so an inexact
    # conversion shows in the logits instead of hiding under tiny activations.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for param in model.parameters():
            if param.dim() >= 2 and param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            elif param.is_floating_point():  # norm weights and biases: no two modules alike
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _greedy(model, ids: torch.Tensor, use_cache: bool) -> list[int]:
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        use_cache=use_cache,
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist()


def _left_padded(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of the prompt and of its last tokens left-padded to the same length: ids, mask, positions (as
    generate() computes them)."""
    short = PROMPT_TOKENS - LEFT_PADDING
    batch = torch.cat([ids, torch.cat([torch.zeros(1, LEFT_PADDING, dtype=ids.dtype), ids[:, -short:]], 1)])
    mask = torch.ones_like(batch)
    mask[1, :LEFT_PADDING] = 0
    return batch, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _padded_logits(model, padded, strict: bool = False) -> torch.Tensor | None:
    """Logits at the real (not padding) positions of the left-padded batch; None where the model does not run on
    it (or gives non-finite logits there) and not STRICT."""
    batch, mask, positions = padded
    try:
        with torch.no_grad():
            logits = model(batch, attention_mask=mask, position_ids=positions).logits.float()
    except Exception:
        if strict:
            raise
        return None
    real = logits[mask.bool()]
    return real if strict or torch.isfinite(real).all() else None


def _structure_text(model) -> str:
    plan = model._attnres_plan
    kinds = [" | ".join(describe(s) for s in kind) for kind in plan.kinds]
    text = kinds[0] if len(kinds) == 1 else "; ".join(f"layers {_ranges(plan, i)}: {k}" for i, k in enumerate(kinds))
    if plan.stream_start:
        text = f"stream starts as layer 0's {plan.stream_start}(embeddings); {text}"
    extras = [
        f"{key}={value:g}"
        for key in ("logit_scale", "logit_divisor", "logit_softcap")
        if (value := getattr(plan, key)) is not None
    ]
    return text + (f" ({', '.join(extras)})" if extras else "")


def _ranges(plan, kind: int) -> str:
    return ",".join(str(i) for i, k in enumerate(plan.layer_kinds) if k == kind)


def check_model_type(model_type: str, variant: str = "", overrides: dict | None = None) -> CoverageRow:
    """Build, convert and check one tiny model; never raises."""
    from .surgery import BlockSizeError, convert_model

    start = time.perf_counter()

    def row(status: str, detail: str, model_class: str = "") -> CoverageRow:
        return CoverageRow(model_type, variant, status, detail, time.perf_counter() - start, model_class)

    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            refusal = config_refusal(tiny_config(model_type, **(overrides or {})))
        except Exception as error:  # noqa: BLE001 - a row of the table, not a failure of the walk
            return row("not built", short_error(error))
        if refusal:  # said by the config alone, as `attnres convert` says it before loading weights
            return row("refused", refusal)
        try:
            model = _build(model_type, overrides or {})
        except Exception as error:  # noqa: BLE001
            return row("not built", short_error(error))
        name = type(model).__name__
        try:
            generator = torch.Generator().manual_seed(1)
            ids = torch.randint(
                3, int(model.config.get_text_config().vocab_size), (1, PROMPT_TOKENS), generator=generator
            )
            with torch.no_grad():
                reference = model(ids).logits.float()
                if not torch.isfinite(reference).all():
                    return row("not built", "the tiny random model's logits are not finite", name)
                expected = _greedy(model, ids, True)
                # Not always `expected`: a model whose own uncached decode differs (Moshi's) is held to itself.
                expected_uncached = _greedy(model, ids, False)
        except Exception as error:  # noqa: BLE001
            return row("not built", "the original model does not run: " + short_error(error), name)
        padded = _left_padded(ids)
        padded_reference = _padded_logits(model, padded)  # None where the original itself takes no padding
        try:
            try:  # an odd block size: blocks that end inside a decoder layer
                converted = convert_model(model, block_size=3)
            except BlockSizeError:  # fewer than 3 sublayers (parallel residual): Full AttnRes
                converted = convert_model(model, full=True)
        except UnsupportedModelError as error:
            return row("refused", str(error), name)
        except Exception as error:  # noqa: BLE001
            return row("refused", "conversion failed: " + short_error(error), name)
        try:
            with torch.no_grad():
                delta = (converted(ids).logits.float() - reference).abs().max().item()
            cached, uncached = _greedy(converted, ids, True), _greedy(converted, ids, False)
        except Exception as error:  # noqa: BLE001
            return row("refused", "the converted model does not run: " + short_error(error), name)
        if not delta <= LOGIT_TOLERANCE:
            return row("refused", f"whole-model check: max |delta logit| {delta:.1e} > {LOGIT_TOLERANCE:.0e}", name)
        if cached != expected:
            return row("refused", "whole-model check: greedy generation with the KV cache differs", name)
        if uncached != expected_uncached:
            return row("refused", "whole-model check: greedy generation without a cache differs", name)
        if padded_reference is not None:
            try:
                padded_delta = (_padded_logits(converted, padded, strict=True) - padded_reference).abs().max().item()
            except Exception as error:  # noqa: BLE001
                return row(
                    "refused", "the converted model does not run on a left-padded batch: " + short_error(error), name
                )
            if not padded_delta <= LOGIT_TOLERANCE:
                return row(
                    "refused", f"whole-model check, left-padded batch: max |delta logit| {padded_delta:.1e}", name
                )
        inconsistent = (
            ""
            if expected_uncached == expected
            else ("; the original's greedy tokens without a cache differ from its cached ones, and both are reproduced")
        )
        return row("converted", _structure_text(converted) + inconsistent, name)


def walk(
    model_types: Iterable[str] | None = None, variants: bool = True, progress: Callable[[str], None] | None = None
) -> CoverageReport:
    """Check every causal-LM model type (or the given ones) and, with `variants`, the VARIANTS rows."""
    import transformers

    types = list(model_types) if model_types is not None else causal_lm_model_types()
    jobs = [(t, "", {}) for t in types]
    if variants:
        jobs += [job for job in VARIANTS if model_types is None or job[0] in types]
    rows = []
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        for model_type, variant, overrides in jobs:
            if progress is not None:
                progress(model_type if not variant else f"{model_type} ({variant})")
            rows.append(run_single_threaded(check_model_type, model_type, variant, overrides))  # tiny models
    finally:
        transformers.logging.set_verbosity(verbosity)
    return CoverageReport(rows, transformers.__version__)


# --- the table in docs/architectures.md ------------------------------------------------------------

BEGIN, END = (
    "<!-- coverage table: generated by `attnres architectures --write docs/architectures.md` -->",
    "<!-- end of coverage table -->",
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(report: CoverageReport) -> str:
    counts = report.counts
    default_counts = {s: sum(1 for r in report.defaults() if r.status == s) for s in STATUSES}
    lines = [
        BEGIN,
        "",
        f"transformers {report.transformers_version}: {len(report.defaults())} causal-LM model types, "
        f"**{default_counts['converted']} converted exactly**, {default_counts['refused']} refused, "
        f"{default_counts['not built']} not built from a tiny config; plus {len(report.rows) - len(report.defaults())} "
        f"config variants ({counts['converted'] - default_counts['converted']} converted).",
        "",
        "| model type | status | structure found (per decoder layer) or reason |",
        "|---|---|---|",
    ]
    for row in report.rows:
        lines.append(f"| {_cell(row.label)} | {row.status} | {_cell(row.detail)} |")
    lines += ["", END]
    return "\n".join(lines)


def replace_table(document: str, table: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(document):
        return document.rstrip("\n") + "\n\n" + table + "\n"
    return pattern.sub(lambda _: table, document)


def table_in(document: str) -> str | None:
    match = re.search(re.escape(BEGIN) + ".*?" + re.escape(END), document, re.S)
    return match.group(0) if match else None
