"""The C++ kernels' build (kernels/cpu.py) around torch's compiler call: its lock across processes
(a lock left by a killed build never hangs a later one; a live build is waited for at most ATTNRES_BUILD_TIMEOUT
and then named), and the fallback where the compiler has no OpenMP. torch's `load_inline` is replaced by one
that takes torch's own lock file as torch does, so these run in a second, with or without a compiler."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory
from torch.utils.file_baton import FileBaton

from attnres_convert.kernels import cpu as depth_kernels_cpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty extension cache, no build kept in this process, and load_inline replaced by torch's locking
    alone: it waits while torch's lock file exists, as torch's does, then 'builds' (records its arguments)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(depth_kernels_cpu, "_BUILT", [])
    calls = []

    def load_inline(name, cpp_sources, extra_cflags, extra_ldflags):
        baton = FileBaton(str(Path(_get_build_directory(name, False)) / "lock"))
        if not baton.try_acquire():
            baton.wait()  # torch's wait: forever, while the file exists
            return "loaded"
        baton.release()
        calls.append({"name": name, "cflags": extra_cflags, "ldflags": extra_ldflags})
        return "built"

    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", load_inline)
    return calls


def _holder(name: str, leave_torch_lock: bool) -> subprocess.Popen:
    """A process that takes the build lock of extension NAME (and, like a build killed midway, creates torch's
    lock file), says so, and sleeps."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from torch.utils.cpp_extension import _get_build_directory
        from attnres_convert.kernels.cpu import _build_lock
        with _build_lock({name!r}):
            if {leave_torch_lock}:
                (Path(_get_build_directory({name!r}, False)) / "lock").touch()
            print("held", flush=True)
            time.sleep(120)
    """)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert process.stdout.readline().strip() == "held"
    return process


def _extension_name() -> str:
    """The name build() compiles under (the digest of the source, torch and the flags)."""
    names = []

    def record(name, **kwargs):
        names.append(name)
        return "built"

    original = sys.modules["torch.utils.cpp_extension"].load_inline
    sys.modules["torch.utils.cpp_extension"].load_inline = record
    try:
        depth_kernels_cpu._compile(depth_kernels_cpu.source_text(), openmp=True)
    finally:
        sys.modules["torch.utils.cpp_extension"].load_inline = original
    return names[0]


def _build_in_thread(seconds: float):
    """build()'s result or exception, failing the test if it has not returned within SECONDS."""
    outcome = {}

    def run():
        try:
            outcome["value"] = depth_kernels_cpu.build()
        except Exception as error:  # noqa: BLE001 - returned to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"build() still waiting after {seconds} s"
    return outcome


def test_a_lock_left_by_a_killed_build_never_hangs_the_next(fresh_build, monkeypatch):
    """A build killed while holding the lock leaves both lock files behind (its own and torch's): the next build
    takes the lock at once (the kernel released it with the process), removes torch's stale file, and builds."""
    monkeypatch.setenv("ATTNRES_BUILD_TIMEOUT", "5")
    name = _extension_name()
    holder = _holder(name, leave_torch_lock=True)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    folder = Path(_get_build_directory(name, False))
    assert (folder / "lock").exists() and (folder / depth_kernels_cpu.LOCK_NAME).exists()
    start = time.monotonic()
    outcome = _build_in_thread(10)
    assert outcome == {"value": "built"}
    assert time.monotonic() - start < 5
    assert not (folder / "lock").exists()
    assert [call["name"] for call in fresh_build] == [name]


def test_a_live_build_is_waited_for_at_most_the_timeout_then_named(fresh_build, monkeypatch):
    """While another process holds the lock, a build waits ATTNRES_BUILD_TIMEOUT seconds, then raises naming the
    lock file and the variable; the timeout is not kept, so a later call builds once the other one is done."""
    monkeypatch.setenv("ATTNRES_BUILD_TIMEOUT", "1")
    name = _extension_name()
    holder = _holder(name, leave_torch_lock=False)
    try:
        start = time.monotonic()
        outcome = _build_in_thread(15)
        waited = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    error = outcome["error"]
    assert isinstance(error, depth_kernels_cpu.BuildLockTimeout)
    assert (
        "waited 1 s" in str(error)
        and depth_kernels_cpu.LOCK_NAME in str(error)
        and "ATTNRES_BUILD_TIMEOUT" in str(error)
    )
    assert 1 <= waited < 10
    assert fresh_build == [] and depth_kernels_cpu._BUILT == []
    assert _build_in_thread(10) == {"value": "built"}  # the holder is gone: the lock is free again


def test_a_bad_timeout_value_is_named(fresh_build, monkeypatch):
    monkeypatch.setenv("ATTNRES_BUILD_TIMEOUT", "soon")
    with pytest.raises(RuntimeError, match="ATTNRES_BUILD_TIMEOUT='soon' is not a number of seconds"):
        depth_kernels_cpu.build()


def test_a_compiler_without_openmp_builds_single_threaded_with_a_warning(fresh_build, monkeypatch):
    """Apple's clang refuses -fopenmp: the kernels are built again without it (another cache name), and a
    warning says they run on one thread and what to install."""
    refused = []

    def clang_without_openmp(name, cpp_sources, extra_cflags, extra_ldflags):
        if "-fopenmp" in extra_cflags or "-fopenmp" in extra_ldflags:
            refused.append(name)
            raise RuntimeError(f"Error building extension '{name}': clang: error: unsupported option '-fopenmp'")
        fresh_build.append({"name": name, "cflags": extra_cflags, "ldflags": extra_ldflags})
        return "built without OpenMP"

    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", clang_without_openmp)
    monkeypatch.setenv("CXX", "clang++")
    with pytest.warns(RuntimeWarning, match=r"clang\+\+\) does not take -fopenmp.*one thread.*brew install libomp"):
        assert depth_kernels_cpu.build() == "built without OpenMP"
    (call,) = fresh_build
    assert "-fopenmp" not in call["cflags"] and call["ldflags"] == [] and "-ffp-contract=off" in call["cflags"]
    assert refused and refused[0] != call["name"]  # the threaded and the single-threaded builds are cached apart


def test_another_build_failure_is_not_taken_for_missing_openmp(fresh_build, monkeypatch):
    def no_compiler(name, **kwargs):
        raise OSError("c++: command not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", no_compiler)
    with pytest.raises(
        RuntimeError, match=r"building the C\+\+ depth-mix kernels failed .*command not found.*unset ATTNRES_KERNEL"
    ):
        depth_kernels_cpu.build()
