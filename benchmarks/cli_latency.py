"""How long `attnres` takes to answer an argument error (and two quick commands), from pressing enter to
the exit: each case runs as a fresh process, interleaved with the others, and the median of the repeats is
printed. Every argument error should come back in well under a second: paths, option combinations, the
recipe schema and output folders are checked before torch and transformers are imported.

    python benchmarks/cli_latency.py [--repeats 5] [--out benchmarks/results/cli-latency.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "--help": ["--help"],
    "--version": ["--version"],
    "convert: no such path": ["convert", "/nonexistent/folder", "-o", "out"],
    "convert: no -o": ["convert"],
    "convert: output exists": ["convert", "-o", "taken"],
    "convert: --num-blocks 0": ["convert", "--num-blocks", "0", "-o", "out"],
    "convert: --full with --block-size": ["convert", "--full", "--block-size", "2", "-o", "out"],
    "convert: bad --max-shard-size": ["convert", "--max-shard-size", "huge", "-o", "out"],
    "eval: no --data": ["eval"],
    "eval: missing file": ["eval", "--data", "missing.txt"],
    "eval: shakespeare:hamlett": ["eval", "--data", "shakespeare:hamlett"],
    "inspect: no such path": ["inspect", "./nowhere"],
    "recipes validate (valid)": ["recipes", "validate", "quickstart-cpu", "output.dir=run"],
    "recipes validate: misspelt key": ["recipes", "validate", "quickstart-cpu", "train.stpes=3"],
    "finetune: misspelt key": ["finetune", "quickstart-cpu", "train.stpes=3"],
    "finetune: missing data file": ["finetune", "quickstart-cpu", "data.train.files=[missing.txt]"],
    "ab: misspelt key": ["ab", "quickstart-cpu", "train.stpes=3"],
    "architectures: misspelt type": ["architectures", "lama"],
    "bench: no such path": ["bench", "/nonexistent/folder"],
}


def run_once(args: list[str], cwd: Path) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "attnres_convert.cli", *args], cwd=cwd, env=env, capture_output=True)
    return time.perf_counter() - start, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CASES}
    codes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as workdir:
        cwd = Path(workdir)
        (cwd / "taken").mkdir()
        (cwd / "taken" / "keep.txt").write_text("a user's file")
        for _ in range(options.repeats):  # interleaved: a busy moment slows every case alike
            for name, args in CASES.items():
                seconds, codes[name] = run_once(args, cwd)
                times[name].append(seconds)
    rows = {
        name: {"median_s": round(statistics.median(t), 3), "max_s": round(max(t), 3), "exit": codes[name]}
        for name, t in times.items()
    }
    width = max(map(len, CASES))
    print(
        f"{'case':<{width}}  median   max  exit   ({options.repeats} runs each, {os.cpu_count()} cores, Python {platform.python_version()})"
    )
    for name, row in rows.items():
        print(f"{name:<{width}}  {row['median_s']:5.2f}s {row['max_s']:5.2f}s  {row['exit']:>3}")
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(
            json.dumps({"repeats": options.repeats, "cores": os.cpu_count(), "cases": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
