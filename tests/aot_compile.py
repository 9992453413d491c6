"""Compiles every program the Triton launchers of kernels/triton.py can choose, ahead of time for sm_80 and
sm_90, and writes one JSON line per program (its configuration, shared memory, registers, local memory, and what its
PTX holds). Run by tests/test_kernels_aot.py in a process of its own: the suite runs the kernels in Triton's
interpreter (TRITON_INTERPRET=1), and Triton reads that once, when it is imported.

    TRITON_INTERPRET=0 python tests/aot_compile.py OUT.jsonl
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnres_convert.kernels import triton as depth_triton

TARGETS = (80, 90)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KERNELS = {"mix_kernel": "launch_mix", "close_kernel": "launch_close", "mix_backward_kernel": "launch_mix_backward"}
D = 64  # the recorded launches' hidden size: a multiple of 16, as real hidden sizes are


class _Recorder:
    """Stands in for a kernel: records each launch's arguments instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def launches(kernel: str, dtype: torch.dtype) -> list:
    """Every launch the launcher makes for a model of `dtype`: each combination of its flags, the partial sum in
    float32 (inference) or in the model's dtype (training). Recorded, not run."""
    recorder, original = _Recorder(), getattr(depth_triton, kernel)
    setattr(depth_triton, kernel, recorder)
    try:
        launch = getattr(depth_triton, KERNELS[kernel])
        m, tokens, z = 2, 3, torch.zeros
        for part_dtype in dict.fromkeys((torch.float32, dtype)):
            if kernel == "mix_kernel":
                for has_part, has_new, init, table, count, save in itertools.product((False, True), repeat=6):
                    launch(
                        z(m + 1, tokens, D),
                        m,
                        z(D),
                        z(tokens, D, dtype=dtype),
                        1e-6,
                        count,
                        inv_rms=None if table else torch.ones(m, tokens),
                        table=z(m, tokens) if table else None,
                        partial=z(tokens, D, dtype=part_dtype) if has_part else None,
                        new=z(tokens, D, dtype=dtype) if has_new else None,
                        init_partial=init,
                        stream_out=z(tokens, D, dtype=dtype) if has_new else None,
                        save=save,
                    )
            elif kernel == "close_kernel":
                for has_new, init, table, rows in itertools.product(
                    (False, True), (False, True), (False, True), (5, 100)
                ):
                    launch(
                        z(tokens, D, dtype=part_dtype),
                        z(tokens, D),
                        z(tokens),
                        1e-6,
                        new=z(tokens, D, dtype=dtype) if has_new else None,
                        init_partial=init,
                        stream=z(tokens, D, dtype=dtype) if has_new else None,
                        stream_out=z(tokens, D, dtype=dtype) if has_new else None,
                        queries=z(rows, D) if table else None,
                        table=z(tokens, rows) if table else None,
                    )
            else:
                for has_part, table, count in itertools.product((False, True), repeat=3):
                    n = m + has_part
                    launch(
                        z(tokens, D, dtype=dtype),
                        z(m, tokens, D),
                        m,
                        z(D),
                        z(tokens, n),
                        z(tokens, n),
                        count,
                        z(m, tokens, D),
                        inv_rms=torch.ones(m, tokens),
                        rms_grad=None if table else z(m, tokens),
                        score_grad=z(m, tokens) if table else None,
                        partial=z(tokens, D, dtype=part_dtype) if has_part else None,
                        inv_partial=torch.ones(tokens) if has_part else None,
                    )
    finally:
        setattr(depth_triton, kernel, original)
    return recorder.launches


def configs(kernel: str) -> list[dict]:
    """Every block configuration the launcher chooses, over every size it takes (the hidden size does not enter)."""
    if kernel == "close_kernel":
        found = {tuple(depth_triton.close_config(64, r).items()) for r in range(1, depth_triton.MAX_QUERIES + 1)}
    else:
        found = {tuple(depth_triton.row_config(64, n).items()) for n in range(1, depth_triton.MAX_SOURCES + 1)}
    return [dict(config) for config in sorted(found)]


def jit_source(fn, args: tuple, kwargs: dict, capability: int):
    """(key, source, options, target) of the program the JIT compiles for these arguments on a GPU of
    `capability`: the JIT's own specialisation (dtypes, 16-byte alignment, divisibility by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    if hasattr(fn, "_pack_args"):  # Triton >= 3.3
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        key = str(specialization) + str(options)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        return key, ASTSource(fn, signature, constexprs, attrs), options, target
    # Triton 3.2 (the Triton of torch 2.6): as its JITFunction.run does
    fn.create_binder(backend)
    bound, sig_and_spec, constexpr_vals, non_constexpr_vals, excess = fn.binder(*args, **kwargs)
    key = "".join(sig_and_spec) + str((constexpr_vals, excess))
    options = backend.parse_options(kwargs)
    sigkeys = [fn.params[i].name for i in fn.non_constexpr_indices]
    signature = {k: ("*i8" if v == "none" else v) for k, v in zip(sigkeys, sig_and_spec[: len(sigkeys)])}
    bound_vals = tuple(bound.values())
    attrs = backend.get_attrs_descriptor(fn.params, bound_vals)
    constant_params = attrs.get_constants()
    constants = {
        p.name: v for v, p in zip(bound_vals, fn.params) if p.is_constexpr or p.num in constant_params or v is None
    }
    del triton
    return key, ASTSource(fn, signature, constants, attrs), options, target


CUOBJDUMP = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resources(cubin: bytes, folder: Path) -> dict:
    """REG (registers per thread), STACK, SHARED (static), LOCAL (per thread, bytes) of the cubin's kernel, as
    NVIDIA's cuobjdump (bundled with Triton) reads them."""
    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run(
        [str(CUOBJDUMP), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
    )
    line = next(line for line in usage.stdout.splitlines() if "REG:" in line)
    found = {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
    return found


def sass_fmas(cubin: bytes, folder: Path) -> list[str]:
    """The float32 fused multiply-adds (FFMA) of the cubin's machine code: ptxas fuses a PTX mul and add itself
    unless told not to (--fmad=false, which Triton passes when fusion is off). The kernels compute in float32; an
    HFMA2.MMA of zeros is ptxas's way of setting a register, not arithmetic."""
    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([str(CUOBJDUMP), "--dump-sass", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in sass.splitlines() if re.search(r"\bFFMA\b", line)]


def compile_all(out) -> None:
    import triton

    from attnres_convert.kernels import triton_kernels as depth_triton_kernels

    assert not os.environ.get("TRITON_INTERPRET", "0") == "1", "run with TRITON_INTERPRET=0"
    folder = Path(tempfile.mkdtemp())
    for kernel, dtype in itertools.product(KERNELS, DTYPES):
        fn = getattr(depth_triton_kernels, kernel)
        recorded = launches(kernel, DTYPES[dtype])
        for capability in TARGETS:
            seen = set()
            for (args, kwargs), config in itertools.product(recorded, configs(kernel)):
                key, source, options, target = jit_source(fn, args, {**kwargs, **config}, capability)
                if key in seen:
                    continue
                seen.add(key)
                start = time.perf_counter()
                program = triton.compile(source, target=target, options=options.__dict__)
                seconds = time.perf_counter() - start
                usage = resources(program.asm["cubin"], folder)
                ptx = program.asm["ptx"]
                record = {
                    "kernel": kernel,
                    "dtype": dtype,
                    "capability": capability,
                    "config": config,
                    "flags": [a for a in args if isinstance(a, bool)],
                    "arch": program.metadata.target.arch,
                    "num_warps": program.metadata.num_warps,
                    "shared": program.metadata.shared,
                    "regs": usage["reg"],
                    "local": usage["local"],
                    "stack": usage["stack"],
                    "enable_fp_fusion": program.metadata.enable_fp_fusion,
                    "fma": [line.strip() for line in ptx.splitlines() if "fma.rn" in line],
                    "muls": sum("mul.f32" in line or "mul.rn.f32" in line for line in ptx.splitlines()),
                    "sass_fma": sass_fmas(program.asm["cubin"], folder),
                    "seconds": round(seconds, 3),
                    "triton": triton.__version__,
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
        if dtype == "fp32":  # the control: Triton's default fusion contracts these kernels' products and sums
            args, kwargs = recorded[-1]
            key, source, options, target = jit_source(
                fn, args, {**kwargs, **configs(kernel)[-1], "enable_fp_fusion": True}, 90
            )
            program = triton.compile(source, target=target, options=options.__dict__)
            fused = [line.strip() for line in program.asm["ptx"].splitlines() if "fma.rn" in line]
            sass = sass_fmas(program.asm["cubin"], folder)
            out.write(json.dumps({"kernel": kernel, "control": True, "fma": fused, "sass_fma": sass}) + "\n")


# fla-core's fused AttnRes kernels (fla.ops.attnres.fused, the depth mix of kernels/fla.py's FlaState), where
# fla-core is installed: its forward and both backward kernels for float32 and bfloat16 sources. Unlike ours their
# hidden size is a compile-time constant (D, and the block BD = next_power_of_2(D)), so they compile for Llama-3.2-1B's
# (2048: the wider of the two the GPU check times, the more registers; `make gpu-check` runs 576 on a GPU); and they
# autotune over 24 (forward, dv) and 10 (dq dw) configurations, of which two each are compiled: the smallest tiles
# and the largest (the most registers).
FLA_KERNELS = ("attnres_fwd_kernel", "attnres_bwd_kernel_dv", "attnres_bwd_kernel_dqdw")
FLA_DTYPES = ("fp32", "bf16")
FLA_HIDDEN = (2048,)
FLA_SOURCES = 9  # the pointer table pads the sources to L2 = max(8, next_power_of_2(L)) entries: 16 here
FLA_CONFIGS = {
    "attnres_fwd_kernel": ({"BL": 1, "num_warps": 4, "num_stages": 2}, {"BL": 8, "num_warps": 16, "num_stages": 3}),
    "attnres_bwd_kernel_dv": ({"BL": 1, "num_warps": 4, "num_stages": 2}, {"BL": 8, "num_warps": 16, "num_stages": 3}),
    "attnres_bwd_kernel_dqdw": (
        {"BN": 1024, "BD": 16, "num_warps": 4, "num_stages": 3},
        {"BN": 4096, "BD": 64, "num_warps": 8, "num_stages": 4},
    ),
}


def fla_fused():
    """fla's fused module, or the reason it cannot be imported (fla-core not installed, or not under this Triton)."""
    try:
        from fla.ops.attnres import fused
    except Exception as error:  # noqa: BLE001 - not installed, or an fla that needs a newer Triton
        return f"fla-core cannot be imported: {type(error).__name__}: {error}"
    return fused


def fla_launches(fused, dtype: torch.dtype, d: int) -> dict:
    """One launch of each fla kernel for L = FLA_SOURCES sources of `dtype` and hidden size d, at checkpoint level
    1 (what FlaState uses), no output norm. The backward's two launches are recorded from fla's own
    fused_attnres_bwd; the forward's arguments are written out as fused_attnres_fwd passes them (it refuses
    tensors that are not on CUDA before launching)."""
    tokens, z = 3, torch.zeros
    residuals = [z(tokens, d, dtype=dtype) for _ in range(FLA_SOURCES)]
    res = fused._build_ptr_table(residuals)
    l2 = len(res)
    stats = dict(rstd=z(FLA_SOURCES, tokens), logit=z(FLA_SOURCES, tokens), lse=z(tokens))
    found = {
        "attnres_fwd_kernel": (
            (),
            dict(
                q=z(d),
                res=res,
                w=z(d),
                ow=None,
                o=z(tokens, d, dtype=dtype),
                o_pre=None,
                **stats,
                N=tokens,
                L=FLA_SOURCES,
                L2=l2,
                D=d,
                eps=1e-6,
                scale=1.0,
                BD=1 << (d - 1).bit_length(),
                HAS_ONORM=False,
                SAVE_OPRE=False,
            ),
        )
    }
    originals = {name: getattr(fused, name) for name in FLA_KERNELS[1:]}
    recorders = {name: _Recorder() for name in originals}
    try:
        for name, recorder in recorders.items():
            setattr(fused, name, recorder)
        fused.fused_attnres_bwd(
            do=z(tokens, d, dtype=dtype),
            q=z(d),
            residuals=residuals,
            res=res,
            w=z(d),
            ow=None,
            o_pre=None,
            eps=1e-6,
            scale=1.0,
            checkpoint_level=1,
            **stats,
        )
    finally:
        for name, original in originals.items():
            setattr(fused, name, original)
    for name, recorder in recorders.items():
        (found[name],) = recorder.launches
    return found


def fla_compile_all(out, folder: Path) -> None:
    import triton

    fused = fla_fused()
    if isinstance(fused, str):
        out.write(json.dumps({"fla": True, "missing": fused}) + "\n")
        return
    for dtype, d in itertools.product(FLA_DTYPES, FLA_HIDDEN):
        for kernel, (args, kwargs) in fla_launches(fused, DTYPES[dtype], d).items():
            fn = getattr(fused, kernel).fn  # the JITFunction under fla's autotuner
            for capability, config in itertools.product(TARGETS, FLA_CONFIGS[kernel]):
                key, source, options, target = jit_source(fn, args, {**kwargs, **config}, capability)
                start = time.perf_counter()
                program = triton.compile(source, target=target, options=options.__dict__)
                seconds = time.perf_counter() - start
                usage = resources(program.asm["cubin"], folder)
                out.write(
                    json.dumps(
                        {
                            "fla": True,
                            "kernel": kernel,
                            "dtype": dtype,
                            "hidden": d,
                            "capability": capability,
                            "config": config,
                            "arch": program.metadata.target.arch,
                            "num_warps": program.metadata.num_warps,
                            "shared": program.metadata.shared,
                            "regs": usage["reg"],
                            "local": usage["local"],
                            "stack": usage["stack"],
                            "seconds": round(seconds, 3),
                            "triton": triton.__version__,
                        }
                    )
                    + "\n"
                )
                out.flush()


if __name__ == "__main__":
    with open(sys.argv[1], "w") as out:
        if os.environ.get("AOT_ONLY_FLA") != "1":
            compile_all(out)
        assert not os.environ.get("TRITON_INTERPRET", "0") == "1", "run with TRITON_INTERPRET=0"
        fla_compile_all(out, Path(tempfile.mkdtemp()))
