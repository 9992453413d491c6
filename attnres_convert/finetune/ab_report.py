"""`attnres ab`'s report: ab.json, ab.md (the tables, the compute equivalent, the curves) and ab.png, and what
the console shows at the end (whole at 80 columns). Reads the report dict run_ab (ab.py) builds."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

AB_JSON, AB_MD, AB_PNG = "ab.json", "ab.md", "ab.png"


def write_report(report: dict, folder: Path) -> None:
    from ..analysis.plots import ab_curves_plot, plot_unless_missing

    (folder / AB_JSON).write_text(json.dumps(report, indent=2))
    (folder / AB_MD).write_text(markdown(report))
    plot_unless_missing(lambda: ab_curves_plot(report, folder / AB_PNG), f"{AB_PNG} (the held-out curves)")


# --- ab.md ----------------------------------------------------------------------------------------


def _delta(entry: dict) -> str:
    delta = entry.get("delta_final")
    if delta is None:
        return ""
    se = ""
    if delta.get("eval_se") is not None:
        se = f"; eval SE {delta['eval_se']:.4f}{' (paired)' if delta.get('eval_se_paired') else ''}"
    if len(delta["per_seed"]) == 1:
        return f"{delta['mean']:+.4f}{se}"
    return f"{delta['mean']:+.4f} ± {delta['std']:.4f} ({delta['min']:+.4f} .. {delta['max']:+.4f}){se}"


def markdown(report: dict) -> str:
    arms = report["arms"]
    base = arms[0]
    seeds = report["seeds"]
    machine = report["machine"]
    start = base["eval"][0] if base["eval"] and base["eval"][0][0] == 0 else None
    lines = [
        f"# A/B: {report['recipe']} ({report['steps']} steps, {base['tokens']:,} training tokens per arm, "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})",
        "",
        f"Command: `{report['command']}`" if report["command"] else "",
        "",
        f"Machine: {machine['cpu']}{', ' + machine['accelerator'] if machine['accelerator'] else ''}; torch {machine['torch']}, "
        f"{machine.get('processes', 1)} process(es) and {machine['threads_per_arm']} thread(s) per arm, {machine['jobs']} arm(s) at a time "
        "(tokens/s depend on what else "
        "the machine was running).",
        "",
        "Held-out loss in nats per token (mean over the seeds; ± the evaluation's standard error); Δ = arm - baseline "
        "at the same seed: mean ± sample standard deviation (min .. max) over the seeds, and the evaluation's standard "
        "error of the mean Δ (paired: from the held-out sequences' own differences, both arms scoring the same "
        "sequences). Negative is better.",
        "",
        "| arm | overrides | held-out loss | perplexity | Δ vs baseline | trainable params | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    if start is not None:
        origin = "random initialisation (step 0)" if report.get("from_scratch") else "original model (step 0)"
        lines.append(f"| {origin} | | {start[1]:.4f} | {math.exp(start[1]):.2f} | | | |")
        for entry in arms[1:]:
            if entry["eval"] and entry["eval"][0][0] == 0:
                lines.append(
                    f"| converted (step 0) | | {entry['eval'][0][1]:.4f} | {math.exp(entry['eval'][0][1]):.2f} | "
                    f"{entry['eval'][0][1] - start[1]:+.1e} vs original | | |"
                )
                break
    for entry in arms:
        params = f"{entry['trainable_parameters']:,}" + (
            f" (AttnRes {entry['attnres_parameters']:,})" if entry["attnres_parameters"] else ""
        )
        speed = f"{entry['tokens_per_s']:,.0f}" if entry["tokens_per_s"] else ""
        if entry.get("tokens_per_s_interleaved"):
            ratio = entry["tokens_per_s_interleaved"] / base["tokens_per_s_interleaved"]
            speed += f" (interleaved {entry['tokens_per_s_interleaved']:,.0f}, {ratio:.2f}x)"
        overrides = " ".join(f"`{o}`" for o in entry["overrides"])
        stderr = f" ± {entry['eval_stderr_final']:.4f}" if entry.get("eval_stderr_final") is not None else ""
        lines.append(
            f"| {entry['name']} | {overrides} | {entry['eval_loss_final']:.4f}{stderr} | {math.exp(entry['eval_loss_final']):.2f} | "
            f"{_delta(entry)} | {params} | {speed} |"
        )
    lines += compute_equivalent_lines(arms)
    lines += ["", "Held-out loss during training (mean over the seeds; Δ vs baseline in brackets):", ""]
    lines += ["| step | " + " | ".join(e["name"] for e in arms) + " |", "|---" * (1 + len(arms)) + "|"]
    for step, loss in base["eval"]:
        cells = [f"{loss:.4f}"]
        for entry in arms[1:]:
            curve, deltas = dict(entry["eval"]), dict(entry.get("delta_curve", []))
            cell = f"{curve[step]:.4f}" if step in curve else ""
            if step in deltas and step:
                cell += f" ({deltas[step]['mean']:+.4f})"
            cells.append(cell)
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    norms = [(e["name"], e["runs"][0]) for e in arms if e["runs"][0]["grad_norm"]]
    if norms:
        lines += ["", f"Gradient norms before clipping (seed {seeds[0]}; median over the run):", ""]
        lines += ["| arm | base / LoRA | AttnRes |", "|---|---|---|"]
        for name, run in norms:
            attn = [v for _, v in run["attnres_grad_norm"]]
            base_norm = statistics.median(v for _, v in run["grad_norm"])
            lines.append(f"| {name} | {base_norm:.3f} | {f'{statistics.median(attn):.3f}' if attn else ''} |")
    return "\n".join(lines) + "\n"


def _ratio(figure: dict) -> str:
    if figure["ratio"] is None:
        return f"not reached (> {figure['arm_tokens']:,} tokens)"
    return f"{figure['ratio']:.2f}x ({figure['baseline_tokens']:,.0f} tokens)"


def compute_equivalent_lines(arms: list[dict]) -> list[str]:
    """Compute equivalent: the baseline tokens that reach each arm's final loss, on the baseline's curve."""
    figures = [(e["name"], e["compute_equivalent"]) for e in arms[1:] if e.get("compute_equivalent")]
    if not figures:
        return []
    lines = [
        "",
        "Compute equivalent: the training tokens the baseline needs to reach the arm's final held-out loss, read off "
        "the baseline's own curve (linear between evaluations), as a multiple of the arm's tokens; above 1 the arm "
        'saves compute. "not reached": the baseline never gets there in this run. The other way round: the tokens '
        "after which the arm reaches the baseline's final loss, and the baseline's tokens as a multiple of them. "
        "No figure is given for a difference within the run's noise (one seed, or |Δ| no larger than the seeds' spread "
        "or the evaluation's standard error): more seeds, steps or held-out text can tell.",
        "",
        "| arm | final loss | baseline tokens to match (mean curves) | per seed | arm tokens to the baseline's final loss | per seed |",
        "|---|---|---|---|---|---|",
    ]

    def ratios(values) -> str:
        return ", ".join("not reached" if r is None else f"{r:.2f}x" for r in values)

    for name, figure in figures:
        if figure.get("noise"):  # a figure read off a difference the run cannot tell from noise claims nothing
            lines.append(
                f"| {name} | {figure['target_loss']:.4f} | within the noise ({figure['noise']}): no savings claim | | | |"
            )
            continue
        reached = figure.get("arm_tokens_to_baseline_final")
        other = "not reached" if reached is None else f"{reached:,.0f} tokens: {figure['ratio_at_baseline_final']:.2f}x"
        lines.append(
            f"| {name} | {figure['target_loss']:.4f} | {_ratio(figure)} | {ratios(figure.get('per_seed', []))} | {other} | "
            f"{ratios(figure.get('per_seed_at_baseline_final', []))} |"
        )
    return lines


# --- the console ----------------------------------------------------------------------------------


def console_report(report: dict, output: Path):
    """What `attnres ab` prints at the end, whole at 80 columns: the arms with their overrides, listed above a
    narrow table of numbers (ab.md's table, with its overrides column, is wider than a terminal), then which
    differences are within the noise. Every number is ab.md's."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    arms, base = report["arms"], report["arms"][0]
    seeds = report["seeds"]
    head = (
        f"A/B: {report['recipe']}, {report['steps']} steps, {base['tokens']:,} training tokens per arm, "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
    )
    parts: list = [Text(head, style="bold"), Text("Arms (overrides on top of the recipe):")]
    labels = {}
    for index, entry in enumerate(arms):
        label = entry["name"] if index < 2 or not entry["name"].startswith("attnres ") else f"sweep {index - 1}"
        labels[entry["name"]] = label
        overrides = " ".join(entry["overrides"]) or "none: the recipe as written"
        parts.append(Text(f"  {label}: {overrides}"))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("arm", no_wrap=True)
    table.add_column("held-out loss", justify="right", no_wrap=True)
    table.add_column("Δ vs baseline", justify="right", no_wrap=True)
    table.add_column("compute equivalent", justify="right", no_wrap=True)
    start = base["eval"][0] if base["eval"] and base["eval"][0][0] == 0 else None
    if start is not None:
        origin = "random init" if report.get("from_scratch") else "original"
        table.add_row(f"{origin} (step 0)", f"{start[1]:.4f}", "", "")
    noise = []
    for entry in arms:
        stderr = f" ± {entry['eval_stderr_final']:.4f}" if entry.get("eval_stderr_final") is not None else ""
        delta = entry.get("delta_final")
        shown = ""
        if delta is not None:
            shown = f"{delta['mean']:+.4f}" + (f" ± {delta['std']:.4f}" if len(delta["per_seed"]) > 1 else "")
        figure = entry.get("compute_equivalent")
        equivalent = ""
        if figure is not None:
            if figure.get("noise"):
                equivalent = "within the noise"
                noise.append(f"{labels[entry['name']]}: {figure['noise']}")
            else:  # the tokens behind the ratio are in ab.md
                equivalent = "not reached" if figure["ratio"] is None else f"{figure['ratio']:.2f}x"
        table.add_row(
            escape(labels[entry["name"]]), f"{entry['eval_loss_final']:.4f}{stderr}", shown, escape(equivalent)
        )
    parts.append(table)
    if noise:
        parts.append(
            Text(
                "Within the noise, so no savings claimed: " + "; ".join(noise) + ". More seeds (--seeds), steps or "
                "held-out text can tell."
            )
        )
    parts.append(Text(f"Every table (curves, per-seed figures, gradient norms): {output / AB_MD}"))
    return Group(*parts)
