"""The tables the `attnres` commands print, each readable at 80 columns (tests/test_cli_screens.py renders them
there): a conversion's structure and verification, the depth weights, an evaluation and a fine-tune's result."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table


def verification_table(report) -> Table:
    table = Table(title=f"Verification against the original ({report.tokens} tokens, {report.dtype})")
    how = "whole forwards" if getattr(report, "greedy_by", "generate") == "forward" else "KV cache"
    for column in ("max |Δ logit|", "KL (nats)", "top-1 agreement", f"greedy ×{report.new_tokens} ({how})", "result"):
        table.add_column(column, justify="right")
    greedy = "identical" if report.greedy_identical else f"differs at {report.first_divergence}"
    verdict = "[green]PASS[/]" if report.passed else "[red]FAIL[/]"
    table.add_row(
        f"{report.max_abs_logit_diff:.2e}", f"{report.kl:.2e}", f"{report.top1_agreement:.2%}", greedy, verdict
    )
    return table


def generate_note(report) -> str | None:
    """What the console says under the verification table when the original could not `generate`."""
    failure = getattr(report, "generate_failure", None)
    if failure is None:
        return None
    return (
        f"The original cannot generate ({escape(failure)}): verified on its logits, the greedy tokens from one "
        "whole forward per token of each model."
    )


def summary_table(summary) -> Table:
    from attnres_convert.io.card import describe_sources

    table = Table(title="Block AttnRes structure")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("base model type", summary.model_type)
    table.add_row("decoder layers / sublayers", f"{summary.num_layers} / {summary.num_sublayers}")
    table.add_row("block size S (sublayers)", str(summary.block_size))
    table.add_row("blocks", str(summary.num_blocks))
    counts = summary.sources_per_sublayer
    table.add_row("sources per sublayer", f"{min(counts)}..{max(counts)} (output: {summary.output_sources})")
    table.add_row("output aggregation reads", describe_sources(summary.num_sublayers, summary.block_size)[-1])
    if summary.query_rank:
        table.add_row("queries", f"input-dependent, rank {summary.query_rank}")
    if summary.additive:
        table.add_row("depth mix", "additive: stream + gated mix of the completed blocks")
    table.add_row("parameters added", f"{summary.params_added:,} ({summary.params_added / summary.params_total:.4%})")
    return table


def depth_table(depth) -> Table:
    """Compact enough for 80 columns with 8 blocks: short labels, no vertical rules."""
    from rich import box

    table = Table(
        title=f"Depth-attention weights (mean over {depth.tokens} tokens)",
        caption="L3 attn: layer 3's attention reads; emb: embedding, bK/sK: block/sublayer K; blank: not read",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("reader", no_wrap=True)
    for column in depth.columns:
        short = column.replace("embedding", "emb").replace("block ", "b").replace("sublayer ", "s")
        table.add_column(short, justify="right", no_wrap=True)
    for reader, row in zip(depth.readers, depth.matrix):
        label = reader.replace("layer ", "L").replace("attention", "attn")
        table.add_row(label, *("" if value != value else f"{value:.2f}" for value in row))
    return table


def eval_table(result) -> Table:
    from attnres_convert.io.console import shorten_middle

    table = Table(title=f"Held-out evaluation ({result.sequences} x {result.seq_len} tokens, {result.dtype})")
    for column in ("model", "AttnRes", "tokens", "loss (nats)", "perplexity"):
        table.add_column(column, justify="left" if column == "model" else "right", no_wrap=True)
    table.add_row(
        escape(shorten_middle(result.model, 30)),
        "yes" if result.converted else "no",
        f"{result.tokens:,}",
        f"{result.loss:.4f}",
        f"{result.perplexity:.3f}",
    )
    return table


def finetune_table(metrics: dict) -> Table:
    processes = "1 process" if metrics["processes"] == 1 else f"{metrics['processes']} processes"
    title = f"Fine-tuned {metrics['steps']} steps, {metrics['tokens']:,} tokens ({processes})"
    table = Table(title=title, min_width=len(title))  # a title never wraps over a narrow table
    for column in ("", "held-out loss", "perplexity"):
        table.add_column(column, justify="right", no_wrap=True)
    if metrics["eval_loss_start"] is not None:
        table.add_row("before (step 0)", f"{metrics['eval_loss_start']:.4f}", f"{metrics['eval_perplexity_start']:.2f}")
    table.add_row("after", f"{metrics['eval_loss']:.4f}", f"{metrics['eval_perplexity']:.2f}")
    return table


def throughput_line(metrics: dict) -> str:
    """What the progress bar's tok/s ends at, and what it measures: training tokens over the seconds spent in
    training steps; loading, evaluations and checkpoints are not counted."""
    return (
        f"training throughput: {metrics['tokens_per_s']:,.0f} tokens/s ({metrics['tokens']:,} tokens in "
        f"{metrics['train_seconds']:,.1f} s of training steps; loading, evaluation and checkpoints not counted)"
    )
