"""Security: remote code only with --trust-remote-code; pickle weights only with weights_only (and a
warning); no unsafe loader anywhere in the package; the code shipped next to converted weights only
defines the model."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from reliability_helpers import ONE_THREAD_ENV, ROOT, assert_user_error, run_attnres, run_cli

PACKAGE = ROOT / "attnres_convert"
SENTINEL_ENV = "ATTNRES_TEST_REMOTE_CODE_SENTINEL"


# ---------------------------------------------------------------- remote code

CUSTOM_CONFIG = f'''
import os
import pathlib

from transformers import LlamaConfig

# Proof that this file ran: it writes the file named by ${SENTINEL_ENV}.
_sentinel = os.environ.get("{SENTINEL_ENV}")
if _sentinel:
    pathlib.Path(_sentinel).write_text("the model's own code ran")


class CustomConfig(LlamaConfig):
    model_type = "llama"
'''

CUSTOM_MODELING = """
from transformers import LlamaForCausalLM

from .configuration_custom import CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


@pytest.fixture()
def remote_code_model(tmp_path, tiny_llama_folder) -> Path:
    """A local folder whose config maps AutoConfig / AutoModelForCausalLM to its own Python files, and whose
    model type transformers does not know: it loads only by running that code."""
    folder = tmp_path / "custom-model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((tiny_llama_folder / "model.safetensors").read_bytes())
    config = json.loads((tiny_llama_folder / "config.json").read_text())
    config.update(
        model_type="tiny_custom_llama",
        architectures=["CustomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (folder / "modeling_custom.py").write_text(CUSTOM_MODELING)
    return folder


def test_remote_code_is_refused_without_the_flag(tmp_path, remote_code_model, monkeypatch):
    sentinel = tmp_path / "remote-code-ran"
    monkeypatch.setenv(SENTINEL_ENV, str(sentinel))
    out = tmp_path / "out"
    result = run_cli("convert", remote_code_model, "-o", out)
    assert_user_error(result, str(remote_code_model), "needs custom code", "--trust-remote-code", out=out)
    assert not sentinel.exists(), "the model's code ran without --trust-remote-code"

    # The library calls refuse too: the config and the weights.
    from attnres_convert.errors import SourceError
    from attnres_convert.io.sources import load_config, load_model, resolve_source

    source = resolve_source(str(remote_code_model))
    for load in (load_config, load_model):
        with pytest.raises(SourceError, match="--trust-remote-code"):
            load(source)
    assert not sentinel.exists()


def test_remote_code_runs_with_the_flag(tmp_path, remote_code_model):
    """In a fresh Python with its own module cache: with trust_remote_code the custom classes load."""
    sentinel = tmp_path / "remote-code-ran"
    env = {
        **os.environ,
        **ONE_THREAD_ENV,
        SENTINEL_ENV: str(sentinel),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_HOME": str(tmp_path / "hf-home"),
    }
    code = textwrap.dedent(f"""
        from attnres_convert.io.sources import load_config, load_model, resolve_source
        source = resolve_source({str(remote_code_model)!r})
        print(type(load_config(source, trust_remote_code=True)).__name__)
        print(type(load_model(source, trust_remote_code=True)).__name__)
    """)
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["CustomConfig", "CustomForCausalLM"]
    assert sentinel.read_text() == "the model's own code ran"


def test_model_with_its_own_code_converts_only_with_the_flag_and_ships_that_code(tmp_path, remote_code_model):
    """With --trust-remote-code a model defined by its own code converts, and the output carries that very
    code, byte for byte, next to ours (the end-to-end load without the original folder: test_remote_code)."""
    out = tmp_path / "out"
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HOME": str(tmp_path / "hf-home")}
    result = run_attnres("convert", remote_code_model, "-o", out, "--trust-remote-code", env=env)
    assert result.returncode == 0, result.stderr
    for name in ("configuration_custom.py", "modeling_custom.py"):
        assert (out / name).read_bytes() == (remote_code_model / name).read_bytes()


# ---------------------------------------------------------------- pickle checkpoints


def _pickle_folder(folder: Path, tiny_llama_folder: Path, state: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama_folder / "config.json").read_text())
    torch.save(state, folder / "pytorch_model.bin")
    return folder


def _state_dict(tiny_llama_folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(tiny_llama_folder / "model.safetensors")


def test_pickle_checkpoint_loads_with_a_warning(tmp_path, tiny_llama_folder):
    folder = _pickle_folder(tmp_path / "pickled", tiny_llama_folder, _state_dict(tiny_llama_folder))
    out = tmp_path / "out"
    result = run_cli("convert", folder, "-o", out)
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "warning:" in flat and "pickle" in flat and "weights_only=True" in flat and "safetensors" in flat, flat
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))  # the output is safetensors


class _RunsCode:
    """Unpickling this calls exec(): what a malicious pytorch_model.bin does."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (exec, (f"open({str(self.sentinel)!r}, 'w').write('pwned')",))


@pytest.mark.parametrize("force_unsafe_env", [False, True], ids=["default", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_malicious_pickle_is_refused(tmp_path, tiny_llama_folder, monkeypatch, force_unsafe_env):
    """A pickle that would run code is refused (weights_only=True, passed explicitly so torch's environment
    override cannot turn it off), with a message saying why and what to use instead."""
    sentinel = tmp_path / "pwned"
    state = _state_dict(tiny_llama_folder)
    state["model.payload"] = _RunsCode(sentinel)
    folder = _pickle_folder(tmp_path / "evil", tiny_llama_folder, state)
    assert b"exec" in (folder / "pytorch_model.bin").read_bytes()  # the payload is in the file
    if force_unsafe_env:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    out = tmp_path / "out"
    result = run_cli("convert", folder, "-o", out)
    assert_user_error(
        result,
        str(folder),
        "refused to load the pickle checkpoint",
        "exec",
        "weights_only=True",
        "safetensors",
        out=out,
    )
    assert not sentinel.exists(), "unpickling ran code"


# ---------------------------------------------------------------- static checks of the package


def _python_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.py"))


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _keyword(call: ast.Call, name: str):
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return None


def test_no_unsafe_deserialisation_anywhere_in_the_package():
    """Every torch.load passes weights_only=True; YAML only through safe_load/SafeLoader; no pickle, marshal,
    eval or exec. Scans every module of attnres_convert and cli.py (also code added later)."""
    problems = []
    for path in _python_files(PACKAGE) + [ROOT / "cli.py"]:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                )
                for name in names:
                    if name.split(".")[0] in ("pickle", "marshal", "shelve", "dill", "cloudpickle"):
                        problems.append(f"{path.name}:{node.lineno} imports {name}")
        for call in _calls(tree):
            name = _dotted(call.func)
            where = f"{path.name}:{call.lineno} {name}"
            if name.endswith("torch.load"):
                flag = _keyword(call, "weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    problems.append(f"{where} without weights_only=True")
            if name in ("eval", "exec", "compile", "__import__"):
                problems.append(f"{where}: evaluates code")
            if name in ("yaml.load", "yaml.load_all"):
                loader = _keyword(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
                if loader is None or "Safe" not in _dotted(loader):
                    problems.append(f"{where} without SafeLoader")
            if name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
                problems.append(f"{where}: unsafe YAML loader")
            if name.endswith("from_pretrained"):
                flag = _keyword(call, "trust_remote_code")
                if isinstance(flag, ast.Constant) and flag.value is True:
                    problems.append(f"{where} with trust_remote_code=True hard-coded")
    assert problems == []


# What the code saved next to converted weights may import: torch, transformers, its own files (relative
# imports) and pure-computation parts of the standard library. It writes no file and builds no native code: the
# C++ and Triton kernels stay in the attnres package (kernels/), which the shipped code asks for, where installed,
# through one import (PACKAGE_IMPORTS), so a folder carries no kernel code of its own (no .cpp, no extension build).
ALLOWED_STDLIB = {
    "__future__",
    "typing",
    "dataclasses",
    "collections",
    "contextlib",
    "inspect",
    "math",
    "enum",
    "functools",
    "itertools",
    "abc",
    "numbers",
    "copy",
    "types",
    "operator",
    "warnings",
    "os",
    "re",
}
PACKAGE_IMPORTS = {("attnres_convert", "kernels")}  # modeling_attnres.installed_kernels: the installed package's
# triton: the fused kernels, imported only where it is installed.
ALLOWED_THIRD_PARTY = {"torch", "transformers", "triton"}
FORBIDDEN_CALLS = {"open", "eval", "exec", "compile", "__import__", "breakpoint", "input"}
# Attribute names that reach files, processes or the network from torch/transformers objects.
FORBIDDEN_ATTRIBUTES = {
    "load",
    "save",
    "hub",
    "load_library",
    "cpp_extension",
    "system",
    "popen",
    "urlopen",
    "hf_hub_download",
    "snapshot_download",
    "cached_file",
    "download",
    "unlink",
    "write_text",
    "write_bytes",
    "rmtree",
    "environ",
    "getenv",
    "set_trace",
}


def _shipped_files(tmp_path: Path) -> list[Path]:
    """The .py files of a real converted folder (whatever save_pretrained copies, not a list kept by hand)."""
    from tiny_models import tiny_model

    from attnres_convert import save_converted
    from attnres_convert.conversion.surgery import convert_model

    out = save_converted(convert_model(tiny_model("llama"), block_size=2), tmp_path / "converted")
    return sorted(out.glob("*.py"))


def test_shipped_code_only_defines_the_model(tmp_path):
    files = _shipped_files(tmp_path)
    from attnres_convert.io.saving import SHIPPED_CODE

    assert (
        sorted(path.name for path in files)
        == sorted(SHIPPED_CODE)
        == ["configuration_attnres.py", "modeling_attnres.py"]
    )
    folder = files[0].parent
    assert not [path.name for path in folder.iterdir() if path.suffix in (".cpp", ".cu", ".so", ".pyd", ".c", ".h")]
    imports, problems = {}, []
    for path in files:
        tree = ast.parse(path.read_text(), filename=path.name)
        # `os` is there only to read environment switches (ATTNRES_KERNEL): `os.environ.get(...)`, nothing else.
        env_reads = {
            id(node.func.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and _dotted(node.func.value) == "os.environ"
        }
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and {(node.module, alias.name) for alias in node.names} <= PACKAGE_IMPORTS
            ):
                modules = []  # the installed attnres package's kernels (none in the folder)
                imports.setdefault(path.name, set()).add(f"{node.module}.{node.names[0].name}")
            elif isinstance(node, ast.ImportFrom):
                modules = [] if node.level else [node.module or ""]
                if node.level:
                    local = (node.module or "").split(".")[0] + ".py"
                    if local not in SHIPPED_CODE:
                        problems.append(f"{where}: relative import of {node.module}, not shipped")
            else:
                modules = []
            for module in modules:
                imports.setdefault(path.name, set()).add(module)
                top = module.split(".")[0]
                if top not in ALLOWED_STDLIB | ALLOWED_THIRD_PARTY:
                    problems.append(f"{where}: imports {module}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
                problems.append(f"{where}: calls {node.func.id}()")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and id(node) not in env_reads
            ):
                problems.append(f"{where}: uses {_dotted(node)} (only os.environ.get is allowed)")
            # Triton's tl.load / tl.store move data between GPU memory and registers, not files.
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in FORBIDDEN_ATTRIBUTES
                and id(node) not in env_reads
                and not _dotted(node).startswith("tl.")
            ):
                problems.append(f"{where}: uses .{node.attr} ({_dotted(node)})")
            if isinstance(node, ast.Name) and node.id in ("__builtins__", "__loader__", "__spec__"):
                problems.append(f"{where}: touches {node.id}")
    assert problems == [], problems
    # What it does import (kept visible in the test output on failure): torch, transformers, typing helpers.
    everything = set().union(*imports.values())
    assert {"torch", "transformers"} <= {module.split(".")[0] for module in everything}
    assert "attnres_convert.kernels" in imports["modeling_attnres.py"]  # the one import of the package, allowed above


def test_shipped_code_opens_no_file_and_no_connection_at_runtime(tmp_path):
    """A converted folder loaded through trust_remote_code in a fresh Python (as a user without attnres
    would): no connection while loading and running it, and its forward pass opens no file."""
    folder = _shipped_files(tmp_path)[0].parent
    code = textwrap.dedent(f"""
        import builtins, socket
        import torch
        from transformers import AutoModelForCausalLM
        connections, opened = [], []
        real_connect, real_open = socket.socket.connect, builtins.open
        def watched_connect(self, address):
            connections.append(address)
            return real_connect(self, address)
        def watched_open(file, *args, **kwargs):
            opened.append(str(file))
            return real_open(file, *args, **kwargs)
        socket.socket.connect = watched_connect
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        assert type(model).__name__ == "AttnResForCausalLM", type(model)
        builtins.open = watched_open
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]))
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
        builtins.open = real_open
        print("OPENED", opened)
        print("CONNECTIONS", connections)
    """)
    env = {
        **os.environ,
        **ONE_THREAD_ENV,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_HOME": str(tmp_path / "hf"),
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    report = [line for line in result.stdout.splitlines() if line.startswith(("OPENED", "CONNECTIONS"))]
    assert report == ["OPENED []", "CONNECTIONS []"], result.stdout


def test_resume_refuses_a_tampered_checkpoint(tmp_path):
    """Accelerate unpickles registered state (custom_checkpoint_*.pkl) without weights_only: a checkpoint that
    holds code is refused before it is read, so `--resume` never runs it."""
    from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe

    from attnres_convert.finetune.recipe import load_recipe
    from attnres_convert.finetune.training import TrainingInterrupted, finetune

    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        tiny_recipe(tiny_model_folder(tmp_path / "model"), write_corpus(tmp_path / "corpus"), out, train={"steps": 6}),
    )
    with pytest.raises(TrainingInterrupted):
        finetune(load_recipe(recipe), stop_at_step=2)
    checkpoint = sorted((out / "checkpoints").iterdir())[-1]
    sentinel = tmp_path / "pwned"
    pickles = sorted(checkpoint.glob("custom_checkpoint_*.pkl"))
    assert pickles
    state = torch.load(pickles[-1], weights_only=True)
    torch.save({**state, "payload": _RunsCode(sentinel)}, pickles[-1])
    result = run_cli("finetune", recipe, "--resume")
    assert_user_error(result, "--resume", pickles[-1].name, "exec", "could run code")
    assert not sentinel.exists(), "resuming ran the checkpoint's code"


def test_cpu_kernel_build_compiles_only_its_own_source(monkeypatch, tmp_path):
    """The package's CPU kernels (never shipped in a folder) build exactly the C++ text of their own source file, and
    only where ATTNRES_KERNEL=cpu selects them: auto (the default) and eager never reach the compiler (auto loads a
    build already on the machine, see test_cpu_kernels.py; here the machine has none)."""
    import torch
    import torch.utils.cpp_extension

    from attnres_convert import kernels as depth_backends
    from attnres_convert.kernels import cpu as depth_kernels_cpu

    calls = []
    monkeypatch.setattr(
        torch.utils.cpp_extension, "load_inline", lambda *args, **kwargs: calls.append((args, kwargs)) or "built"
    )
    monkeypatch.setattr(depth_kernels_cpu, "_BUILT", [])
    monkeypatch.setattr(depth_kernels_cpu, "_PREBUILT", [])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    x = torch.zeros(1, 1, 8)
    for mode in ("auto", "eager", ""):
        monkeypatch.setenv("ATTNRES_KERNEL", mode)
        assert depth_backends.cpu_kernels_for(x) is None
    assert calls == []
    monkeypatch.setenv("ATTNRES_KERNEL", "cpu")
    assert depth_backends.cpu_kernels_for(x) == "built"
    (name,), kwargs = calls[0]
    assert name.startswith("attnres_depth_cpu_") and kwargs["cpp_sources"] == [depth_kernels_cpu.source_text()]
    assert (
        depth_kernels_cpu.source_text()
        == Path(depth_kernels_cpu.__file__).with_name("depth_kernels_cpu.cpp").read_text()
    )
    assert set(kwargs) == {"cpp_sources", "extra_cflags", "extra_ldflags"}  # no CUDA sources, no extra includes
