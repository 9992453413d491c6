"""`make gpu-check`: one prepared check of the GPU path, for a machine lent for a few minutes where nothing can
be installed.

It runs with the Python it is given, from the checkout (PYTHONPATH), and needs torch, transformers, triton,
accelerate, typer and rich; pytest for the CUDA tests and pydantic for the A/B are used where present (the A/B
also from the wheels `make gpu-check-wheels` downloads into gpu-check-wheels/, unpacked, never installed).
Nothing is downloaded: both models are built from configs with random weights, SmolLM2-135M's shape and
Llama-3.2-1B's, which is all that exactness and speed depend on.

Stages, in order of what matters most, each with a time budget inside a global deadline (8 minutes on a GPU):

  environment   versions (torch, transformers, triton, ...), the GPU, its CUDA capability
  models        both shapes built with random weights and saved, then converted (`attnres convert`'s library call)
  exactness     both models on the device, fp32 and bf16, eager and Triton depth mix: logits and cached
                greedy tokens of the converted model against the original (conversion/verify.py)
  bench-*       `attnres bench` on the device (analysis/bench.py: prefill, decode, training step, peak memory,
                ratios converted / original) for the eager path, the Triton kernels and --compile
  cuda-tests    `pytest -m cuda` (the Triton kernels against the eager path)
  ab            a short from-scratch A/B (`attnres ab --from-scratch`) on the checkout's own docs as bytes
  depth-mix-kernels  one reader's depth mix alone, forward and forward + backward, timed on the device and checked
                against float64: fla-core's fused AttnRes kernels (FlaState, from gpu-check-wheels/ where fla is not
                installed), our Triton training kernels (TrainState), the eager TrainState and BlockState

A stage records its result or its error, and one failing stage does not stop the rest. The slow and
hang-prone stages (bench, tests, A/B) run as child processes killed at their budget; a stage that the
deadline leaves no time for is recorded as not reached. `--device cpu --quick` runs the same plumbing on tiny
shapes in a few minutes (CUDA-only stages are recorded as skipped, with the reason).

    PYTHONPATH=. python3 -m attnres_convert.analysis.gpu_check --out gpu-check [--device cpu --quick]

writes OUT/gpu-check.json and OUT/gpu-check.md; `--results DIR` also copies them into DIR (benchmarks/results)
named after the GPU.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..io.console import quiet_libraries
from .gpu_check_mix import depth_mix_kernels
from .gpu_check_plan import QUICK_PLAN, QUICK_SHAPES, SHAPES, Plan
from .gpu_check_report import markdown, results_name

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the package's parent
WHEELS = ROOT / "gpu-check-wheels"
REPORT_JSON, REPORT_MD = "gpu-check.json", "gpu-check.md"
# What a full check may take on one GPU, and what is kept back to write the reports.
DEADLINE_S = 480
REPORT_RESERVE_S = 10


@dataclass
class Stage:
    name: str
    budget_s: float  # on a GPU; --quick on a CPU gives each stage its own (QUICK_BUDGETS)
    run: Callable[[Check, float], dict]
    cuda_only: str | None = None  # why the stage needs CUDA: skipped on a CPU with this reason


@dataclass
class StageResult:
    name: str
    status: str  # ok | partial (its budget ran out before some of its runs) | failed | skipped | not reached
    seconds: float = 0.0
    budget_s: float = 0.0
    result: dict = field(default_factory=dict)
    error: str | None = None


class Check:
    """One run of the check: settings, the work folder, the clock."""

    def __init__(self, device: str, quick: bool, out: Path, deadline_s: float, work: Path):
        self.device, self.quick, self.out, self.work = device, quick, out, work
        self.started = time.monotonic()
        self.deadline_s = deadline_s
        self.plan = QUICK_PLAN if quick else Plan()
        self.shapes = QUICK_SHAPES if quick else SHAPES
        self.folders: dict[str, Path] = {}  # shape -> original folder
        self.converted: dict[str, Path] = {}  # shape -> converted folder
        self.log = open(out / "gpu-check.log", "w")  # children's output, for a failure's details

    def left(self) -> float:
        """Seconds to the deadline, less what writing the reports keeps back."""
        return self.deadline_s - REPORT_RESERVE_S - (time.monotonic() - self.started)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def child(self, cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """CMD run from the checkout with the package on PYTHONPATH, killed after TIMEOUT seconds
        (subprocess.TimeoutExpired). Its output goes to the log and comes back for parsing."""
        full_env = dict(os.environ, **(env or {}))
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p)
        if self.device == "cpu":
            full_env["CUDA_VISIBLE_DEVICES"] = ""
        self.log.write(f"\n$ {' '.join(cmd)}\n")
        self.log.flush()
        # A session of its own: at the timeout the whole group goes (bench's memory children, torch.compile's
        # workers), so nothing of a stage keeps the GPU or the CPUs busy during the next one.
        with subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        ) as process:
            try:
                stdout, stderr = process.communicate(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
                self.log.write(f"{stdout}{stderr}\n[killed after {timeout:.0f} s]\n")
                raise
        self.log.write(stdout + stderr)
        self.log.flush()
        return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


# --- stages ---------------------------------------------------------------------------------------------------


def environment(check: Check, limit: float) -> dict:
    import torch

    from .bench import machine_info

    info = {
        **machine_info("cpu"),  # the GPU's own fields below, with the check's
        "device": check.device,
        "quick": check.quick,
        "packages": {
            name: _version(name)
            for name in (
                "torch",
                "transformers",
                "triton",
                "accelerate",
                "peft",
                "typer",
                "rich",
                "pydantic",
                "pytest",
                "datasets",
                "gguf",
                "matplotlib",
            )
        },
        "torch_cuda": torch.version.cuda,
    }
    if check.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"--device cuda: no CUDA GPU is visible to torch {torch.__version__} (torch.version.cuda={torch.version.cuda})"
            )
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            bf16=torch.cuda.is_bf16_supported(),
        )
    return info


def _version(name: str) -> str | None:
    """NAME's version where it imports, None where it does not (a missing optional package is a fact to record)."""
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - not installed, or broken: either way not usable here
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # importable without metadata (unpacked from a wheel)
        return getattr(module, "__version__", "unknown")


def models(check: Check, limit: float) -> dict:
    """Each shape with random weights saved as a model folder (bf16 on a GPU: half the bytes to write), then
    converted into a second folder by the library call `attnres convert` makes (not verified here: exactness
    is its own stage, on the device)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ..conversion.convert import convert

    dtype = torch.bfloat16 if check.cuda else torch.float32
    built = {}
    for name, values in check.shapes.items():
        started = time.monotonic()
        config = LlamaConfig(**values)
        torch.manual_seed(0)
        with torch.device(check.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        params = sum(p.numel() for p in model.parameters())
        folder = check.work / name
        model.save_pretrained(folder)
        del model
        _free()
        check.folders[name] = folder
        converted = convert(str(folder), check.work / f"{name}-attnres", verify=False)
        check.converted[name] = check.work / f"{name}-attnres"
        built[name] = {
            "parameters": params,
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "saved_dtype": str(dtype).removeprefix("torch."),
            "block_size": converted.summary.block_size,
            "num_blocks": converted.summary.num_blocks,
            "params_added": converted.summary.params_added,
            "seconds": round(time.monotonic() - started, 1),
        }
    return built


def exactness(check: Check, limit: float) -> dict:
    """Both models on the device in fp32 and bf16: the original's logits and cached greedy tokens captured,
    then the converted model (loaded as a user loads it, its shipped code) compared, under each depth mix."""
    import torch

    from ..conversion.verify import capture_reference, compare
    from .bench import BenchSettings, load_for_bench
    from .timing import kernel_env

    started = time.monotonic()
    kernels = ["eager", "triton"] if check.cuda else ["eager"]
    rows, not_reached = [], []
    for name in check.shapes:
        for dtype in ("float32", "bfloat16"):
            if time.monotonic() - started > limit:
                not_reached.append(f"{name} {dtype}")
                continue
            settings = BenchSettings(device=check.device, dtype=dtype)
            original = load_for_bench(check.folders[name], settings, remote_code=False)
            vocab = original.config.vocab_size
            ids = torch.randint(3, vocab, (1, check.plan.exact_tokens), generator=torch.Generator().manual_seed(0))
            reference = capture_reference(original, ids.to(check.device), check.plan.exact_new_tokens)
            del original
            _free()
            converted = load_for_bench(check.converted[name], settings, remote_code=True)
            for mode in kernels:
                try:
                    with kernel_env(mode):
                        report = compare(reference, converted).to_dict()
                except Exception as error:  # noqa: BLE001 - one depth mix failing is that row's result
                    rows.append({"model": name, "dtype": dtype, "kernels": mode, "error": _one_line(error)})
                    continue
                report.pop("tolerances")
                rows.append({"model": name, "dtype": dtype, "kernels": mode, **report})
            del converted
            _free()
    failed = [f"{r['model']} {r['dtype']} {r['kernels']}" for r in rows if not r.get("passed")]
    result = {"rows": rows, "not_reached": not_reached}
    if failed:
        raise StageFailure(f"not exact within the dtype's tolerance (or failed): {', '.join(failed)}", result)
    return result


def bench(kernels: str, compile_: bool = False, dtype: str | None = None) -> Callable[[Check, float], dict]:
    """`attnres bench` of each model (a child process each, killed at the time left) with one depth mix, in
    DTYPE (default: bench's, bfloat16 on a GPU and float32 on a CPU)."""

    def run(check: Check, limit: float) -> dict:
        started = time.monotonic()
        dtype_ = dtype or ("bfloat16" if check.cuda else "float32")
        plan = check.plan.bench
        runs, failures, not_reached = {}, [], []
        names = list(check.shapes)
        weights = {name: check.shapes[name]["hidden_size"] ** 0.5 for name in names}  # the 1B shape takes longer
        for index, name in enumerate(names):
            left = limit - (time.monotonic() - started)
            if left < 5:
                runs[name] = {"status": "not reached"}
                not_reached.append(name)
                continue
            out = check.out / "bench" / f"{name}-{kernels}{'-compile' if compile_ else ''}-{dtype_}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "attnres_convert",
                "bench",
                str(check.folders[name]),
                "--device",
                check.device,
                "--dtype",
                dtype_,
                "--kernels",
                kernels,
                "--batch",
                str(plan["batch"]),
                "--seq-len",
                str(plan["seq_len"]),
                "--decode-tokens",
                str(plan["decode_tokens"]),
                "--rounds",
                str(plan["rounds"]),
                "--json",
                str(out),
            ]
            if compile_:
                # Memory is measured without torch.compile (a fresh process per model): the eager rows have it.
                # Decoding recompiles as the cache grows: prefill and the training step say what compile gives.
                cmd += ["--compile", "--measure", "prefill,train"]
            share = left * weights[name] / sum(weights[n] for n in names[index:])  # the models left share the time left
            try:
                done = check.child(cmd, share)
            except subprocess.TimeoutExpired:
                runs[name] = {"status": "timed out", "after_s": round(share, 1)}
                failures.append(f"{name}: timed out after {share:.0f} s")
                continue
            if done.returncode != 0:
                runs[name] = {"status": "failed", "exit": done.returncode, "error": _tail(done.stderr)}
                failures.append(f"{name}: exit {done.returncode}")
                continue
            data = json.loads(out.read_text())
            runs[name] = {
                "status": "ok",
                "json": str(out.relative_to(check.out)),
                "settings": data["settings"],
                "rows": [_bench_row(row) for row in data["rows"]],
            }
        result = {"kernels": kernels, "compile": compile_, "dtype": dtype_, "runs": runs, "not_reached": not_reached}
        if failures:
            raise StageFailure("; ".join(failures), result)
        return result

    return run


def _bench_row(row: dict) -> dict:
    keep = ("name", "label", "unit", "original", "converted", "ratio", "ratio_median")
    return {k: row[k] for k in keep if k in row}


def cuda_tests(check: Check, limit: float) -> dict:
    """`pytest -m cuda` on the test files that carry the marker; pytest missing is recorded, not fatal."""
    if _version("pytest") is None:
        raise StageSkipped("pytest is not installed: the CUDA tests did not run (the other stages need no pytest)")
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.cuda" in p.read_text())
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *files]
    try:
        done = check.child(cmd, limit, env={"TRITON_INTERPRET": "0"})
    except subprocess.TimeoutExpired:
        raise StageFailure(f"pytest -m cuda did not finish in {limit:.0f} s", {"files": files}) from None
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", done.stdout)}
    result = {"files": files, "exit": done.returncode, "summary": _tail(done.stdout, 1), **counts}
    if done.returncode not in (0, 5) or counts.get("failed") or counts.get("error") or counts.get("errors"):
        raise StageFailure(f"pytest -m cuda: {result['summary']}", result)
    return result


def ab(check: Check, limit: float) -> dict:
    """`attnres ab ab-scratch-cpu --from-scratch` resized by the plan, on the SmolLM2-shape config, reading the
    checkout's Markdown as UTF-8 bytes (nothing to download), both arms on the device."""
    env = _pydantic_path(check)
    text = [str(p) for p in sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]]
    out = check.out / "ab"
    overrides = [
        f"model.source={check.folders['smollm2-135m']}",
        f"data.train.files={json.dumps(text)}",
        "data.eval.files=null",
        "data.eval.fraction=0.1",
        f"output.dir={check.work / 'ab-run'}",
        *check.plan.ab_overrides,
    ]
    if not check.cuda:
        overrides = [o for o in overrides if not o.startswith("train.mixed_precision")]
    cmd = [
        sys.executable,
        "-m",
        "attnres_convert",
        "ab",
        "ab-scratch-cpu",
        *overrides,
        "--from-scratch",
        "--output",
        str(out),
        "--workdir",
        str(check.work / "ab-arms"),
        "--overwrite",
    ]
    try:
        done = check.child(cmd, limit, env=env)
    except subprocess.TimeoutExpired:
        raise StageFailure(f"the A/B did not finish in {limit:.0f} s", {"command": cmd}) from None
    if done.returncode != 0:
        raise StageFailure(f"attnres ab exited {done.returncode}: {_tail(done.stderr)}", {"overrides": overrides})
    report = json.loads((out / "ab.json").read_text())
    keep = (
        "name",
        "converted",
        "eval",
        "eval_loss_final",
        "delta_final",
        "tokens",
        "tokens_per_s",
        "trainable_parameters",
    )
    arms = [{k: arm[k] for k in keep if k in arm} for arm in report["arms"]]
    return {
        "steps": report["steps"],
        "overrides": overrides,
        "arms": arms,
        "report": str((out / "ab.md").relative_to(check.out)),
        "pydantic": env.get("PYTHONPATH") and "from gpu-check-wheels" or "installed",
    }


def _pydantic_path(check: Check) -> dict:
    """{} where pydantic imports; else PYTHONPATH with the pydantic wheels of gpu-check-wheels/ unpacked (a
    wheel is a zip of the package: unpacking it is all a pure-Python one needs, and a compiled one whose tags
    match this Python). Missing wheels: a StageFailure naming the make target that downloads them."""
    if _version("pydantic") is not None:
        return {}
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = [w for w in sorted(WHEELS.glob("*.whl")) if "-cp" not in w.name or f"-{tag}-" in w.name]
    if not any(w.name.startswith("pydantic_core") for w in wheels):
        raise StageFailure(
            f"the A/B reads a recipe, which needs pydantic: not installed, and no pydantic wheels for {tag} in {WHEELS}. "
            "Run `make gpu-check-wheels` where the package registry is reachable and copy gpu-check-wheels/ with the checkout.",
            {},
        )
    target = check.work / "wheels"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    return {"PYTHONPATH": str(target)}


# --- running and reporting ------------------------------------------------------------------------------------


class StageSkipped(Exception):
    """A stage that cannot run here (a tool it needs is missing): recorded as skipped, with the reason."""


class StageFailure(Exception):
    """A stage that ran and found a problem: its message, and what it measured until then."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


# In order of priority. The budgets add up to more than the deadline: a stage that finishes early leaves its
# time to the later ones, and the deadline, not the sum, decides where the check stops (the rest: not reached).
STAGES = [
    Stage("environment", 10, environment),
    Stage("models", 60, models),
    Stage("exactness", 60, exactness),
    # fla-core's kernels against ours: which one CUDA training uses by default (docs/kernels.md) rests on it.
    Stage("depth-mix-kernels", 150, lambda check, limit: depth_mix_kernels(check, limit, WHEELS)),
    Stage("bench-eager", 180, bench("eager")),  # first-call compiling and autotuning (fla-core) included
    Stage("bench-triton", 150, bench("triton"), cuda_only="the Triton kernels run on CUDA tensors"),
    Stage("cuda-tests", 60, cuda_tests),
    Stage("ab", 60, ab),
    Stage(
        "bench-compile",
        100,
        bench("eager", compile_=True),
        cuda_only="torch.compile on a CPU builds C++ for minutes; the GPU path is what this measures",
    ),
    Stage("bench-eager-fp32", 60, bench("eager", dtype="float32"), cuda_only="the CPU bench already runs fp32"),
]
# --quick on a CPU: tiny shapes, but two loaded cores import torch slowly in every child process.
QUICK_BUDGETS = {
    "environment": 30,
    "models": 60,
    "exactness": 60,
    "bench-eager": 150,
    "cuda-tests": 90,
    "ab": 200,
    "depth-mix-kernels": 60,
}


def run_check(
    device: str = "cuda",
    quick: bool = False,
    out: Path = Path("gpu-check"),
    deadline_s: float | None = None,
    stages: list[str] | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """Every stage (or those named in STAGES) in order, each within its budget and the deadline; writes
    OUT/gpu-check.json and OUT/gpu-check.md and returns the report."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = (
        deadline_s
        if deadline_s is not None
        else (sum(QUICK_BUDGETS.values()) if quick and device == "cpu" else DEADLINE_S)
    )
    with tempfile.TemporaryDirectory(prefix="attnres-gpu-check-") as tmp:
        check = Check(device, quick, out, deadline, Path(tmp))
        results: list[StageResult] = []
        try:
            for stage in STAGES:
                if stages is not None and stage.name not in stages:
                    continue
                results.append(_run_stage(check, stage, say))
        finally:
            check.log.close()
    report = {
        "check": "attnres gpu-check",
        "command": " ".join([Path(sys.executable).name, "-m", "attnres_convert.analysis.gpu_check", *sys.argv[1:]]),
        "device": device,
        "quick": quick,
        "deadline_s": deadline,
        "seconds": round(time.monotonic() - check.started, 1),
        "environment": next((r.result for r in results if r.name == "environment"), {}),
        "stages": [asdict(r) for r in results],
    }
    (out / REPORT_JSON).write_text(json.dumps(report, indent=2, default=str))
    (out / REPORT_MD).write_text(markdown(report))
    return report


def _run_stage(check: Check, stage: Stage, say: Callable[[str], None]) -> StageResult:
    budget = QUICK_BUDGETS.get(stage.name, stage.budget_s) if check.quick and not check.cuda else stage.budget_s
    if stage.cuda_only and not check.cuda:
        say(f"- {stage.name}: skipped ({stage.cuda_only})")
        return StageResult(stage.name, "skipped", budget_s=budget, error=f"CUDA only: {stage.cuda_only}")
    needs = {
        "exactness": "models",
        "bench-eager": "models",
        "bench-triton": "models",
        "bench-compile": "models",
        "bench-eager-fp32": "models",
        "ab": "models",
    }.get(stage.name)
    if needs == "models" and not check.converted:
        say(f"- {stage.name}: skipped (no models)")
        return StageResult(stage.name, "skipped", budget_s=budget, error="the models stage built no models")
    limit = min(budget, check.left())
    if limit < min(5.0, budget):
        say(f"- {stage.name}: not reached ({check.left():.0f} s left before the deadline)")
        return StageResult(
            stage.name, "not reached", budget_s=budget, error=f"{max(0.0, check.left()):.0f} s left before the deadline"
        )
    say(f"- {stage.name} (budget {budget:.0f} s) ...")
    started = time.monotonic()
    try:
        with quiet_libraries(), warnings.catch_warnings():
            # The random-weight folders have no tokenizer, on purpose: convert's advice to save one is not for them.
            warnings.filterwarnings("ignore", message=".*has no tokenizer")
            outcome = stage.run(check, limit)
        result = StageResult(stage.name, "ok", result=outcome)
        if outcome.get("not_reached"):  # in-process work is not cut mid-run: what the budget left out is named
            result.status, result.error = "partial", f"budget spent before: {', '.join(outcome['not_reached'])}"
    except StageSkipped as reason:
        result = StageResult(stage.name, "skipped", error=str(reason))
    except StageFailure as failure:
        result = StageResult(stage.name, "failed", result=failure.result, error=str(failure))
    except Exception as error:  # noqa: BLE001 - one stage's error is recorded, the next stage runs
        check.log.write(traceback.format_exc())
        result = StageResult(stage.name, "failed", error=_one_line(error))
    finally:
        _free()
    result.seconds, result.budget_s = round(time.monotonic() - started, 1), budget
    say(f"  {result.status} in {result.seconds:.0f} s" + (f": {result.error}" if result.error else ""))
    return result


def _free() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def _one_line(error: BaseException) -> str:
    from ..errors import first_line

    return first_line(error, with_type=True)


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--quick", action="store_true", help="Tiny shapes and few steps: the plumbing, in a few minutes on a CPU."
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("GPU_CHECK_OUT") or "gpu-check"))
    parser.add_argument(
        "--deadline", type=float, default=None, help=f"Seconds for every stage together (default {DEADLINE_S})."
    )
    parser.add_argument("--stages", default=None, help="Comma-separated stage names to run (default: all).")
    parser.add_argument(
        "--results", type=Path, default=None, help="Also copy both reports into this folder (benchmarks/results)."
    )
    args = parser.parse_args(argv)
    names = [s.name for s in STAGES]
    chosen = None if args.stages is None else [s.strip() for s in args.stages.split(",") if s.strip()]
    if chosen is not None and (unknown := [s for s in chosen if s not in names]):
        parser.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(names)}")
    print(f"attnres gpu-check on {args.device}{' (quick)' if args.quick else ''}: reports in {args.out}/", flush=True)
    report = run_check(
        args.device, args.quick, args.out, args.deadline, chosen, say=lambda line: print(line, flush=True)
    )
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        name = results_name(report)
        shutil.copy(args.out / REPORT_JSON, args.results / f"{name}.json")
        shutil.copy(args.out / REPORT_MD, args.results / f"{name}.md")
        print(f"copied to {args.results / name}.json and .md")
    statuses = [s["status"] for s in report["stages"]]
    print(
        f"wrote {args.out / REPORT_JSON} and {args.out / REPORT_MD}: "
        + ", ".join(
            f"{statuses.count(s)} {s}"
            for s in ("ok", "partial", "failed", "skipped", "not reached")
            if statuses.count(s)
        )
    )
    return 1 if "failed" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
