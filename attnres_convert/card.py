"""Model cards (README.md with hub front matter) for converted and fine-tuned folders."""

from __future__ import annotations

from pathlib import Path

import yaml

from .surgery import describe_sources

# Licences of the models that ship offline with this project.
KNOWN_LICENSES = {"SmolLM2-135M-Instruct.Q4_1.gguf": "apache-2.0"}
DEFAULT_BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def base_identity(source) -> tuple[str | None, str | None]:
    """(base_model hub id, licence) when they can be known without the network."""
    if source is None:
        return None, None
    if source.kind == "default":
        return DEFAULT_BASE_ID, KNOWN_LICENSES.get(source.gguf_file)
    if source.kind == "hub":
        return source.location, None
    readme = Path(source.location) / "README.md"
    if readme.is_file():
        text = readme.read_text(errors="replace")
        if text.startswith("---"):
            try:
                meta = yaml.safe_load(text.split("---", 2)[1]) or {}
            except yaml.YAMLError:
                meta = {}
            base = meta.get("base_model")
            return (base[0] if isinstance(base, list) else base), meta.get("license")
    return None, KNOWN_LICENSES.get(source.gguf_file or "")


def front_matter(base_model: str | None, license_: str | None, extra_tags: tuple[str, ...] = ()) -> str:
    meta = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["attnres", "block-attnres", *extra_tags],
    }
    if base_model:
        meta["base_model"] = base_model
    meta["license"] = license_ or "other"
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _sources_table(summary) -> str:
    described = describe_sources(summary.num_sublayers, summary.block_size)
    rows = ["| reader | sources |", "|---|---|"]
    for index, sources in enumerate(described[:-1], start=1):
        rows.append(f"| sublayer {index} | {sources} |")
    rows.append(f"| output | {described[-1]} |")
    return "\n".join(rows)


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
        "## Load it",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", trust_remote_code=True)',
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO")',
        "```",
        "",
        "The modeling code ships in this folder (`modeling_attnres.py` and its relative imports) and needs "
        "only torch and transformers.",
        "",
        "## Conversion",
        "",
        f"- block size S = {summary.block_size} sublayers, {summary.num_blocks} blocks over "
        f"{summary.num_sublayers} sublayers",
        f"- parameters added: {summary.params_added:,} ({summary.params_added / summary.params_total:.4%} of "
        f"{summary.params_total:,})",
        "- source scaling: `count` (a sublayer reads n x the softmax mix of its n sources, which at zero "
        "queries is exactly the residual sum)",
        "",
        _sources_table(summary),
        "",
    ]
    if report is not None:
        lines += [
            "## Verification against the original",
            "",
            f"On {report.tokens} tokens of sample text, {report.dtype}:",
            "",
            "| max abs logit diff | KL (nats) | top-1 agreement | greedy generation (KV cache) |",
            "|---|---|---|---|",
            f"| {report.max_abs_logit_diff:.2e} | {report.kl:.2e} | {report.top1_agreement:.2%} | "
            f"{'identical' if report.greedy_identical else 'differs'} over {report.new_tokens} tokens |",
            "",
        ]
    return "\n".join(lines)
