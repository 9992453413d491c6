"""Every transformers internal attnres uses is reached through modeling/transformers_compat.py, one test each, so a
transformers upgrade that moves one fails here under the internal's name (and loading says which one it was)."""

import ast
import re
import tomllib
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from attnres_convert import transformers_compat
from attnres_convert.transformers_compat import INTERNALS, MODULES, SINCE, MissingTransformersInternal, has, internal

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "attnres_convert"
# transformers' public API, imported where it is used; everything else goes through transformers_compat.
PUBLIC_MODULES = {"transformers", "transformers.modeling_outputs", "transformers.utils", "transformers.utils.logging"}


@pytest.mark.parametrize("name", sorted(INTERNALS))
def test_internal_is_where_attnres_looks(name):
    module_name, purpose = INTERNALS[name]
    if name in SINCE and not has(name):
        since, instead = SINCE[name]
        # Missing only where SINCE says so: an older release of the range, whose way attnres takes instead.
        assert Version(transformers.__version__) < Version(since), f"transformers {transformers.__version__} lacks {name}"
        pytest.skip(f"transformers {transformers.__version__} predates {module_name}.{name} ({since}): {instead}")
    assert has(name)
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
    with pytest.raises(MissingTransformersInternal, match=r"no transformers\.core_model_loading\.PrefixChange.*transformers>=5\.16\.1,<6"):
        internal("PrefixChange")


def test_only_internals_are_optional():
    assert set(SINCE) <= set(INTERNALS)
    assert all(Version(since) > Version(transformers_compat.TESTED_TRANSFORMERS.split(",")[0][2:]) for since, _ in SINCE.values())


@pytest.mark.parametrize("has_spec", [True, False], ids=["with SubConfigSpec", "before SubConfigSpec"])
def test_sub_config_built_by_its_model_type(has_spec, monkeypatch):
    if not has_spec:  # as on transformers < 5.20, whichever is installed
        monkeypatch.setattr(transformers_compat, "has", lambda name: False if name == "SubConfigSpec" else has(name))
    elif not has("SubConfigSpec"):
        pytest.skip(f"transformers {transformers.__version__} has no SubConfigSpec (since {SINCE['SubConfigSpec'][0]})")
    gpt2 = transformers_compat.build_sub_config({"model_type": "gpt2", "n_layer": 2}, "llama")
    default = transformers_compat.build_sub_config(None, "llama")
    if has_spec:  # transformers builds it from the spec: nothing to do
        assert gpt2 == {"model_type": "gpt2", "n_layer": 2} and default is None
    else:
        assert type(gpt2) is transformers.GPT2Config and gpt2.n_layer == 2
        assert type(default) is transformers.LlamaConfig
        assert default.hidden_size == transformers.LlamaConfig().hidden_size
        assert transformers_compat.build_sub_config(gpt2, "llama") is gpt2
        with pytest.raises(TypeError, match="must be a dict, a PreTrainedConfig or None"):
            transformers_compat.build_sub_config("gpt2", "llama")


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


def test_causal_lm_class_found_where_an_older_mapping_keys_it_by_the_composite_type(monkeypatch):
    """transformers before 5.2x maps Emu3's text causal LM only under `emu3` (Emu3Config), so a converted Emu3
    folder (its base config an Emu3TextConfig, base_model_type 'emu3_text_model') builds its base model from the
    entry whose type its type starts with and whose class takes its config."""
    from transformers import Emu3ForCausalLM, Emu3TextConfig, LlamaConfig, LlamaForCausalLM

    older = {LlamaConfig: LlamaForCausalLM}  # no entry for Emu3TextConfig
    names = {"llama": "LlamaForCausalLM", "emu3": "Emu3ForCausalLM", "emu": "NoSuchClassForCausalLM"}
    real = transformers_compat.internal
    monkeypatch.setattr(transformers_compat, "internal", lambda name: {
        "MODEL_FOR_CAUSAL_LM_MAPPING": older, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": names}.get(name) or real(name))
    assert transformers_compat.causal_lm_class(Emu3TextConfig(), "emu3_text_model") is Emu3ForCausalLM
    assert transformers_compat.causal_lm_class(LlamaConfig(), "llama") is LlamaForCausalLM
    with pytest.raises(KeyError):  # nothing takes it: the mapping's own error
        transformers_compat.causal_lm_class(Emu3TextConfig(), "mllama_text_model")
