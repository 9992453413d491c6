"""What AttnRes costs beyond `attnres bench`: converted vs original SmolLM2-135M, fp32, 2 threads, both models in one
process, interleaved runs, with Full AttnRes, gradient checkpointing, several processes and `attnres convert` itself.
The timing and peak-memory code is the library's (attnres_convert/analysis/timing.py, step_memory.py), which
`attnres bench` runs too.

    python benchmarks/overhead.py [--repeats 7] [--processes 3] [--cpu-kernels] [--compile] [--skip-train]
                                  [--skip-memory] [--skip-convert] [--mapped]
                                  [--out benchmarks/results/overhead-smollm2-cpu.json]

Both models are loaded as users load them: the original by `from_pretrained` of its folder, the converted
one by `from_pretrained(..., trust_remote_code=True)` of the folder `attnres convert` wrote (in a child
process, so this process runs the modeling code saved in that folder). The depth mix runs on the path
ATTNRES_KERNEL selects for CPU tensors (eager unless set otherwise); the results record it. --cpu-kernels
adds the prefill and decode rows of the same converted models with ATTNRES_KERNEL=cpu (the C++ kernels
shipped in the folder), interleaved in the same rounds: eager and compiled readers side by side.

Reports ratios converted/original (the ratio of the medians of interleaved runs, and the median of
the per-round ratios, which a slow phase of the machine moves less) for prefill (512 tokens), decode
(64 new tokens with the KV cache), one training step (forward + backward, 4 x 256 tokens, with and
without gradient checkpointing, plus its peak memory), Full AttnRes prefill, and `attnres convert`
against a plain load + save_pretrained. The speed rows are measured in --processes fresh processes (each
holding both models) and combined by medians, each process's ratio kept. Nothing here is a pass/fail test:
it prints and records numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from attnres_convert.analysis import timing  # noqa: E402
from attnres_convert.analysis.step_memory import measure_in_child  # noqa: E402
from attnres_convert.analysis.timing import interleaved, resident, with_kernel  # noqa: E402
from attnres_convert.finetune.optim import enable_checkpointing  # noqa: E402

console = Console()


def prepare_folder(workdir: Path) -> Path:
    """SmolLM2 dequantised once to a plain HF folder, so loads in the benchmark are fast and equal."""
    from attnres_convert.io.samples import default_model_path
    from attnres_convert.io.saving import atomic_folder
    from attnres_convert.io.sources import load_model, load_tokenizer, resolve_source

    folder = workdir / "smollm2-hf"
    if not (folder / "config.json").exists():
        source = resolve_source(str(default_model_path()))  # dequantised on load: plain float32 weights

        def write(staging: Path) -> None:
            load_model(source, "float32").save_pretrained(staging)
            load_tokenizer(source).save_pretrained(staging)

        # moved into place whole; `owned`: a folder left without config.json by an interrupted run is replaced
        atomic_folder(folder, write, owned=True)
    return folder


def holds_current_code(converted: Path) -> bool:
    """Whether a converted folder is complete and ships the installed package's modeling code (a folder kept from
    an earlier run with other code is converted again: a benchmark measures the code under test)."""
    from attnres_convert import modeling

    shipped = Path(modeling.__file__).parent
    return (converted / "config.json").is_file() and all(
        (converted / name).is_file() and (converted / name).read_bytes() == (shipped / name).read_bytes()
        for name in modeling.SHIPPED_CODE
    )


def converted_folder(folder: Path, workdir: Path, full: bool = False) -> Path:
    """`attnres convert` of the original folder, in a child process (as a user converts)."""
    out = workdir / ("smollm2-full-attnres" if full else "smollm2-attnres")
    if not holds_current_code(out):
        attnres = str(Path(sys.executable).with_name("attnres"))
        cmd = [attnres, "convert", str(folder), "-o", str(out), "--no-verify", "--overwrite"]
        subprocess.run(cmd + (["--full"] if full else []), check=True, capture_output=True)
    return out


def compared(metric: str, times: dict[str, list[float]], converted: str = "converted") -> dict:
    """The row of one comparison in this script's format (the library's medians and ratios)."""
    row = timing.compared(times["original"], times[converted])
    return {
        "metric": metric,
        "original_s": row["original"],
        "converted_s": row["converted"],
        "ratio": row["ratio"],
        "paired_ratio": row["paired_ratio"],
    }


def speed(
    original, converted, full, repeats: int, compiled: bool, train: bool = True, cpu_kernels: bool = False
) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (1, 512), generator=generator)
    short = prompt[:, :32]
    batch = torch.randint(100, 40000, (4, 256), generator=generator)
    models = {"original": original, "converted": converted, "full": full}
    if compiled:
        models = {name: torch.compile(model) for name, model in models.items()}
    rows = []

    def prefill(model):
        def run():
            with torch.no_grad():  # inference: the decorator of a factory would not cover the call
                return model(prompt, use_cache=False)

        return run

    runs = {name: prefill(m) for name, m in models.items()}
    kernels = cpu_kernels and not compiled
    if kernels:
        runs.update(
            {f"{name} [cpu kernels]": with_kernel("cpu", prefill(models[name])) for name in ("converted", "full")}
        )
    t = interleaved(runs, repeats)
    rows.append(compared("prefill 512 tokens", t))
    rows.append(compared("prefill 512 tokens, Full AttnRes (S=1)", t, "full"))
    if kernels:
        rows.append(compared("prefill 512 tokens [cpu kernels]", t, "converted [cpu kernels]"))
        rows.append(compared("prefill 512 tokens, Full AttnRes (S=1) [cpu kernels]", t, "full [cpu kernels]"))

    def decode(model):
        kwargs = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
        base = model._orig_mod if hasattr(model, "_orig_mod") else model
        return lambda: base.generate(short, **kwargs)

    if not compiled:
        runs = {name: decode(models[name]) for name in ("original", "converted")}
        if kernels:
            runs["converted [cpu kernels]"] = with_kernel("cpu", decode(models["converted"]))
        t = interleaved(runs, repeats)
        rows.append(compared("decode 64 tokens (KV cache)", t))
        if kernels:
            rows.append(compared("decode 64 tokens (KV cache) [cpu kernels]", t, "converted [cpu kernels]"))

    # Compiled: the plain training step only (compiling a backward takes minutes: measured 62 s for the
    # original, 177 s for the converted model on this machine), and no decode (generate recompiles).
    for checkpointing in ((False,) if compiled else (False, True)) if train else ():

        def step(model):
            def run():
                model.zero_grad(set_to_none=True)
                model(batch, labels=batch).loss.backward()

            return run

        for m in (original, converted):
            m.train()
            if checkpointing:
                enable_checkpointing(m)
            else:
                m.activation_checkpointing_disable()
        t = interleaved({name: step(models[name]) for name in ("original", "converted")}, max(3, repeats))
        rows.append(compared("train step 4x256" + (", grad checkpointing" if checkpointing else ""), t))
        for m in (original, converted):
            m.zero_grad(set_to_none=True)
            m.activation_checkpointing_disable()
            m.eval()
    return rows


def speed_in_processes(args, workdir: Path) -> tuple[list[dict], dict]:
    """The speed rows measured in fresh processes, one after another, each loading both models and
    interleaving them: where a process's weights and buffers land in memory moves its ratios (measured:
    the same code's decode ratio 1.04 in one process and 1.09 in the next), so one process is one sample.
    Per row: the median over the processes of each estimate, and every process's ratio. Also returns the
    last process's meta (what it loaded)."""
    runs = []
    for index in range(args.processes):
        out = workdir / f"speed-{index}.json"
        cmd = [
            sys.executable,
            __file__,
            "--speed-only",
            "--out",
            str(out),
            "--workdir",
            str(workdir),
            "--repeats",
            str(args.repeats),
            "--threads",
            str(args.threads),
        ]
        cmd += [
            flag
            for flag, on in (
                ("--mapped", args.mapped),
                ("--skip-train", args.skip_train),
                ("--compile", args.compile),
                ("--cpu-kernels", args.cpu_kernels),
            )
            if on
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        measured = json.loads(out.read_text())
        runs.append(measured["rows"])
    rows = []
    for samples in zip(*runs):
        row = {"metric": samples[0]["metric"], "process_ratios": [r["ratio"] for r in samples]}
        for key in ("original_s", "converted_s", "ratio", "paired_ratio"):
            row[key] = statistics.median(r[key] for r in samples)
        rows.append(row)
    return rows, measured["meta"]


def step_memory(folder: Path, converted_path: Path, threads: int) -> list[dict]:
    """Peak memory a training step adds (activations, gradients, autograd buffers), 4 x 256 tokens, measured in a
    fresh child per model (attnres_convert/analysis/step_memory.py, as `attnres bench` measures it)."""
    rows = []
    for checkpointing in (False, True):
        peaks = {
            converted: measure_in_child(
                converted_path if converted else folder,
                device="cpu",
                dtype="float32",
                batch=4,
                seq_len=256,
                kernels=None,
                remote_code=converted,
                threads=threads,
                checkpointing=checkpointing,
            )
            for converted in (False, True)
        }
        rows.append(
            {
                "metric": "train step peak memory" + (", grad checkpointing" if checkpointing else ""),
                "original_s": peaks[False] / 2**20,
                "converted_s": peaks[True] / 2**20,
                "ratio": peaks[True] / peaks[False],
                "unit": "MiB",
            }
        )
    return rows


def _timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of a child process."""
    start = time.perf_counter()
    code = (
        "import resource, subprocess, sys, json; r = subprocess.run(sys.argv[1:], capture_output=True); "
        "print(json.dumps({'rc': r.returncode, 'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
        "'err': r.stderr.decode()[-2000:]}))"
    )
    out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    if data["rc"] != 0:
        raise RuntimeError(data["err"])
    return time.perf_counter() - start, data["rss"] / 1024


def convert_cost(folder: Path, workdir: Path, repeats: int) -> list[dict]:
    plain = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, dtype="auto")
        m.save_pretrained(sys.argv[1]); AutoTokenizer.from_pretrained({str(folder)!r}).save_pretrained(sys.argv[1])
        """
    )
    attnres = str(Path(sys.executable).with_name("attnres"))
    runs = {"plain": [], "convert": [], "convert+verify": []}
    for i in range(repeats):
        outputs = [workdir / f"{name}{i}" for name in ("plain", "conv", "ver")]
        for out in outputs:  # what an earlier (or interrupted) run wrote: the commands write new folders
            shutil.rmtree(out, ignore_errors=True)
        runs["plain"].append(_timed([sys.executable, "-c", plain, str(outputs[0])]))
        runs["convert"].append(_timed([attnres, "convert", str(folder), "-o", str(outputs[1]), "--no-verify"]))
        runs["convert+verify"].append(_timed([attnres, "convert", str(folder), "-o", str(outputs[2])]))
        for out in outputs:
            shutil.rmtree(out, ignore_errors=True)
    med = {k: (statistics.median(t for t, _ in v), statistics.median(m for _, m in v)) for k, v in runs.items()}
    rows = []
    for name in ("convert", "convert+verify"):
        rows.append(
            {
                "metric": f"`attnres {name}` time vs load+save",
                "original_s": med["plain"][0],
                "converted_s": med[name][0],
                "ratio": med[name][0] / med["plain"][0],
            }
        )
        rows.append(
            {
                "metric": f"`attnres {name}` peak RSS vs load+save",
                "original_s": med["plain"][1],
                "converted_s": med[name][1],
                "ratio": med[name][1] / med["plain"][1],
                "unit": "MiB",
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also measure torch.compile'd models")
    parser.add_argument("--skip-convert", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep the model folders here (reused by later runs, converted again for other modeling code)",
    )
    parser.add_argument(
        "--mapped", action="store_true", help="time the weights as from_pretrained maps them (page-cache dependent)"
    )
    parser.add_argument("--skip-train", action="store_true", help="no training-step rows (prefill and decode only)")
    parser.add_argument(
        "--cpu-kernels",
        action="store_true",
        help="also the prefill and decode rows with ATTNRES_KERNEL=cpu (compiles the C++ kernels once)",
    )
    parser.add_argument("--processes", type=int, default=3, help="measure the speed rows in this many fresh processes")
    parser.add_argument("--speed-only", action="store_true", help=argparse.SUPPRESS)  # one of those processes
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "overhead-smollm2-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="attnres-bench-"))
    folder = prepare_folder(workdir)
    converted_path, full_path = converted_folder(folder, workdir), converted_folder(folder, workdir, full=True)
    meta = {
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "loaded": "original: from_pretrained(folder); converted: from_pretrained(attnres convert folder, trust_remote_code=True)",
        "weights": "mapped by from_pretrained"
        if args.mapped
        else "copied into process memory after from_pretrained (see resident)",
        "processes": 1 if args.speed_only else args.processes,
        "attnres_kernel": os.environ.get("ATTNRES_KERNEL", "auto") + " (CPU tensors: eager unless triton or cpu;"
        " rows marked [cpu kernels]: cpu)",
        "load_average_start": os.getloadavg(),
    }

    def record(rows):  # written after every stage, so a long run that is stopped keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta["load_average_now"] = os.getloadavg()
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    if args.speed_only or args.processes == 1:
        remote = dict(dtype=torch.float32, trust_remote_code=True)
        load = (lambda m: m) if args.mapped else resident
        original = load(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
        converted = load(AutoModelForCausalLM.from_pretrained(converted_path, **remote).eval())
        full = load(AutoModelForCausalLM.from_pretrained(full_path, **remote).eval())
        meta["converted_class"] = f"{type(converted).__module__}.{type(converted).__name__}"
        rows = speed(
            original,
            converted,
            full,
            args.repeats,
            compiled=False,
            train=not args.skip_train,
            cpu_kernels=args.cpu_kernels,
        )
        record(rows)
        if args.compile:
            compiled = speed(original, converted, full, args.repeats, True, train=not args.skip_train)
            rows += [dict(r, metric=r["metric"] + " [compiled]") for r in compiled]
            record(rows)
        del original, converted, full
        if args.speed_only:
            return
    else:
        rows, child = speed_in_processes(args, workdir)
        meta["converted_class"] = child["converted_class"]
        record(rows)
    if not args.skip_memory:
        rows += step_memory(folder, converted_folder(folder, workdir), args.threads)
        record(rows)
    if not args.skip_convert:
        rows += convert_cost(folder, workdir, max(1, args.repeats // 3))
        record(rows)

    table = Table(title=f"AttnRes overhead, SmolLM2-135M fp32, {args.threads} threads (medians, interleaved)")
    for column in ("metric", "original", "converted", "converted / original", "per-round ratio", "processes"):
        table.add_column(column, justify="right" if column != "metric" else "left")
    for r in rows:
        unit = r.get("unit", "s")
        fmt = "{:.1f} MiB" if unit == "MiB" else "{:.3f} s"
        paired = f"{r['paired_ratio']:.3f}" if "paired_ratio" in r else ""
        spread = f"{min(r['process_ratios']):.3f}-{max(r['process_ratios']):.3f}" if "process_ratios" in r else ""
        table.add_row(
            r["metric"], fmt.format(r["original_s"]), fmt.format(r["converted_s"]), f"{r['ratio']:.3f}", paired, spread
        )
    console.print(table)
    console.print(f"written to {args.out}")


if __name__ == "__main__":
    main()
