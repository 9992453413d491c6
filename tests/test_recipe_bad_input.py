"""Bad recipes: `attnres recipes validate` and `attnres finetune` both refuse them with exit code 2,
a message naming the field and the problem, and nothing written in output.dir. YAML is read with a safe
loader: a `!!python/object` tag is an error, never an object."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe
from reliability_helpers import assert_user_error, leftovers, read_only_folder, run_cli


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    model = tiny_model_folder(root / "tiny-llama")  # max_position_embeddings 256
    corpus = write_corpus(root / "corpus")
    return {"root": root, "model": model, "corpus": corpus}


def _recipe(tmp_path, setup, **sections) -> tuple[Path, Path]:
    out = tmp_path / "run"
    return write_recipe(tmp_path / "recipe.yaml", tiny_recipe(setup["model"], setup["corpus"], out, **sections)), out


def _both(recipe: Path, out: Path, *needles, overrides=()):
    """validate and finetune: the same refusal, nothing written."""
    for command in (["recipes", "validate"], ["finetune"]):
        result = run_cli(*command, recipe, *overrides)
        assert_user_error(result, *needles, out=out)


def test_a_valid_recipe_validates(tmp_path, setup):
    recipe, out = _recipe(tmp_path, setup)
    result = run_cli("recipes", "validate", recipe)
    assert result.exit_code == 0, result.output
    assert leftovers(out) == []  # validate never writes


@pytest.mark.parametrize(
    "text, needles",
    [
        ("model: [unclosed\n  train: {", ["not valid YAML"]),
        ("just a string\n", ["a recipe is a YAML mapping"]),
        ("- a\n- list\n", ["a recipe is a YAML mapping"]),
        ("\x00\x01binary", ["recipe"]),
    ],
    ids=["broken", "scalar", "list", "binary"],
)
def test_recipe_that_is_not_yaml(tmp_path, text, needles):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    _both(path, tmp_path / "run", str(path), *needles)


def test_python_tags_are_rejected_not_evaluated(tmp_path, setup):
    """`!!python/object/apply:os.system` would run a command under an unsafe loader; here it is a YAML error."""
    sentinel = tmp_path / "pwned"
    recipe, out = _recipe(tmp_path, setup)
    text = recipe.read_text().replace(
        "trainable: attnres", f"trainable: !!python/object/apply:os.system ['touch {sentinel}']"
    )
    assert "python/object" in text
    recipe.write_text(text)
    _both(recipe, out, str(recipe), "not valid YAML", "python/object")
    assert not sentinel.exists()
    for tag in ("!!python/name:os.system", "!!python/object/new:subprocess.Popen [['touch', '%s']]" % sentinel):
        recipe.write_text(f"description: {tag}\n")
        _both(recipe, out, "not valid YAML")
    assert not sentinel.exists()


def test_unknown_keys(tmp_path, setup):
    recipe, out = _recipe(tmp_path, setup, train={"learning_rate": 1e-3}, model={"blok_size": 2})
    _both(recipe, out, "train.learning_rate: unknown key", "model.blok_size: unknown key", "known keys")
    data = yaml.safe_load(recipe.read_text())
    data["trainer"] = {"steps": 3}
    write_recipe(recipe, data)
    _both(recipe, out, "trainer: unknown key")


@pytest.mark.parametrize(
    "sections, needles",
    [
        ({"train": {"steps": "many"}}, ["train.steps", "integer"]),
        ({"train": {"lr": "fast"}}, ["train.lr", "number"]),
        ({"train": {"steps": 2.5}}, ["train.steps"]),
        ({"data": {"seq_len": [32]}}, ["data.seq_len"]),
        ({"train": {"trainable": "everything"}}, ["train.trainable", "must be one of"]),
        ({"model": {"convert": "perhaps"}}, ["model.convert"]),
    ],
    ids=["steps-str", "lr-str", "steps-float", "seq-len-list", "trainable-literal", "convert-bool"],
)
def test_wrong_types(tmp_path, setup, sections, needles):
    recipe, out = _recipe(tmp_path, setup, **sections)
    _both(recipe, out, *needles)


@pytest.mark.parametrize("lr", [0, -1e-3])
def test_non_positive_learning_rate(tmp_path, setup, lr):
    recipe, out = _recipe(tmp_path, setup, train={"lr": lr})
    _both(recipe, out, "train.lr: must be > 0")
    recipe, out = _recipe(tmp_path, setup, train={"attnres_lr": lr})
    _both(recipe, out, "train.attnres_lr: must be > 0")


def test_non_positive_learning_rate_as_override(tmp_path, setup):
    recipe, out = _recipe(tmp_path, setup)
    _both(recipe, out, "train.lr: must be > 0", overrides=["train.lr=0"])
    _both(recipe, out, "train.stepz", "unknown key", overrides=["train.stepz=3"])


def test_missing_data_files(tmp_path, setup):
    missing = tmp_path / "nowhere" / "train.txt"
    recipe, out = _recipe(tmp_path, setup, data={"train": {"files": [str(missing)]}})
    _both(recipe, out, "data.train.files[0]", str(missing))
    recipe, out = _recipe(tmp_path, setup, data={"train": {"files": [str(tmp_path / "nothing-*.txt")]}})
    _both(recipe, out, "data.train.files[0]", "no file matches")


def test_empty_data(tmp_path, setup):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    recipe, out = _recipe(tmp_path, setup, data={"train": {"files": [str(empty)]}})
    _both(recipe, out, "data.train.files[0]", "is empty")


def test_whitespace_only_data_is_refused_by_finetune(tmp_path, setup):
    """A file that is not empty but holds no text passes validation (no tokenizer there) and is refused when
    the run reads it, still before anything is written."""
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n")
    recipe, out = _recipe(tmp_path, setup, data={"train": {"files": [str(blank)]}})
    result = run_cli("finetune", recipe)
    assert_user_error(result, "data.train", "not enough")
    assert not (out / "checkpoints").exists() and not (out / "model").exists()


def test_sequence_length_above_the_model(tmp_path, setup):
    recipe, out = _recipe(tmp_path, setup, data={"seq_len": 4096})
    _both(recipe, out, "data.seq_len", "4096", "256 positions", "at most 256")


def test_recipe_output_is_not_a_run_folder(tmp_path, setup):
    recipe, out = _recipe(tmp_path, setup)
    out.mkdir()
    (out / "thesis.tex").write_text("mine")
    result = run_cli("finetune", recipe, "output.overwrite=true")
    assert_user_error(result, "output.dir", "not an attnres run folder")
    assert sorted(os.listdir(out)) == ["thesis.tex"]


def test_recipe_file_missing(tmp_path):
    missing = tmp_path / "nope.yaml"
    for command in (["recipes", "validate"], ["finetune"]):
        assert_user_error(run_cli(*command, missing), str(missing), "does not exist")


def test_output_dir_on_a_read_only_location(tmp_path, setup):
    """Refused before the model or the data is loaded, also as root (immutable folder, /sys)."""
    with read_only_folder(tmp_path / "locked") as locked:
        if not locked:
            pytest.skip("cannot make a folder read-only here")
        recipe, _ = _recipe(tmp_path, setup, output={"dir": str(tmp_path / "locked" / "run")})
        _both(recipe, tmp_path / "locked" / "run", "output.dir", "not writable", "choose a folder you can write to")
        assert list((tmp_path / "locked").iterdir()) == []
    if Path("/sys").is_dir() and not Path("/sys/attnres-run").exists():
        recipe, _ = _recipe(tmp_path, setup, output={"dir": "/sys/attnres-run"})
        _both(recipe, Path("/sys/attnres-run"), "output.dir", "not writable")


def test_output_dir_below_a_file(tmp_path, setup):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    recipe, _ = _recipe(tmp_path, setup, output={"dir": str(blocker / "run")})
    _both(recipe, blocker / "run", "output.dir", "is a file, not a folder")
    assert blocker.read_text() == "a file"


def test_overwrite_of_a_run_in_a_read_only_folder(tmp_path, setup):
    """output.overwrite writes the new run beside the earlier one and renames it into place once finished:
    refused before anything is loaded where that folder cannot be written, the earlier run untouched."""
    out = tmp_path / "locked" / "run"
    out.mkdir(parents=True)
    (out / "recipe.yaml").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    with read_only_folder(tmp_path / "locked") as locked:
        if not locked:
            pytest.skip("cannot make a folder read-only here")
        recipe, _ = _recipe(tmp_path, setup, output={"dir": str(out), "overwrite": True})
        result = run_cli("finetune", recipe)
        assert_user_error(
            result,
            "output.dir",
            f"cannot replace the run in {out}",
            "not writable",
            "choose an output.dir in a folder you can write to",
        )
        assert sorted(os.listdir(tmp_path / "locked")) == ["run"]
    assert sorted(os.listdir(out)) == ["metrics.jsonl", "recipe.yaml"]
