"""`attnres convert` end to end on a tiny local model folder."""

import json

import pytest
from tiny_models import tiny_model
from typer.testing import CliRunner

from attnres_convert.cli import app

runner = CliRunner()


def test_convert_writes_a_verified_folder(tiny_llama_folder, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(tiny_llama_folder), "-o", str(out), "--block-size", "3"])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and "identical" in result.output
    assert "block size S (sublayers)" in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == 3
    record = json.loads((out / "attnres_conversion.json").read_text())
    assert record["verification"]["passed"] is True
    assert record["verification"]["max_abs_logit_diff"] <= 1e-4
    assert record["summary"]["sources_per_sublayer"] == [1, 2, 2, 2, 3, 3]  # docs/design.md, S = 3
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "block-attnres" in card and "trust_remote_code=True" in card
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial")]


def test_verification_fits_a_short_learned_position_table(tmp_path):
    """GPT-2 with 64 positions cannot run the default 256 + 32 tokens (its position table ends at 64): the
    check shortens itself to the context window instead of crashing, and records what it ran."""
    folder, out = tmp_path / "gpt2-64", tmp_path / "out"
    tiny_model("gpt2", n_positions=64).save_pretrained(folder)
    result = runner.invoke(app, ["convert", str(folder), "-o", str(out)])
    assert result.exit_code == 0, result.output
    verification = json.loads((out / "attnres_conversion.json").read_text())["verification"]
    assert (verification["tokens"], verification["new_tokens"]) == (48, 16)
    assert verification["passed"] and verification["greedy_identical"]
    inspect = runner.invoke(app, ["inspect", str(out), "--max-tokens", "500"])
    assert inspect.exit_code == 0, inspect.output


def test_full_and_num_blocks(tiny_llama_folder, tmp_path):
    result = runner.invoke(
        app, ["convert", str(tiny_llama_folder), "-o", str(tmp_path / "full"), "--full", "--no-verify"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "full" / "config.json").read_text())["block_size"] == 1
    result = runner.invoke(
        app, ["convert", str(tiny_llama_folder), "-o", str(tmp_path / "nb"), "--num-blocks", "2", "--no-verify"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "nb" / "config.json").read_text())["block_size"] == 4  # 6 sublayers, whole layers


@pytest.mark.parametrize(
    "args, message",
    [
        (["--block-size", "2", "--full"], "only one of"),
        (["--block-size", "3", "--num-blocks", "2"], "only one of"),
        (["--block-size", "0"], "--block-size must be >= 1, got 0"),
        (["--block-size", "7"], "larger than the model's 6 sublayers"),
        (["--num-blocks", "9"], "more than the model's 6 sublayers"),
    ],
)
def test_impossible_block_settings_are_refused_before_writing(tiny_llama_folder, tmp_path, args, message):
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(tiny_llama_folder), "-o", str(out), *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not out.exists()
