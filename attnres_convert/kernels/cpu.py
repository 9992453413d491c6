"""C++ kernels for the depth mix on CPU, run by default for float32 inference once built on a machine (`prebuilt`),
compiled on first use with ATTNRES_KERNEL=cpu: their build, their Python wrappers and the check that lets them fuse a
sublayer's norm. The math is modeling_attnres.py's; the buffers they serve
are cpu_buffers.py's.

On CPU the eager reader is a chain of small operations, and both forwards pay for it in their own way:

* a decoding step pays per operation (5-7 us each inside the model): a reader's norm, scores, softmax and
  count-scaled mix are six of them. `step_mix` is one call.
* a prefill is bound by memory traffic: the eager mix is a chain of multiply-adds over whole sources, each
  reading and writing the running sum again. `buffer_mix` reads each source once per token, merges the
  reader's score table (phase 1) with the partial sum's score, and writes the mix once. A block's close is
  `close_source`: the pending residual adds and the new source's 1 / rms in one pass.

Both readers also make the previous output's residual adds, and can return the sublayer's RMSNorm of the mix
instead of the mix (`fused_norm`): the original model runs that norm as five operations over the whole
tensor, which the kernels fold into the pass that wrote the row, summing its squares in torch's own order so
the result keeps the module's bits.

Both compute h = H + sum_i (n alpha_i - 1) k_i with n alpha_i - 1 = (n e_i - sum e) / sum e, exactly 0 when
all scores are equal: at zero queries h is the stream H bit for bit, as on the eager path. Inference only
(no backward): forwards with autograd run the eager path. float32 only: the buffers the eager path keeps
for a float32 model are what these read.

The source, `depth_kernels_cpu.cpp`, is compiled by torch.utils.cpp_extension on the first call in a process
that selected it, once per machine (cached under TORCH_EXTENSIONS_DIR, about 25 s on 2 cores); it needs a C++
compiler, ninja and the Python headers. It ships in the attnres package (never in a converted folder): a model
loaded from a folder uses it where attnres is installed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_NAME = "depth_kernels_cpu.cpp"

# Process-wide on purpose: a compiled extension is loaded into the process once, whatever model asks for it, and
# the lock keeps two threads from compiling (or loading) it at the same time.
_BUILT: list = []  # the compiled module, or the build's exception, once per process
_LOCK = threading.Lock()

# The vector instructions of torch's own CPU capability (the one its kernels run with here), so a build cached
# in a folder shared between machines runs on each machine whose torch picks the same capability.
# -mtune=native only orders instructions. -fopenmp: the token loop runs on ATen's thread pool (the build links
# to the OpenMP runtime torch ships and has already loaded).
_VECTOR_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx512dq", "-mavx512bw", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def _flags(openmp: bool = True) -> list[str]:
    vector = _VECTOR_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    # -ffp-contract=off: a fused norm rounds each product and sum as torch's kernels do (no FMA contraction).
    return ["-O3", "-ffp-contract=off", *(["-fopenmp"] if openmp else []), *vector, "-mtune=native"]


# How long a process waits for another one building the same kernels (ATTNRES_BUILD_TIMEOUT, seconds): a build
# takes about 25 s on 2 cores, a loaded machine several times that.
BUILD_TIMEOUT_ENV = "ATTNRES_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT = 600.0
LOCK_NAME = "attnres-build.lock"


def _build_timeout() -> float:
    text = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    try:
        return float(text) if text else DEFAULT_BUILD_TIMEOUT
    except ValueError:
        raise RuntimeError(f"{BUILD_TIMEOUT_ENV}={text!r} is not a number of seconds") from None


def source_text() -> str:
    """The C++ source, shipped in this package beside this file."""
    return Path(__file__).with_name(SOURCE_NAME).read_text()


def build():
    """The compiled kernels (built on the first call in this process, from torch's extension cache after the
    first build on this machine). `config`: the model's, to find the source where it is not next to this file
    (see `source_text`). Raises RuntimeError saying what is missing where the build fails."""
    with _LOCK:
        if not _BUILT:
            built = _build(source_text())
            if isinstance(built, BuildLockTimeout):
                raise built  # another process's build: the next call may find it done, so it is not kept
            _BUILT.append(built)
    if isinstance(_BUILT[0], Exception):
        raise _BUILT[0]
    return _BUILT[0]


def _build(source: str):
    """The compiled module, or the RuntimeError that says what is missing. With a compiler that has no OpenMP
    (Apple's clang), the kernels are built without it, single-threaded, and a warning says what to install."""
    try:
        return _compile(source, openmp=True)
    except Exception as error:  # noqa: BLE001 - compiler missing, headers missing, ...: all mean the same to a user
        if not _refuses_openmp(error):
            return _build_error(error)
    compiler = os.environ.get("CXX", "c++")
    warnings.warn(
        f"AttnRes: the C++ compiler ({compiler}) does not take -fopenmp, so the C++ depth-mix kernels are built "
        f"without OpenMP and run on one thread. For threaded kernels install OpenMP and use a compiler that "
        f"supports it (macOS: brew install libomp llvm, then CXX=$(brew --prefix llvm)/bin/clang++), or unset "
        f"ATTNRES_KERNEL to run the eager path.",
        RuntimeWarning,
        stacklevel=3,
    )
    try:
        return _compile(source, openmp=False)
    except Exception as error:  # noqa: BLE001 - as above
        return _build_error(error)


def _refuses_openmp(error: Exception) -> bool:
    """Whether a failed build failed on OpenMP: the flag, its header or its runtime library."""
    text = str(error).lower()
    return any(word in text for word in ("fopenmp", "omp.h", "openmp", "-lgomp", "-lomp"))


def _build_error(error: Exception) -> RuntimeError:
    if isinstance(error, BuildLockTimeout):
        return error
    return RuntimeError(
        f"ATTNRES_KERNEL=cpu: building the C++ depth-mix kernels failed ({type(error).__name__}: "
        f"{str(error).strip()[-500:]}). They need a C++ compiler (g++ or clang++), ninja on the PATH and the "
        f"Python headers (python3-dev); install them, or unset ATTNRES_KERNEL to run the eager path."
    )


def extension_name(source: str, openmp: bool) -> str:
    """The name of the kernels' build in torch's extension cache: new for every source, flags and torch install
    (a build is made against that torch's headers, and two environments sharing one cache would otherwise rebuild
    it in turn)."""
    flags = _flags(openmp)
    digest = hashlib.sha1("\0".join([source, torch.__version__, torch.__file__, *flags]).encode()).hexdigest()[:12]
    return f"attnres_depth_cpu_{digest}"


def prebuilt():
    """The compiled kernels where this machine has built them already (`attnres kernels build`, which `make install`
    runs, or an earlier ATTNRES_KERNEL=cpu run), else None: the default path (ATTNRES_KERNEL=auto) compiles
    nothing. Asked once per process; a build that does not load is None here (auto falls back to the eager path)
    and the error is ATTNRES_KERNEL=cpu's to report (which compiles it again)."""
    if not _PREBUILT:  # asked at every forward: the lock only until the first answer
        with _LOCK:
            if not _PREBUILT:
                _PREBUILT.append(_load_prebuilt())
    return _PREBUILT[0]


_PREBUILT: list = []  # process-wide, as _BUILT: the kernels if a build was on this machine when first asked, or None


def _load_prebuilt():
    """The build's module imported as it is (no compiler, no ninja, no file written): its name says which source, flags
    and torch it was built from (`extension_name`), so a build under that name is this source's."""
    source = source_text()
    root = extensions_root()
    for openmp in (True, False):
        name = extension_name(source, openmp)
        library = root / name / f"{name}.so"
        if not library.is_file():
            continue
        try:
            spec = importlib.util.spec_from_file_location(name, library)
            kernels = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(kernels)
        except Exception as error:  # noqa: BLE001 - a build cut short, a library that does not load: the eager path
            logger.info("AttnRes: the C++ depth-mix kernels built at %s did not load (%s); eager path", library, error)
            return None
        if not _BUILT:
            _BUILT.append(kernels)
        return kernels
    return None


def extensions_root() -> Path:
    """Where torch keeps its extension builds (TORCH_EXTENSIONS_DIR, else its default root and a folder per Python
    and accelerator), as torch.utils.cpp_extension names it, without creating anything (torch's own lookup makes
    the folder it names)."""
    from torch.utils.cpp_extension import get_default_build_root

    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen is not None:
        return Path(chosen)
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def _compile(source: str, openmp: bool):
    from torch.utils.cpp_extension import load_inline

    flags = _flags(openmp)
    name = extension_name(source, openmp)
    logger.info("AttnRes: loading the C++ depth-mix kernels (compiled on their first use on a machine)")
    start = time.perf_counter()
    with _build_lock(name):
        kernels = load_inline(
            name, cpp_sources=[source], extra_cflags=flags, extra_ldflags=["-fopenmp"] if openmp else []
        )
    seconds = time.perf_counter() - start
    if seconds > 5:
        logger.warning(
            "AttnRes: compiled the C++ depth-mix kernels in %.0f s, once for this machine (torch keeps the build in "
            "its extension cache, TORCH_EXTENSIONS_DIR)",
            seconds,
        )
    return kernels


class BuildLockTimeout(RuntimeError):
    """Another process held the build lock for longer than ATTNRES_BUILD_TIMEOUT."""


@contextlib.contextmanager
def _build_lock(name: str):
    """Exclusive use of extension NAME's build folder across processes, waited for at most ATTNRES_BUILD_TIMEOUT
    seconds. torch's own lock there is a file whose presence means "a build is running": a build killed midway
    leaves it, and every later load of that extension waits for it forever. This lock is an flock(2) on a file
    beside it, which the kernel releases when its holder dies, so a lock left by a killed process never blocks;
    whoever holds it knows that no build is running, and removes a torch lock file left behind. (Without fcntl,
    on Windows, torch's lock is taken as it is.)"""
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory  # noqa: PLC2701 - where torch builds it
    except ImportError:
        yield
        return
    folder = Path(_get_build_directory(name, False))
    timeout = _build_timeout()
    deadline = time.monotonic() + timeout
    with (folder / LOCK_NAME).open("a") as lock:
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BuildLockTimeout(
                        f"ATTNRES_KERNEL=cpu: waited {timeout:.0f} s for another process building the C++ depth-mix "
                        f"kernels (it holds {folder / LOCK_NAME}). Let it finish and run again, raise "
                        f"{BUILD_TIMEOUT_ENV} (seconds), or unset ATTNRES_KERNEL to run the eager path."
                    ) from None
                time.sleep(0.2)
        try:
            left = folder / "lock"
            if left.exists():
                logger.warning("AttnRes: removing %s, left by a build that was killed midway", left)
                left.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def buffer_mix(
    kernels,
    sources: torch.Tensor,
    m: int,
    has_partial: bool,
    q: torch.Tensor,
    stream: torch.Tensor,
    eps: float,
    count: bool,
    table: torch.Tensor | None = None,
    inv_rms: torch.Tensor | None = None,
    added: torch.Tensor | None = None,
    init: bool = False,
    norm: tuple = (),
) -> torch.Tensor:
    """A many-token reader with the `build()` kernels: sources [K, B, T, D] source-major, stream [B, T, D];
    table [K, B, T] (this reader's scores of the completed sources) or inv_rms [K, B, T]; added [B, T, D], the
    previous output, which first joins the partial sum (slot m; `init`: becomes it) and the stream. Returns the
    mix [B, T, D], or with `norm` (a `fused_norm`) the sublayer's norm of it. (A few-token reader calls
    `kernels.step_mix(padded, n, q, stream, count, added, slot, *norm)` directly, with `NONE` for no added
    output and `NO_NORM` for no norm.)"""
    d = sources.shape[-1]
    flat = kernels.buffer_mix(
        sources.reshape(sources.shape[0], -1, d),
        m,
        has_partial,
        q,
        stream.reshape(-1, d),
        eps,
        count,
        NONE if table is None else table.reshape(table.shape[0], -1),
        NONE if inv_rms is None else inv_rms.reshape(inv_rms.shape[0], -1),
        NONE if added is None else added.reshape(-1, d),
        init,
        *(norm or NO_NORM),
    )
    return flat.view(stream.shape)


NONE = torch.empty(0)  # an absent optional tensor argument
NO_NORM = (NONE, 0.0, 8)  # the norm arguments of a reader that returns its mix

# Lanes of torch's CPU sum to try (its vector width in floats differs between builds and machines).
_LANES = (8, 16, 4)


def fused_norm(kernels, norm: torch.nn.Module) -> tuple:
    """(weight, eps, lanes) for the kernels to apply `norm` to a reader's mix in the same pass, or () where the
    module must be called: it is fused only after its class's output on test rows matched the kernels' `rms_norm`
    bit for bit (one row, as in a decoding step, and enough rows for torch to spread them over threads), so a
    converted model gives the same bits with and without the fusion. That covers the RMSNorm of Llama-style
    families in float32; any other norm (a LayerNorm, a (1 + weight) scale, a norm in another dtype) fails the
    check and is called as before. So does a norm with hooks (they must see their call), a replaced `forward`
    (accelerate's offloading) or under autocast.

    The verdict is kept on the module itself, for what it was made from: the class (which a conversion may
    change), the eps and the size. It never depends on the weight's values, which the check replaces by its own
    probe weight (see `_verified`), and the weight is read at every call: changing it, in place or not, leaves
    nothing stale."""
    if (
        norm._forward_hooks
        or norm._forward_pre_hooks
        or "forward" in norm.__dict__
        or _global_hooks()
        or torch.is_autocast_enabled("cpu")
    ):
        return ()
    weight = norm._parameters.get("weight")
    if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
        return ()
    fields = norm.__dict__
    key = (type(norm), fields.get("variance_epsilon", fields.get("eps")), weight.shape)
    entry = fields.get(_VERDICT)
    if entry is None or entry[0] != key:
        entry = (key, _verified(kernels, norm))
        fields[_VERDICT] = entry
    if entry[1] is None:
        return ()
    return (weight, *entry[1])


_VERDICT = "_attnres_fused_norm"  # the attribute of a norm module that keeps `fused_norm`'s verdict on it


def _global_hooks() -> bool:
    module = torch.nn.modules.module
    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def _verified(kernels, norm: torch.nn.Module) -> tuple | None:
    """(eps, lanes) where the kernels' RMSNorm reproduces `norm`'s class bit for bit; None otherwise. The check
    runs the module's own forward on a shallow copy that holds a probe weight (random, seeded) in place of its
    own, so the verdict says what the class computes, whatever the module's weight holds now or later (a weight
    of ones, a weight changed in place after the check). The module itself is never modified: another thread
    may be running it."""
    eps = norm.__dict__.get("variance_epsilon", norm.__dict__.get("eps"))
    weight = norm._parameters.get("weight")
    if not isinstance(eps, float) or weight is None or weight.dim() != 1 or weight.dtype != torch.float32:
        return None
    d = weight.numel()
    if d >= 1 << 15 or weight.device.type != "cpu":
        return None
    generator = torch.Generator().manual_seed(0)
    probe = torch.nn.Parameter(torch.randn(d, generator=generator) * 0.5 + 1.0, requires_grad=False)
    twin = copy.copy(norm)
    twin.__dict__["_parameters"] = {**norm._parameters, "weight": probe}
    rows = 33 + (1 << 15) // d  # past torch's grain (32768 elements): a multi-threaded reduction
    x = torch.randn(1, rows, d, generator=generator) * torch.logspace(-4, 4, rows).view(1, rows, 1)
    with torch.no_grad():
        try:
            # The class's forward (a converted final norm's mixin passes a plain tensor on to the norm's own).
            expected = type(norm).forward(twin, x), type(norm).forward(twin, x[:, :1])
        except Exception:  # noqa: BLE001 - a module that cannot run on plain float32 rows is not fused
            return None
        if not all(isinstance(e, torch.Tensor) and e.dtype == torch.float32 for e in expected):
            return None
        for lanes in _LANES:
            got = kernels.rms_norm(x, probe, eps, lanes), kernels.rms_norm(x[:, :1].contiguous(), probe, eps, lanes)
            if all(g.shape == e.shape and torch.equal(g, e) for g, e in zip(got, expected)):
                return eps, lanes
    logger.info(
        "AttnRes: %s is not fused into the C++ depth mix (its output differs from an RMSNorm's)", type(norm).__name__
    )
    return None
