"""The tokenizer of a converted folder loads with plain `AutoTokenizer`, and its processor (for a text-only model,
that tokenizer) with `AutoProcessor`, in a fresh Python, as the original's do, for a folder, a GGUF and a hub-cache
source; a broken tokenizer is reported with its file; a model without one
still converts and says so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from finetune_helpers import tiny_model_folder
from reliability_helpers import ONE_THREAD_ENV, leftovers, run_cli, squash

from attnres_convert import convert
from attnres_convert.errors import SourceError
from attnres_convert.io.samples import SAMPLE_TEXT

ROOT = Path(__file__).resolve().parent.parent
TEXT = SAMPLE_TEXT[:400]

# A fresh Python that loads a tokenizer (or processor) as a user would and prints its class and its ids for TEXT.
# Its stdin is closed, so a "Do you wish to run the custom code? [y/N]" prompt cannot be answered: it shows in the
# output, and transformers falls back to a generic config with a "model of type `attnres`" warning.
CHILD = textwrap.dedent(
    """
    import json, sys
    import transformers
    location, kwargs, text, loader = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    tokenizer = getattr(transformers, loader).from_pretrained(location, **kwargs)
    print("IDS " + json.dumps([type(tokenizer).__name__, tokenizer(text)["input_ids"]]))
    """
)
LOADERS = ("AutoTokenizer", "AutoProcessor")
# What a prompt or the fallback's warning prints; none of it may appear.
NOISE = ("[y/N]", "custom code", "trust_remote_code", "attnres", "model of type")
TRUST = [
    True,
    pytest.param(
        None,
        marks=pytest.mark.xfail(
            strict=True,
            reason=(
                "transformers (5.16.1 to 5.25) AutoTokenizer and AutoProcessor read the model config (AutoConfig) before "
                "tokenizer_config.json, whatever the folder's tokenizer_class says, and a config whose model type only the "
                "shipped code knows asks whether to run that code (then warns when the answer is no); transformers has no "
                "setting in the folder that answers it, and the model type must stay attnres (docs/design.md)"
            ),
        ),
    ),
    pytest.param(
        False,
        marks=pytest.mark.xfail(
            strict=True,
            reason=(
                "transformers (5.16.1 to 5.25) falls back to a generic config for the refused model type and warns "
                "'You are using a model of type `attnres` to instantiate a model of type ``'"
            ),
        ),
    ),
]


def _child_env(extra: dict | None = None) -> dict:
    env = {**os.environ, **ONE_THREAD_ENV, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.pop("TRANSFORMERS_VERBOSITY", None)  # transformers' default verbosity: its warnings are printed
    return env


def load_in_child(location, env: dict | None = None, loader: str = "AutoTokenizer", **kwargs) -> tuple[list, str]:
    """The class LOADER.from_pretrained(LOCATION, **KWARGS) returns in a fresh Python and the ids it gives TEXT,
    and everything else it printed."""
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(location), json.dumps(kwargs), TEXT, loader],
        capture_output=True,
        text=True,
        env=_child_env(env),
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    ids = json.loads(next(line for line in lines if line.startswith("IDS "))[4:])
    other = "\n".join(line for line in lines if not line.startswith("IDS ")) + run.stderr
    return ids, other


def assert_loads_like_the_original(
    converted: Path, original_ids: list, trust, env: dict | None = None, loader: str = "AutoTokenizer"
) -> None:
    kwargs = {} if trust is None else {"trust_remote_code": trust}
    ids, output = load_in_child(converted, env, loader, **kwargs)
    noise = [needle for needle in NOISE if needle.lower() in output.lower()]
    assert not noise, f"{noise} printed by {loader}.from_pretrained:\n{output}"
    assert ids == original_ids  # the same class, the same ids


def _tokenizer_class(folder: Path) -> str | None:
    return json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")


def _cached_hub_repo(tmp_path: Path) -> tuple[dict, Path]:
    """tiny-org/tiny-llama (a tiny model with its tokenizer) in an HF cache under TMP_PATH: the environment that
    reads it offline, and the snapshot folder."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf-cache" / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = tiny_model_folder(repo / "snapshots" / revision)
    env = {"HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    return env, snapshot


def _convert_from_the_hub_cache(env: dict, out: Path) -> subprocess.CompletedProcess:
    """convert('tiny-org/tiny-llama') in a fresh Python (the cache location is read when huggingface_hub is
    imported), every warning shown."""
    script = (
        "import sys, warnings; warnings.simplefilter('always', UserWarning); from attnres_convert import convert; "
        "convert('tiny-org/tiny-llama', sys.argv[1], verify=False)"
    )
    return subprocess.run(
        [sys.executable, "-c", script, str(out)],
        capture_output=True,
        text=True,
        env=_child_env(env),
        stdin=subprocess.DEVNULL,
        timeout=300,
    )


@pytest.fixture(scope="module")
def from_folder(tmp_path_factory):
    """A tiny model folder with a tokenizer, converted; the ids its original tokenizer gives TEXT."""
    root = tmp_path_factory.mktemp("tokenizer-folder")
    tiny_model_folder(root / "plain")
    convert(root / "plain", root / "converted", verify=False)
    ids = {}
    for loader in LOADERS:
        ids[loader], output = load_in_child(root / "plain", loader=loader)
        assert ids[loader] and not any(needle.lower() in output.lower() for needle in NOISE), output  # quiet original
    return root, ids


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("trust", TRUST)
def test_tokenizer_of_a_converted_folder_loads_like_the_original(from_folder, trust, loader):
    root, original_ids = from_folder
    assert _tokenizer_class(root / "converted") == _tokenizer_class(root / "plain")
    assert_loads_like_the_original(root / "converted", original_ids[loader], trust, loader=loader)


@pytest.mark.extended
def test_tokenizer_of_a_folder_converted_from_the_hub_cache_loads_like_the_original(tmp_path):
    """A hub id whose snapshot is in the HF cache, converted offline."""
    env, _ = _cached_hub_repo(tmp_path)
    run = _convert_from_the_hub_cache(env, tmp_path / "converted")
    assert run.returncode == 0, run.stderr[-3000:]
    for loader in LOADERS:
        original_ids, output = load_in_child("tiny-org/tiny-llama", env, loader)
        assert not any(needle.lower() in output.lower() for needle in NOISE), output
        assert_loads_like_the_original(tmp_path / "converted", original_ids, True, loader=loader)


def test_processor_files_of_a_hub_cache_source_are_copied(tmp_path):
    """An image-text repo's processor files (here a preprocessor config and a chat template) are not fetched by
    loading the model: convert fetches them (offline: from the HF cache) and copies them unchanged."""
    env, snapshot = _cached_hub_repo(tmp_path)
    preprocessor = json.dumps({"image_processor_type": "SiglipImageProcessor", "size": {"height": 32, "width": 32}})
    (snapshot / "preprocessor_config.json").write_text(preprocessor)
    (snapshot / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    run = _convert_from_the_hub_cache(env, tmp_path / "converted")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "converted" / "preprocessor_config.json").read_text() == preprocessor
    assert (tmp_path / "converted" / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
    assert not (tmp_path / "converted" / "processor_config.json").exists()  # the repo has none


@pytest.mark.slow
@pytest.mark.extended
def test_tokenizer_of_a_folder_converted_from_a_gguf_loads_like_the_original(smollm2_path, tmp_path):
    """The embedded SmolLM2 GGUF: its tokenizer is rebuilt from the GGUF's metadata, saved with the converted
    folder, and encodes as transformers' own reading of the GGUF does."""
    convert(smollm2_path, tmp_path / "converted", verify=False)
    for loader in LOADERS:
        original_ids, output = load_in_child(smollm2_path.parent, loader=loader, gguf_file=smollm2_path.name)
        assert not any(needle.lower() in output.lower() for needle in NOISE), output
        assert_loads_like_the_original(tmp_path / "converted", original_ids, True, loader=loader)


# ---------------------------------------------------------------- tokenizers that do not load, and none


def test_a_corrupt_tokenizer_fails_naming_the_file(from_folder, tmp_path):
    """A tokenizer.json that does not parse is an error naming that file and the reason, before anything is
    written; it is not a model converted without its tokenizer."""
    root, _ = from_folder
    broken = shutil.copytree(root / "plain", tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    out = tmp_path / "out"
    with pytest.raises(SourceError, match=r"could not load the tokenizer of .*broken/tokenizer\.json\): Expecting"):
        convert(broken, out, verify=False)
    assert leftovers(out) == []
    result = run_cli("convert", broken, "-o", out, "--no-verify")
    assert result.exit_code == 2, result.output
    assert squash(str(broken / "tokenizer.json")) in squash(result.output), result.output
    assert leftovers(out) == []


def test_a_folder_without_a_tokenizer_converts_and_says_so_once(tiny_llama_folder, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert(tiny_llama_folder, tmp_path / "library", verify=False)
    said = [w for w in caught if "has no tokenizer" in str(w.message)]
    assert len(said) == 1 and str(tiny_llama_folder) in str(said[0].message), [str(w.message) for w in caught]
    assert not list((tmp_path / "library").glob("tokenizer*"))
    assert (tmp_path / "library" / "config.json").is_file()
    result = run_cli("convert", tiny_llama_folder, "-o", tmp_path / "cli")
    assert result.exit_code == 0, result.output
    flat = squash(result.output)
    assert flat.count(squash("has no tokenizer")) == 1 and "warning:" in flat, result.output


def test_a_converted_folder_without_a_tokenizer_still_opens(tiny_llama_folder, tmp_path):
    """`attnres eval`/`inspect` open a converted folder saved without a tokenizer (None), and report a broken one."""
    from attnres_convert.io.loading import load_any

    convert(tiny_llama_folder, tmp_path / "converted", verify=False)
    assert load_any(tmp_path / "converted").tokenizer is None
    (tmp_path / "converted" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(SourceError, match=r"converted/tokenizer_config\.json"):
        load_any(tmp_path / "converted")


def test_tokenizer_of_a_fine_tuned_folder_loads_like_the_original(from_folder, tmp_path):
    """Fine-tuning writes a model folder of its own: its tokenizer loads as the source's does."""
    from finetune_helpers import tiny_recipe, write_corpus

    from attnres_convert.finetune.recipe import parse_recipe
    from attnres_convert.finetune.training import finetune

    root, original_ids = from_folder
    recipe = tiny_recipe(root / "plain", write_corpus(tmp_path / "corpus"), tmp_path / "run", train={"steps": 2})
    result = finetune(parse_recipe(recipe))
    assert _tokenizer_class(result.model_dir) == _tokenizer_class(root / "plain")
    for loader in LOADERS:
        assert_loads_like_the_original(result.model_dir, original_ids[loader], True, loader=loader)


@pytest.mark.extended
def test_hub_cache_sources_without_or_with_a_broken_tokenizer(tmp_path):
    """A cached hub repo without tokenizer files converts and says so once; one whose tokenizer.json is corrupt
    fails naming the repo and the reason, and writes nothing."""
    env, snapshot = _cached_hub_repo(tmp_path)
    (snapshot / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    run = _convert_from_the_hub_cache(env, tmp_path / "broken")
    assert run.returncode != 0 and "could not load the tokenizer of tiny-org/tiny-llama" in run.stderr, run.stderr[
        -3000:
    ]
    assert leftovers(tmp_path / "broken") == []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / name).unlink()
    run = _convert_from_the_hub_cache(env, tmp_path / "without")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("tiny-org/tiny-llama has no tokenizer") == 1, run.stderr[-3000:]
    assert (tmp_path / "without" / "config.json").is_file() and not list((tmp_path / "without").glob("tokenizer*"))
