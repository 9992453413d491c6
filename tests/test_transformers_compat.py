"""Every transformers internal attnres uses is listed in transformers_compat.py, one test each, so a transformers
upgrade that moves one fails here under the internal's name (and loading says which one it was). The package reaches
them through that module; the code shipped next to converted weights (which cannot import the package) imports its
few directly, each one listed there too."""

import ast
import re
from pathlib import Path

import pytest
import tomllib
import transformers
from packaging.version import Version

from attnres_convert import transformers_compat
from attnres_convert.modeling import SHIPPED_CODE, configuration_attnres, modeling_attnres
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
        assert Version(transformers.__version__) < Version(since), (
            f"transformers {transformers.__version__} lacks {name}"
        )
        pytest.skip(f"transformers {transformers.__version__} predates {module_name}.{name} ({since}): {instead}")
    assert has(name)
    found = internal(name)
    assert found is getattr(transformers_compat, name)
    assert callable(found) or len(found) > 0, f"{module_name}.{name} is empty"  # a function, class or a filled table
    assert purpose


def test_a_moved_internal_fails_naming_it(monkeypatch):
    monkeypatch.setitem(INTERNALS, "SubConfigSpec", ("transformers.no_such_module", "declaring the sub-config"))
    with pytest.raises(
        MissingTransformersInternal, match=r"transformers\.no_such_module\.SubConfigSpec.*declaring the sub-config"
    ):
        transformers_compat.SubConfigSpec
    monkeypatch.setitem(INTERNALS, "NoSuchName", ("transformers.configuration_utils", "nothing"))
    with pytest.raises(
        ImportError,
        match=rf"transformers {re.escape(transformers.__version__)} has no transformers\.configuration_utils\.NoSuchName",
    ):
        internal("NoSuchName")
    with pytest.raises(AttributeError):
        transformers_compat.not_an_internal


def test_a_module_that_no_longer_imports_fails_naming_the_internal(monkeypatch):
    def moved():
        raise ModuleNotFoundError("No module named 'transformers.core_model_loading'")

    monkeypatch.setitem(MODULES, "transformers.core_model_loading", moved)
    with pytest.raises(
        MissingTransformersInternal,
        match=r"no transformers\.core_model_loading\.PrefixChange.*transformers>=5\.16\.1,<6",
    ):
        internal("PrefixChange")


def test_only_internals_are_optional():
    assert set(SINCE) <= set(INTERNALS)
    assert all(
        Version(since) > Version(transformers_compat.TESTED_TRANSFORMERS.split(",")[0][2:])
        for since, _ in SINCE.values()
    )


@pytest.mark.parametrize("has_spec", [True, False], ids=["with SubConfigSpec", "before SubConfigSpec"])
def test_sub_config_built_by_its_model_type(has_spec, monkeypatch):
    """The shipped config builds its text_config itself where transformers has no SubConfigSpec (SINCE)."""
    build_sub_config = configuration_attnres.build_sub_config
    if not has_spec:  # as on transformers < 5.20, whichever is installed
        monkeypatch.setattr(configuration_attnres, "SubConfigSpec", None)
    elif not has("SubConfigSpec"):
        pytest.skip(f"transformers {transformers.__version__} has no SubConfigSpec (since {SINCE['SubConfigSpec'][0]})")
    assert (configuration_attnres.SubConfigSpec is not None) == has_spec  # the shipped file found it where it is
    gpt2 = build_sub_config({"model_type": "gpt2", "n_layer": 2}, "llama")
    default = build_sub_config(None, "llama")
    if has_spec:  # transformers builds it from the spec: nothing to do
        assert gpt2 == {"model_type": "gpt2", "n_layer": 2} and default is None
    else:
        assert type(gpt2) is transformers.GPT2Config and gpt2.n_layer == 2
        assert type(default) is transformers.LlamaConfig
        assert default.hidden_size == transformers.LlamaConfig().hidden_size
        assert build_sub_config(gpt2, "llama") is gpt2
        with pytest.raises(TypeError, match="must be a dict, a PreTrainedConfig or None"):
            build_sub_config("gpt2", "llama")


def test_every_internal_has_its_module_importer():
    assert {module for module, _ in INTERNALS.values()} == set(MODULES)


def test_tested_range_is_pyprojects():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = next(d for d in dependencies if d.startswith("transformers"))
    assert declared.split("#")[0].strip().removeprefix("transformers") == transformers_compat.TESTED_TRANSFORMERS


def _transformers_imports(path: Path) -> set[tuple[str, str | None]]:
    """(module, name) of each transformers import (name None for `import transformers...`)."""
    imports = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.startswith("transformers")
        ):
            imports |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            imports |= {(alias.name, None) for alias in node.names if alias.name.startswith("transformers")}
    return imports


# The shipped code (generated from modeling/sources/) cannot import the package, so it imports its internals itself.
SHIPPED = [PACKAGE / "modeling" / name for name in SHIPPED_CODE] + sorted(
    (PACKAGE / "modeling" / "sources").glob("*.py")
)


def test_no_module_imports_an_internal_directly():
    direct = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "transformers_compat.py" and path not in SHIPPED
        for module, _ in _transformers_imports(path)
        if module not in PUBLIC_MODULES
    }
    assert not direct, f"import these through attnres_convert/transformers_compat.py: {sorted(direct)}"


def test_every_internal_the_shipped_code_imports_is_listed():
    """Each internal the shipped files import is one INTERNALS lists from the same module, so its test above fails
    when transformers moves it; the shipped file actually holds each one it imports (generated, not stale)."""
    unlisted, found = [], set()
    for path in SHIPPED:
        for module, name in _transformers_imports(path):
            if module in PUBLIC_MODULES:
                continue
            found.add(name)
            if INTERNALS.get(name, (None,))[0] != module:
                unlisted.append(f"{path.relative_to(ROOT)}: {module}.{name}")
    assert not unlisted, f"list these in transformers_compat.INTERNALS: {unlisted}"
    assert {"SubConfigSpec", "MODEL_FOR_CAUSAL_LM_MAPPING", "PrefixChange", "guard_torch_init_functions"} <= found


def test_causal_lm_class_found_where_an_older_mapping_keys_it_by_the_composite_type(monkeypatch):
    """transformers before 5.2x maps Emu3's text causal LM only under `emu3` (Emu3Config), so a converted Emu3
    folder (its base config an Emu3TextConfig, base_model_type 'emu3_text_model') builds its base model from the
    entry whose type its type starts with and whose class takes its config."""
    from transformers import Emu3ForCausalLM, Emu3TextConfig, LlamaConfig, LlamaForCausalLM
    from transformers.models.auto import modeling_auto

    older = {LlamaConfig: LlamaForCausalLM}  # no entry for Emu3TextConfig
    names = {"llama": "LlamaForCausalLM", "emu3": "Emu3ForCausalLM", "emu": "NoSuchClassForCausalLM"}
    monkeypatch.setattr(modeling_auto, "MODEL_FOR_CAUSAL_LM_MAPPING", older)
    monkeypatch.setattr(modeling_auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", names)
    assert modeling_attnres.causal_lm_class(Emu3TextConfig(), "emu3_text_model") is Emu3ForCausalLM
    assert modeling_attnres.causal_lm_class(LlamaConfig(), "llama") is LlamaForCausalLM
    with pytest.raises(KeyError):  # nothing takes it: the mapping's own error
        modeling_attnres.causal_lm_class(Emu3TextConfig(), "mllama_text_model")
