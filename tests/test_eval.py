"""`attnres eval`: held-out loss and perplexity, the same for a plain model and its conversion, equal to
the loss transformers computes itself; --json, --seq-len, --max-tokens; errors with their messages."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import save_plain_and_converted, tiny_model
from transformers import AutoTokenizer
from typer.testing import CliRunner

from attnres_convert import convert_model, save_converted
from attnres_convert.analysis.evaluate import EvalError, evaluate, evaluation_sequences
from attnres_convert.cli import app
from attnres_convert.io.samples import SAMPLE_TEXT

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(smollm2_folder, tmp_path_factory):
    """A tiny Llama with SmolLM2's vocabulary (plain and converted, with the tokenizer) and a text file."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    base = tiny_model("llama", vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    root = tmp_path_factory.mktemp("eval")
    save_plain_and_converted(base, tokenizer, root, block_size=3)
    text = root / "held_out.txt"
    text.write_text(SAMPLE_TEXT * 3)
    return root, base, tokenizer, text


def test_plain_and_converted_score_the_same_as_transformers(setup):
    root, base, tokenizer, text = setup
    plain = evaluate(str(root / "plain"), [str(text)], seq_len=64)
    converted = evaluate(str(root / "attnres"), [str(text)], seq_len=64)
    assert not plain.converted and converted.converted
    sequences = evaluation_sequences(tokenizer, [str(text)], 64)
    assert plain.sequences == converted.sequences == len(sequences) >= 4
    assert plain.tokens == converted.tokens == len(sequences) * 63
    assert converted.loss == pytest.approx(plain.loss, abs=1e-5)
    # transformers' own loss (mean over each sequence's 63 predictions; all sequences are full)
    with torch.no_grad():
        reference = base(
            torch.from_numpy(sequences.tokens).long(), labels=torch.from_numpy(sequences.tokens).long()
        ).loss
    assert plain.loss == pytest.approx(reference.item(), rel=1e-5)
    assert plain.perplexity == pytest.approx(math.exp(plain.loss))


def test_cli_json_and_table(setup):
    root, _, _, text = setup
    result = runner.invoke(
        app, ["eval", str(root / "attnres"), "--data", str(text), "--seq-len", "32", "--max-tokens", "200", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["converted"] is True and data["seq_len"] == 32 and data["sequences"] == 200 // 32
    assert data["tokens"] == 6 * 31 and data["perplexity"] == pytest.approx(math.exp(data["loss"]))
    table = runner.invoke(
        app, ["eval", str(root / "plain"), "--data", str(text), "--seq-len", "32", "--batch-size", "4"]
    )
    assert table.exit_code == 0 and "perplexity" in table.output and f"{data['loss']:.4f}"[:3] in table.output


def test_embedded_corpus_names(setup):
    root, _, _, _ = setup
    result = evaluate(str(root / "attnres"), ["shakespeare:hamlet"], seq_len=128, max_tokens=512)
    assert result.sequences == 4 and result.tokens == 4 * 127


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--data", "missing.txt"], "file missing.txt does not exist"),
        (["--data", "nowhere/*.txt"], "no file matches"),
        ([], "Missing option '--data'"),
        (["--seq-len", "512"], "longer than the model's 256 positions"),
        (["--seq-len", "100000", "--max-tokens", "200000"], "longer than"),
        (["--seq-len", "200", "--max-tokens", "100"], "not enough for one sequence"),
    ],
)
def test_cli_bad_input(setup, args, needle):
    root, _, _, text = setup
    if args and args[0] == "--seq-len":
        args = ["--data", str(text), *args]
    result = runner.invoke(app, ["eval", str(root / "attnres"), *args])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split())


def test_model_without_tokenizer(tmp_path):
    save_converted(convert_model(tiny_model("llama")), tmp_path / "m")
    (tmp_path / "t.txt").write_text("some text")
    with pytest.raises(EvalError, match="has no tokenizer"):
        evaluate(str(tmp_path / "m"), [str(tmp_path / "t.txt")])


def test_a_record_without_the_text_field_is_a_data_error(setup, tmp_path):
    """Held-out records are read by the text pipeline fine-tuning uses: a record without `text` is named."""
    from attnres_convert.errors import DataError

    root, _, _, _ = setup
    records = tmp_path / "held_out.jsonl"
    records.write_text('{"body": "to be or not to be"}\n')
    with pytest.raises(DataError, match=r"--data: record 1 of .*held_out\.jsonl has no field 'text'; set text_field"):
        evaluate(str(root / "attnres"), [str(records)], seq_len=4)
    result = runner.invoke(app, ["eval", str(root / "attnres"), "--data", str(records), "--seq-len", "4"])
    assert result.exit_code == 2 and "has no field 'text'" in " ".join(result.output.split()), result.output
