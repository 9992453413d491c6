"""gpu-check's depth-mix-kernels stage (attnres_convert/analysis/gpu_check.py runs it): one reader's depth mix alone,
forward and forward + backward, timed on the device and checked against float64, on four implementations of the same
function: fla-core's fused AttnRes kernels (kernels/fla.py's FlaState; fla from the wheels of gpu-check-wheels/
where it is not installed), our Triton training kernels (TrainState with kernels/triton.py's kernels), the eager TrainState
(hand-written backward) and the plain BlockState (autograd). On a CPU (--quick) only the eager two run: the plumbing."""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import os
import sys
import time
import zipfile
from pathlib import Path

from ..errors import first_line

# The shapes: hidden sizes of SmolLM2-135M and Llama-3.2-1B, 4096 tokens (4 x 1024), a reader with 3 sources (embedding,
# one completed block, the partial sum) and with 9 (seven completed blocks). --quick: the plumbing on tiny shapes.
MIX_HIDDEN = {"smollm2-135m": 576, "llama-3.2-1b": 2048}
MIX_TOKENS, MIX_SOURCES, MIX_ROUNDS = (4, 1024), (3, 9), 25
QUICK_MIX = dict(hidden={"smollm2-135m": 64, "llama-3.2-1b": 96}, tokens=(2, 8), rounds=3)
MIX_PATHS = ("fla", "triton", "train-eager", "blockstate")
# fla autotunes each kernel over up to 24 configurations at the first call of every (sources, hidden size, dtype):
# here 8 such keys, minutes of compiling. The check keeps the configurations of one software-pipelining depth
# (num_stages 2 for the forward and dv kernels, 3 for dq dw: 12, 12 and 5 of 24, 24 and 10; their loops run over at
# most a few tiles, where pipelining has little to overlap). FLA_FULL_AUTOTUNE=1 keeps them all.
FLA_STAGES_KEPT = {"attnres_fwd_kernel": 2, "attnres_bwd_kernel_dv": 2, "attnres_bwd_kernel_dqdw": 3}


def _fla_importable(check, wheels: Path) -> str | None:
    """None where fla imports (installed, or from the fla-core and einops wheels of gpu-check-wheels/, unpacked onto
    sys.path as `_pydantic_path` does for the A/B's children); else why not."""
    from ..kernels import fla as depth_fla

    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("einops") is None:
        found = [w for w in sorted(wheels.glob("*.whl")) if w.name.startswith(("fla_core-", "einops-"))]
        if len({w.name.split("-")[0] for w in found}) < 2:
            return (
                f"fla-core is not installed and {wheels} holds no fla-core and einops wheels: run `make gpu-check-wheels` "
                "where the package registry is reachable and copy gpu-check-wheels/ with the checkout"
            )
        target = check.work / "fla-wheels"
        for wheel in found:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
        depth_fla._FLA.clear()  # a failed import before the wheels were there is not the answer
    if depth_fla.fla_mix_function() is None:
        return depth_fla.fla_import_error()
    return None


def _prune_fla_autotune() -> dict:
    from fla.ops.attnres import fused

    kept = {}
    for name, stages in FLA_STAGES_KEPT.items():
        kernel = getattr(fused, name)
        before = len(kernel.configs)
        if os.environ.get("FLA_FULL_AUTOTUNE") != "1":
            kernel.configs = [c for c in kernel.configs if c.num_stages == stages] or kernel.configs
        kept[name] = f"{len(kernel.configs)} of {before}"
    return kept


def _mix_case(torch, device: str, dtype, d: int, n: int, tokens: tuple[int, int], seed: int) -> dict:
    """The leaves of one reader: embedding and completed-block outputs, the partial sum (n - 2 completed blocks after the
    embedding), its query and key norm weight, and the cotangent; plus the float64 reference mix and query gradient."""
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def make(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dt)

    outputs = [make(*tokens, d, scale=1.0 + i / 2) for i in range(n)]  # embedding, n - 2 blocks, the partial sum
    query, key_norm = make(1, d, scale=0.5, dt=torch.float32), 1.0 + make(d, scale=0.2, dt=torch.float32)
    grad = make(*tokens, d)
    keys = torch.stack([o.double() for o in outputs])
    q = query.double().reshape(-1).requires_grad_()
    scores = (keys @ (q * key_norm.double())) * torch.rsqrt(keys.square().mean(-1) + 1e-5)
    reference = n * (torch.softmax(scores, dim=0)[..., None] * keys).sum(0)
    (dq,) = torch.autograd.grad(reference, q, grad.double())
    return {
        "outputs": outputs,
        "query": query,
        "key_norm": key_norm,
        "grad": grad,
        "reference": reference.detach(),
        "dq": dq,
    }


def _mix_state(path: str, case: dict, kernels):
    """The state of the reader on `path`, built through the state protocol (start, add, close), with grads."""
    from ..kernels.fla import FlaState
    from ..kernels.training import TrainState
    from ..modeling.modeling_attnres import BlockState

    outputs = [o.detach().requires_grad_() for o in case["outputs"]]
    n, eps = len(outputs), 1e-5
    if path == "fla":
        state = FlaState.start(outputs[0], eps)
    elif path == "blockstate":
        state = BlockState.start(outputs[0], eps)
    else:
        state = TrainState.start(outputs[0], eps, n, None, kernels if path == "triton" else None)
    for block in outputs[1:-1]:
        state = state.add(block).close(eps)
    state = state.add(outputs[-1])  # the partial sum
    query, key_norm = case["query"].detach().requires_grad_(), case["key_norm"].detach().requires_grad_()
    return state, query, key_norm, [query, key_norm, *outputs]


def depth_mix_kernels(check, limit: float, wheels: Path) -> dict:
    """One reader's depth mix ("count" scaling, as a converted model's), alone: its forward, and its forward + backward
    to the query, the key norm's weight and every source (through the state's per-block work for this one reader), on
    fla's kernels (FlaState), our Triton training kernels (TrainState with kernels), the eager TrainState (hand-written
    backward) and the plain BlockState (autograd). Median of interleaved rounds timed with CUDA events; the error of
    each mix and query gradient against float64. On a CPU (--quick) only the eager paths run (the plumbing)."""
    import torch

    from .. import kernels as depth_backends

    started = time.monotonic()
    quick = check.quick and not check.cuda
    hidden, tokens, rounds = (
        (QUICK_MIX["hidden"], QUICK_MIX["tokens"], QUICK_MIX["rounds"])
        if quick
        else (MIX_HIDDEN, MIX_TOKENS, MIX_ROUNDS)
    )
    skipped: dict[str, str] = {}
    kernels = None
    if check.cuda:
        why_not = _fla_importable(check, wheels)
        if why_not is not None:
            skipped["fla"] = why_not
        try:
            kernels = depth_backends.triton_kernels_for(torch.empty(0, device="cuda"), "triton")
        except RuntimeError as error:
            skipped["triton"] = first_line(error, with_type=True)
    else:
        skipped["fla"] = skipped["triton"] = "CUDA only"
    result = {"tokens": tokens[0] * tokens[1], "rounds": rounds, "skipped": skipped, "rows": [], "not_reached": []}
    if "fla" not in skipped:
        result["fla_autotune"] = _prune_fla_autotune()
        result["fla_version"] = importlib.metadata.version("fla-core")
    paths = [p for p in MIX_PATHS if p not in skipped]

    def timed(fn) -> float:
        if check.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    cases = [(dtype, model, n) for dtype in (torch.bfloat16, torch.float32) for model in hidden for n in MIX_SOURCES]
    for dtype, model, n in cases:
        name = f"{model} {str(dtype).removeprefix('torch.')} n={n}"
        if time.monotonic() - started > limit * 0.8:
            result["not_reached"].append(name)
            continue
        case = _mix_case(torch, check.device, dtype, hidden[model], n, tokens, seed=n)
        built = {path: _mix_state(path, case, kernels) for path in paths}
        row = {
            "model": model,
            "hidden": hidden[model],
            "dtype": str(dtype).removeprefix("torch."),
            "sources": n,
            "paths": {},
        }

        def forward(path, built=built):
            state, query, key_norm, _ = built[path]
            return state.mix(state.fold(query, key_norm), 1e-5, "count")

        def both(path, built=built, case=case):
            state, query, key_norm, leaves = built[path]
            return torch.autograd.grad(forward(path), leaves, case["grad"], retain_graph=True)

        for path in paths:  # the first calls: compile and autotune, timed apart
            begin = time.perf_counter()
            mixed, grads = forward(path), both(path)
            if check.cuda:
                torch.cuda.synchronize()
            row["paths"][path] = {
                "first_call_s": round(time.perf_counter() - begin, 3),
                "mix_error": (mixed.double() - case["reference"]).abs().max().item(),
                "dq_error": (grads[0].double().reshape(-1) - case["dq"]).abs().max().item(),
                "reference_max": case["reference"].abs().max().item(),
                "dq_max": case["dq"].abs().max().item(),
            }
        times = {path: {"forward": [], "forward_backward": []} for path in paths}
        for _ in range(rounds):  # interleaved: a clock or thermal drift reaches every path alike
            for path in paths:
                times[path]["forward"].append(timed(lambda: forward(path)))
                times[path]["forward_backward"].append(timed(lambda: both(path)))
        for path in paths:
            for what, values in times[path].items():
                row["paths"][path][f"{what}_ms"] = round(sorted(values)[len(values) // 2], 4)
        result["rows"].append(row)
        del built, case
        gc.collect()
        if check.cuda:
            torch.cuda.empty_cache()
    return result


def mix_markdown(mix: dict) -> list[str]:
    """The stage's table for gpu-check.md (nothing where it measured nothing)."""

    def _num(value) -> str:
        return f"{value:.4g}"

    lines: list[str] = []
    if mix.get("rows"):
        lines += [
            "",
            f"## Depth mix alone (one reader, count scaling, {mix['tokens']} tokens, median of {mix['rounds']})",
            "",
            "| model | dtype | sources | path | forward ms | forward + backward ms | max abs error (mix) | (of max) "
            "| max abs error (query grad) | (of max) | first call s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in mix["rows"]:
            for path, r in row["paths"].items():
                lines.append(
                    f"| {row['model']} | {row['dtype']} | {row['sources']} | {path} | {_num(r['forward_ms'])} | "
                    f"{_num(r['forward_backward_ms'])} | {r['mix_error']:.2e} | {_num(r['reference_max'])} | "
                    f"{r['dq_error']:.2e} | {_num(r['dq_max'])} | {_num(r['first_call_s'])} |"
                )
        for path, why in mix.get("skipped", {}).items():
            lines.append(f"\n{path}: not run ({why})")
        if mix.get("fla_autotune"):
            lines.append(
                f"\nfla-core {mix.get('fla_version')}, autotuned over: "
                + ", ".join(f"{k} {v}" for k, v in mix["fla_autotune"].items())
            )
    return lines
