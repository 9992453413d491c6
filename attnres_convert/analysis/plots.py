"""PNG figures: depth-attention heatmaps, per-sublayer magnitude/gradient profiles, loss curves.

Figures are built on matplotlib's object API with the Agg canvas (no pyplot, no global backend switch,
no display needed), so plotting works on a headless machine and inside other programs.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

ORIGINAL_COLOR, CONVERTED_COLOR = "#7f7f7f", "#d62728"


def plot_unless_missing(draw, what: str) -> bool:
    """DRAW() where matplotlib is installed; without it, a warning that WHAT is not drawn and how to install it
    (a run's numbers are all written: the picture is the one thing left out). Whether it drew."""
    from ..optional import available, missing_message

    if not available("matplotlib"):
        warnings.warn(f"{what} is not drawn: {missing_message('matplotlib', 'drawing it')}", UserWarning, stacklevel=2)
        return False
    draw()
    return True


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str | os.PathLike) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def _heatmap(axis, matrix: np.ndarray, row_labels: list[str], columns: list[str], title: str, relative: bool, scale):
    import matplotlib

    # Relative: n x alpha, the weight against uniform (1 = what a freshly converted model gives), on a
    # diverging map centred at 1, so a small learned preference shows where raw weights look flat.
    shown = matrix * (~np.isnan(matrix)).sum(1, keepdims=True) if relative else matrix
    cmap = matplotlib.colormaps["RdBu_r" if relative else "viridis"].with_extremes(bad="white")  # white: not a source
    image = axis.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=scale, aspect="auto", interpolation="nearest")
    axis.set_title(title, fontsize=10)
    axis.set_xticks(range(len(columns)), [_short(c) for c in columns], fontsize=7, rotation=0)
    step = max(1, math.ceil(len(row_labels) / 16))
    axis.set_yticks(range(0, len(row_labels), step), row_labels[::step], fontsize=7)
    axis.set_xlabel("source", fontsize=8)
    if matrix.shape[0] <= 40 and matrix.shape[1] <= 12:
        for (row, col), value in np.ndenumerate(shown):
            if not np.isnan(value):
                dark = abs(scale(value) - 0.5) > 0.3 if relative else scale(value) < 0.6
                text = f"{value:.2f}" if relative else f"{value:.2f}".lstrip("0")
                axis.text(col, row, text, ha="center", va="center", fontsize=5.5, color="white" if dark else "black")
    return image


def _short(column: str) -> str:
    if column == "embedding":
        return "emb"
    kind, number = column.split()
    return ("B" if kind == "block" else "y") + number


def depth_heatmaps(depth, path: str | os.PathLike, title: str = "", relative: bool = False) -> Path:
    """Sublayer x source heatmaps of the mean depth-attention weights: pre-attention and pre-MLP side by
    side (one panel for parallel-residual models), the output aggregation as a strip below. `relative`
    colours n x alpha (weight against uniform) instead of alpha."""
    from matplotlib.colors import Normalize, TwoSlopeNorm

    kinds = np.array(depth.kinds)
    groups = [
        (kind, label)
        for kind, label in (
            ("attention", "pre-attention"),
            ("mlp", "pre-MLP"),
            ("attention+mlp", "pre-block (parallel attention + MLP)"),
        )
        if (kinds == kind).any()
    ]
    if relative:
        ratios = (depth.matrix * (~np.isnan(depth.matrix)).sum(1, keepdims=True))[~np.isnan(depth.matrix)]
        spread = max(0.05, float(np.abs(ratios - 1.0).max()) if ratios.size else 0.05)
        scale = TwoSlopeNorm(vcenter=1.0, vmin=max(0.0, 1.0 - spread), vmax=1.0 + spread)
    else:
        finite = depth.matrix[~np.isnan(depth.matrix)]
        scale = Normalize(0.0, float(finite.max()) if finite.size else 1.0)
    rows = max(int((kinds == kind).sum()) for kind, _ in groups)
    figure = _figure(3.4 * len(groups) + 1.2, min(11.0, 1.9 + 0.2 * rows))
    grid = figure.add_gridspec(2, len(groups), height_ratios=[max(rows, 1), 1.4])
    image = None
    for index, (kind, label) in enumerate(groups):
        axis = figure.add_subplot(grid[0, index])
        mask = kinds == kind
        layer_labels = [str(layer) for layer, keep in zip(depth.layers, mask) if keep]
        image = _heatmap(axis, depth.matrix[mask], layer_labels, depth.columns, label, relative, scale)
        if index == 0:
            axis.set_ylabel("decoder layer", fontsize=8)
    output_axis = figure.add_subplot(grid[1, :])
    _heatmap(
        output_axis, depth.matrix[kinds == "output"], ["output"], depth.columns, "output aggregation", relative, scale
    )
    label = "weight / uniform weight (n x alpha)" if relative else "mean softmax weight alpha"
    figure.colorbar(image, ax=figure.axes, shrink=0.6, label=label)
    figure.suptitle(title or "Depth-attention weights", fontsize=10)
    return _save(figure, path)


def magnitude_profiles(
    original, converted, kinds: Sequence[str], path: str | os.PathLike, title: str = "", identical: bool = False
) -> Path:
    """Four panels over sublayers 1..L, original (residual sum) against converted (AttnRes): the stream
    each sublayer reads, what it adds, its share of the stream (PreNorm dilution) and its gradient."""
    x = np.arange(1, len(kinds) + 1)
    panels = [
        ("stream_rms", "RMS of the stream a sublayer reads", True),
        ("output_rms", "RMS of what a sublayer adds", True),
        ("output_share", "added / read (PreNorm dilution)", True),
        ("grad_norm", "gradient norm of a sublayer's parameters", True),
    ]
    figure = _figure(11.0, 6.4)
    axes = figure.subplots(2, 2, sharex=True)
    for axis, (attr, label, log) in zip(axes.flat, panels):
        if not identical:
            axis.plot(
                x, getattr(original, attr), color=ORIGINAL_COLOR, lw=1.4, label="residual sum (pseudo-queries zeroed)"
            )
        axis.plot(
            x,
            getattr(converted, attr),
            color=CONVERTED_COLOR,
            lw=1.2,
            ls="--" if identical else "-",
            label="AttnRes = residual sum (pseudo-queries at zero)" if identical else "Block AttnRes (learned)",
        )
        if log:
            axis.set_yscale("log")
        axis.set_title(label, fontsize=9)
        axis.grid(alpha=0.3, which="both", lw=0.5)
        _mark_mlp(axis, kinds)
    for axis in axes[1]:
        axis.set_xlabel("sublayer (execution order)", fontsize=8)
    axes[0, 0].legend(fontsize=7, loc="upper left")
    figure.suptitle(title or "Per-sublayer magnitudes and gradients", fontsize=10)
    return _save(figure, path)


def _mark_mlp(axis, kinds: Sequence[str]) -> None:
    """Light ticks at MLP sublayers: attention and MLP outputs differ in scale, hence the zigzag."""
    axis.tick_params(labelsize=7)
    if "mlp" in kinds and len(kinds) <= 80:
        for index, kind in enumerate(kinds, start=1):
            if kind == "mlp":
                axis.axvline(index, color="#1f77b4", alpha=0.06, lw=2)


def loss_curve_plot(
    history: Sequence[Mapping],
    path: str | os.PathLike,
    title: str = "Training",
    keys: Sequence[str] = ("loss", "eval_loss"),
) -> Path:
    """Loss against step for each of `keys` present in history ([{"step": .., "loss": .., "eval_loss": ..}]);
    points without a key are skipped, so sparse held-out evaluations draw as their own line."""
    figure = _figure(6.0, 3.6)
    axis = figure.add_subplot()
    styles = {
        "loss": dict(color="#1f77b4", lw=1.0, alpha=0.9),
        "eval_loss": dict(color="#d62728", lw=1.6, marker="o", ms=3),
    }
    for key in keys:
        points = [(p["step"], p[key]) for p in history if p.get(key) is not None and "step" in p]
        if points:
            steps, values = zip(*points)
            axis.plot(
                steps, values, label={"loss": "training", "eval_loss": "held-out"}.get(key, key), **styles.get(key, {})
            )
    axis.set_xlabel("optimizer step", fontsize=8)
    axis.set_ylabel("loss (nats / token)", fontsize=8)
    axis.tick_params(labelsize=7)
    axis.grid(alpha=0.3, lw=0.5)
    if axis.lines:
        axis.legend(fontsize=8)
    axis.set_title(title, fontsize=10)
    return _save(figure, path)


def ab_curves_plot(report: Mapping, path: str | os.PathLike) -> Path:
    """`attnres ab`: held-out loss against step for every arm (mean over seeds, each seed a thin line), and
    beside it each arm's difference to the baseline at the same seed (mean, with the seeds' min..max band)."""
    import matplotlib

    figure = _figure(10.0, 3.8)
    curves, deltas = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    colors = matplotlib.colormaps["tab10"]
    for index, arm in enumerate(report["arms"]):
        color = ORIGINAL_COLOR if index == 0 else colors((index - 1) % 10)
        for run in arm["runs"]:
            if len(arm["runs"]) > 1 and run["eval"]:
                steps, values = zip(*run["eval"])
                curves.plot(steps, values, color=color, lw=0.6, alpha=0.35)
        if arm["eval"]:
            steps, values = zip(*arm["eval"])
            style = dict(color="black", ls="--", zorder=3) if index == 0 else dict(color=color)  # the reference, on top
            curves.plot(steps, values, lw=1.6, marker="o", ms=3, label=arm["name"], **style)
        points = [(step, d["mean"], d["min"], d["max"]) for step, d in arm.get("delta_curve", [])]
        if points:
            steps, mean, low, high = zip(*points)
            deltas.plot(steps, mean, color=color, lw=1.6, marker="o", ms=3, label=arm["name"])
            deltas.fill_between(steps, low, high, color=color, alpha=0.15, lw=0)
    deltas.axhline(0.0, color=ORIGINAL_COLOR, lw=1.0)
    seeds = len(report.get("seeds", [])) or 1
    curves.set_title(f"Held-out loss ({seeds} seed{'s' if seeds > 1 else ''}: mean and each seed)", fontsize=10)
    deltas.set_title("Arm - baseline, same seed (mean, min..max)", fontsize=10)
    for axis, label in ((curves, "loss (nats / token)"), (deltas, "Δ loss (nats / token)")):
        axis.set_xlabel("optimizer step", fontsize=8)
        axis.set_ylabel(label, fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3, lw=0.5)
        if axis.lines:
            axis.legend(fontsize=7)
    return _save(figure, path)


def retrofit_plot(report: Mapping, path: str | os.PathLike) -> Path:
    """`attnres ab --retrofit-after`: the retrofit's lead (baseline - AttnRes) at the end of the continued steps
    against the pretraining steps N (mean, the seeds' min..max as error bars), beside it the from-scratch lead
    at N + continued steps when the study has those arms; and the lead during the continued steps, one line per N."""
    import matplotlib

    figure = _figure(10.0, 3.8)
    by_n, by_step = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    points = report["after"]

    def errorbar(axis, xs, leads, **style):
        means = [lead["mean"] for lead in leads]
        low = [lead["mean"] - lead["min"] for lead in leads]
        high = [lead["max"] - lead["mean"] for lead in leads]
        axis.errorbar(xs, means, yerr=[low, high], marker="o", ms=4, capsize=3, lw=1.6, **style)

    errorbar(
        by_n,
        [p["after"] for p in points],
        [p["lead_final"] for p in points],
        color=CONVERTED_COLOR,
        label=f"retrofit, after {report['continued_steps']} continued steps",
    )
    if report.get("from_scratch_arms"):
        errorbar(
            by_n,
            [p["after"] for p in points],
            [p["scratch"]["lead"] for p in points],
            color="black",
            ls="--",
            label="from scratch, same tokens (N + continued)",
        )
    colors = matplotlib.colormaps["viridis"]
    for index, point in enumerate(points):
        steps = [step for step, _ in point["lead_curve"]]
        by_step.plot(
            steps,
            [lead["mean"] for _, lead in point["lead_curve"]],
            marker="o",
            ms=3,
            lw=1.4,
            color=colors(index / max(1, len(points) - 1) * 0.85),
            label=f"after {point['after']} steps",
        )
    seeds = len(report.get("seeds", [])) or 1
    by_n.set_title(f"Lead at the end vs pretraining steps N ({seeds} seed{'s' if seeds > 1 else ''})", fontsize=10)
    by_step.set_title("Retrofit lead during the continued steps (mean)", fontsize=10)
    for axis, xlabel in ((by_n, "pretraining steps N"), (by_step, "continued step")):
        axis.axhline(0.0, color=ORIGINAL_COLOR, lw=1.0)
        axis.set_xlabel(xlabel, fontsize=8)
        axis.set_ylabel("lead: baseline - AttnRes (nats / token)", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3, lw=0.5)
        if axis.lines:
            axis.legend(fontsize=7)
    return _save(figure, path)
