"""Converting a big checkpoint: peak memory and time of `attnres convert` against copying the files and
against a plain load + save_pretrained, on a random-weight Llama of 1.2B parameters (bf16, 2.4 GB in
shards of 1 GB); and the embedded SmolLM2-135M GGUF converted streamed against in memory.

    python benchmarks/big_checkpoint.py [--workdir DIR] [--keep] [--steps A,B] [--out benchmarks/results/big-checkpoint.json]

Every measured step runs in a fresh process that reports its own peak resident memory (VmHWM) and wall
time, its imports done before the clock starts (their time is recorded apart). The input files are in the
page cache for every step (each step reads them; none is dropped), and each step starts after an untimed
sync, so that no step pays for the previous one's writes: the times compare work, not cold disk reads.
Nothing here is a pass/fail test: it prints and records numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A TinyLlama-like shape with 24 layers and an untied head: 1.19B parameters.
CONFIG = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=4,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    dtype="bfloat16",
)

MAKE_MODEL = """
import json, sys, torch
from pathlib import Path
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig
folder = Path(sys.argv[1]); folder.mkdir(parents=True)
config = LlamaConfig(**json.loads(sys.argv[2]))
config.save_pretrained(folder)
with torch.device("meta"):
    skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
state = skeleton.state_dict()
split = split_torch_state_dict_into_shards(state, max_shard_size="1GB")
generator = torch.Generator().manual_seed(0)
for file, names in split.filename_to_tensors.items():
    tensors = {}
    for name in names:
        shape = state[name].shape
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:  # std 0.02, as transformers initialises Llama
            tensors[name] = (0.02 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
    save_file(tensors, folder / file, metadata={"format": "pt"})
    del tensors
index = {"metadata": {"total_size": sum(t.numel() * 2 for t in state.values())}, "weight_map": split.tensor_to_filename}
(folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
print(json.dumps({"parameters": sum(t.numel() for t in state.values())}))
"""

# Each step: sys.argv = [-, SOURCE, OUT]; prints one JSON line with its own peak RSS and time.
PROBE = """
import json, sys, time
began = time.perf_counter()
from attnres_convert.conversion.memory_budget import current_rss, peak_rss, reset_peak_rss
{imports}
reset_peak_rss()
start_rss, start = current_rss(), time.perf_counter()
{body}
print(json.dumps({{"seconds": time.perf_counter() - start, "import_seconds": start - began, "peak_rss": peak_rss(),
                  "start_rss": start_rss, **extra}}))
"""

STEPS = {
    "copy the files": (
        "import shutil\nfrom pathlib import Path",
        "Path(sys.argv[2]).mkdir()\nfor f in sorted(Path(sys.argv[1]).iterdir()): shutil.copyfile(f, Path(sys.argv[2]) / f.name)\nextra = {}",
    ),
    "load + save_pretrained": (
        "from transformers import AutoModelForCausalLM\nimport transformers.modeling_utils",
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype='auto')\nm.save_pretrained(sys.argv[2])\nextra = {}",
    ),
    "attnres convert --no-verify": (
        "from attnres_convert import convert\nimport attnres_convert.conversion.convert  # imports before the clock",
        "convert(sys.argv[1], sys.argv[2], verify=False)\nextra = {}",
    ),
    "attnres convert --max-memory 1.5GB": (
        "from attnres_convert import convert\nimport attnres_convert.conversion.convert",
        "r = convert(sys.argv[1], sys.argv[2], max_memory='1.5GB')\n"
        "extra = {'verification': r.verification.to_dict(), 'budget': r.verification_budget}",
    ),
    # The embedded SmolLM2-135M GGUF (Q4_1, 0.1 GB; 0.54 GB dequantised to float32): streamed against in memory.
    "GGUF: attnres convert --no-verify": (
        "from attnres_convert import convert\nimport attnres_convert.conversion.convert, attnres_convert.io.gguf_stream",
        "convert(None, sys.argv[2], verify=False)\nextra = {}",
    ),
    "GGUF: attnres convert --no-verify --no-stream": (
        "from attnres_convert import convert\nimport attnres_convert.conversion.convert, attnres_convert.io.gguf_stream",
        "convert(None, sys.argv[2], verify=False, stream=False)\nextra = {}",
    ),
}
# Copy and streamed conversion alternate (the disk's speed drifts on a shared machine); the slow steps run once.
ORDER = ["copy the files", "attnres convert --no-verify"] * 3 + [
    "load + save_pretrained",
    "attnres convert --max-memory 1.5GB",
]
ORDER += ["GGUF: attnres convert --no-verify", "GGUF: attnres convert --no-verify --no-stream"]


def run_step(name: str, source: Path, out: Path) -> dict:
    imports, body = STEPS[name]
    shutil.rmtree(out, ignore_errors=True)
    os.sync()  # untimed: the previous step's writes reach the disk before this one starts
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    code = textwrap.dedent(PROBE).format(imports=imports, body=body)
    process = subprocess.run(
        [sys.executable, "-c", code, str(source), str(out)], capture_output=True, text=True, env=env
    )
    if process.returncode != 0:
        raise SystemExit(f"{name} failed:\n{process.stderr[-3000:]}")
    result = json.loads(process.stdout.strip().splitlines()[-1])
    result["output_files"] = sorted(p.name for p in out.glob("*.safetensors*"))
    result["output_bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    return result


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def summarize(runs: list[dict], input_files: int, model_bytes: int) -> dict:
    """Medians per step, ratios to the copy, and the extrapolation to 8B and 70B bf16 checkpoints: the
    streamed conversion's time is a fixed part (config, the structure proven on a miniature, the meta model)
    plus the copy of the bytes, so it is extrapolated as (convert - copy) + size x (copy per GB)."""
    median = {}
    for name in [step for step in dict.fromkeys(ORDER) if any(run["step"] == step for run in runs)]:
        mine = sorted((run for run in runs if run["step"] == name), key=lambda run: run["seconds"])
        median[name] = mine[len(mine) // 2]
    copy = median["copy the files"]["seconds"]
    summary = {
        name: {
            "seconds": run["seconds"],
            "x_copy": None if name.startswith("GGUF") else run["seconds"] / copy,
            "peak_rss_gb": run["peak_rss"] / 1e9,
            "peak_rss_growth_gb": (run["peak_rss"] - run["start_rss"]) / 1e9,
            "import_seconds": run.get("import_seconds"),
            "files": len([f for f in run["output_files"] if f.endswith(".safetensors")]),
            "runs": sum(r["step"] == name for r in runs),
        }
        for name, run in median.items()
    }
    gigabytes = model_bytes / 1e9
    convert = median["attnres convert --no-verify"]["seconds"]
    fixed, per_gb = max(0.0, convert - copy), copy / gigabytes

    def at(size_gb: float) -> dict:
        return {
            "copy_seconds": size_gb * per_gb,
            "convert_seconds": fixed + size_gb * per_gb,
            "x_copy": (fixed + size_gb * per_gb) / (size_gb * per_gb),
        }

    return {
        "command": "python benchmarks/big_checkpoint.py",
        "model": {"config": CONFIG, "input_files": input_files, "bytes": model_bytes},
        "cpu_count": os.cpu_count(),
        "note": "shared 2-core machine with other jobs running (load averages recorded per step); median run per step; "
        "every step starts after os.sync() (untimed), its time excludes its imports (import_seconds)",
        "summary": summary,
        "extrapolation_no_verify": {
            "fixed_seconds": fixed,
            "copy_seconds_per_gb": per_gb,
            "8B_bf16_16GB": at(16.0),
            "70B_bf16_140GB": at(140.0),
            "peak_rss": "constant: tensors are copied by the kernel (copy_file_range), none is held in memory",
        },
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the random model for another run")
    parser.add_argument("--resummarize", action="store_true", help="recompute the summary of --out from its runs")
    parser.add_argument(
        "--steps",
        default=None,
        help="run only these steps (comma-separated step names); the other steps keep their runs from --out",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "big-checkpoint.json")
    args = parser.parse_args()
    if args.resummarize:
        old = json.loads(args.out.read_text())
        record = summarize(old["runs"], old["model"]["input_files"], old["model"]["bytes"])
        args.out.write_text(json.dumps(record, indent=2))
        print(json.dumps(record["summary"], indent=2), json.dumps(record["extrapolation_no_verify"], indent=2))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="attnres-big-"))
    source = workdir / "llama-1.2b"
    if not source.exists():
        print(f"writing a random-weight Llama to {source} ...", flush=True)
        made = subprocess.run(
            [sys.executable, "-c", MAKE_MODEL, str(source), json.dumps(CONFIG)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        if made.returncode != 0:
            raise SystemExit(made.stderr[-3000:])
    files = sorted(source.glob("*.safetensors"))
    model_bytes = sum(p.stat().st_size for p in files)
    steps = ORDER if args.steps is None else [name for name in ORDER if name in args.steps.split(",")]
    runs = [] if args.steps is None else [r for r in json.loads(args.out.read_text())["runs"] if r["step"] not in steps]
    for name in steps:
        print(f"{name} ...", flush=True)
        before = load_average()
        result = run_step(name, source, workdir / "out")
        result.update(
            step=name,
            load_average_before=before,
            load_average_after=load_average(),
            measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        runs.append(result)
        print(f"  {result['seconds']:.1f} s, peak RSS {result['peak_rss'] / 1e9:.2f} GB", flush=True)
    record = summarize(runs, len(files), model_bytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record["summary"], indent=2))
    print(f"written {args.out}")
    if not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
