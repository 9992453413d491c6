"""The package's layers, read from the source with ast (every import counts, module-level or inside a
function): errors <- modeling (the shipped code) <- kernels, architectures <- io <- conversion <- hub / analysis
<- finetune <- cli. The one exception: the shipped code asks for the installed package's kernels (an absolute import
of attnres_convert.kernels inside a function), which a converted folder's copy does as well.
A module never imports a layer above its own, and no chain of imports comes back to where it started; the
shipped code is what a converted folder holds. And the files stay readable as files: no module over
MAX_LINES lines, no C or C++ inside a Python file, no symbolic link tracked by git."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

import attnres_convert
from attnres_convert.modeling import SHIPPED_CODE

PACKAGE = Path(attnres_convert.__file__).resolve().parent
ROOT = "(the package root, which re-exports every layer)"
RANK = {
    "errors": 0,
    "optional": 0.5,
    "modeling": 1,
    "kernels": 1.5,
    "architectures": 1.5,
    "transformers_compat": 1.5,
    "block_sizes": 1.5,
    "depth_controls": 1.6,
    "io": 2,
    "conversion": 3,
    "hub": 4,
    "analysis": 4,
    "serving": 4,
    "finetune": 5,
    ROOT: 6,
    "cli_kit": 6.5,
    "cli_tables": 6.6,
    "cli_training": 6.7,
    "cli": 7,
    "__main__": 8,
}
SHIPPED_MAY_IMPORT = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)
# The installed attnres package's kernels, asked for inside a function (modeling_attnres.installed_kernels).
OPTIONAL_KERNELS = "attnres_convert.kernels"
# A module a newcomer can read in one sitting; past this it holds more than one thing. The generated modeling file
# is read as its sources (modeling/sources/), each under the limit; its own size is test_generated_modeling's.
MAX_LINES = 700
GENERATED = "modeling.modeling_attnres"
SYMLINK_MODE = "120000"  # git's file mode for a symbolic link


def modules() -> dict[str, Path]:
    """'io.saving' -> its file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).with_suffix("")
        if relative.name == "__init__" and len(relative.parts) == 1:
            continue
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        found[".".join(parts)] = path
    return found


def package_imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module of this package, line) for every import in the file; relative ones resolved."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            # `from .pkg import name` imports the submodule pkg.name when there is one
            targets = [f"{module}.{a.name}" if _is_module(module, a.name) else module for a in node.names]
        else:
            continue
        for target in targets:
            if isinstance(node, ast.Import) or not node.level:
                if target.split(".")[0] != "attnres_convert" or (
                    top(name) == "modeling" and target == OPTIONAL_KERNELS
                ):
                    continue
                target = target.partition(".")[2]
            found.append((target.strip(".") or ROOT, node.lineno))
    return found


def _is_module(module: str, name: str) -> bool:
    folder = PACKAGE.joinpath(*module.removeprefix("attnres_convert").strip(".").split(".")) if module else PACKAGE
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()


def top(module: str) -> str:
    return module.split(".")[0]


def test_the_import_parser_sees_relative_absolute_and_lazy_imports(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "from ..errors import AttnResError\nfrom .card import x\nimport attnres_convert.hub.push\n"
        "def f():\n    from ..finetune import training\n    import json\n"
    )
    assert package_imports("io.sample", source) == [
        ("errors", 1),
        ("io.card", 2),
        ("hub.push", 3),
        ("finetune.training", 5),
    ]


def test_no_module_imports_a_layer_above_its_own():
    violations = []
    for name, path in modules().items():
        for target, line in package_imports(name, path):
            source_layer, target_layer = top(name), top(target)
            if source_layer == target_layer:
                continue
            where = f"{path.relative_to(PACKAGE)}:{line} imports {target}"
            if RANK[target_layer] > RANK[source_layer]:
                violations.append(f"{where} (a higher layer)")
            elif RANK[target_layer] == RANK[source_layer]:
                violations.append(f"{where} (a sibling it must not depend on)")
    assert violations == [], "\n".join(violations)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package (the package root included) -> the other modules of the package it imports."""
    files = modules() | {ROOT: PACKAGE / "__init__.py"}
    graph = {}
    for name, path in files.items():
        # The root's relative imports resolve from the package itself.
        targets = package_imports("" if name == ROOT else name, path)
        graph[name] = {target for target, _ in targets if target != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of the graph, each as the shortest chain of imports from a module back to itself; a module
    already on a reported circle starts no other, so one tangle is reported once or a few times, not per module."""
    cycles, covered = [], set()
    for start in sorted(graph):
        if start in covered:
            continue
        chain = _chain_back_to(graph, start)
        if chain:
            cycles.append(chain)
            covered.update(chain)
    return cycles


def _chain_back_to(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """[start, ..., start], the fewest imports that lead from start back to it (breadth first); None if none do."""
    parents = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph.get(node, ())):
            if target == start:
                chain = [start]
                while node is not None:
                    chain.append(node)
                    node = parents[node]
                return chain[::-1]
            if target not in parents:
                parents[target] = node
                queue.append(target)
    return None


def test_no_chain_of_imports_comes_back_to_where_it_started():
    tangled = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a", "f"}, "f": {"e"}}
    assert import_cycles(tangled) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert import_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    cycles = import_cycles(import_graph())
    assert cycles == [], "import circles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def long_modules(files: dict[str, Path], limit: int = MAX_LINES) -> list[str]:
    counts = {name: len(path.read_text().splitlines()) for name, path in files.items()}
    return [f"{name}: {count} lines" for name, count in counts.items() if count > limit]


def test_no_module_is_over_the_line_limit(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules({p.stem: p for p in tmp_path.glob("*.py")}) == [f"long: {MAX_LINES + 1} lines"]
    too_long = long_modules(
        {name: path for name, path in modules().items() if name != GENERATED} | {ROOT: PACKAGE / "__init__.py"}
    )
    assert too_long == [], f"over {MAX_LINES} lines (split by what each part owns):\n" + "\n".join(too_long)


def includes_in(paths: list[Path]) -> list[str]:
    """'file:line' for each `#include` in these files: C or C++ belongs in its own source file."""
    return [
        f"{path.name}:{number}"
        for path in paths
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "#include" in line
    ]


def test_no_python_file_holds_c_or_cpp(tmp_path):
    (tmp_path / "embedded.py").write_text('SOURCE = """\n#include <cmath>\n"""\n')
    (tmp_path / "plain.py").write_text("import math\n")
    assert includes_in(sorted(tmp_path.glob("*.py"))) == ["embedded.py:2"]
    found = includes_in(sorted(PACKAGE.rglob("*.py")))
    assert found == [], "#include inside Python files:\n" + "\n".join(found)


def tracked_symlinks(repository: Path) -> list[str]:
    """The paths git tracks as symbolic links in this checkout (mode 120000 in the index)."""
    listing = subprocess.run(["git", "ls-files", "-s", "-z"], cwd=repository, capture_output=True, check=True).stdout
    entries = (entry.decode().split("\t", 1) for entry in listing.split(b"\0") if entry)
    return [path for info, path in entries if info.split()[0] == SYMLINK_MODE]


def test_no_symbolic_link_is_tracked(tmp_path):
    """A checkout on Windows, or a tool that does not follow links, gets a small text file for each."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "target.py").write_text("x = 1\n")
    (tmp_path / "link.py").symlink_to("target.py")
    subprocess.run(["git", "add", "target.py", "link.py"], cwd=tmp_path, check=True)
    assert tracked_symlinks(tmp_path) == ["link.py"]
    repository = PACKAGE.parent
    if not (repository / ".git").exists():
        pytest.skip("the package is not in a git checkout")
    assert tracked_symlinks(repository) == []


def test_errors_is_the_bottom_and_the_recipe_schema_stands_alone():
    assert package_imports("errors", PACKAGE / "errors.py") == []
    # The schema is parsed and validated without the file system, the models or the hub: it may share
    # convert's option declarations (fields, size parsing), which need nothing else of the package, and say that
    # pydantic is missing (optional.py).
    schema = {target for target, _ in package_imports("finetune.recipe", PACKAGE / "finetune" / "recipe.py")}
    assert schema <= {"errors", "optional", "conversion.options", "io.hub_access"}, schema
    assert [target for target, _ in package_imports("optional", PACKAGE / "optional.py")] == ["errors"]
    options = {target for target, _ in package_imports("conversion.options", PACKAGE / "conversion" / "options.py")}
    assert options <= {"errors", "io.samples", "io.hub_access"}, options


def test_the_shipped_code_imports_only_its_siblings_torch_transformers_and_stdlib():
    folder = PACKAGE / "modeling"
    code = sorted(
        p.name for p in folder.iterdir() if p.suffix in (".py", ".cpp") and p.name not in ("__init__.py", "generate.py")
    )
    assert code == list(SHIPPED_CODE)
    siblings = {Path(name).stem for name in SHIPPED_CODE}
    problems = []
    for name in (name for name in SHIPPED_CODE if name.endswith(".py")):
        for node in ast.walk(ast.parse((folder / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level != 1 or node.module not in siblings:
                    problems.append(f"{name}:{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                roots = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module == "attnres_convert":
                    roots = [f"{node.module}.{alias.name}" for alias in node.names]
                problems += [
                    f"{name}:{node.lineno}: import {root}"
                    for root in roots
                    if root.split(".")[0] not in SHIPPED_MAY_IMPORT and root != OPTIONAL_KERNELS
                ]
    assert problems == [], "\n".join(problems)


@pytest.fixture(scope="module")
def converted_folder(tmp_path_factory):
    from tiny_models import tiny_model

    from attnres_convert import convert_model, save_converted

    return save_converted(convert_model(tiny_model("llama"), block_size=2), tmp_path_factory.mktemp("layout") / "m")


def test_a_converted_folder_holds_exactly_the_shipped_code(converted_folder):
    code = sorted(p.name for p in converted_folder.rglob("*") if p.suffix in (".py", ".cpp"))
    assert code == sorted(SHIPPED_CODE)
    for name in SHIPPED_CODE:  # the files themselves, not older or generated copies
        assert (converted_folder / name).read_bytes() == (PACKAGE / "modeling" / name).read_bytes(), name


def test_importing_the_package_registers_nothing_and_registration_is_explicit(converted_folder):
    """Importing every module leaves transformers' Auto classes alone; register_auto_classes (called by
    convert_model, save_converted and load_converted; idempotent) makes AutoModelForCausalLM load the
    folder with this package's classes, no remote code."""
    import subprocess
    import textwrap

    code = textwrap.dedent(
        f"""
        import importlib, pkgutil
        import attnres_convert
        # Not the command line, the entry point, or the vLLM model class and its parts (they import vLLM: only
        # vLLM imports them).
        skip = {{"attnres_convert.cli", "attnres_convert.__main__"}} | {{
            f"attnres_convert.serving.vllm_{{name}}" for name in ("model", "parallel", "weights")
        }}
        for info in pkgutil.walk_packages(attnres_convert.__path__, "attnres_convert."):
            if info.name not in skip:
                importlib.import_module(info.name)
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        print("attnres" in CONFIG_MAPPING)
        attnres_convert.register_auto_classes()
        attnres_convert.register_auto_classes()
        print(type(AutoModelForCausalLM.from_pretrained({str(converted_folder)!r}, trust_remote_code=False)).__name__)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PACKAGE.parent,
        stdin=subprocess.DEVNULL,
    )
    assert result.stdout.split() == ["False", "AttnResForCausalLM"], result.stdout + result.stderr[-2000:]


def test_the_command_line_starts_without_torch():
    """`attnres --help` and the option declarations it reads load neither torch nor transformers: the
    package's public names load on first use."""
    import subprocess

    code = "import sys, attnres_convert.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PACKAGE.parent,
        stdin=subprocess.DEVNULL,
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]


def test_tests_share_helpers_through_helper_modules_never_through_test_modules():
    """A test module is imported by pytest alone: what tests share lives in a helper module (tiny_models,
    isolated, design_reference, ...), under a public name. Python code inside strings (run by a child Python)
    is not an import of this file and is not read here."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names, module = [alias.name for alias in node.names], node.module
            elif isinstance(node, ast.Import):
                names, module = [], None
                found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if _is_test(a.name)]
            else:
                continue
            if module is None or not (tests / f"{module}.py").exists():
                continue
            if _is_test(module):
                found.append(f"{path.name}:{node.lineno} imports test module {module}")
            found += [f"{path.name}:{node.lineno} imports {module}.{n}" for n in names if n.startswith("_")]
    assert not found, "move what is shared into a helper module, under a public name:\n" + "\n".join(found)


def _is_test(module: str) -> bool:
    return module.split(".")[0].startswith("test_")
