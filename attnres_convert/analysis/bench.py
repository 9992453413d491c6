"""`attnres bench` as a library call: a model converted and measured against its original, side by side.

Both models are loaded as a user loads them: the original by `from_pretrained` of its folder (a GGUF file or
hub id is saved to a temporary folder first), the converted one by `from_pretrained(...,
trust_remote_code=True)` of the folder `attnres convert` wrote, so the code that runs is the code that folder
ships. In one process, on the same inputs, interleaved round by round (analysis/timing.py), it measures:

* prefill: one forward of BATCH x SEQ_LEN tokens without the cache;
* decode: `generate` of DECODE_TOKENS greedy tokens with the KV cache after a PROMPT_TOKENS prompt;
* train step: forward + backward of BATCH x SEQ_LEN tokens with labels;
* memory: the peak a training step adds, measured in a fresh process per model (analysis/step_memory.py).

Each row keeps both medians and their ratio, converted / original (> 1: the converted model is slower or
bigger), plus the median of the per-round ratios. Nothing is a pass/fail check on seconds.
"""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..architectures import UnsupportedModelError, vocab_size_of
from ..conversion.surgery import BlockSizeError
from ..errors import AttnResError, first_line
from ..io.sources import DTYPES, ModelSource, load_model, load_tokenizer, resolve_source
from . import step_memory
from .bench_settings import DEVICES, KERNELS, MEASURES, BenchError, BenchSettings, check_values, runs_total  # noqa: F401
from .timing import compared, device_sync, interleaved, kernel_env, ratio_noise, replace_weights, resident


@dataclass
class BenchResult:
    model: str
    settings: dict
    machine: dict
    conversion: dict
    rows: list[dict]
    command: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def row(self, name: str) -> dict:
        return next(r for r in self.rows if r["name"] == name)


def check_settings(settings: BenchSettings) -> None:
    """Refuse, before anything is loaded, what this machine cannot run; the message names the setting."""
    check_values(settings)
    if settings.device == "cuda" and not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise BenchError(
            f"--device cuda: {why} (torch {torch.__version__}). Run on a machine with a GPU, or use --device cpu."
        )
    dtype = settings.resolved_dtype
    _check_dtype_runs(settings.device, dtype)
    if settings.kernels == "triton":
        _check_triton(settings.device)
    if settings.kernels == "cpu":
        _check_cpu_kernels(settings.device, dtype)


def _check_dtype_runs(device: str, dtype: str) -> None:
    """A matmul and its backward in DTYPE on DEVICE: what a forward and a training step need."""
    if device == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise BenchError(
            f"--dtype bfloat16: {torch.cuda.get_device_name()} has no bfloat16. Use --dtype float16 or float32."
        )
    try:
        a = torch.ones(4, 4, dtype=DTYPES[dtype], device=device, requires_grad=True)
        (a @ a).softmax(-1).sum().backward()
    except (RuntimeError, TypeError) as error:
        raise BenchError(
            f"--dtype {dtype} does not run on {device} here ({first_line(error)}). Use --dtype float32."
        ) from error


def _check_triton(device: str) -> None:
    if device != "cuda":
        raise BenchError(
            "--kernels triton runs the Triton kernels on CUDA tensors: use --device cuda, or --kernels eager or cpu on CPU."
        )
    try:
        import triton  # noqa: F401
    except ImportError as error:
        raise BenchError(
            f"--kernels triton: Triton cannot be imported ({first_line(error)}). pip install triton, or use --kernels eager."
        ) from error


def _check_cpu_kernels(device: str, dtype: str) -> None:
    if device != "cpu" or dtype != "float32":
        raise BenchError(
            f"--kernels cpu runs the C++ kernels on float32 CPU tensors (asked: {dtype} on {device}): use "
            f"--device cpu --dtype float32, or --kernels eager."
        )
    from ..kernels import cpu as depth_kernels_cpu

    try:
        depth_kernels_cpu.build()
    except RuntimeError as error:
        raise BenchError(f"--kernels cpu: {error}") from error


def machine_info(device: str) -> dict:
    """What the numbers were measured on."""
    import transformers

    info = {
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def saving_stage(source: ModelSource) -> str:
    """The stage line of saving SOURCE as a folder: short enough for 80 columns piped (Rich crops a stage line
    there), since the full name of the embedded model alone is 66 characters."""
    from ..io.console import shorten_middle

    if source.kind == "default":
        return "Saving the embedded GGUF as a model folder"
    return f"Saving {shorten_middle(source.short_name, 28)} as a model folder"


def _original_folder(source: ModelSource, work: Path) -> Path:
    """SOURCE as a folder that from_pretrained reads: itself, or saved once (a GGUF file dequantised)."""
    if source.kind == "folder":
        return Path(source.location)
    folder = work / "original"
    model = load_model(source, "auto")
    model.save_pretrained(folder)
    tokenizer = load_tokenizer(source)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def _naming(source: ModelSource, folder: Path) -> Iterator[None]:
    """Errors about FOLDER, the temporary copy of SOURCE, name what the user gave instead."""
    try:
        yield
    except (AttnResError, UnsupportedModelError, BlockSizeError) as error:
        if source.kind == "folder":
            raise
        raise type(error)(str(error).replace(str(folder), source.name)) from error


def load_for_bench(folder: Path, settings: BenchSettings, remote_code: bool):
    """FOLDER's model as `AutoModelForCausalLM.from_pretrained` gives it to a user. With REMOTE_CODE, the class
    is the one the folder ships (what trust_remote_code=True loads in a fresh process), even where this process
    has registered the package's own AttnRes classes, which transformers would otherwise prefer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..transformers_compat import get_class_from_dynamic_module

    dtype = DTYPES[settings.resolved_dtype]
    if remote_code:
        reference = AutoConfig.from_pretrained(folder, trust_remote_code=True).auto_map["AutoModelForCausalLM"]
        model = get_class_from_dynamic_module(reference, str(folder)).from_pretrained(folder, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model = model.to(settings.device)
    if settings.device == "cpu":
        resident(model)
    return model.eval()


def run_bench(
    model: str | os.PathLike | None,
    settings: BenchSettings | None = None,
    *,
    stage: Callable[
        [str], contextlib.AbstractContextManager
    ] = contextlib.nullcontext,  # no display: a stage is a no-op block
    on_run: Callable[[str], None] = lambda name: None,
    command: str | None = None,
) -> BenchResult:
    """Convert MODEL (hub id, folder, .gguf; None: the embedded SmolLM2) into a temporary folder and measure
    the converted model against the original. ON_RUN(name) is told of every run (`runs_total` counts them),
    STAGE(name) wraps each stage. Raises BenchError / SourceError / UnsupportedModelError before measuring."""
    from ..conversion.convert import convert

    settings = settings or BenchSettings()
    check_settings(settings)
    source = resolve_source(None if model is None else os.fspath(model))
    threads_before = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="attnres-bench-") as tmp:
            work = Path(tmp)
            if source.kind != "folder":
                with stage(saving_stage(source)):
                    original_folder = _original_folder(source, work)
            else:
                original_folder = Path(source.location)
            with stage("Converting"), warnings.catch_warnings(), _naming(source, original_folder):
                # The temporary converted folder needs no tokenizer: convert's advice about one is not for this.
                warnings.filterwarnings("ignore", message=".*has no tokenizer")
                converted = convert(
                    str(original_folder),
                    work / "converted",
                    verify=False,
                    block_size=settings.block_size,
                    full=settings.full,
                )
            with stage("Loading both models"):
                original = load_for_bench(original_folder, settings, remote_code=False)
                attnres = load_for_bench(work / "converted", settings, remote_code=True)
            machine = machine_info(settings.device)
            rows, notes = _measure(original, attnres, settings, stage, on_run)
            if "memory" in settings.measure:
                with stage("peak memory of a training step (a process per model)"):
                    memory = _memory_row(original_folder, work / "converted", settings)
                if memory is None:
                    notes.append(
                        "peak memory: this system has no /proc/self/clear_refs to reset the peak resident size"
                    )
                else:
                    rows.append(memory)
    finally:
        torch.set_num_threads(threads_before)
    if hasattr(os, "getloadavg"):
        machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    for row in rows:  # a ratio the timings' spread or the machine's load makes meaningless is marked, with why
        if (why := ratio_noise(row, machine)) is not None:
            row["noise"] = why
    summary = converted.summary
    settings_dict = asdict(settings) | {
        "dtype": settings.resolved_dtype,
        "kernels": settings.kernels or os.environ.get("ATTNRES_KERNEL", "auto"),
    }
    settings_dict["measure"] = list(settings.measure)
    conversion = {
        "block_size": summary.block_size,
        "num_blocks": summary.num_blocks,
        "num_sublayers": summary.num_sublayers,
        "params_added": summary.params_added,
        "model_type": summary.model_type,
        "converted_class": f"{type(attnres).__module__}.{type(attnres).__name__}",
    }
    return BenchResult(source.name, settings_dict, machine, conversion, rows, command, notes)


def _measure(original, converted, settings: BenchSettings, stage, on_run) -> tuple[list[dict], list[str]]:
    device, notes, rows = settings.device, [], []
    vocab = vocab_size_of(original)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (settings.batch, settings.seq_len), generator=generator).to(device)
    prompt = tokens[:1, : min(settings.prompt_tokens, settings.seq_len)]
    models = {"original": original, "converted": converted}
    if settings.compile:
        for model in models.values():
            model.forward = torch.compile(model.forward, dynamic=True)
    kernels = settings.kernels
    sync = device_sync(device)

    # On CPU each round draws new memory for the weights (see replace_weights); a GPU's memory is not mapped that way.
    on_cpu = torch.device(device).type == "cpu"
    before_round = (lambda order: replace_weights(models, order)) if on_cpu else (lambda order: None)

    def timed(label: str, make: Callable) -> dict:
        runs = {name: make(model) for name, model in models.items()}
        with stage(label), kernel_env(kernels):
            return compared(
                **interleaved(runs, settings.rounds, sync=sync, after_run=on_run, before_round=before_round)
            )

    if "prefill" in settings.measure:

        def prefill(model):
            def run():
                with torch.no_grad():
                    model(tokens, use_cache=False)

            return run

        rows.append(
            {
                "name": "prefill",
                "label": f"prefill {settings.batch} x {settings.seq_len} tokens",
                "unit": "s",
                **timed("prefill", prefill),
            }
        )
    if "decode" in settings.measure:
        new = settings.decode_tokens
        pad = original.generation_config.pad_token_id
        pad = pad if pad is not None else (original.config.get_text_config().eos_token_id or 0)
        pad = pad[0] if isinstance(pad, list) else pad

        def decode(model):
            kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
            return lambda: model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)

        row = {"name": "decode", "label": f"decode {new} tokens (KV cache)", "unit": "s", **timed("decode", decode)}
        row["original_tokens_per_s"] = new / row["original"]
        row["converted_tokens_per_s"] = new / row["converted"]
        rows.append(row)
    if "train" in settings.measure:

        def step(model):
            def run():
                model.zero_grad(set_to_none=True)
                model(tokens, labels=tokens).loss.backward()

            return run

        for model in models.values():
            model.train()
        try:
            rows.append(
                {
                    "name": "train_step",
                    "label": f"train step {settings.batch} x {settings.seq_len} (fwd + bwd)",
                    "unit": "s",
                    **timed("train step", step),
                }
            )
        finally:
            for model in models.values():
                model.zero_grad(set_to_none=True)
                model.eval()
    return rows, notes


def _memory_row(original_folder: Path, converted_folder: Path, settings: BenchSettings) -> dict | None:
    if settings.device == "cpu" and not step_memory.cpu_peak_supported():
        return None
    common = dict(
        device=settings.device,
        dtype=settings.resolved_dtype,
        batch=settings.batch,
        seq_len=settings.seq_len,
        threads=settings.threads,
    )
    original = step_memory.measure_in_child(original_folder, kernels=None, remote_code=False, **common)
    converted = step_memory.measure_in_child(converted_folder, kernels=settings.kernels, remote_code=True, **common)
    mib = 2**20
    return {
        "name": "train_step_peak_memory",
        "label": f"train step peak memory {settings.batch} x {settings.seq_len}",
        "unit": "MiB",
        "original": original / mib,
        "converted": converted / mib,
        "ratio": converted / original,
    }
