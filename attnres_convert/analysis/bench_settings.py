"""`attnres bench`'s settings and the checks that need no torch: a wrong number, measure, device or kernel
name is answered before torch is imported (the command imports analysis/bench.py, which needs torch, after)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import AttnResError
from ..io.paths import write_problem

MEASURES = ("prefill", "decode", "train", "memory")
KERNELS = ("eager", "triton", "cpu")
DEVICES = ("cpu", "cuda")


class BenchError(AttnResError):
    """A bench setting this machine cannot run (device, dtype, kernels): the message names it."""


@dataclass
class BenchSettings:
    """What `attnres bench` measures and how. dtype None: float32 on CPU, bfloat16 on CUDA. kernels None:
    the depth mix runs where ATTNRES_KERNEL sends it (auto: Triton on CUDA, eager on CPU)."""

    device: str = "cpu"
    dtype: str | None = None
    kernels: str | None = None
    compile: bool = False
    batch: int = 1
    seq_len: int = 512
    decode_tokens: int = 64
    prompt_tokens: int = 32
    rounds: int = 5
    threads: int | None = None
    measure: tuple[str, ...] = MEASURES
    block_size: int | None = None
    full: bool = False

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device == "cuda" else "float32")


def output_problem(path: Path) -> str | None:
    """Why a results file cannot be written at PATH, or None (checked before a run, not after it)."""
    return f"{path} is a folder" if path.is_dir() else write_problem(path.parent)


def check_values(settings: BenchSettings) -> None:
    """The settings' own values, checked without torch: counts of at least 1, known measures, device and kernels."""
    for name in ("batch", "seq_len", "decode_tokens", "prompt_tokens", "rounds"):
        if getattr(settings, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} {getattr(settings, name)}: must be at least 1.")
    if settings.threads is not None and settings.threads < 1:
        raise BenchError(f"--threads {settings.threads}: must be at least 1.")
    unknown = [m for m in settings.measure if m not in MEASURES]
    if unknown or not settings.measure:
        raise BenchError(f"--measure {','.join(settings.measure)}: choose from {', '.join(MEASURES)}.")
    if settings.device not in DEVICES:
        raise BenchError(f"--device {settings.device!r} is not a device bench runs on: use cpu or cuda.")
    if settings.resolved_dtype not in ("float32", "bfloat16", "float16"):
        raise BenchError(f"--dtype {settings.resolved_dtype!r}: use float32, bfloat16 or float16.")
    if settings.kernels is not None and settings.kernels not in KERNELS:
        raise BenchError(f"--kernels {settings.kernels!r}: use eager, triton or cpu.")
    if settings.compile and settings.kernels in ("triton", "cpu"):
        raise BenchError(
            f"--kernels {settings.kernels} does not run under --compile: torch.compile fuses the eager depth mix "
            f"itself. Use --kernels eager with --compile, or drop --compile."
        )
    if settings.kernels == "triton" and settings.device != "cuda":
        raise BenchError(
            "--kernels triton runs the Triton kernels on CUDA tensors: use --device cuda, or --kernels eager or cpu on CPU."
        )
    if settings.kernels == "cpu" and (settings.device != "cpu" or settings.resolved_dtype != "float32"):
        raise BenchError(
            f"--kernels cpu runs the C++ kernels on float32 CPU tensors (asked: {settings.resolved_dtype} on "
            f"{settings.device}): use --device cpu --dtype float32, or --kernels eager."
        )


def runs_total(settings: BenchSettings) -> int:
    """How many timed and warm-up runs `run_bench` makes (both models), for a progress bar's total."""
    timed = [m for m in settings.measure if m in ("prefill", "decode", "train")]
    return len(timed) * 2 * (settings.rounds + 1)


# --- how long it takes ----------------------------------------------------------------------------

# Seconds one run takes on the embedded SmolLM2-135M-Instruct (float32, CPU, eager depth mix, the mean of the
# original and the converted model) at the default sizes (1 x 512 tokens, 64 decode tokens), measured by
# `attnres bench --threads 1 --json benchmarks/results/bench-smollm2-cpu.json` on an idle 2-core machine
# (AMD EPYC, load average 1.0: the one thread's own). A round runs each measure once per model.
PACE_S = {"prefill": 1.60, "decode": 2.71, "train": 5.16}
PACE_THREADS = 1
# The work around the rounds, not measured as a whole: saving the GGUF as a folder and converting it (`attnres
# convert --no-verify` takes 4.0 s, docs/performance.md), loading both models, and the memory measure's two
# fresh processes, each importing torch and transformers, loading a model and taking one training step.
SETUP_S = 30.0
MEMORY_S = 30.0
# The same `attnres bench --rounds 1` on a 2-core machine running other jobs (load average 3 to 7, 2 threads):
# a round took 8.4 min, the whole run 21 min. Torch's threads wait on each other when the cores are taken.
BUSY_ROUND_MIN, BUSY_TOTAL_MIN = 8.4, 21
QUICK = {"rounds": 1, "seq_len": 128, "decode_tokens": 16}
QUICK_SETTINGS_TEXT = f"{QUICK['rounds']} round, {QUICK['seq_len']} tokens, {QUICK['decode_tokens']} decode tokens"


def _round_seconds(settings: BenchSettings, threads: int) -> float:
    """Both models once through each timed measure, at PACE_S scaled by the tokens and (compute-bound prefill
    and training only) by the threads; decoding one token at a time gains little from threads."""
    tokens = settings.batch * settings.seq_len / 512
    speedup = threads / PACE_THREADS
    per_run = {
        "prefill": PACE_S["prefill"] * tokens / speedup,
        "decode": PACE_S["decode"] * settings.decode_tokens / 64,
        "train": PACE_S["train"] * tokens / speedup,
    }
    return 2 * sum(per_run[m] for m in settings.measure if m in per_run)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


ROUND_COST = (
    f"On the embedded SmolLM2-135M at the defaults a round took {2 * sum(PACE_S.values()):.0f} s with 1 thread on an "
    f"idle 2-core machine, {BUSY_ROUND_MIN} min with 2 threads on a 2-core machine running other jobs. It scales "
    "with the tokens and the model's size."
)


def quick_settings(settings: BenchSettings) -> BenchSettings:
    """--quick: one round of short sequences, without the memory measure, wherever the user left the defaults."""
    from dataclasses import replace

    defaults = BenchSettings()
    changes = {name: value for name, value in QUICK.items() if getattr(settings, name) == getattr(defaults, name)}
    if settings.measure == defaults.measure:
        changes["measure"] = tuple(m for m in MEASURES if m != "memory")
    return replace(settings, **changes)


def estimate(settings: BenchSettings, embedded: bool, cores: int, load: float | None = None) -> str:
    """What the run will take, said before it starts: for the embedded model, from PACE_S scaled by the sizes
    and threads; for another model, the embedded model's round as a yardstick. LOAD (the load average) above
    the cores: the machine is busy, and the measured busy run says how much longer it can take."""
    if settings.device != "cpu":
        return "On a GPU the rounds take seconds; reading and converting the model take the most."
    threads = max(1, min(settings.threads or cores, cores))
    round_s = _round_seconds(settings, threads)
    rounds = f"{settings.rounds + 1} rounds (one a warm-up) of about {_duration(round_s)}"
    if embedded:
        total = SETUP_S + (settings.rounds + 1) * round_s + (MEMORY_S if "memory" in settings.measure else 0.0)
        text = f"Estimate on an idle machine: about {_duration(total)} with {threads} thread(s), {rounds}."
    else:
        text = (
            f"{settings.rounds + 1} rounds (one a warm-up): one of the embedded SmolLM2-135M would take about "
            f"{_duration(round_s)} with {threads} thread(s) on an idle machine; a bigger model's take longer."
        )
    if load is not None and load > cores:
        text += (
            f" This machine is busy (load average {load:.1f} on {cores} cores): it can take many times longer "
            f"({BUSY_TOTAL_MIN} min for --rounds 1 on a 2-core machine at load 3 to 7)."
        )
    if settings.rounds > 1 or "memory" in settings.measure:
        text += " --quick: a rough look sooner."
    return text
