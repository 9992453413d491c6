"""The Triton kernels compiled ahead of time for real GPUs, without one (tests/aot_compile.py does the compiling, in
a process of its own): every program a launcher of kernels/triton.py can choose (its block sizes, from the
launcher's own `row_config` and `close_config` over every size it takes; the pointer dtypes of every combination of
its flags), in float32, bfloat16 and float16, for sm_80 (A100) and sm_90 (H100), specialised as the JIT specialises
it. Each compiles to a cubin within the target's shared memory and registers, and neither its PTX nor its machine
code holds a fused multiply-add: the launches state `enable_fp_fusion=False`, so every product and every sum rounds
on its own, as in the PyTorch reference and in the interpreter that tests/test_kernels.py runs.

`make test-aot-triton TRITON=3.2.0` runs these under another Triton (3.2.0: the one torch 2.6, the lowest torch
supported, requires)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the compile tests need triton (the test extra installs it)")

import aot_compile  # noqa: E402

from attnres_convert.kernels import triton as depth_triton  # noqa: E402

pytestmark = [pytest.mark.aot, pytest.mark.extended]

# Per compute capability, from the CUDA C++ Programming Guide, "Technical Specifications per Compute Capability":
# shared memory per block (the opt-in maximum: 163 KB on 8.0, 227 KB on 9.0), 32-bit registers per thread and per
# block (64 K on both).
LIMITS = {
    80: {"shared": 163 * 1024, "regs_per_thread": 255, "regs_per_block": 64 * 1024},
    90: {"shared": 227 * 1024, "regs_per_thread": 255, "regs_per_block": 64 * 1024},
}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    """Every program, compiled once for the module: one record each (tests/aot_compile.py)."""
    folder = tmp_path_factory.mktemp("aot")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(folder / "triton-cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "aot_compile.py"), str(folder / "programs.jsonl")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    records = [json.loads(line) for line in (folder / "programs.jsonl").read_text().splitlines()]
    programs = sum(not r.get("control") and not r.get("missing") for r in records)
    print(
        f"\n{programs} programs (and {len(records) - programs} controls) compiled in {time.perf_counter() - start:.1f} s"
    )
    return records


def _programs(compiled, kernel, dtype, capability) -> list[dict]:
    return [
        r
        for r in compiled
        if not r.get("control")
        and not r.get("fla")
        and (r["kernel"], r["dtype"], r["capability"]) == (kernel, dtype, capability)
    ]


@pytest.mark.parametrize("capability", aot_compile.TARGETS, ids=[f"sm_{c}" for c in aot_compile.TARGETS])
@pytest.mark.parametrize("dtype", aot_compile.DTYPES)
@pytest.mark.parametrize("kernel", aot_compile.KERNELS)
def test_every_program_compiles_within_the_targets_limits(compiled, kernel, dtype, capability, record_property):
    programs = _programs(compiled, kernel, dtype, capability)
    # Every block configuration the launcher can choose, compiled (for every signature its flags make).
    assert sorted({json.dumps(p["config"], sort_keys=True) for p in programs}) == sorted(
        json.dumps(c, sort_keys=True) for c in aot_compile.configs(kernel)
    )
    limits, report = LIMITS[capability], []
    for p in programs:
        assert p["arch"] == capability
        line = f"{kernel} {dtype} sm_{capability} {p['config']}: shared {p['shared']} B, {p['regs']} registers, local {p['local']} B"
        report.append(line)
        assert p["shared"] <= limits["shared"], line
        assert 0 < p["regs"] <= limits["regs_per_thread"], line
        assert p["regs"] * 32 * p["num_warps"] <= limits["regs_per_block"], line
        assert p["local"] == 0 and p["stack"] == 0, line  # no spills
    record_property("programs", report)
    print("\n" + "\n".join(report))


@pytest.mark.parametrize("capability", aot_compile.TARGETS, ids=[f"sm_{c}" for c in aot_compile.TARGETS])
@pytest.mark.parametrize("dtype", aot_compile.DTYPES)
@pytest.mark.parametrize("kernel", aot_compile.KERNELS)
def test_no_multiply_and_add_is_contracted(compiled, kernel, dtype, capability):
    """The products and sums that must each round as the reference's do, and that Triton's default would contract
    into FMAs (the control below finds them): the mix's weighted sum (acc += coef_i k_i) and the partial sum's
    statistics (squares += p p, dots += p q); the close's squares (k k) and scores; the backward's gradient updates
    (row + coef_i g + via_i q), its dq (via_i k_i) and d partial."""
    programs = _programs(compiled, kernel, dtype, capability)
    assert programs
    for p in programs:
        assert p["enable_fp_fusion"] is False
        assert p["fma"] == [], (p["config"], p["fma"][:3])  # none in the PTX
        assert p["sass_fma"] == [], (p["config"], p["sass_fma"][:3])  # nor fused by ptxas in the machine code
        assert p["muls"] > 0  # the products are there, each rounded on its own


def test_the_fusion_check_can_fail(compiled):
    """The same launches with Triton's default fusion contract products and sums into FMAs: the check above looks
    at instructions that are there to be found."""
    controls = {r["kernel"]: r["fma"] for r in compiled if r.get("control")}
    assert set(controls) == set(aot_compile.KERNELS)
    for kernel, fused in controls.items():
        assert any(line.startswith("fma.rn.f32") for line in fused), kernel
    sass = {r["kernel"]: r["sass_fma"] for r in compiled if r.get("control")}
    assert all(any("FFMA" in line for line in lines) for lines in sass.values()), sass


def test_every_flag_combination_is_recorded():
    """The launches compiled cover every combination of each launcher's flags, and state the fusion policy."""
    # mix: 6 flags, close: 3, mix_backward: 3; init_partial counts only with a new output (mix: 16 fewer, close: 2).
    for kernel, combinations in (("mix_kernel", 48), ("close_kernel", 6), ("mix_backward_kernel", 8)):
        launches = aot_compile.launches(kernel, torch.bfloat16)
        seen = {tuple(a for a in args if isinstance(a, bool)) for args, _ in launches}
        assert len(seen) == combinations, kernel
        assert all(kwargs["enable_fp_fusion"] is False for _, kwargs in launches)
        assert all(kwargs == {**kwargs, **depth_triton.FP_POLICY} for _, kwargs in launches)


def test_the_hidden_size_does_not_choose_a_program():
    """aot_compile.configs enumerates the sources and queries a launch can have; the hidden size, which it holds at
    64, does not enter the choice (the kernels walk D in chunks), so those are every configuration."""
    for d in (1, 64, 576, 2048, 4096, 7168, 16384, 65536):
        for n in (1, 2, 17, 61, depth_triton.MAX_SOURCES):
            assert depth_triton.row_config(d, n) == depth_triton.row_config(64, n)
        for r in (1, 16, 17, 61, depth_triton.MAX_QUERIES):
            assert depth_triton.close_config(d, r) == depth_triton.close_config(64, r)


def _fla_programs(compiled, kernel, dtype, capability) -> list[dict]:
    missing = [r["missing"] for r in compiled if r.get("fla") and r.get("missing")]
    if missing:
        pytest.skip(missing[0])
    return [
        r
        for r in compiled
        if r.get("fla") and (r["kernel"], r["dtype"], r["capability"]) == (kernel, dtype, capability)
    ]


@pytest.mark.parametrize("capability", aot_compile.TARGETS, ids=[f"sm_{c}" for c in aot_compile.TARGETS])
@pytest.mark.parametrize("dtype", aot_compile.FLA_DTYPES)
@pytest.mark.parametrize("kernel", aot_compile.FLA_KERNELS)
def test_fla_kernels_compile_within_the_targets_limits(compiled, kernel, dtype, capability, record_property):
    """fla-core's fused AttnRes kernels (FlaState's depth mix, kernels/fla.py), forward and backward, compile
    for sm_80 and sm_90 at the hidden sizes of SmolLM2-135M and Llama-3.2-1B, for two of their autotune
    configurations each (tests/aot_compile.py's FLA_CONFIGS), within shared memory and registers. Measured with
    Triton 3.9: none spills, except the dq dw reduction's largest tile (BN 4096 x BD 64, 8 warps), which keeps
    4.7-7.1 KB per thread on the stack; its autotuner also has configurations that do not (BN 1024 x BD 16 here),
    which is what a tuned launch should pick (printed, not asserted: fla's choice, not ours). Their fused
    multiply-adds are fla's business: FlaState's mix is equal to the eager one up to rounding, not bit for bit."""
    programs = _fla_programs(compiled, kernel, dtype, capability)
    assert {(p["hidden"], json.dumps(p["config"], sort_keys=True)) for p in programs} == {
        (d, json.dumps(c, sort_keys=True)) for d in aot_compile.FLA_HIDDEN for c in aot_compile.FLA_CONFIGS[kernel]
    }
    limits, report = LIMITS[capability], []
    for p in programs:
        assert p["arch"] == capability
        line = (
            f"fla {kernel} {dtype} D={p['hidden']} sm_{capability} {p['config']}: shared {p['shared']} B, "
            f"{p['regs']} registers, local {p['local']} B, stack {p['stack']} B"
        )
        report.append(line)
        assert p["shared"] <= limits["shared"], line
        assert 0 < p["regs"] <= limits["regs_per_thread"], line
        assert p["regs"] * 32 * p["num_warps"] <= limits["regs_per_block"], line
        largest_reduction = kernel == "attnres_bwd_kernel_dqdw" and p["config"]["BN"] == 4096
        if not largest_reduction:
            assert p["local"] == 0 and p["stack"] == 0, line  # no spills
    record_property("programs", report)
    print("\n" + "\n".join(report))
