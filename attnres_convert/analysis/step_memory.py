"""Peak memory of one training step (forward + backward) of a model folder, measured in a fresh process.

A step's peak is what it adds to the memory held before it: activations, gradients, autograd buffers. It is
measured in a child process per model, after a warm-up step, so neither the other model nor the allocator's
history of the timing runs moves it:

* CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, less what was allocated before;
* CPU (Linux): the resident set's high-water mark (VmHWM), reset through /proc/self/clear_refs, less the
  resident size before the step; malloc returns freed blocks to the system (fixed mmap threshold, trim at
  0, set for the child only), so the peak is the step's own and not what the allocator kept.

    python -m attnres_convert.analysis.step_memory FOLDER --device cpu --dtype float32 --batch 1 --seq-len 512
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

CLEAR_REFS = Path("/proc/self/clear_refs")


def cpu_peak_supported() -> bool:
    """Whether this system lets a process reset and read its peak resident size (Linux /proc)."""
    return sys.platform.startswith("linux") and CLEAR_REFS.exists()


def measure_in_child(
    folder: Path,
    *,
    device: str,
    dtype: str,
    batch: int,
    seq_len: int,
    kernels: str | None,
    remote_code: bool,
    threads: int | None,
    checkpointing: bool = False,
) -> int:
    """Bytes a training step of FOLDER's model adds at its peak, measured in a fresh process."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    if kernels is not None:
        env["ATTNRES_KERNEL"] = kernels
    cmd = [
        sys.executable,
        "-m",
        "attnres_convert.analysis.step_memory",
        str(folder),
        "--device",
        device,
        "--dtype",
        dtype,
        "--batch",
        str(batch),
        "--seq-len",
        str(seq_len),
    ]
    cmd += ["--remote-code"] if remote_code else []
    cmd += ["--checkpointing"] if checkpointing else []
    cmd += ["--threads", str(threads)] if threads else []
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the training step's memory of {folder} failed: {done.stderr.strip()[-1500:]}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["step_peak_bytes"])


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from ..architectures import vocab_size_of

    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--remote-code", action="store_true")
    parser.add_argument("--checkpointing", action="store_true", help="non-reentrant activation checkpointing")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(
        args.folder, dtype=getattr(torch, args.dtype), trust_remote_code=args.remote_code
    ).to(device)
    model.train()
    if args.checkpointing:  # non-reentrant: the only kind AttnRes models accept (under transformers' newer name too)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    vocab = vocab_size_of(model)
    batch = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        model(batch, labels=batch).loss.backward()

    step()  # warm-up: one-time allocations (thread pools, autograd buffers, kernels) are not the step's
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = _status("VmRSS:")
        CLEAR_REFS.write_text("5")  # resets the peak resident size (VmHWM) to the current one
        step()
        peak = _status("VmHWM:") - before
    print(json.dumps({"step_peak_bytes": peak}))


if __name__ == "__main__":
    _main()
