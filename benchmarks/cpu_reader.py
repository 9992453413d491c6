"""One reader's depth mix on CPU, alone: the eager path against the C++ kernels (ATTNRES_KERNEL=cpu).

    python benchmarks/cpu_reader.py [--repeats 200] [--out benchmarks/results/cpu-reader.json]

SmolLM2-135M's shapes (d = 576, 61 readers' score table), float32, 2 threads, random sources:

* prefill: a reader of 512 tokens with 4 completed sources and its partial sum, on the source-major
  buffer with the score table (eager `SourceBuffer.mix` against `buffer_mix`); and the last sublayer's
  reader of Full AttnRes (S = 1): 60 completed sources and the partial sum;
* decoding: a reader of one token with 5 sources on the token-major step buffer (kernels/step.py's `step_mix`
  against the kernel's `step_mix`).

The two are interleaved call by call, with a 32 MB pass over an unrelated tensor before each call, since
inside a model the weights of the sublayers in between evict the caches. Medians and their ratio are
printed and recorded; nothing here is a pass/fail test. The first run on a machine compiles the kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from attnres_convert.kernels import cpu as depth_kernels_cpu  # noqa: E402
from attnres_convert.kernels.step import StepViews, step_mix  # noqa: E402
from attnres_convert.kernels.training import table_scores  # noqa: E402
from attnres_convert.modeling import modeling_attnres as da  # noqa: E402

D, READERS, EPS = 576, 61, 1e-5


def timed(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each callable, interleaved, each call after a pass that flushes the caches."""
    flush = torch.randn(8_000_000)
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            flush.mul_(1.0)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def prefill_reader(kernels, repeats: int, tokens: int = 512, completed: int = 4) -> dict:
    generator = torch.Generator().manual_seed(0)
    capacity = completed + 5
    sources = torch.randn(capacity, 1, tokens, D, generator=generator)
    queries = 0.05 * torch.randn(READERS, D, generator=generator)
    inv_rms, scores = torch.empty(capacity, 1, tokens), torch.empty(capacity, 1, tokens, READERS)
    for i in range(completed):
        inv_rms[i] = da.inverse_rms(sources[i], EPS)
        scores[i] = table_scores(sources[i].view(-1, D), queries, inv_rms[i].view(-1)).view(1, tokens, READERS)
    state = da.SourceBuffer(sources, inv_rms, completed, True, sources[-1], queries, scores, shared_stream=True)
    reader = 7
    fns = {
        "eager": lambda: state.mix(queries[reader], EPS, "count", reader),
        "cpu": lambda: depth_kernels_cpu.buffer_mix(
            kernels, sources, completed, True, queries[reader], sources[-1], EPS, True, table=scores[..., reader]
        ),
    }
    medians = timed(fns, repeats)
    return {
        "metric": f"prefill reader, {tokens} tokens, {completed + 1} sources",
        **medians,
        "ratio": medians["cpu"] / medians["eager"],
    }


def decoding_reader(kernels, repeats: int, sources: int = 5) -> dict:
    generator = torch.Generator().manual_seed(0)
    padded = torch.randn(1, 1, 10, D + 1, generator=generator)
    step = StepViews.of(padded, EPS, 0.05 * torch.randn(READERS, D, generator=generator), shared_stream=True)
    q, stream = step.queries[7], step.slots[9]
    fns = {
        "eager": lambda: step_mix(step, sources, q, stream, "count"),
        "cpu": lambda: kernels.step_mix(
            step.padded[sources], sources, q, stream, True, depth_kernels_cpu.NONE, 0, *depth_kernels_cpu.NO_NORM
        ),
    }
    medians = timed(fns, repeats)
    return {
        "metric": f"decoding reader, 1 token, {sources} sources",
        **medians,
        "ratio": medians["cpu"] / medians["eager"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-reader.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = depth_kernels_cpu.build()
    rows = [
        prefill_reader(kernels, args.repeats),
        prefill_reader(kernels, max(10, args.repeats // 10), completed=60),
        decoding_reader(kernels, args.repeats),
    ]
    for row in rows:
        print(
            f"{row['metric']}: eager {row['eager'] * 1e6:.1f} us, C++ {row['cpu'] * 1e6:.1f} us, ratio {row['ratio']:.2f}"
        )
    meta = {
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
