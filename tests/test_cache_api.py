"""The KV cache under the installed transformers' name: the shipped model takes `cache` and the older
`past_key_values`, passes the cache on under the name the base model takes, and generating from a converted
folder raises no deprecation warning. And the suite's own guard: deprecation and future warnings raised by our
code are errors (pyproject's filters, with the attribution tests/conftest.py fixes), everyone else's are not."""

import json
import warnings

import pytest
import torch
from isolated import run_isolated
from tiny_models import randomize_queries, tiny_model, token_ids
from torch import nn
from transformers.utils.deprecation import deprecate_kwarg

from attnres_convert import save_converted
from attnres_convert.conversion.surgery import convert_model
from attnres_convert.io.saving import SHIPPED_CODE
from attnres_convert.modeling.modeling_attnres import INSTALLED, cache_keyword, cache_of


class _Renamed(nn.Module):
    """A module whose forward renamed a keyword the way transformers renamed the cache (any version)."""

    @deprecate_kwarg("old_name", "99.0.0", new_name="new_name")
    def forward(self, x, new_name=None):
        return x


def _call_from(module_name: str):
    """Calls _Renamed with its old keyword from code whose module is `module_name`."""
    namespace = {"__name__": module_name, "_Renamed": _Renamed, "torch": torch}
    exec("def call():\n    return _Renamed()(torch.zeros(1), old_name=1)\n", namespace)
    return namespace["call"]


def test_a_deprecated_keyword_our_code_passes_to_a_module_fails_the_suite():
    # transformers attributes the warning to the frame above its wrapper: torch's Module._call_impl. Without
    # tests/conftest.py re-attributing it to the module's caller, this call would pass silently.
    with pytest.raises(FutureWarning, match="old_name"):
        _call_from("attnres_convert.conversion.some_module")()
    with pytest.raises(FutureWarning, match="old_name"):
        _call_from("transformers_modules.converted.0123abcd.modeling_attnres")()
    # The same call from code that is not ours: ignored, as pyproject's filters say.
    _call_from("some_other_library.models")()


def test_module_calls_are_attributed_to_their_caller():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _Renamed()(torch.zeros(1), old_name=1)
    assert [w.filename for w in caught] == [__file__]


@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
@pytest.mark.parametrize("stem", sorted(name[:-3] for name in SHIPPED_CODE if name.endswith(".py")))
def test_every_shipped_module_is_covered_by_the_error_filters(stem, category):
    # A converted folder's code is imported as transformers_modules.<folder>.<hash>.<module> (transformers 5.24;
    # without the hash on earlier releases): a new shipped file must be under the filters too.
    for module in (f"transformers_modules.converted.0123abcd.{stem}", f"transformers_modules.converted.{stem}"):
        with pytest.raises(category):
            warnings.warn_explicit("from shipped code", category, f"{stem}.py", 1, module=module)


def test_cache_keyword_reads_the_forward_it_is_given():
    def current(input_ids=None, cache=None, past_key_values=None): ...
    def legacy(input_ids=None, past_key_values=None): ...
    def any_keyword(input_ids=None, **kwargs): ...

    assert cache_keyword(current) == "cache"
    assert cache_keyword(legacy) == "past_key_values"
    assert cache_keyword(any_keyword) == INSTALLED


def test_the_older_keyword_still_carries_the_cache():
    model = randomize_queries(convert_model(tiny_model("llama"), block_size=3).eval(), 0.1, seed=0, key_norms=0.1)
    ids = token_ids(1, 10)
    with torch.no_grad():
        whole = model(ids).logits[:, -1]
        prefill = model(ids[:, :-1], use_cache=True)
        cache = cache_of(prefill)
        assert cache is not None and cache.get_seq_length() == ids.shape[1] - 1
        by_old_name = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(by_old_name, whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="once"):
        model(ids[:, -1:], cache=cache, past_key_values=type(cache)(), use_cache=True)


def test_generate_from_a_converted_folder_is_quiet_and_uses_its_cache(tmp_path):
    """Plain transformers in a fresh process (its once-only deprecation logs not yet spent, this package not
    importable): generate with the cache warns about nothing and decodes as without it; at conversion's zero
    queries it decodes as the original does."""
    tiny_model("llama").save_pretrained(tmp_path / "original")
    save_converted(convert_model(tiny_model("llama"), block_size=3).eval(), tmp_path / "converted")
    trained = randomize_queries(convert_model(tiny_model("llama"), block_size=3).eval(), 0.1, seed=1, key_norms=0.1)
    save_converted(trained, tmp_path / "trained")
    result = run_isolated(
        f"""
        import json, warnings
        import torch
        from transformers import AutoModelForCausalLM
        ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            def greedy(folder, use_cache):
                model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + "/" + folder,
                                                             trust_remote_code=True).eval()
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                       use_cache=use_cache).tolist()
            tokens = {{f"{{name}}-{{c}}": greedy(name, c) for name in ("original", "converted", "trained")
                       for c in (True, False)}}
        print("RESULT" + json.dumps({{"tokens": tokens, "warnings": [f"{{w.category.__name__}}: {{w.message}}"
                                                                     for w in caught]}}))
        """
    )
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT")), None)
    assert line is not None, result.stderr[-3000:]
    found = json.loads(line[len("RESULT") :])
    tokens = found["tokens"]
    about_the_cache = [w for w in found["warnings"] if "past_key_values" in w or "cache" in w]
    assert about_the_cache == [], about_the_cache
    assert "past_key_values" not in result.stderr, result.stderr[-3000:]  # transformers' logged deprecation
    assert tokens["converted-True"] == tokens["converted-False"] == tokens["original-True"]
    assert tokens["trained-True"] == tokens["trained-False"]
    assert tokens["trained-True"] != tokens["original-True"]  # the trained queries changed the decoding
