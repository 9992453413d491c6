"""The project installs like a package: the wheel built from this checkout, installed into a fresh
environment, runs `attnres` from a temporary directory with the checkout nowhere on sys.path: the shipped
recipes, the embedded model and text, and a one-step fine-tune of a tiny model all work from the wheel.

The fresh environment is a venv without pip whose only link to the shared one is a .pth line naming its
site-packages (torch, transformers... are not installed again); .pth files of the shared environment, such
as its editable install of this checkout, are not processed from there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from finetune_helpers import tiny_model_folder, tiny_recipe, write_recipe

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # builds a wheel and runs its command in fresh processes
NOT_PACKAGED = shutil.ignore_patterns(
    ".git",
    ".venv*",
    ".ci",
    "tests",
    "benchmarks",
    "docs",
    "outputs",
    "runs",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".cache",
)


def run(*args, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "ATTNRES_RECIPES")}
    env.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", COLUMNS="200", HF_HUB_OFFLINE="1"
    )
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=NOT_PACKAGED)
    built = run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        source,
        "-w",
        work / "dist",
        cwd=work,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = (work / "dist").glob("attnres-*.whl")

    env = work / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True, timeout=120)
    python = env / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=work).stdout.strip())
    installed = run(
        sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site, wheel, cwd=work
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    (site / "shared-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    cwd = work / "elsewhere"
    cwd.mkdir()
    return {"wheel": wheel, "python": python, "site": site, "attnres": site / "bin" / "attnres", "cwd": cwd}


def attnres(installed, *args, timeout: float = 240) -> subprocess.CompletedProcess:
    """The installed console script, run by the fresh environment's Python (as its shebang would be there)."""
    return run(installed["python"], installed["attnres"], *args, cwd=installed["cwd"], timeout=timeout)


def test_the_wheel_holds_the_package_the_recipes_and_no_top_level_cli(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = wheel.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert wheel.read(top_level).decode().split() == ["attnres_convert"]
        entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "attnres = attnres_convert.cli:main" in entry_points
    # vLLM's plugin (docs/serving.md): installing the wheel is what registers the architecture with vLLM.
    assert "[vllm.general_plugins]\nattnres = attnres_convert.serving.vllm_plugin:register" in entry_points
    assert "attnres_convert/serving/vllm_model.py" in names
    shipped = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    assert (
        sorted(
            Path(n).name
            for n in names
            if n.startswith("attnres_convert/recipes/") and n.endswith(".yaml") and "/accelerate/" not in n
        )
        == shipped
    )
    assert "attnres_convert/cli.py" in names and not any(n == "cli.py" for n in names)
    # The code a converted folder ships (two files), and the kernels that stay in the package: the C++ source
    # is package data, read beside kernels/cpu.py where ATTNRES_KERNEL=cpu builds it (no folder carries it).
    for name in (
        "modeling/modeling_attnres.py",
        "modeling/configuration_attnres.py",
        "architectures.py",
        "transformers_compat.py",
        "block_sizes.py",
        "depth_controls.py",
        "io/base_code.py",
        "kernels/__init__.py",
        "kernels/cpu.py",
        "kernels/depth_kernels_cpu.cpp",
        "kernels/step.py",
        "kernels/triton.py",
        "kernels/controls.py",
    ):
        assert f"attnres_convert/{name}" in names, name


def test_the_installed_package_is_the_wheel_not_the_checkout(installed):
    code = "import json, sys, attnres_convert; print(attnres_convert.__file__); print(json.dumps(sys.path))"
    probe = run(installed["python"], "-c", code, cwd=installed["cwd"])
    location, path = probe.stdout.splitlines()
    assert Path(location).is_relative_to(installed["site"]), location
    # No folder on sys.path holds a checkout's attnres_convert (the shared venv may sit inside one).
    holders = [entry for entry in json.loads(path) if (Path(entry or installed["cwd"]) / "attnres_convert").exists()]
    assert holders == [str(installed["site"])], holders


def test_recipes_list_and_validate_from_the_wheel(installed):
    listed = attnres(installed, "recipes", "list")
    assert listed.returncode == 0, listed.stderr
    assert str(installed["site"]) in listed.stdout.replace("\n", "")  # the recipes folder is the installed one
    for name in ("quickstart-cpu", "ab-smollm2-shakespeare"):
        assert name in listed.stdout
    assert "invalid" not in listed.stdout
    # The embedded model (its GGUF config: positions) and the embedded Shakespeare plays resolve from here.
    valid = attnres(installed, "recipes", "validate", "quickstart-cpu")
    assert valid.returncode == 0, valid.stdout + valid.stderr
    assert "valid: quickstart-cpu" in valid.stdout


def test_a_one_step_finetune_from_the_wheel(installed):
    cwd = installed["cwd"]
    model = tiny_model_folder(cwd / "tiny-model")
    held = cwd / "held_out.txt"
    held.write_text("To be, or not to be, that is the question.\n" * 40)
    # Training text from the embedded Shakespeare corpus, as the shipped recipes read it.
    recipe = tiny_recipe(model, {"train": ["shakespeare:tempest"], "eval": [str(held)]}, Path("run"))
    recipe["data"]["max_tokens"] = 4096
    write_recipe(cwd / "tiny.yaml", recipe)
    result = attnres(installed, "finetune", "tiny.yaml", "train.steps=1", "train.warmup_steps=0", "eval.every=0")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    final = json.loads((cwd / "run" / "final_metrics.json").read_text())
    assert final["steps"] == 1 and final["eval_loss"] > 0
    config = json.loads((cwd / "run" / "model" / "config.json").read_text())
    assert config["model_type"] == "attnres" and config["auto_map"]["AutoModelForCausalLM"]
    assert (cwd / "run" / "model" / "modeling_attnres.py").is_file()
