"""Models with their own code shaped as remote-code models on the hub often are (tests/trunk_model): the decoder
stack in a plain `nn.Module` trunk called with the token ids alone, a config naming its sizes its own way (`width`,
`depth`, `vocab`), no KV cache, `get_input_embeddings` on the outer causal LM only. `attnres convert
--trust-remote-code` finds the embedding, stack and head, runs the trunk through the outer model's own forward,
verifies on logits where the original cannot `generate` (and says so), and refuses what cannot convert with exit 2
and a sentence naming what is missing: never a traceback."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from isolated import BLOCK_IMPORT
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from typer.testing import CliRunner

from attnres_convert import load_converted
from attnres_convert.cli import app

FIXTURE = Path(__file__).parent / "trunk_model"
runner = CliRunner()


def trunk_folder(folder: Path, architecture: str, **config) -> Path:
    """A tiny random checkpoint of one of the fixture's causal-LM classes, as a repository with its own code holds it."""
    folder.mkdir(parents=True)
    # A model type of its own per variant, as distinct repositories have: a converted folder loaded in this process
    # registers its base code under its type, which would then serve the next variant.
    model_type = (
        "tiny_"
        + architecture.removeprefix("Tiny").removesuffix("ForCausalLM").lower()
        + "".join(f"_{key}" for key, value in sorted(config.items()) if value)
    )
    for path in FIXTURE.glob("*.py"):
        (folder / path.name).write_text(path.read_text().replace('"tiny_trunk"', repr(model_type)))
    auto_map = {
        "AutoConfig": "configuration_tiny_trunk.TinyTrunkConfig",
        "AutoModelForCausalLM": f"modeling_tiny_trunk.{architecture}",
    }
    (folder / "config.json").write_text(
        json.dumps({"model_type": model_type, "architectures": [architecture], "auto_map": auto_map, **config})
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(folder, trust_remote_code=True), trust_remote_code=True
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger than the default init, so that an inexact conversion shows in the logits
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * (0.15 if param.dim() >= 2 else 0.05))
    model.save_pretrained(folder)
    return folder


def _logits(model, ids):
    out = model(ids)
    return (out if isinstance(out, tuple) else (out.logits,))[0]


def _greedy_by_forward(model, ids, steps=6):
    for _ in range(steps):
        ids = torch.cat([ids, _logits(model, ids)[:, -1:].argmax(-1)], dim=1)
    return ids[:, -steps:]


def _convert(source: Path, out: Path, *extra: str):
    result = runner.invoke(
        app, ["convert", str(source), "-o", str(out), "--trust-remote-code", "--block-size", "2", *extra]
    )
    assert "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result


# (the causal-LM class, what generate of the original fails with: None where it generates)
VARIANTS = {
    "no-cache": ("TinyNoCacheForCausalLM", "num_hidden_layers"),  # forward(input_ids, labels=None)
    "ignored-cache": ("TinyIgnoredCacheForCausalLM", "num_hidden_layers"),  # takes past_key_values, ignores it
    "own-argument-names": ("TinyOwnArgsForCausalLM", "no attribute 'generate'"),  # forward(tokens, targets) -> tuple
    "generates-without-cache": ("TinyGeneratingForCausalLM", None),  # the trunk has get_input_embeddings too
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trunk_model_converts_exactly_and_loads(tmp_path, variant):
    architecture, generate_failure = VARIANTS[variant]
    source = trunk_folder(tmp_path / "tiny", architecture)
    original = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).eval()
    assert not isinstance(original.trunk, PreTrainedModel)  # a plain module
    assert not hasattr(original.trunk, "get_input_embeddings") or variant == "generates-without-cache"
    out = tmp_path / "converted"
    result = _convert(source, out)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "PASS" in text and "identical" in text
    record = json.loads((out / "attnres_conversion.json").read_text())["verification"]
    assert record["passed"] is True and record["max_abs_logit_diff"] <= 1e-5 and record["new_tokens"] > 0
    if generate_failure is None:
        assert record["greedy_by"] == "generate" and record["generate_failure"] is None
        assert "cannot generate" not in text
    else:
        assert record["greedy_by"] == "forward" and generate_failure in record["generate_failure"]
        assert "The original cannot generate" in text and "verified on its logits" in text
        assert "cannot `generate`" in (out / "README.md").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["outer_forward"] is True and config["stream_width"] == 48
    structure = config["structure"]
    assert (structure["base_model"], structure["layers"], structure["final_norm"], structure["lm_head"]) == (
        "trunk",
        "blocks",
        "norm",
        "head",
    )
    assert [b["norm"] for s in structure["kinds"][0] for b in s["branches"]] == ["norm1", "norm2"]

    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _logits(original, ids)
        want_tokens = _greedy_by_forward(original, ids)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    want_generated = original.generate(ids, **kwargs) if generate_failure is None else None
    converted = load_converted(out, trust_remote_code=True).eval()
    assert converted.get_input_embeddings() is converted.trunk.tok
    with torch.no_grad():
        assert (converted(ids).logits - want).abs().max().item() <= 1e-5
        assert torch.isfinite(converted(ids, labels=ids).loss)
        for name, param in converted.named_parameters():  # trained queries: the depth attention runs in the trunk
            if "_res_proj" in name:
                param.add_(0.5)
        assert (converted(ids).logits - want).abs().max().item() > 1e-3

    # Where neither the original folder nor attnres is: AutoModelForCausalLM with the folder's own code.
    torch.save(
        {"ids": ids, "logits": want, "tokens": want_tokens, "generated": want_generated}, tmp_path / "expected.pt"
    )
    shutil.move(source, tmp_path / "moved-away")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = BLOCK_IMPORT + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == "AttnResForCausalLM" and type(model.trunk).__name__.startswith("Trunk")
        # the causal mask, a buffer the checkpoint does not hold, is made by the base model's own init
        assert torch.equal(model.trunk.blocks[0].attn.causal, torch.ones(64, 64, dtype=torch.bool).tril())
        ids = data["ids"]
        with torch.no_grad():
            logits = model(ids).logits
            assert (logits - data["logits"]).abs().max() <= 1e-5, (logits - data["logits"]).abs().max()
            for _ in range(6):
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        assert torch.equal(ids[:, -6:], data["tokens"])
        if data["generated"] is not None:
            generated = model.generate(data["ids"], attention_mask=torch.ones_like(data["ids"]), max_new_tokens=6,
                                       do_sample=False, pad_token_id=0)
            assert torch.equal(generated, data["generated"]), (generated, data["generated"])
        print("REMOTE-OK")
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "fresh-modules-cache"))
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert "REMOTE-OK" in result.stdout, result.stderr[-3000:]


def test_trunk_model_converts_without_verification(tmp_path):
    """The issue's first case: `--no-verify` on a trunk without get_input_embeddings exits 0."""
    source = trunk_folder(tmp_path / "tiny", "TinyNoCacheForCausalLM")
    result = _convert(source, tmp_path / "converted", "--no-verify")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "converted" / "attnres_conversion.json").read_text())["verification"] is None


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("case", ["post-norm", "no-input-embeddings"])
def test_trunk_model_that_cannot_convert_exits_2_naming_what_is_missing(tmp_path, case, verify):
    if case == "post-norm":
        source = trunk_folder(tmp_path / "tiny", "TinyNoCacheForCausalLM", post_norm=True)
        expected = ("cannot convert", "decoder layer 0", "returns the output of its norm `norm2`", "post-norm layer")
    else:
        source = trunk_folder(tmp_path / "tiny", "TinyNoAccessorsForCausalLM")
        expected = (
            "cannot convert",
            "TinyNoAccessorsForCausalLM.get_input_embeddings fails (NotImplementedError",
            "names no token embedding",
            "Define get_input_embeddings on the causal LM class",
        )
    result = _convert(source, tmp_path / "converted", *([] if verify else ["--no-verify"]))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    for words in expected:
        assert words in text, text
    assert not (tmp_path / "converted").exists()
