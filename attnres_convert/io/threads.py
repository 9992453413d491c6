"""How many torch threads CPU work gets: one per core not already busy (or OMP_NUM_THREADS), for `attnres finetune`
and `attnres convert`. torch's default is every core; where other jobs hold some, its threads wait for each other
at every operation: on a 2-core machine with other jobs running, a training step of quickstart-cpu took 17.4 s with
2 threads and 2.6 s with 1, and `attnres convert` of the embedded model 122 s against 49 s
(benchmarks/training_threads.py, docs/first-run.md).

Imports nothing of torch: the caller sets the count it is given (`torch_threads`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Process-wide on purpose: a reading stands for REUSE_S seconds, so a process that converts or trains several
# times in a row (a script, the test suite) does not wait SECONDS before each.
REUSE_S = 30.0
_LAST: list = []  # (monotonic time, the reading)


def busy_cores(seconds: float = 0.5) -> tuple[float, str]:
    """How many cores other work keeps busy now, and how that was measured: the non-idle share of /proc/stat's CPU
    time over SECONDS (this process waits meanwhile, so it is not counted; a reading of the last REUSE_S seconds is
    reused); where there is no /proc/stat, the 1-minute load average (which lags: work that just ended, such as the
    conversion before `make demo`'s fine-tune, still counts in it)."""
    import time

    if _LAST and time.monotonic() - _LAST[0][0] < REUSE_S:
        return _LAST[0][1]
    reading = _busy_cores(seconds)
    _LAST[:] = [(time.monotonic(), reading)]
    return reading


def _busy_cores(seconds: float) -> tuple[float, str]:
    import time

    def sample() -> tuple[int, int] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields[:8]), fields[3] + fields[4]  # user..steal; idle + iowait

    first = sample()
    if first is not None:
        time.sleep(seconds)
        second = sample()
        if second is not None and second[0] > first[0]:
            share = 1 - (second[1] - first[1]) / (second[0] - first[0])
            return max(0.0, share) * usable_cores(), f"busy over {seconds:g} s"
    if hasattr(os, "getloadavg"):
        return os.getloadavg()[0], "load average"
    return 0.0, "not measured"


def cpu_threads(processes: int = 1, cores: int | None = None, busy: float | None = None, env=None) -> tuple[int, str]:
    """The torch threads of each of PROCESSES training processes on the CPU, and why, in words.

    OMP_NUM_THREADS, where set, decides. Otherwise: the cores not already busy (busy_cores), shared among the
    processes, at least one each: a busy machine then slows the work by its load alone (see the module's text)."""
    env = os.environ if env is None else env
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) >= 1:
        return int(given), "OMP_NUM_THREADS"
    cores = cores or usable_cores()
    how = "given"
    if busy is None:
        busy, how = busy_cores()
    per_process = max(processes, 1)
    threads = max(1, min(cores // per_process, int((cores - busy) / per_process + 0.5)))
    return threads, f"{cores} cores, {busy:.1f} of them busy ({how}): one per idle core; OMP_NUM_THREADS sets it"


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch computes with THREADS threads inside the block (None: as it is), and as before after it."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
