"""Faults during `convert`: a SIGKILL at any moment leaves no partial folder at the output path and
an existing output untouched until the new one is complete; leftover temporary folders are never taken
for the output and are removed by the next run; Ctrl-C and SIGTERM clean up at once.

The kills are real signals to real processes. To kill at many moments without paying the import time of
torch for each, the converting processes are forked from a multiprocessing forkserver that has imported
attnres_convert once; the installed `attnres` command itself is killed and interrupted too."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_helpers import ONE_THREAD_ENV, ROOT, convert_in_child, forkserver_context, snapshot

STAGES = (
    "Reading config",
    "Loading model",
    "Running the original model",
    "Converting",
    "Verifying against the original",
    "Saving",
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama with a 32k vocabulary (16 MB of weights: saving takes long enough to be hit), the complete
    output of converting it with S = 3 (the new output) and with S = 2 (the previous output)."""
    from tiny_models import tiny_model

    from attnres_convert import convert

    root = tmp_path_factory.mktemp("faults")
    source = root / "base"
    tiny_model("llama", vocab_size=32000).save_pretrained(source)
    # The in-memory path (load, convert, save_pretrained); test_big_checkpoints kills the streamed one.
    convert(str(source), root / "reference-new", block_size=3, verify=False, stream=False)
    convert(str(source), root / "reference-old", block_size=2, verify=False, stream=False)
    return {
        "root": root,
        "source": source,
        "new": snapshot(root / "reference-new"),
        "old_folder": root / "reference-old",
        "old": snapshot(root / "reference-old"),
    }


@pytest.fixture(scope="module")
def forkserver():
    return forkserver_context()


def partials(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.partial-*"))


def assert_old_or_complete_new(out: Path, models, previous) -> str:
    """OUT is exactly what was there before (the previous output, or nothing) or exactly a complete new output."""
    state = snapshot(out)
    if state == previous:
        return "old" if previous else "absent"
    assert state == models["new"], (
        f"{out} is neither the previous output nor a complete new one: {state and sorted(state)}"
    )
    return "new"


def _kill_at(context, models, out: Path, trigger, verify: bool) -> tuple[str, bool]:
    """Start a conversion into OUT, SIGKILL it at TRIGGER; return (outcome, partial folder seen at the kill)."""
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=convert_in_child, args=(str(models["source"]), str(out), 3, verify, send))
    process.start()
    send.close()
    kind, value = trigger
    deadline = time.monotonic() + 120
    try:
        if kind == "stage":  # (stage name, delay after it starts)
            name, delay = value
            while time.monotonic() < deadline:
                assert receive.poll(deadline - time.monotonic()), "the child stopped reporting"
                if receive.recv() == name:
                    break
            time.sleep(delay)
        elif kind == "file":  # kill as soon as the temporary folder holds this file
            while time.monotonic() < deadline and process.is_alive():
                if any((p / value).exists() for p in partials(out)):
                    break
                time.sleep(0.0005)
        seen = bool(partials(out))
        process.kill()
    finally:
        process.join(30)
        receive.close()
    assert process.exitcode == -signal.SIGKILL or process.exitcode == 0, process.exitcode
    return ("finished" if process.exitcode == 0 else "killed"), seen


@pytest.mark.slow
@pytest.mark.extended
def test_sigkill_at_any_moment_keeps_the_previous_output(tmp_path, models, forkserver):
    """SIGKILL at every stage of load / convert / verify / save, and inside saving at random moments and as
    each file appears: OUT is always the previous output byte for byte, or the complete new one."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(models["old_folder"], out)
    rng = random.Random(6)
    triggers = [("stage", ("started", 0.0))]
    triggers += [("stage", (name, rng.uniform(0, 0.05))) for name in STAGES[:-1]]
    triggers += [("stage", ("Saving", delay)) for delay in [0.0] + sorted(rng.uniform(0, 0.06) for _ in range(5))]
    triggers += [("file", name) for name in ("config.json", "model.safetensors", "README.md", "modeling_attnres.py")]
    outcomes, seen_partial = [], 0
    for trigger in triggers:
        verify = trigger[0] == "stage" and trigger[1][0] in STAGES[2:5]
        ended, seen = _kill_at(forkserver, models, out, trigger, verify)
        outcome = assert_old_or_complete_new(out, models, models["old"])
        outcomes.append((trigger, ended, outcome))
        seen_partial += seen
        if outcome == "new":  # a kill after the swap: put the previous output back for the next kill
            shutil.rmtree(out)
            shutil.copytree(models["old_folder"], out)
    # Every kill before saving cut the run short, and several landed in the middle of saving (a temporary
    # folder existed); a late one may find the run already finished, which is fine.
    assert all(ended == "killed" for trigger, ended, _ in outcomes[: 1 + len(STAGES) - 1]), outcomes
    assert seen_partial >= 4, outcomes
    assert not (tmp_path / "out" / "config.json").is_symlink()
    # Leftovers of the killed runs are not the output, and the next run removes them.
    left = partials(out)
    assert left, "expected temporary folders left by the killed runs"
    from attnres_convert import convert

    convert(str(models["source"]), out, block_size=3, verify=False, overwrite=True, stream=False)
    assert snapshot(out) == models["new"]
    assert partials(out) == []


def test_sigkill_without_a_previous_output_leaves_nothing(tmp_path, models, forkserver):
    out = tmp_path / "fresh" / "out"
    triggers = [
        ("stage", ("Converting", 0.0)),
        ("stage", ("Saving", 0.0)),
        ("stage", ("Saving", 0.03)),
        ("file", "model.safetensors"),
        ("file", "README.md"),
    ]
    for trigger in triggers:
        _kill_at(forkserver, models, out, trigger, verify=False)
        outcome = assert_old_or_complete_new(out, models, None)
        if outcome == "new":
            import shutil

            shutil.rmtree(out)
        # A temporary folder is hidden and never looks like the output: a run without --overwrite is not refused.
        from attnres_convert.io.saving import check_output

        assert check_output(out) == out
        assert not out.exists()


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_cleanup_removes_only_dead_runs_of_this_host(tmp_path):
    from attnres_convert.io.saving import _host_tag, clean_stale_partials

    out = tmp_path / "out"
    host, dead, alive = _host_tag(), _dead_pid(), os.getpid()
    names = {
        f".out.partial-{host}-{dead}-abc": "removed",  # a killed run of this host
        f".out.partial-{host}-{os.getppid()}-def": "kept",  # a running process
        f".out.partial-{host}-{alive}-ghi": "kept",  # this process
        f".out.partial-0000beef-{dead}-jkl": "kept",  # another host sharing the folder
        ".out.partial-garbage": "kept",  # not named by us
        ".other.partial-{host}-{dead}-mno": "kept",  # another output's
        f".outx.partial-{host}-{dead}-pqr": "kept",
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text("x")
    (tmp_path / f".out.partial-{host}-{dead}-file").write_text("a file, not a folder")
    removed = clean_stale_partials(out)
    assert [p.name for p in removed] == [n for n, fate in names.items() if fate == "removed"]
    for name, fate in names.items():
        assert (tmp_path / name).exists() == (fate == "kept"), name
    assert (tmp_path / f".out.partial-{host}-{dead}-file").exists()


def test_cleanup_restores_the_previous_output_after_a_kill_between_renames(tmp_path, models):
    """Where the filesystem cannot swap two folders atomically, the previous output is moved aside, then the
    new one in: a kill between the two renames leaves OUT missing. The next run puts the previous one back."""
    import shutil

    from attnres_convert.io.saving import _host_tag, clean_stale_partials

    out = tmp_path / "out"
    host, dead = _host_tag(), _dead_pid()
    shutil.copytree(models["old_folder"], tmp_path / f".out.partial-{host}-{dead}-old-abc")
    (tmp_path / f".out.partial-{host}-{dead}-def").mkdir()
    clean_stale_partials(out)
    assert snapshot(out) == models["old"]
    assert partials(out) == []


def test_without_atomic_exchange_the_swap_still_completes(tmp_path, models, monkeypatch):
    import shutil

    from attnres_convert import convert
    from attnres_convert.io import saving

    monkeypatch.setattr(saving, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    shutil.copytree(models["old_folder"], out)
    convert(str(models["source"]), out, block_size=3, verify=False, overwrite=True, stream=False)
    assert snapshot(out) == models["new"] and partials(out) == []


# ---------------------------------------------------------------- the installed command


def _run_and_signal(out: Path, source: Path, sig: int) -> tuple[subprocess.CompletedProcess, bool]:
    """`attnres convert SOURCE -o OUT --overwrite --no-verify --no-stream` (the in-memory path, as the reference
    outputs were written), sent SIG as soon as its temporary folder appears."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from attnres_convert.cli import main; sys.exit(main())",
            "convert",
            str(source),
            "-o",
            str(out),
            "--overwrite",
            "--no-verify",
            "--block-size",
            "3",
            "--no-stream",
        ],
        cwd=ROOT,
        env={**os.environ, **ONE_THREAD_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    deadline, hit = time.monotonic() + 120, False
    while time.monotonic() < deadline and process.poll() is None:
        if partials(out):
            process.send_signal(sig)
            hit = True
            break
        time.sleep(0.0005)
    stdout, stderr = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), hit


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=["SIGKILL", "SIGINT", "SIGTERM"])
def test_installed_command_interrupted_while_saving(tmp_path, models, sig):
    """The real command, signalled while it writes: the previous output survives untouched. Ctrl-C and SIGTERM
    also remove the temporary folder at once (SIGKILL's is removed by the next run, above)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(models["old_folder"], out)
    result, hit = _run_and_signal(out, models["source"], sig)
    outcome = assert_old_or_complete_new(out, models, models["old"])
    if not hit:
        pytest.skip("the command finished before its temporary folder was seen")
    if outcome == "new":
        assert result.returncode in (0, -sig, 1, 128 + sig)
        return
    if sig == signal.SIGKILL:
        assert result.returncode == -signal.SIGKILL
    else:
        assert result.returncode == 128 + sig, (result.returncode, result.stderr)  # unwound, not killed by the signal
        assert partials(out) == [], "the temporary folder was not removed"
        assert "Traceback" not in result.stderr, result.stderr
    assert json.loads((out / "config.json").read_text())["block_size"] == 2


@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "over-previous"])
def test_disk_full_while_saving(tmp_path, models, monkeypatch, previous):
    """A write error half-way (here: no space left) is a clear error, exit 2, the temporary folder is gone and
    the previous output, if any, is untouched."""
    import errno
    import shutil

    from reliability_helpers import assert_user_error, run_cli

    from attnres_convert.io import saving

    def disk_full(model, folder, tokenizer=None, extra=None, max_shard_size=None):
        (folder / "model.safetensors").write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "model.safetensors"))

    monkeypatch.setattr(saving, "write_converted", disk_full)
    out = tmp_path / "out"
    if previous:
        shutil.copytree(models["old_folder"], out)
    result = run_cli(
        "convert", models["source"], "-o", out, "--overwrite", "--no-verify", "--block-size", "3", "--no-stream"
    )
    assert_user_error(result, str(out), "No space left on device", "nothing was written there", "free disk space")
    assert snapshot(out) == (models["old"] if previous else None)
    assert partials(out) == []
