"""Model cards (README.md with hub front matter) for converted and fine-tuned folders.

`conversion_card` is written by `attnres convert`; `finetune_card` by `attnres finetune`. Both share the
front matter (base_model, library_name, pipeline_tag, tags, licence), the loading instructions and the
conversion settings; the fine-tune card adds the recipe, held-out metrics (also as `model-index`, so
the hub shows them) and the loss curve.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from ..block_sizes import source_ranges
from ..errors import scrub

# Licences of the models that ship offline with this project.
KNOWN_LICENSES = {"SmolLM2-135M-Instruct.Q4_1.gguf": "apache-2.0"}
DEFAULT_BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TAGS = ("attnres", "block-attnres")
BASELINE_TAGS = ("attnres-baseline", "fine-tuned")  # a plain model: not tagged as AttnRes


def read_front_matter(text: str) -> dict:
    """The YAML front matter of a model card ({} when there is none); ValueError when it does not parse."""
    if not text.startswith("---"):
        return {}
    parts = text.split("---", 2)
    if len(parts) < 3:
        raise ValueError("the front matter is not closed by a --- line")
    try:
        meta = yaml.safe_load(parts[1]) or {}
    except yaml.YAMLError as error:
        raise ValueError(str(error)) from None
    if not isinstance(meta, dict):
        raise ValueError("the front matter is not a YAML mapping")
    return meta


def card_identity(folder: str | Path) -> tuple[str | None, str | None]:
    """(base_model, licence) from a folder's model card: a fine-tune of a converted folder keeps the
    original base model and its licence. A missing or unreadable card says nothing."""
    card = Path(folder) / "README.md"
    try:
        meta = read_front_matter(card.read_text(errors="replace")) if card.is_file() else {}
    except ValueError:
        meta = {}
    base = meta.get("base_model")
    return (base[0] if isinstance(base, list) else base), meta.get("license")


def base_identity(source) -> tuple[str | None, str | None]:
    """(base_model hub id, licence) when they can be known without the network."""
    if source is None:
        return None, None
    if source.kind == "default":
        return DEFAULT_BASE_ID, KNOWN_LICENSES.get(source.gguf_file)
    if source.kind == "hub":
        return source.location, None
    base, license_ = card_identity(source.location)
    return base, license_ or KNOWN_LICENSES.get(source.gguf_file or "")


def front_matter(
    base_model: str | None, license_: str | None, tags: Sequence[str] = TAGS, extra: Mapping | None = None
) -> str:
    meta = {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": list(tags)}
    if base_model:
        meta["base_model"] = base_model
    meta["license"] = license_ or "other"
    meta.update(extra or {})
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"


def shipped_code_lines() -> tuple[tuple[str, ...], int]:
    """The code files a converted folder ships and their lines together (as the package writes them)."""
    from ..modeling import SHIPPED_CODE

    folder = Path(__file__).resolve().parent.parent / "modeling"
    return SHIPPED_CODE, sum(len((folder / name).read_text().splitlines()) for name in SHIPPED_CODE)


def _load_section() -> list[str]:
    files, lines = shipped_code_lines()
    return [
        "## Load it",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
        "",
        "# Pin the revision you have read: remote code runs as it is at that commit, not as a later push changes it.",
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", revision="COMMIT", trust_remote_code=True)',
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO", revision="COMMIT", trust_remote_code=True)',
        "",
        'generator = pipeline("text-generation", model=model, tokenizer=tokenizer)',
        'print(generator("To be, or not to be", max_new_tokens=20)[0]["generated_text"])',
        "```",
        "",
        f"`trust_remote_code=True` runs the modeling code shipped in this repo: {len(files)} files, "
        f"{' and '.join(f'`{name}`' for name in files)}, {lines:,} lines together, plain PyTorch and transformers "
        "(nothing is compiled or downloaded). Read them before you pass the flag, and pin `revision=` to the commit "
        "you read. Where the `attnres` package is installed, its faster depth-mix kernels are used (and fla-core's "
        "on CUDA, where installed); without it the model runs and trains on PyTorch alone. The tokenizer is a stock "
        "one, but `AutoTokenizer` "
        "reads the config first and, without `trust_remote_code=True`, asks whether to run the custom code. "
        "The model type is `attnres`, so tools that do not know it refuse the repo "
        "instead of silently dropping the depth-attention weights.",
        "",
        "## Serve it with vLLM",
        "",
        "With `attnres` installed beside vLLM (its plugin registers the architecture; the families whose attention "
        "goes through transformers' attention interface are served, hybrid Mamba and linear-attention stacks are "
        "refused with the reason):",
        "",
        "```bash",
        "vllm serve PATH_OR_REPO --trust-remote-code",
        "```",
        "",
        "Its speed against the base model in the same engine, with both downloaded to local folders: "
        "`python benchmarks/vllm_serving.py --original BASE_FOLDER --converted THIS_FOLDER` from the attnres "
        "repository (requests/s and output tokens/s, and their ratios).",
        "",
    ]


def _sources_table(summary) -> str:
    described = describe_sources(summary.num_sublayers, summary.block_size)
    rows = ["| reader | sources |", "|---|---|"]
    for index, sources in enumerate(described[:-1], start=1):
        rows.append(f"| sublayer {index} | {sources} |")
    rows.append(f"| output | {described[-1]} |")
    return "\n".join(rows)


def _query_lines(summary) -> list[str]:
    rank = getattr(summary, "query_rank", 0)
    additive = (
        [
            "- mix: additive (`additive` true): a reader reads its residual stream plus `g` times the softmax mix of "
            "the embedding and the completed blocks, `g` one scalar per reader (`*_res_proj.gate`, zero at conversion, "
            "so the conversion stays exact). These models run the plain PyTorch depth mix."
        ]
        if getattr(summary, "additive", False)
        else []
    )
    if not rank:
        return ["- queries: static, one learned vector per reader (`query_rank` 0)", *additive]
    return [
        f"- queries: input-dependent, `query_rank` {rank}: a reader's query is `w + B A x / rms(x)` per token, with x "
        f"its input in the original model (the residual stream), A [{rank}, d] (`*_res_proj.down`, random) and B "
        f"[d, {rank}] (`*_res_proj.up`, zero at conversion, so the conversion stays exact). These models run "
        "the plain PyTorch depth mix: `ATTNRES_KERNEL=triton` and `cpu` are refused.",
        *additive,
    ]


def _conversion_section(summary) -> list[str]:
    counts = summary.sources_per_sublayer
    return [
        "## Conversion",
        "",
        f"- base architecture: `{summary.model_type}`, {summary.num_layers} decoder layers, "
        f"{summary.num_sublayers} sublayers (attention and MLP each count as one; a parallel-residual layer is one)",
        f"- block size S = {summary.block_size} sublayers, {summary.num_blocks} blocks",
        f"- sources per sublayer: {min(counts)} to {max(counts)}; the output aggregation reads {summary.output_sources}",
        f"- parameters added: {summary.params_added:,} ({summary.params_added / summary.params_total:.4%} of "
        f"{summary.params_total:,})",
        "- source scaling: `count`: a sublayer reads n x the softmax mix of its n sources, which at zero "
        "pseudo-queries is exactly the residual sum. Every reader of the stream is a norm, so this is the "
        "paper's AttnRes with each norm's eps rescaled by 1/n^2.",
        *_query_lines(summary),
        "",
        "`yi` is the output of sublayer i (`y0` the embedding), `ya:b` the sum of outputs a..b:",
        "",
        _sources_table(summary),
        "",
    ]


def _verification_section(report) -> list[str]:
    if report is None:
        return []
    failure = getattr(report, "generate_failure", None)
    how = "KV cache" if failure is None else "one whole forward per token"
    lines = [
        "## Verification against the original",
        "",
        f"On {report.tokens} tokens of sample text, {report.dtype}, right after conversion:",
        "",
        f"| max abs logit diff | KL (nats) | top-1 agreement | greedy generation ({how}) |",
        "|---|---|---|---|",
        f"| {report.max_abs_logit_diff:.2e} | {report.kl:.2e} | {report.top1_agreement:.2%} | "
        f"{'identical' if report.greedy_identical else 'differs'} over {report.new_tokens} tokens |",
        "",
    ]
    if failure is not None:
        lines += [
            f"The original model cannot `generate` (`{failure}`): it was verified on its logits, the greedy tokens "
            "coming from one whole forward per token of each model.",
            "",
        ]
    return lines


def _inspect_section() -> list[str]:
    return [
        "## See what it learned",
        "",
        "```bash",
        "attnres inspect PATH_OR_REPO --plot depth.png     # depth-attention heatmaps, magnitudes, gradients",
        "attnres eval PATH_OR_REPO --data held_out.txt     # held-out loss and perplexity",
        "```",
        "",
    ]


def conversion_card(model, summary, report, source) -> str:
    base_model, license_ = base_identity(source)
    name = source.name if source is not None else "the base model"
    lines = [
        front_matter(base_model, license_),
        f"# {name} with Block Attention Residuals",
        "",
        f"This is `{name}` ({summary.model_type}, {summary.num_layers} layers) converted by "
        "`attnres` to **Block Attention Residuals**: every residual connection is "
        "replaced by softmax attention over depth with learned pseudo-queries. The queries start at zero, "
        "so this model reproduces the original exactly until it is trained.",
        "",
        *_changed_part(model),
        *_load_section(),
        *_conversion_section(summary),
        *_verification_section(report),
        *_inspect_section(),
    ]
    return scrub("\n".join(lines))  # nothing token-shaped ever reaches a public card


def _changed_part(model) -> list[str]:
    """Where the decoder stack sits inside a larger model (an image-text model's language model): which part
    changed, and that the rest did not."""
    plan = getattr(model, "_attnres_plan", None)
    if plan is None or "." not in plan.layers:
        return []
    stack = f"{plan.base_model}.{plan.layers}"
    return [
        f"Only the language model changed: its decoder layers (`{stack}`) and the output aggregation "
        f"(`{plan.base_model}.output_attn_res_*`) hold the AttnRes parameters. Every other module (vision or audio "
        "tower, projector, embeddings, head) keeps the original's weights, and processor files found beside "
        "them are copied unchanged.",
        "",
    ]


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def _metrics_table(metrics: Mapping[str, Mapping[str, float]]) -> list[str]:
    columns: list[str] = []
    for values in metrics.values():
        columns += [key for key in values if key not in columns]
    rows = ["| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, values in metrics.items():
        rows.append(f"| {name} | " + " | ".join(_fmt(values.get(column, "")) for column in columns) + " |")
    return rows


def _repo_name(name: str, base_model: str | None, suffix: str) -> str:
    """A repo-style model name for `model-index` ("SmolLM2-135M-Instruct-attnres"), not a display name
    such as "SmolLM2-135M-Instruct (embedded, ....gguf)"."""
    stem = base_model.split("/")[-1] if base_model else re.sub(r"[^A-Za-z0-9._-]+", "-", name.split(" (")[0]).strip("-")
    return f"{stem or 'model'}-{suffix}"


def _model_index(name: str, metrics: Mapping[str, float], eval_data: str) -> list[dict]:
    """The hub's structured eval results for the fine-tuned model (loss and perplexity when given)."""
    entries = [
        {"type": key, "value": round(float(metrics[key]), 4), "name": f"held-out {key}"}
        for key in ("loss", "perplexity")
        if key in metrics
    ]
    if not entries:
        return []
    return [
        {
            "name": name,
            "results": [
                {
                    "task": {"type": "text-generation", "name": "Text Generation"},
                    "dataset": {"type": "text", "name": eval_data},
                    "metrics": entries,
                }
            ],
        }
    ]


def _curve_rows(history: Sequence[Mapping]) -> list[str]:
    """A few points of the loss curve as a table, so the card says something where images do not render."""
    if not history:
        return []
    picks = sorted({0, len(history) - 1, *range(0, len(history), max(1, len(history) // 8))})
    columns = [key for key in history[picks[-1]] if key != "step"]
    rows = ["| step | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for index in picks:
        point = history[index]
        rows.append(f"| {point.get('step', index)} | " + " | ".join(_fmt(point.get(c, "")) for c in columns) + " |")
    return rows + [""]


def finetune_card(summary, *, verification=None, **training) -> str:
    """The README.md of a fine-tuned Block AttnRes folder.

    summary: the ConversionSummary of the trained model (surgery.summarize(model)).
    verification: the VerificationReport of the conversion, when the fine-tune converted the model itself.
    training: the keyword arguments of `trained_card` (name, base_model, license, recipe, metrics, ...).
    """
    return trained_card(summary, verification, **training)


def baseline_card(**training) -> str:
    """The README.md of the baseline of an A/B fine-tune: the original model (no AttnRes) trained with the
    same recipe. A plain transformers model: no attnres tags, no remote code. Keyword arguments: `trained_card`'s."""
    return trained_card(None, None, **training)


def trained_card(
    summary,
    verification,
    *,
    name: str,
    base_model: str | None,
    license: str | None,  # noqa: A002 - the hub's own field name
    recipe: Mapping,
    metrics: Mapping[str, Mapping[str, float]],
    finetuned_key: str | None = None,
    eval_data: str = "held-out text",
    train_data: str | None = None,
    loss_curve: str | None = "loss_curve.png",
    history: Sequence[Mapping] | None = None,
) -> str:
    """The card of a fine-tuned folder: a Block AttnRes model (SUMMARY given) or the plain baseline (None).

    name: what was fine-tuned, for the title (e.g. "SmolLM2-135M-Instruct").
    base_model, license: of the original model (card_identity(converted_folder) or base_identity(source)).
    recipe: the resolved recipe as plain data (rendered as YAML).
    metrics: held-out numbers per model, e.g. {"original": {"loss": 3.1, "perplexity": 22.2},
        "fine-tuned": {"loss": 2.9, "perplexity": 18.2}}; finetuned_key names the fine-tuned row
        (default: the last one) and goes into the hub's `model-index`.
    eval_data / train_data: short descriptions of the held-out and training text.
    loss_curve: an image file saved in the same folder (plots.loss_curve_plot), or None.
    history: optional [{"step": ..., "loss": ..., "eval_loss": ...}, ...], shown as a small table.
    """
    on = f" on {train_data}" if train_data else ""
    attnres = summary is not None
    tags, suffix = ((*TAGS, "fine-tuned"), "attnres") if attnres else (BASELINE_TAGS, "baseline")
    lines = [_finetune_front_matter(name, base_model, license, metrics, finetuned_key, eval_data, tags, suffix)]
    if attnres:
        lines += [
            f"# {name} with Block Attention Residuals, fine-tuned",
            "",
            f"`{name}` ({summary.model_type}, {summary.num_layers} layers) converted by `attnres` to **Block Attention "
            "Residuals** (softmax attention over depth with learned pseudo-queries, starting from an exact copy of "
            f"the original), then fine-tuned{on}.",
            "",
            *_load_section(),
        ]
    else:
        lines += [
            f"# {name}, fine-tuned (baseline, no AttnRes)",
            "",
            f"The original `{name}` trained{on} with the same `attnres finetune` recipe as its Block AttnRes "
            "counterpart, for comparison. It is a plain transformers model: "
            "`AutoModelForCausalLM.from_pretrained(PATH_OR_REPO)`.",
            "",
        ]
    lines += _training_sections(metrics, eval_data, loss_curve, history, recipe)
    if attnres:
        lines += [*_conversion_section(summary), *_verification_section(verification), *_inspect_section()]
    return scrub("\n".join(lines))  # a recipe must not carry a token to a public card


def _finetune_front_matter(name, base_model, license_, metrics, finetuned_key, eval_data, tags, suffix) -> str:
    """Front matter of a fine-tuned folder: a finetune of the base model, with the fine-tuned row of METRICS
    (FINETUNED_KEY, default the last) as the hub's `model-index`."""
    finetuned_key = finetuned_key or (list(metrics)[-1] if metrics else None)
    extra = {"base_model_relation": "finetune"} if base_model else {}
    if finetuned_key and (
        index := _model_index(_repo_name(name, base_model, suffix), metrics.get(finetuned_key, {}), eval_data)
    ):
        extra["model-index"] = index
    return front_matter(base_model, license_, tags, extra)


def _training_sections(metrics, eval_data: str, loss_curve: str | None, history, recipe) -> list[str]:
    """Held-out evaluation, training curve and recipe: what every fine-tune card shows."""
    lines = [
        "## Held-out evaluation",
        "",
        f"On {eval_data} (never seen in training):",
        "",
        *_metrics_table(metrics),
        "",
    ]
    if loss_curve or history:
        lines += ["## Training curve", ""]
        if loss_curve:
            lines += [f"![training and held-out loss]({loss_curve})", ""]
        lines += _curve_rows(history or [])
    recipe_yaml = yaml.safe_dump(_plain(recipe), sort_keys=False, allow_unicode=True).rstrip()
    return lines + ["## Recipe", "", "```yaml", recipe_yaml, "```", ""]


def _plain(value):
    """Recipe values as YAML-safe plain data (paths, tuples, enums, pydantic models)."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(mode="json"))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def describe_sources(num_sublayers: int, block_size: int) -> list[str]:
    """Readable source lists, e.g. 'y0, y1:3, y4' (for the CLI and the model card)."""
    out = []
    for ranges in source_ranges(num_sublayers, block_size):
        out.append(", ".join("y0" if a == 0 else (f"y{a}" if a == b else f"y{a}:{b}") for a, b in ranges))
    return out
