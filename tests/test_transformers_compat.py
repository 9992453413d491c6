"""Every transformers internal attnres uses is reached through modeling/transformers_compat.py, one test each, so a
transformers upgrade that moves one fails here under the internal's name (and loading says which one it was)."""

import ast
import re
import tomllib
from pathlib import Path

import pytest
import transformers

from attnres_convert.modeling import transformers_compat
from attnres_convert.modeling.transformers_compat import INTERNALS, MODULES, MissingTransformersInternal, internal

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "attnres_convert"
# transformers' public API, imported where it is used; everything else goes through transformers_compat.
PUBLIC_MODULES = {"transformers", "transformers.modeling_outputs", "transformers.utils", "transformers.utils.logging"}


@pytest.mark.parametrize("name", sorted(INTERNALS))
def test_internal_is_where_attnres_looks(name):
    module_name, purpose = INTERNALS[name]
    found = internal(name)
    assert found is getattr(transformers_compat, name)
    assert callable(found) or len(found) > 0, f"{module_name}.{name} is empty"  # a function, class or a filled table
    assert purpose


def test_a_moved_internal_fails_naming_it(monkeypatch):
    monkeypatch.setitem(INTERNALS, "SubConfigSpec", ("transformers.no_such_module", "declaring the sub-config"))
    with pytest.raises(MissingTransformersInternal, match=r"transformers\.no_such_module\.SubConfigSpec.*declaring the sub-config"):
        transformers_compat.SubConfigSpec
    monkeypatch.setitem(INTERNALS, "NoSuchName", ("transformers.configuration_utils", "nothing"))
    with pytest.raises(ImportError, match=rf"transformers {re.escape(transformers.__version__)} has no transformers\.configuration_utils\.NoSuchName"):
        internal("NoSuchName")
    with pytest.raises(AttributeError):
        transformers_compat.not_an_internal


def test_a_module_that_no_longer_imports_fails_naming_the_internal(monkeypatch):
    def moved():
        raise ModuleNotFoundError("No module named 'transformers.core_model_loading'")

    monkeypatch.setitem(MODULES, "transformers.core_model_loading", moved)
    with pytest.raises(MissingTransformersInternal, match=r"no transformers\.core_model_loading\.PrefixChange.*transformers>=5\.23"):
        internal("PrefixChange")


def test_every_internal_has_its_module_importer():
    assert {module for module, _ in INTERNALS.values()} == set(MODULES)


def test_tested_range_is_pyprojects():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = next(d for d in dependencies if d.startswith("transformers"))
    assert declared.split("#")[0].strip().removeprefix("transformers") == transformers_compat.TESTED_TRANSFORMERS


def _transformers_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("transformers"):
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names if alias.name.startswith("transformers")}
    return modules


def test_no_module_imports_an_internal_directly():
    direct = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "transformers_compat.py"
        for module in _transformers_imports(path) - PUBLIC_MODULES
    }
    assert not direct, f"import these through modeling/transformers_compat.py: {sorted(direct)}"
