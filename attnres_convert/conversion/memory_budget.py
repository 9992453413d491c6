"""How much memory a verification may use, and how it stays inside it.

A model that fits in the budget is loaded whole. A larger one is loaded as Accelerate's big-model inference
does (`device_map="auto"` with a CPU limit): the layers that fit stay in memory, the rest stay in their
safetensors files and are read layer by layer during each forward. The logits are the same either way;
only the time changes, so a streamed verification runs fewer tokens.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import psutil

from ..errors import AttnResError
from .options import parse_size

DEFAULT_FRACTION = 0.8  # of the memory available now, when no budget is given
OVERHEAD = 256 * 2**20  # activations of a short forward, the tokenizer, Python objects
STREAMED_TOKENS = 64  # each forward of a streamed model reads every offloaded layer from disk
STREAMED_NEW_TOKENS = 8


def available_memory() -> int:
    return psutil.virtual_memory().available


def current_rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """The process's peak resident memory, in bytes: since the last `reset_peak_rss` where Linux allows it
    (VmHWM), else since the start (ru_maxrss, what `/usr/bin/time -v` reports)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Start a new peak measurement from the current resident memory (Linux: clear_refs 5). False where the
    system cannot, and then peak_rss still counts from the start of the process."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def human(size: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


@dataclass(frozen=True)
class VerifyBudget:
    """The memory a verification may use and how it loads each model within it."""

    budget: int
    chosen: bool  # chosen from the free memory (no --max-memory given)
    weights_in_memory: int | None  # None: the whole model fits; else the CPU limit for resident weights
    tokens: int
    new_tokens: int

    @property
    def streamed(self) -> bool:
        return self.weights_in_memory is not None

    def describe(self) -> str:
        origin = "80% of the free memory" if self.chosen else "--max-memory"
        how = (
            f"layers beyond {human(self.weights_in_memory)} streamed from the files, {self.tokens} tokens"
            if self.streamed
            else "whole model in memory"
        )
        return f"memory budget {human(self.budget)} ({origin}): {how}"

    def load_kwargs(self, offload_folder: str) -> dict:
        """from_pretrained arguments that keep the loaded model inside the budget."""
        if not self.streamed:
            return {}
        return {"device_map": "auto", "max_memory": {"cpu": self.weights_in_memory}, "offload_folder": offload_folder}


def plan_verification(
    model_bytes: int, largest_layer_bytes: int, max_memory: int | str | None, tokens: int, new_tokens: int
) -> VerifyBudget:
    """Whether a model of MODEL_BYTES verifies in memory or streamed, within MAX_MEMORY (None: a budget from
    the free memory). The budget covers the whole process: what it holds now, one model's resident weights,
    the layer being streamed in (twice: read and in use) and the activations."""
    chosen = max_memory is None
    budget = int(available_memory() * DEFAULT_FRACTION) if chosen else parse_size(max_memory, "--max-memory")
    spare = budget - current_rss() - OVERHEAD
    if model_bytes <= spare:
        return VerifyBudget(budget, chosen, None, tokens, new_tokens)
    resident = spare - 2 * largest_layer_bytes
    if resident <= 0:
        needed = current_rss() + OVERHEAD + 2 * largest_layer_bytes + 64 * 2**20
        raise AttnResError(
            f"a verification memory budget of {human(budget)} is too small for this model: this process already "
            f"holds {human(current_rss())} and one decoder layer is {human(largest_layer_bytes)}. Give "
            f"--max-memory {human(needed).replace(' ', '')} or more, or skip the check with --no-verify."
        )
    return VerifyBudget(budget, chosen, resident, min(tokens, STREAMED_TOKENS), min(new_tokens, STREAMED_NEW_TOKENS))


def verify_saved(
    source, folder, budget: VerifyBudget, dtype: str, tokenizer, text: str, trust_remote_code: bool = False
):
    """Check the converted FOLDER against the original SOURCE, one model in memory at a time, each loaded
    within BUDGET (streamed from its files when it does not fit). Returns a VerificationReport."""
    import gc
    import shutil
    import tempfile
    from pathlib import Path

    from ..architectures import vocab_size_of
    from ..io.sources import DTYPES, load_model
    from ..modeling.modeling_attnres import AttnResForCausalLM
    from .verify import capture_reference, compare, fit_to_context, sample_input_ids

    offload = Path(tempfile.mkdtemp(prefix=".attnres-offload-", dir=Path(folder).parent))
    try:
        if budget.streamed and getattr(source, "gguf_file", None):
            original = _dequantised_original(folder, dtype, budget.load_kwargs(str(offload / "original")))
        else:
            original = load_model(source, dtype, trust_remote_code, **budget.load_kwargs(str(offload / "original")))
        tokens, new_tokens = fit_to_context(original.config, budget.tokens, budget.new_tokens)
        ids = sample_input_ids(tokenizer, text, tokens, vocab_size_of(original))
        reference = capture_reference(original, ids, new_tokens)
        del original
        gc.collect()
        converted = AttnResForCausalLM.from_pretrained(
            folder, dtype=DTYPES[dtype], **budget.load_kwargs(str(offload / "converted"))
        ).eval()
        report = compare(reference, converted)
        del converted
        gc.collect()
        return report
    finally:
        shutil.rmtree(offload, ignore_errors=True)


def _dequantised_original(folder, dtype: str, load_kwargs: dict):
    """The original model of a streamed GGUF conversion, loaded within a budget it does not fit in whole.

    transformers loads a GGUF only whole (it cannot leave a GGUF model's layers on disk). The converted folder
    holds the same base tensors, dequantised by transformers' own GGUF name map and tensor processors under the
    base model's names, in safetensors shards that Accelerate can read layer by layer; so the base model's own
    class is loaded from them, with the base config. Its forward is the original's; the AttnRes tensors are
    left out."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from ..io.sources import DTYPES
    from ..modeling.configuration_attnres import AttnResConfig

    base_config = AttnResConfig.from_pretrained(folder).text_config
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report would list every AttnRes tensor as unexpected
    try:
        return AutoModelForCausalLM.from_pretrained(
            folder, config=base_config, dtype=DTYPES[dtype], **load_kwargs
        ).eval()
    finally:
        logging.set_verbosity(verbosity)
