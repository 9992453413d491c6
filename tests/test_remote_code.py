"""A model with its own code (`auto_map`, a model type transformers does not ship): `attnres convert FOLDER
--trust-remote-code` finds and proves its structure, converts it exactly, and ships its code next to the converted
model's, so the folder loads with trust_remote_code=True where neither the original folder nor attnres exists."""

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
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from attnres_convert import load_converted
from attnres_convert.cli import app
from attnres_convert.errors import SourceError

FIXTURE = Path(__file__).parent / "remote_code_model"
AUTO_MAP = {
    "AutoConfig": "configuration_tiny_prenorm.TinyPreNormConfig",
    "AutoModelForCausalLM": "modeling_tiny_prenorm.TinyPreNormForCausalLM",
}
runner = CliRunner()


# A model whose config names its sizes its own way (d_model, n_vocab, n_layer: no hidden_size, vocab_size or
# num_hidden_layers) and whose head, `unembed`, is a plain Linear that get_output_embeddings does not return.
OWN_NAMES_FIXTURE = Path(__file__).parent / "own_names_model"
OWN_NAMES_AUTO_MAP = {
    "AutoConfig": "configuration_own_names.OwnNamesConfig",
    "AutoModelForCausalLM": "modeling_own_names.OwnNamesForCausalLM",
}


def own_code_folder(
    folder: Path,
    fixture: Path = FIXTURE,
    model_type: str = "tiny_prenorm",
    architecture: str = "TinyPreNormForCausalLM",
    auto_map: dict = AUTO_MAP,
) -> Path:
    """A tiny random checkpoint of a fixture model, as a repository with its own code holds it."""
    folder.mkdir(parents=True)
    for path in fixture.glob("*.py"):
        shutil.copyfile(path, folder / path.name)
    config = {"model_type": model_type, "architectures": [architecture], "auto_map": auto_map}
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(folder, trust_remote_code=True), trust_remote_code=True
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger than the default init, so that an inexact conversion shows in the logits
        for param in model.parameters():
            scale = 0.15 if param.dim() >= 2 else 0.05
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(folder)
    return folder


def _greedy(model, ids, use_cache=True):
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, use_cache=use_cache, pad_token_id=0
    )
    return out[:, ids.shape[1] :]


def test_convert_without_trust_remote_code_says_to_pass_it(tmp_path):
    source = own_code_folder(tmp_path / "tiny-own-code")
    result = runner.invoke(app, ["convert", str(source), "-o", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "--trust-remote-code" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-own-code"]


@pytest.mark.slow
def test_own_code_model_converts_exactly_and_loads_without_its_folder_or_attnres(tmp_path, monkeypatch):
    source = own_code_folder(tmp_path / "tiny-own-code")
    out = tmp_path / "converted"
    result = runner.invoke(app, ["convert", str(source), "-o", str(out), "--trust-remote-code", "--block-size", "3"])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and "identical" in result.output
    for name in ("configuration_tiny_prenorm.py", "modeling_tiny_prenorm.py", "base_code.py", "modeling_attnres.py"):
        assert (out / name).is_file(), name
    assert "from .modeling_tiny_prenorm import TinyPreNormForCausalLM" in (out / "base_code.py").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnres" and config["base_model_type"] == "tiny_prenorm"
    # Discovery found the fixture's own names (no table entry has them).
    kinds = config["structure"]["kinds"][0]
    assert [b["norm"] for s in kinds for b in s["branches"]] == ["attn_norm", "ffn_norm"]
    assert config["structure"]["layers"] == "blocks" and config["structure"]["final_norm"] == "final_norm"

    original = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).eval()
    with pytest.raises(SourceError, match="--trust-remote-code"):
        load_converted(out)
    converted = load_converted(out, trust_remote_code=True).eval()
    with torch.no_grad():  # non-zero queries: the reload below must get these very tensors, not fresh zeros
        for name, param in converted.named_parameters():
            if "_res_" in name:
                param.add_(0.1)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = original(ids).logits
        got = load_converted(out, trust_remote_code=True).eval()(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(_greedy(load_converted(out, trust_remote_code=True).eval(), ids), _greedy(original, ids))

    trained = tmp_path / "trained"
    converted.save_pretrained(trained)  # the user's own save: the base code goes along again
    # Without attnres the folder runs its built-in paths, which the package runs under ATTNRES_KERNEL=eager.
    monkeypatch.setenv("ATTNRES_KERNEL", "eager")
    with torch.no_grad():
        expected = converted(ids).logits
        expected_tokens = _greedy(converted, ids)
    torch.save({"ids": ids, "logits": expected, "tokens": expected_tokens, "original": want}, tmp_path / "expected.pt")
    shutil.move(source, tmp_path / "moved-away")  # the original folder is gone
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = BLOCK_IMPORT + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        for folder in ({str(out)!r}, {str(trained)!r}):
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert type(model.model).__name__ == "TinyPreNormModel", type(model.model)
            with torch.no_grad():
                logits = model(data["ids"]).logits
            if folder == {str(out)!r}:  # as converted: zero queries, the original's logits
                assert (logits - data["original"]).abs().max() <= 1e-5
            else:
                assert torch.equal(logits, data["logits"]), (logits - data["logits"]).abs().max()
                tokens = model.generate(data["ids"], attention_mask=torch.ones_like(data["ids"]), max_new_tokens=6,
                                        do_sample=False, pad_token_id=0)[:, data["ids"].shape[1]:]
                assert torch.equal(tokens, data["tokens"])
        print("REMOTE-OK")
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "fresh-modules-cache"))  # nothing copied from the source
    env.pop("PYTHONPATH", None)
    env.pop("ATTNRES_KERNEL", None)
    # This process's thread count, so the logits compared bit for bit sum in the same order (like for like).
    code = code.replace("import torch\n", f"import torch\ntorch.set_num_threads({torch.get_num_threads()})\n", 1)
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
    assert not any("tiny-own-code" in p.name for p in (tmp_path / "fresh-modules-cache").rglob("*"))


def test_own_code_that_claims_a_transformers_model_type_is_refused(tmp_path):
    """A converted folder registers the base code under its model type; one transformers ships cannot be
    registered over, so the folder would silently build transformers' implementation instead."""
    from attnres_convert.architectures import UnsupportedModelError
    from attnres_convert.conversion.surgery import convert_model

    source = own_code_folder(tmp_path / "tiny-own-code")
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True)
    model.config.model_type = "llama"  # as a repository whose own code reuses a transformers model type
    with pytest.raises(UnsupportedModelError, match="transformers also ships.*without --trust-remote-code"):
        convert_model(model)


@pytest.mark.slow
def test_own_code_model_with_its_own_config_names_converts_exactly(tmp_path):
    """Sizes the config does not name are read from the modules (the stream's width, the embedding's rows, the
    stack's length) and the head is found from the logits; the converted config records the stream's width for
    the shipped code (`stream_width`), which cannot read a `hidden_size` the base config does not have."""
    source = own_code_folder(
        tmp_path / "own-names", OWN_NAMES_FIXTURE, "own_names_lm", "OwnNamesForCausalLM", OWN_NAMES_AUTO_MAP
    )
    base_config = json.loads((source / "config.json").read_text())
    assert {"d_model", "n_vocab", "n_layer"} <= set(base_config)
    assert not {"hidden_size", "vocab_size", "num_hidden_layers"} & set(base_config)
    original = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).eval()
    assert original.get_output_embeddings() is None
    out = tmp_path / "converted"
    result = runner.invoke(app, ["convert", str(source), "-o", str(out), "--trust-remote-code", "--block-size", "2"])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and "identical" in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["stream_width"] == base_config["d_model"] == 48
    assert "outer_forward" not in config  # its base model takes the standard inputs: the converted model calls it
    structure = config["structure"]
    assert (structure["base_model"], structure["layers"], structure["final_norm"], structure["lm_head"]) == (
        "transformer",
        "h",
        "ln_f",
        "unembed",
    )
    assert len(structure["layer_kinds"]) == base_config["n_layer"] == 3

    ids = torch.randint(3, 112, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = original(ids).logits
    want_tokens = _greedy(original, ids)
    converted = load_converted(out, trust_remote_code=True).eval()
    with torch.no_grad():
        assert (converted(ids).logits - want).abs().max().item() <= 1e-5
    assert torch.equal(_greedy(converted, ids), want_tokens)
    assert torch.equal(_greedy(converted, ids, use_cache=False), want_tokens)
    torch.save({"ids": ids, "logits": want, "tokens": want_tokens}, tmp_path / "expected.pt")
    shutil.move(source, tmp_path / "moved-away")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = BLOCK_IMPORT + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        assert type(model.transformer).__name__ == "OwnNamesModel", type(model.transformer)
        assert model.transformer.h[0].mlp_res_proj.weight.shape == (1, 48)
        with torch.no_grad():
            logits = model(data["ids"]).logits
            loss = model(data["ids"], labels=data["ids"]).loss  # the loss reads the vocabulary from the logits
        assert (logits - data["logits"]).abs().max() <= 1e-5, (logits - data["logits"]).abs().max()
        assert torch.isfinite(loss)
        tokens = model.generate(data["ids"], attention_mask=torch.ones_like(data["ids"]), max_new_tokens=6,
                                do_sample=False, pad_token_id=0)[:, data["ids"].shape[1]:]
        assert torch.equal(tokens, data["tokens"]), (tokens, data["tokens"])
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


def test_a_refusal_ends_as_a_sentence_before_the_pointer_to_the_coverage(tmp_path):
    from attnres_convert.conversion.convert import SEE_COVERAGE, refusal

    message = refusal("my-model", ValueError("it names no LM head"))
    assert message == f"cannot convert my-model: it names no LM head. {SEE_COVERAGE}"
    assert refusal("m", ValueError("post-norm.")) == f"cannot convert m: post-norm. {SEE_COVERAGE}"
