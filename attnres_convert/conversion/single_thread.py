"""Small work computed on one CPU thread, without changing the thread count of any other thread.

The structure proof and the coverage walk run a few tokens through every decoder layer: thousands of
operations too small to share between threads, where on a busy machine the threads of each matrix product
wait on each other (SmolLM2's find_plan on a loaded 2-core machine: 0.4 s on one thread, 1 to 13 s on
two). In torch's OpenMP builds (the CPU builds it ships) the intra-op thread count belongs to each thread:
`torch.set_num_threads` sets the calling thread's, so such work runs on a thread of its own, set to one,
and every other thread keeps its count. `torch.set_num_threads` also sets the count a thread starts with
the first time it runs torch code; the caller puts that back at once, to its own count (which it does not
change), and only then does the work start. Where torch's thread pool is process-wide (builds without
OpenMP), the work so runs with the caller's count, and nothing changes either.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

Result = TypeVar("Result")


def run_single_threaded(work: Callable[..., Result], *args, **kwargs) -> Result:
    """WORK(*ARGS, **KWARGS) computed with one intra-op thread; its result is returned (or its exception
    raised) in the calling thread. Runs inline where the calling thread computes on one thread already.
    Thread-local torch settings (grad mode, autocast) do not carry over: WORK sets its own."""
    threads = torch.get_num_threads()
    if threads == 1:
        return work(*args, **kwargs)
    configured, start_value_restored = threading.Event(), threading.Event()
    outcome: dict = {}

    def run() -> None:
        try:
            torch.get_num_threads()  # this thread's count is set up now, from the start value, not later
            torch.set_num_threads(1)
            configured.set()
            start_value_restored.wait()
            outcome["result"] = work(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - raised again in the calling thread
            outcome["error"] = error
        finally:
            configured.set()

    worker = threading.Thread(target=run, name="attnres-single-thread", daemon=True)
    worker.start()
    try:
        configured.wait()
    finally:  # an interrupt here too leaves the start value as it was
        torch.set_num_threads(threads)  # the start value back; the calling thread already computes on THREADS
        start_value_restored.set()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
