"""Recipes: schema, overrides, file checks, shipped recipes, data preparation and order (no training here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe

from attnres_convert.finetune.data import SequenceOrder, held_out, local_micro_batches, split_lines
from attnres_convert.finetune.preflight import check_recipe
from attnres_convert.finetune.recipe import RecipeError, apply_overrides, load_recipe, parse_recipe, shipped_recipes
from attnres_convert.io.text import chunk, expand_files, pack

ROOT = Path(__file__).resolve().parent.parent


def minimal(**sections) -> dict:
    recipe = {
        "data": {"train": {"files": ["shakespeare:*"]}},
        "train": {"steps": 10, "lr": 1e-4},
        "output": {"dir": "out"},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    return recipe


def error_of(data: dict) -> str:
    with pytest.raises(RecipeError) as caught:
        parse_recipe(data)
    return str(caught.value)


class Ran:
    def __init__(self, result):
        self.returncode, self.stdout, self.stderr = result.exit_code, result.stdout, result.stderr


def run_cli(*args):
    """`attnres ARGS` in this process (CliRunner; stdout and stderr apart), lines not wrapped."""
    from typer.testing import CliRunner

    from attnres_convert import cli

    return Ran(CliRunner().invoke(cli.app, [str(a) for a in args], env={"COLUMNS": "300"}))


# --- schema ---------------------------------------------------------------------------------------


def test_defaults_fill_in_a_minimal_recipe():
    recipe = parse_recipe(minimal())
    assert recipe.model.source is None and recipe.model.convert
    assert recipe.train.trainable == "attnres" and recipe.train.peak_attnres_lr == pytest.approx(1e-4)
    assert recipe.data.eval.fraction == 0.05 and recipe.data.seq_len == 256
    assert recipe.lora.target_modules == "all-linear" and recipe.lora.merge


@pytest.mark.parametrize(
    "sections, expected",
    [
        ({"train": {"lr": 0}}, "train.lr: must be > 0"),
        ({"train": {"lr": -1e-3}}, "train.lr: must be > 0"),
        ({"train": {"steps": 0}}, "train.steps: must be >= 1"),
        (
            {"train": {"trainable": "everything"}},
            "train.trainable: must be one of 'attnres', 'lora' or 'full' (got 'everything')",
        ),
        ({"train": {"warmup_steps": 10}}, "train: warmup_steps (10) must be smaller than steps (10)"),
        ({"train": {"betas": [0.9, 1.5]}}, "train: betas must be in [0, 1)"),
        ({"train": {"steps": "many"}}, "train.steps: input should be a valid integer"),
        ({"data": {"seq_len": 4}}, "data.seq_len: must be >= 8"),
        ({"data": {"eval": {"fraction": 1.5}}}, "data.eval.fraction: must be < 1"),
        (
            {"data": {"eval": {"fraction": 0.1, "files": ["a.txt"]}}},
            "data.eval: give exactly one of files, dataset, fraction (got files, fraction)",
        ),
        (
            {"model": {"num_blocks": 4, "full": True}},
            "model: give at most one of block_size, num_blocks, full (got num_blocks, full)",
        ),
        (
            {"lora": {"target_modules": "attention"}},
            "lora.target_modules: must be a list of module names or 'all-linear'",
        ),
        ({"lora": {"target_modules": []}}, "lora.target_modules: must name at least one module"),
        (
            {"model": {"convert": False}},
            "train.trainable: 'attnres' trains only the AttnRes parameters, but model.convert is false",
        ),
        ({"output": {"dir": ""}}, "output.dir: must not be empty"),
    ],
)
def test_invalid_values_name_the_field_and_the_problem(sections, expected):
    assert expected in error_of(minimal(**sections))


def test_unknown_keys_are_rejected_with_the_known_ones():
    message = error_of(minimal(train={"learning_rate": 1e-3}))
    assert message.startswith("train.learning_rate: unknown key (known keys: trainable, steps,")
    assert "bogus: unknown key" in error_of({**minimal(), "bogus": 1})
    assert "data.train.file: unknown key" in error_of(minimal(data={"train": {"file": ["x"], "files": ["y"]}}))


def test_missing_required_fields_and_several_errors_at_once():
    message = error_of({"data": {"train": {"files": ["x"]}}, "train": {"lr": 0}})
    assert message.splitlines() == ["train.steps: required", "train.lr: must be > 0", "output: required"]


def test_train_source_needs_exactly_one_kind():
    assert "data: train: give exactly one of files, dataset (got none)" in error_of(
        minimal(data={"train": {"files": None}})
    )


# --- overrides ------------------------------------------------------------------------------------


def test_overrides_parse_yaml_values_and_create_nested_keys():
    data = apply_overrides(
        minimal(),
        [
            "train.lr=3e-4",
            "train.steps=20",
            "model.source=null",
            "lora.target_modules=[q_proj, v_proj]",
            "model.num_blocks=4",
            "train.mixed_precision=bf16",
            "output.dir=runs/a=b",
        ],
    )
    recipe = parse_recipe(data)
    assert recipe.train.lr == pytest.approx(3e-4) and recipe.train.steps == 20
    assert recipe.model.source is None and recipe.model.num_blocks == 4
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.output.dir == "runs/a=b"  # only the first '=' separates key and value


def test_malformed_overrides_are_reported_together():
    with pytest.raises(RecipeError) as caught:
        apply_overrides(minimal(), ["train.lr", "=3", "train.lr.x=1", "a..b=2"])
    lines = str(caught.value).splitlines()
    assert lines[0] == "train.lr: an override is key.path=value (e.g. train.lr=1e-4)"
    assert "train.lr: is a value, not a section; cannot set train.lr.x" in lines
    assert len(lines) == 4


def test_override_of_an_unknown_key_is_an_unknown_key():
    with pytest.raises(RecipeError, match=r"train\.lrr: unknown key"):
        parse_recipe(apply_overrides(minimal(), ["train.lrr=1"]))


# --- shipped recipes ------------------------------------------------------------------------------


def test_every_shipped_recipe_validates():
    shipped = shipped_recipes()
    assert {
        "quickstart-cpu",
        "ab-smollm2-shakespeare",
        "smollm2-135m-fineweb-edu",
        "smollm2-360m-fineweb-edu",
        "qwen3-0.6b-fineweb-edu",
        "llama-3.2-1b-fineweb-edu",
    } <= set(shipped)
    for name, path in shipped.items():
        recipe = load_recipe(path)
        assert recipe.description, f"{name} has no description"
        check_recipe(recipe, check_output=False)  # data files exist; hub sources are not contacted


def test_gpu_recipes_use_public_hub_models_and_datasets():
    for name in (
        "smollm2-135m-fineweb-edu",
        "smollm2-360m-fineweb-edu",
        "qwen3-0.6b-fineweb-edu",
        "llama-3.2-1b-fineweb-edu",
    ):
        recipe = load_recipe(name)
        assert "/" in recipe.model.source and recipe.data.train.dataset == "HuggingFaceFW/fineweb-edu"
        assert recipe.train.mixed_precision == "bf16"


def test_quickstart_holds_out_whole_plays():
    recipe = load_recipe("quickstart-cpu")
    train, _ = expand_files(recipe.data.train.files, "data.train.files")
    held, _ = expand_files(recipe.data.eval.files, "data.eval.files")
    assert len(held) >= 2 and set(held) < set(train)  # removed from training when the corpus is built


# --- file system checks ---------------------------------------------------------------------------


def test_check_reports_missing_empty_and_unknown_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "data.csv").write_text("a,b\n")
    recipe = parse_recipe(
        minimal(
            data={
                "train": {
                    "files": [
                        str(tmp_path / "nope.txt"),
                        str(tmp_path / "*.md"),
                        str(tmp_path / "empty.txt"),
                        str(tmp_path / "data.csv"),
                        "shakespeare:no_such_play",
                    ]
                }
            },
            output={"dir": str(tmp_path / "out")},
        )
    )
    with pytest.raises(RecipeError) as caught:
        check_recipe(recipe)
    lines = str(caught.value).splitlines()
    assert f"data.train.files[0]: file {tmp_path / 'nope.txt'} does not exist" in lines
    assert f"data.train.files[1]: no file matches '{tmp_path / '*.md'}'" in lines
    assert f"data.train.files[2]: file {tmp_path / 'empty.txt'} is empty" in lines
    assert any(line.startswith("data.train.files[3]:") and "unknown type" in line for line in lines)
    assert any(line.startswith("data.train.files[4]: no Shakespeare play matches 'no_such_play'") for line in lines)


def test_check_refuses_a_long_seq_len_and_an_impossible_source(tmp_path):
    model = tiny_model_folder(tmp_path / "model")  # 256 positions
    corpus = write_corpus(tmp_path / "text")
    recipe = parse_recipe(tiny_recipe(model, corpus, tmp_path / "out", data={"seq_len": 512}))
    with pytest.raises(
        RecipeError, match=r"data\.seq_len: 512 is longer than the model's 256 positions; use at most 256"
    ):
        check_recipe(recipe)
    recipe = parse_recipe(tiny_recipe(tmp_path / "missing", corpus, tmp_path / "out"))
    with pytest.raises(RecipeError, match=r"model\.source: no such file or folder"):
        check_recipe(recipe)


def test_output_folder_rules(tmp_path):
    corpus = write_corpus(tmp_path / "text")
    model = tiny_model_folder(tmp_path / "model")
    other = tmp_path / "someone-elses"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        recipe = parse_recipe(tiny_recipe(model, corpus, other, output={"overwrite": overwrite}))
        with pytest.raises(RecipeError, match=r"output\.dir: .* is not an attnres run folder"):
            check_recipe(recipe)
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    check_recipe(parse_recipe(tiny_recipe(model, corpus, run)))  # stopped before its first checkpoint: started over
    (run / "checkpoints" / "step-0000002").mkdir(parents=True)
    with pytest.raises(RecipeError, match="already holds a run; pass --resume"):
        check_recipe(parse_recipe(tiny_recipe(model, corpus, run)))
    check_recipe(parse_recipe(tiny_recipe(model, corpus, run)), resume=True)
    check_recipe(parse_recipe(tiny_recipe(model, corpus, run, output={"overwrite": True})))


# --- data -----------------------------------------------------------------------------------------


def test_held_out_fraction_is_evenly_spaced_whole_documents():
    picked = [i for i in range(40) if held_out(i, 0.1)]
    assert picked == [9, 19, 29, 39]
    assert [i for i in range(3) if held_out(i, 0.5)] == [1]
    head, tail = split_lines("".join(f"line {i}\n" for i in range(10)), 0.2)
    assert head.count("\n") == 8 and tail == "line 8\nline 9\n"


def test_pack_and_chunk():
    docs = [np.arange(5, dtype=np.int32), np.arange(10, 17, dtype=np.int32)]
    packed = pack(docs, 4, pad_id=0)
    assert packed.tokens.tolist() == [[0, 1, 2, 3], [4, 10, 11, 12], [13, 14, 15, 16]]
    assert packed.lengths.tolist() == [4, 4, 4]
    pieces = chunk(docs, 4, pad_id=-1)
    assert pieces.tokens.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13], [14, 15, 16, -1]]  # [4] alone predicts nothing
    batch = pieces.batch([2])
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0]] and batch["predictions"] == 2
    assert packed.batch([0, 1])["attention_mask"] is None and packed.batch([0, 1])["predictions"] == 6


def test_order_is_a_deterministic_permutation_per_epoch():
    order = SequenceOrder(10, seed=3)
    first, second = order.take(0, 10), order.take(10, 10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first.tolist() != second.tolist()
    assert SequenceOrder(10, seed=3).take(7, 6).tolist() == np.concatenate([first[7:], second[:3]]).tolist()
    assert SequenceOrder(10, seed=4).take(0, 10).tolist() != first.tolist()


def test_processes_split_the_global_batch_like_gradient_accumulation():
    order = SequenceOrder(50, seed=0)
    single = local_micro_batches(order, step=3, micro_batch=2, grad_accum=4, rank=0, world=1)
    rank0 = local_micro_batches(order, step=3, micro_batch=2, grad_accum=2, rank=0, world=2)
    rank1 = local_micro_batches(order, step=3, micro_batch=2, grad_accum=2, rank=1, world=2)
    assert [m.tolist() for m in single] == [m.tolist() for m in (rank0[0], rank1[0], rank0[1], rank1[1])]


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_rejects_a_bad_recipe_with_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "bad.yaml", minimal(train={"lr": 0, "bogus": 1}, output={"dir": str(out)}))
    result = run_cli("finetune", str(recipe))
    assert result.returncode == 2
    assert "train.lr: must be > 0" in result.stderr and "train.bogus: unknown key" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli("finetune", str(recipe), "train.lr=1e-3", "train.bogus=null", "train.steps=-1")
    assert result.returncode == 2 and "train.steps: must be >= 1" in result.stderr
    result = run_cli("finetune", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2 and "does not exist" in result.stderr
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    result = run_cli("finetune", str(tmp_path / "list.yaml"))
    assert result.returncode == 2 and "a recipe is a YAML mapping" in result.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "list.yaml"]


def test_cli_recipes_list_show_validate(tmp_path):
    listed = run_cli("recipes", "list")
    assert listed.returncode == 0 and "quickstart-cpu" in listed.stdout and "invalid" not in listed.stdout
    shown = run_cli("recipes", "show", "quickstart-cpu")
    assert shown.returncode == 0 and yaml.safe_load(shown.stdout)["data"]["train"]["files"] == ["shakespeare:*"]
    assert shown.stdout == (ROOT / "recipes" / "quickstart-cpu.yaml").read_text()
    valid = run_cli("recipes", "validate", "quickstart-cpu", "train.steps=5")
    assert valid.returncode == 0 and "valid: quickstart-cpu" in valid.stdout and "5 steps" in valid.stdout
    shown_valid = run_cli("recipes", "validate", "quickstart-cpu", "train.steps=5", "--show")
    assert shown_valid.returncode == 0 and yaml.safe_load(shown_valid.stdout)["train"]["steps"] == 5
    bad = write_recipe(tmp_path / "r.yaml", minimal(data={"train": {"files": [str(tmp_path / "none.txt")]}}))
    invalid = run_cli("recipes", "validate", str(bad))
    assert (
        invalid.returncode == 2
        and f"data.train.files[0]: file {tmp_path / 'none.txt'} does not exist" in invalid.stderr
    )
    unknown = run_cli("recipes", "show", "no-such-recipe")
    assert unknown.returncode == 2 and "shipped: " in unknown.stderr


def test_corpus_from_jsonl_parquet_and_a_datasets_builder(tmp_path):
    """Records are documents; a held-out fraction takes whole documents (every 10th here) from any source."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from finetune_helpers import char_tokenizer

    from attnres_convert.finetune.data import build_corpus

    texts = [f"document {i}: " + "to be or not " * (i % 4 + 1) for i in range(30)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": texts}), parquet)
    held = {9, 19, 29}
    expected_train = sum(len(t) + 1 for i, t in enumerate(texts) if i not in held)  # one token per character + EOS
    sources = [
        {"files": [str(jsonl)]},
        {"files": [str(parquet)], "text_field": "body"},
        {"dataset": "json", "data_files": [str(jsonl)]},
    ]
    for source in sources:
        recipe = parse_recipe(
            minimal(data={"train": source, "eval": {"fraction": 0.1}, "seq_len": 16}, eval={"max_sequences": None})
        )
        corpus = build_corpus(recipe, char_tokenizer(), 10**6)
        assert (corpus.train_documents, corpus.eval_documents) == (27, 3), source
        assert corpus.train.num_tokens == expected_train // 16 * 16, source
        assert corpus.eval.num_tokens == sum(len(texts[i]) + 1 for i in held) // 16 * 16, source
    recipe = parse_recipe(minimal(data={"train": {"files": [str(jsonl)], "text_field": "body"}}))
    with pytest.raises(
        RecipeError, match=r"data\.train: record 1 of .*docs\.jsonl has no field 'body'; set text_field"
    ):
        build_corpus(recipe, char_tokenizer(), 10**6)
