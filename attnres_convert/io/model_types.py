"""The causal-LM model types of the installed transformers, read from its source without importing it.

Importing `transformers.models.auto.modeling_auto` imports torch (about 2 s on two cores), so a command given a
misspelt model type would answer slowly. transformers declares the mapping as a literal
(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = OrderedDict([("llama", "LlamaForCausalLM"), ...])`), which `ast` reads in
a few milliseconds. tests/test_cli_screens.py checks that it equals the imported mapping, so a transformers
release that declares it otherwise fails there; until then, `None` sends the caller to the import.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

MAPPING = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"


def causal_lm_model_types() -> set[str] | None:
    """The model types of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, or None where the source does not declare them as
    a literal list of pairs."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "models" / "auto" / "modeling_auto.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(target, ast.Name) and target.id == MAPPING for target in node.targets)
            and isinstance(node.value, ast.Call)
            and len(node.value.args) == 1
        ):
            try:
                return {model_type for model_type, _ in ast.literal_eval(node.value.args[0])}
            except (ValueError, TypeError):
                return None
    return None
