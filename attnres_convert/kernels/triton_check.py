"""The first-use self-check of the Triton kernels: the first time a kernel variant (its compiled program, its flags
and its tensors' dtypes) runs on a device, it runs once on a small input beside its PyTorch reference
(triton_reference.py). A variant that fails to compile or launch, or differs beyond what docs/kernels.md
promises, runs the reference from then on, with one warning that names the kernel, the device and the difference.

The promise, per launch: the residual stream a kernel writes, and at zero queries the mix, bit for bit; any other
output within a rounding of its dtype at its scale (`TOLERANCE` times its largest magnitude, at least 1).
"""

from __future__ import annotations

import threading
import warnings

import torch

# The largest difference the check accepts, relative to an output's scale: float32 outputs (scores, weights,
# sums) within what summing in another order and the GPU's approximate exp and rsqrt give; a model-dtype output
# within one rounding of its dtype (8 and 11 significant bits).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
PROBE_TOKENS = 3

# Process-wide on purpose: a verdict is a property of a compiled program on a device, the same for every model.
_VERDICTS: dict = {}  # key -> True (the kernel runs) or False (the reference runs)
_LOCK = threading.Lock()


def trusted(key: tuple, kernel: str, device: torch.device, probe) -> bool:
    """Whether the variant `key` of `kernel` runs on the kernel, checking it the first time on `device`. probe():
    the difference between the kernel and its reference on a small input (a sentence), or None if within the
    promise."""
    verdict = _VERDICTS.get(key)
    if verdict is None:
        with _LOCK:
            if key not in _VERDICTS:
                _VERDICTS[key] = _first_use(key, kernel, device, probe)
            verdict = _VERDICTS[key]
    return verdict


def _first_use(key: tuple, kernel: str, device: torch.device, probe) -> bool:
    try:
        with torch.no_grad():
            difference = probe()
    except Exception as error:  # a compile error, a program over the device's resources, a failed launch: any
        lines = str(error).strip().splitlines() or [""]
        difference = f"it failed to compile or run ({type(error).__name__}: {lines[0]})"
    if difference is None:
        return True
    warnings.warn(
        f"attnres: the Triton kernel {kernel} ({describe(key)}) on {device_name(device)} does not match its "
        f"PyTorch reference: {difference}. This variant runs the reference (eager PyTorch) from now on; set "
        f"ATTNRES_KERNEL=eager to skip the kernels.",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def describe(key: tuple) -> str:
    """A variant key (kernel, block sizes or why there are none, flags set, dtypes, device) in words."""
    _, config, flags, dtypes, _ = key
    blocks = ", ".join(f"{name}={value}" for name, value in config) if isinstance(config, tuple) else config
    names = sorted({str(dtype).removeprefix("torch.") for dtype in dtypes if dtype is not None})
    return f"{blocks}; flags: {', '.join(flags) or 'none'}; dtypes: {', '.join(names)}"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} (Triton's interpreter)"


def compare(got: dict, want: dict, exact: tuple = ()) -> str | None:
    """The first output of `got` that differs from `want` beyond the promise (bit for bit for those in `exact`),
    as a sentence; None if none does."""
    for name, reference in want.items():
        if reference is None:
            continue
        result = got[name]
        if name in exact:
            if not torch.equal(result, reference):
                changed = (result != reference).sum().item()
                return f"{name} is not bit for bit ({changed} of {reference.numel()} values differ)"
            continue
        scale = max(1.0, reference.float().abs().max().item())
        error = (result.float() - reference.float()).abs().max().item()
        allowed = TOLERANCE.get(reference.dtype, 1e-4) * scale
        if not error <= allowed:  # also catches NaN
            return f"{name} differs by {error:.3g} (allowed {allowed:.3g})"
    return None


def run_both(launch, reference, kwargs: dict, returns: tuple, written: tuple) -> list[dict]:
    """[kernel's outputs, reference's outputs]: each side on its own copy of the inputs; the outputs are the named
    return values and the named arguments written in place."""
    sides = []
    for run in (launch, reference):
        copied = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
        values = run(**copied)
        outputs = dict(zip(returns, values if isinstance(values, tuple) else (values,)))
        outputs.update({name: copied[name] for name in written if copied.get(name) is not None})
        sides.append(outputs)
    return sides
