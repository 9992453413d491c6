"""Where the AttnRes overhead goes inside a converted SmolLM2-135M (fp32, 2 threads): the time of each AttnRes
function per forward, against the forward and against the original model's forward, for a 512-token prefill and
a decoding step, on the eager path and with the C++ kernels (ATTNRES_KERNEL=cpu).

    python benchmarks/attnres_parts.py [--repeats 7] [--workdir DIR] [--out benchmarks/results/attnres-parts.json]

The converted model is loaded as users load it (`from_pretrained(..., trust_remote_code=True)` of the folder
`attnres convert` wrote, so the shipped modeling code runs), and the functions the converted layers call are
wrapped with timers in that loaded module: `start_state`, `_all_queries` (every sublayer's query folded
with its key norm, once per forward) and the readers' `depth_mix` (the same calls for a prefill and a decoding
step; a block's close and an output's add are the state's methods, counted in the layer's own time). The timers cost a little themselves, so the parts are an upper bound; what they show is the split. The reference rows are a plain `torch.add` over the bytes a prefill reader moves and over 100 MB.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.overhead import converted_folder, prepare_folder, resident  # noqa: E402

console = Console()
PARTS = ("start_state", "_all_queries", "depth_mix", "run_sublayer")
SHOWN = ("start_state", "_all_queries", "depth_mix")


def timed_parts(module, totals: dict) -> None:
    """Wrap the loaded modeling module's functions (looked up by name at call time by the layers) with timers."""
    for name in PARTS:
        function = getattr(module, name)

        def timer(*args, _function=function, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(module, name, timer)


def measure(original, converted, totals: dict, run, repeats: int) -> dict:
    """Interleaved runs of both models; the parts' medians per converted run."""
    per_run: dict[str, list[float]] = collections.defaultdict(list)
    times: dict[str, list[float]] = {"original": [], "converted": []}
    with torch.no_grad():
        run(original), run(converted)
        for index in range(repeats):
            order = (("original", original), ("converted", converted))
            for name, model in order if index % 2 == 0 else order[::-1]:
                totals.clear()
                start = time.perf_counter()
                run(model)
                times[name].append(time.perf_counter() - start)
                if name == "converted":
                    for part in PARTS:
                        per_run[part].append(totals[part])
    original_s, converted_s = statistics.median(times["original"]), statistics.median(times["converted"])
    parts = {part: statistics.median(values) for part, values in per_run.items()}
    return {"original_s": original_s, "converted_s": converted_s, "parts_s": parts}


def bandwidth_reference() -> list[dict]:
    """A plain add (two reads, one write) over the bytes a prefill reader of 5 sources moves with its residual
    adds (512 tokens x 576 floats, 10 rows per token: ~12 MB) and over 100 MB, warm: the rate a reader's traffic
    could run at."""
    rows = []
    for total in (512 * 576 * 10 * 4, 100 * 2**20):
        n = total // 12
        a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
        runs = []
        for _ in range(30):
            start = time.perf_counter()
            torch.add(a, b, out=out)
            runs.append(time.perf_counter() - start)
        seconds = statistics.median(runs)
        rows.append({"bytes": 12 * n, "seconds": seconds, "gb_per_s": 12 * n / seconds / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=ROOT / "outputs" / "bench")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "attnres-parts.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    args.workdir.mkdir(parents=True, exist_ok=True)
    folder = prepare_folder(args.workdir)
    original = resident(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    converted = resident(
        AutoModelForCausalLM.from_pretrained(
            converted_folder(folder, args.workdir), dtype=torch.float32, trust_remote_code=True
        ).eval()
    )
    module = sys.modules[type(converted).__module__]
    totals: dict[str, float] = collections.defaultdict(float)
    timed_parts(module, totals)
    prompt = torch.randint(
        0, converted.config.text_config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0)
    )
    short = prompt[:, :32]

    def prefill(model):
        model(prompt)

    def decode(model):  # 64 greedy tokens after 32: the parts are per generate call, divided by 65 forwards below
        model.generate(short, max_new_tokens=64, min_new_tokens=64, do_sample=False)

    rows = []
    for mode in ("eager", "cpu"):
        os.environ["ATTNRES_KERNEL"] = mode
        for what, run, forwards in (("prefill 512 tokens", prefill, 1), ("decode 64 tokens after 32", decode, 65)):
            result = measure(original, converted, totals, run, args.repeats)
            row = {"metric": what, "kernel": mode, "forwards": forwards, **result}
            row["ratio"] = result["converted_s"] / result["original_s"]
            parts = {k: 1e3 * v / forwards for k, v in result["parts_s"].items()}
            row["parts_ms_per_forward"] = parts
            row["attnres_ms_per_forward"] = sum(parts[k] for k in SHOWN)
            rows.append(row)
    os.environ.pop("ATTNRES_KERNEL", None)
    reference = bandwidth_reference()
    meta = {
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "note": "parts timed by wrapping the loaded modeling module's functions; run_sublayer is the base model's work",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "bandwidth_reference": reference}, indent=2))

    table = Table(title="AttnRes parts, ms per forward (SmolLM2-135M fp32, medians of interleaved runs)")
    table.add_column("part")
    for row in rows:
        table.add_column(f"{row['metric'].split(' ')[0]}, {row['kernel']}", justify="right")
    lines = [
        ("original forward", lambda r: 1e3 * r["original_s"] / r["forwards"]),
        ("converted forward", lambda r: 1e3 * r["converted_s"] / r["forwards"]),
    ]
    lines += [(part, lambda r, part=part: r["parts_ms_per_forward"][part]) for part in SHOWN]
    lines += [("AttnRes parts", lambda r: r["attnres_ms_per_forward"])]
    for name, value in lines:
        table.add_row(name, *(f"{value(row):.2f}" for row in rows))
    table.add_row(
        "parts / original",
        *(f"{r['attnres_ms_per_forward'] * r['forwards'] / (1e3 * r['original_s']):.3f}" for r in rows),
    )
    table.add_row("converted / original", *(f"{r['ratio']:.3f}" for r in rows))
    console.print(table)
    for row in reference:
        console.print(f"plain add over {row['bytes'] / 1e6:.0f} MB: {row['gb_per_s']:.1f} GB/s")
    console.print(f"written to {args.out}")


if __name__ == "__main__":
    main()
