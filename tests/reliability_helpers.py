"""Shared helpers of the reliability and security tests: run the CLI, check a user error, make
tiny model folders and broken copies of them, read sharded ones."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent


# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP threads spinning
# against other processes make a 1-second fine-tuning run take 25 s: every test module runs with one torch
# thread (conftest's `_one_thread`), and the processes these tests start get one thread too.
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_cli(*args, env: dict | None = None):
    """`attnres ARGS` in this process (a CliRunner): the exit code and everything printed."""
    from attnres_convert import cli

    return CliRunner().invoke(cli.app, [str(arg) for arg in args], env=env)


def squash(text: str) -> str:
    """Without whitespace: Rich wraps long messages at the terminal width, anywhere a space is."""
    return "".join(text.split())


def leftovers(out: Path) -> list[Path]:
    """Anything named after OUT beside it: the output itself or a temporary folder for it."""
    out = Path(os.path.abspath(out))
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def assert_user_error(result, *needles: str, out: Path | None = None, code: int = 2) -> str:
    """Exit code 2, a one-line `error:` that contains every needle (case-insensitive), no traceback, and
    nothing written at OUT (not even a temporary folder beside it)."""
    output = result.output
    assert result.exit_code == code, f"exit code {result.exit_code}, output:\n{output}\n{result.exception!r}"
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output, output
    assert "error" in output.lower(), output
    flat = squash(output).lower()
    for needle in needles:
        assert squash(str(needle)).lower() in flat, f"{needle!r} not in:\n{output}"
    if out is not None:
        assert leftovers(Path(out)) == [], f"written at the output: {leftovers(Path(out))}"
    return output


def run_attnres(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The installed `attnres` entry point (cli:main) in a fresh Python."""
    full_env = {**os.environ, **ONE_THREAD_ENV, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", "import sys; from attnres_convert.cli import main; sys.exit(main())", *map(str, args)],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def save_tiny(folder: Path, family: str = "llama", **save_kwargs) -> Path:
    from tiny_models import tiny_model

    tiny_model(family).save_pretrained(folder, **save_kwargs)
    return folder


def sharded_tensors(folder: Path) -> dict:
    """Every tensor of a sharded model folder, read through its index, which must name exactly what the
    shards hold."""
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(folder / file))
    assert set(tensors) == set(index["weight_map"]), folder
    return tensors


def save_config_only(folder: Path, config) -> Path:
    config.save_pretrained(folder)
    return folder


def copy_model(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def truncate(path: Path, fraction: float = 0.5) -> Path:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(int(size * fraction))
    return path


def edit_config(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))
    return folder


# ---------------------------------------------------------------- fault injection (run in a child process)


def convert_in_child(source: str, out: str, block_size: int, verify: bool, conn, stream: bool = False) -> None:
    """`attnres_convert.conversion.convert` reporting each stage over CONN as it starts (the parent kills us at chosen
    moments). Runs in a forkserver child: torch and transformers are already imported there."""
    import torch

    from attnres_convert import convert

    torch.set_num_threads(1)

    @contextlib.contextmanager
    def stage(name):
        conn.send(name)
        yield

    conn.send("started")
    convert(source, out, block_size=block_size, verify=verify, overwrite=True, stage=stage, stream=stream)
    conn.send("done")


def snapshot(folder: Path) -> dict[str, str] | None:
    """Relative path -> sha256 of every file under FOLDER (None when it does not exist)."""
    import hashlib

    folder = Path(folder)
    if not folder.exists():
        return None
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def forkserver_context():
    """A multiprocessing context whose forkserver has imported attnres once: a child starts in milliseconds,
    so tests can kill many of them. (The forkserver never ran torch code, so forking it is safe.)"""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["reliability_helpers", "tiny_models", "attnres_convert", "attnres_convert.finetune.training"]
    )
    return context


def finetune_in_child(recipe_path: str, resume: bool) -> None:
    """`attnres_convert.finetune.training.finetune` on a recipe file, quietly (the parent kills us at chosen moments)."""
    import torch

    from attnres_convert.finetune.recipe import load_recipe
    from attnres_convert.finetune.training import finetune

    torch.set_num_threads(1)
    finetune(load_recipe(recipe_path), resume=resume)


@contextlib.contextmanager
def read_only_folder(folder: Path):
    """FOLDER made read-only for real, also for root (who ignores permission bits): the immutable attribute
    (chattr +i) as root, chmod 555 otherwise. Yields False where this filesystem cannot do it."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        done = (
            shutil.which("chattr") is not None
            and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        )
        try:
            yield done
        finally:
            if done:
                subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        try:
            yield True
        finally:
            folder.chmod(0o755)
