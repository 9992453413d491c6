"""attnres runs from a checkout (`python3 -m attnres_convert`) where only torch, transformers, accelerate, peft,
typer and rich are installed: a command that needs a missing optional package says which, why and how to install
it (exit 2, nothing written); the others work. The packages are made unimportable in a child process by a
meta-path finder that refuses them, as if they were not installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from reliability_helpers import save_tiny, squash

from attnres_convert.errors import AttnResError
from attnres_convert.optional import REQUIRED, REQUIREMENTS, MissingPackageError, available, require

ROOT = Path(__file__).resolve().parents[1]


def _typer_requires_pydantic() -> bool:
    """typer >= 0.29 requires pydantic and imports it to parse every command's parameters: where it is installed,
    pydantic cannot be missing (typer itself would fail), so the pydantic cases need an older typer."""
    from importlib.metadata import requires

    return any(r.replace(" ", "").startswith("pydantic") and "extra" not in r for r in requires("typer") or [])


TYPER_NEEDS_PYDANTIC = _typer_requires_pydantic()
OPTIONAL = tuple(
    p for p in ("pydantic", "datasets", "gguf", "matplotlib", "pyarrow") if p != "pydantic" or not TYPER_NEEDS_PYDANTIC
)
needs_pydantic = pytest.mark.skipif(
    not available("pydantic"), reason="reads a recipe, and pydantic is not installed here"
)
needs_typer_without_pydantic = pytest.mark.skipif(
    TYPER_NEEDS_PYDANTIC, reason="this typer requires pydantic (typer >= 0.29), so pydantic cannot be missing here"
)

pytestmark = pytest.mark.extended  # end to end, tens of seconds: `make test-extended`

# `python -c BLOCKED_RUN "pkg1,pkg2" ARGS...`: `python -m attnres_convert ARGS` with those packages unimportable.
BLOCKED_RUN = r"""
import importlib.abc, runpy, sys

blocked = set(sys.argv[1].split(","))
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NotInstalled())
sys.argv = ["attnres_convert", *sys.argv[2:]]
runpy.run_module("attnres_convert", run_name="__main__", alter_sys=True)
"""


def run_without(blocked, *args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python3 -m attnres_convert ARGS` from the checkout, BLOCKED not importable."""
    cmd = [sys.executable, "-c", BLOCKED_RUN, ",".join(blocked), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=_env())


def _env() -> dict:
    import os

    return dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def assert_names_the_package(done: subprocess.CompletedProcess, module: str, needed_for: str) -> None:
    text = squash(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert squash(f"needs the Python package '{module}', which is not installed") in text, done.stderr
    assert squash(needed_for) in text, done.stderr
    assert (
        squash(f"-m pip install {REQUIREMENTS[module]}") in text
        or squash(f"-m pip install '{REQUIREMENTS[module]}'") in text
    ), done.stderr


def test_require_names_the_package_why_and_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # None in sys.modules: `import gguf` raises ImportError
    with pytest.raises(MissingPackageError) as raised:
        require("gguf", "reading model.gguf (a GGUF file)")
    message = str(raised.value)
    assert isinstance(raised.value, AttnResError)  # the CLI's exit code 2
    assert message.startswith("reading model.gguf (a GGUF file) needs the Python package 'gguf'")
    assert message.endswith(f"Install it with: {sys.executable} -m pip install 'gguf>=0.17.1'")
    assert not available("gguf")
    monkeypatch.setitem(REQUIREMENTS, "json", "json")  # an installed one comes back imported
    assert require("json", "anything").__name__ == "json" and available("json")
    with pytest.raises(ValueError, match="not one of the optional packages"):
        require("numpy", "anything")


def test_the_pip_commands_install_what_pyproject_requires():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {d.split(">")[0].split("=")[0].split("<")[0].strip().lower(): d.split("#")[0].strip() for d in declared}
    for module, requirement in REQUIREMENTS.items():
        if module in bounds:  # pyarrow comes with datasets: no bound of its own
            assert requirement == bounds[module], (module, requirement, bounds[module])
    for module, requirement in REQUIRED.items():
        assert requirement == bounds[module], (module, requirement, bounds[module])


@pytest.mark.parametrize("blocked", [("typer",), ("torch",), ("torch", "typer", "rich")], ids=",".join)
def test_a_missing_required_package_is_named_with_its_install_command(blocked, tmp_path):
    """`python3 -m attnres_convert --help` (and `python3 cli.py`) on a Python without typer or torch: one line naming
    every missing required package and the pip command for this Python, exit code 2, no traceback."""
    for done in (run_without(blocked, "--help"), _run_cli_py_without(blocked, "--help")):
        text = squash(done.stderr)
        assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr, done.stderr
        assert (
            squash(f"attnres needs the Python package{'s' if len(blocked) > 1 else ''} {', '.join(blocked)}, which")
            in text
        ), done.stderr
        assert squash(f"{sys.executable} -m pip install") in text, done.stderr
        for module in blocked:
            assert REQUIRED[module] in done.stderr or repr(REQUIRED[module]) in done.stderr, done.stderr
        assert ("download.pytorch.org/whl/cpu" in done.stderr) == ("torch" in blocked), done.stderr


def _run_cli_py_without(blocked, *args) -> subprocess.CompletedProcess:
    """`python3 cli.py ARGS` in the checkout, BLOCKED not importable."""
    script = BLOCKED_RUN.replace(
        'runpy.run_module("attnres_convert", run_name="__main__", alter_sys=True)',
        'runpy.run_path("cli.py", run_name="__main__")',
    )
    cmd = [sys.executable, "-c", script, ",".join(blocked), *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=_env())


@pytest.mark.slow
@needs_typer_without_pydantic
def test_recipes_say_they_need_pydantic_and_write_nothing(tmp_path):
    for args in (
        ["finetune", "quickstart-cpu", f"output.dir={tmp_path / 'run'}"],
        ["recipes", "list"],
        ["ab", "ab-scratch-cpu", "--from-scratch", "-o", tmp_path / "ab"],
    ):
        done = run_without(OPTIONAL, *args)
        assert_names_the_package(done, "pydantic", "a fine-tuning recipe (attnres finetune, ab and recipes)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_gguf_matplotlib_pyarrow_are_asked_for_by_the_command_that_needs_them(tmp_path):
    tiny = save_tiny(tmp_path / "tiny")
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    done = run_without(["gguf"], "convert", gguf_file, "-o", tmp_path / "out")
    assert_names_the_package(done, "gguf", f"reading {gguf_file} (a GGUF file)")
    assert not (tmp_path / "out").exists()

    done = run_without(["matplotlib"], "inspect", tiny, "--plot", tmp_path / "depth.png", "--max-tokens", "8")
    assert_names_the_package(done, "matplotlib", "--plot (drawing the depth-attention weights)")
    assert not list(tmp_path.glob("depth*.png"))

    parquet = tmp_path / "held-out.parquet"
    parquet.write_bytes(b"PAR1")
    done = run_without(["pyarrow"], "eval", tiny, "--data", parquet)
    assert_names_the_package(done, "pyarrow", f"reading {parquet} (a Parquet file)")


@pytest.mark.slow
@needs_pydantic
def test_a_recipe_reading_a_dataset_says_it_needs_datasets_before_training(tmp_path):
    tiny = save_tiny(tmp_path / "tiny")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {{source: {tiny}}}\n"
        "data: {train: {dataset: wikitext, name: wikitext-2-raw-v1}, eval: {fraction: 0.1}, seq_len: 16}\n"
        f"train: {{trainable: full, steps: 2, micro_batch: 1, lr: 1.0e-4}}\noutput: {{dir: {tmp_path / 'run'}}}\n"
    )
    done = run_without(["datasets"], "finetune", recipe)
    assert_names_the_package(done, "datasets", "reading the dataset 'wikitext'")
    assert "data.train.dataset" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_convert_and_bench_run_without_any_optional_package(tmp_path):
    tiny = save_tiny(tmp_path / "tiny")
    done = run_without(OPTIONAL, "--version")
    assert done.returncode == 0 and done.stdout.startswith("attnres "), done.stderr
    done = run_without(
        OPTIONAL, "convert", tiny, "-o", tmp_path / "converted", "--verify-tokens", "16", "--verify-new-tokens", "4"
    )
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["model_type"] == "attnres" and "PASS" in done.stdout
    out = tmp_path / "bench.json"
    done = run_without(
        OPTIONAL,
        "bench",
        tiny,
        "--seq-len",
        "16",
        "--decode-tokens",
        "2",
        "--rounds",
        "1",
        "--measure",
        "prefill,train",
        "--json",
        out,
    )
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"prefill", "train_step"} and all(row["ratio"] > 0 for row in rows.values())


@pytest.mark.slow
@needs_pydantic
def test_an_ab_without_matplotlib_writes_everything_but_the_picture(tmp_path):
    tiny = save_tiny(tmp_path / "tiny")
    out = tmp_path / "ab"
    docs = json.dumps([str(p) for p in sorted((ROOT / "docs").glob("*.md"))])
    done = run_without(
        ["matplotlib"],
        "ab",
        "ab-scratch-cpu",
        "--from-scratch",
        "-o",
        out,
        "--workdir",
        tmp_path / "arms",
        f"model.source={tiny}",
        "model.layers=2",
        "model.hidden=32",
        "model.heads=2",
        "model.kv_heads=2",
        "model.num_blocks=1",
        f"data.train.files={docs}",
        "data.eval.files=null",
        "data.eval.fraction=0.2",
        "data.seq_len=16",
        "train.steps=2",
        "train.warmup_steps=0",
        "train.micro_batch=1",
        "eval.every=1",
        "eval.max_sequences=2",
        f"output.dir={tmp_path / 'run'}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["ab.json", "ab.md"]
    assert len(json.loads((out / "ab.json").read_text())["arms"]) == 2
    text = squash(done.stderr)
    assert (
        squash("ab.png (the held-out curves) is not drawn") in text
        and squash("-m pip install 'matplotlib>=3.9'") in text
    )
    assert squash(f"{out} (ab.json, ab.md)") in squash(done.stdout), done.stdout  # the files it wrote, no more
    # each arm's run folder: everything but loss_curve.png
    runs = sorted((tmp_path / "arms").glob("*/seed-0"))
    assert [run.parent.name for run in runs] == ["attnres", "baseline"]
    for run in runs:
        assert (run / "final_metrics.json").is_file() and not (run / "loss_curve.png").exists()
