"""`attnres bench` results as a console table, as JSON, and as the Markdown the docs carry.

All three read the same dict (`BenchResult.to_dict()`, or the JSON file it was written to), so a page made
from a results file shows exactly what the run printed.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from rich.table import Table

from ..io.saving import current_umask
from .bench_settings import output_problem  # noqa: F401 - re-exported

RATIO_MEANING = "ratio: converted / original (time, memory)"


def value_text(row: dict, side: str) -> str:
    """One side's number in the unit a reader expects: tokens/s for decoding, seconds, MiB."""
    if row["name"] == "decode":
        return f"{row[f'{side}_tokens_per_s']:.1f} tok/s"
    if row["unit"] == "MiB":
        return f"{row[side]:,.0f} MiB"
    return f"{row[side]:.3f} s"


def title(result: dict) -> str:
    s = result["settings"]
    compiled = ", compiled" if s.get("compile") else ""
    return f"{result['model']}: {s['device']} {s['dtype']}, depth mix {s['kernels']}{compiled}, {s['rounds']} rounds"


def ratio_texts(row: dict) -> tuple[str, str]:
    """The ratio and per-round ratio cells: 'noise' where the timings cannot carry a ratio (row['noise'] says why)."""
    if row.get("noise"):
        return "noise", "noise" if "paired_ratio" in row else ""
    return f"{row['ratio']:.3f}", f"{row['paired_ratio']:.3f}" if "paired_ratio" in row else ""


def noise_notes(result: dict) -> list[str]:
    """One line per ratio shown as noise: which, why, and how to get a result."""
    return [
        f"{row['label']}: the ratio is noise, not a result: {row['noise']}. Run again with more --rounds on an idle "
        "machine (or with --threads 1 where other work holds cores)."
        for row in result["rows"]
        if row.get("noise")
    ]


def console_table(result: dict) -> Table:
    """Medians side by side, ratios that are noise said to be; fits 80 columns."""
    notes = noise_notes(result)
    caption = f"medians of interleaved runs; {RATIO_MEANING}" + "".join(f"\n{note}" for note in notes)
    table = Table(title=title(result), caption=caption, caption_justify="left" if notes else "center")
    for column in ("measure", "original", "converted", "ratio", "per round"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    for row in result["rows"]:
        table.add_row(row["label"], value_text(row, "original"), value_text(row, "converted"), *ratio_texts(row))
    return table


def machine_line(result: dict) -> str:
    m = result["machine"]
    where = m.get("gpu") or f"{m['processor']}, {m['cpu_count']} cores"
    load = f"; load average {m['load_average_start'][0]:.1f} at the start" if m.get("load_average_start") else ""
    threads = f"{m['torch_threads']} torch thread" + ("s" if m["torch_threads"] != 1 else "")
    return f"{where}, {threads}; torch {m['torch']}, transformers {m['transformers']}; {m['date']}{load}"


def markdown(result: dict, json_path: str | None = None) -> str:
    """The result as a Markdown table with the command that produced it and the machine it ran on. JSON_PATH: where
    its results file is kept, named in the command's --json in place of where the run wrote it."""
    command = result.get("command") or "attnres bench"
    if json_path is not None:
        command = re.sub(r"--json \S+", f"--json {json_path}", command)
    lines = [
        "```bash",
        command,
        "```",
        "",
        f"{title(result)}; {machine_line(result)}.",
        "",
        "| measure | original | converted | converted / original | per-round ratio |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ratio, paired = ratio_texts(row)
        lines.append(
            f"| {row['label']} | {value_text(row, 'original')} | {value_text(row, 'converted')} | {ratio} | {paired} |"
        )
    lines += [f"\n{note}" for note in result.get("notes", []) + noise_notes(result)]
    return "\n".join(lines) + "\n"


def write_json(result: dict, path: str | os.PathLike) -> Path:
    """RESULT written to PATH whole or not at all (a temporary file beside it, renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o666 & ~current_umask())  # the mode a plainly created file gets, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())


# A block of a Markdown page made from a results file: `<!-- bench: benchmarks/results/X.json -->`, the table,
# `<!-- /bench -->`. `python docs/generate.py` rewrites what is between the markers; its check keeps them current.
BENCH_BLOCK = re.compile(r"(<!-- bench: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- /bench -->)", re.S)


def fill_bench_blocks(text: str, root: Path) -> str:
    """TEXT with every bench block's table made again from its results file (a path relative to ROOT)."""
    return BENCH_BLOCK.sub(
        lambda m: m.group(1) + markdown(read_json(root / m.group("path")), m.group("path")) + m.group(4), text
    )
