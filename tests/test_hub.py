"""`attnres push` and `convert --push-to-hub` against a fake hub on 127.0.0.1 (only the HTTP boundary is
replaced): every file the loading contract needs is published, the published repo loads and computes
the same logits, the token never leaks, and offline / incomplete / refused pushes fail with a message."""

from __future__ import annotations

import json
import logging
import shutil
import socket

import pytest
import torch
from fake_hub import PUBLIC, FakeHub
from huggingface_hub import constants
from tiny_models import tiny_model, token_ids
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from attnres_convert import convert
from attnres_convert.cli import app
from attnres_convert.errors import scrub
from attnres_convert.hub.push import HubError, check_push_ready, push_folder
from attnres_convert.modeling import SHIPPED_CODE

TOKEN = "hf_FakeTokenForTests0123456789abcdefXYZ"
# What a pushed converted folder holds: the weights, configs, card, conversion record and the shipped code.
CONTRACT = {
    "config.json",
    "generation_config.json",
    # `attnres convert` streams a safetensors model: base weights, then the AttnRes parameters' own shard
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "README.md",
    "attnres_conversion.json",
    *SHIPPED_CODE,
}
runner = CliRunner()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake hub, with huggingface_hub pointed at it, no token in the environment and an empty login cache."""
    with FakeHub(TOKEN) as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # see fake_hub: plain HTTP LFS, not Xet's CAS
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        yield fake


@pytest.fixture(scope="module")
def converted(tiny_llama_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "tiny-attnres"
    convert(str(tiny_llama_folder), out, verify_tokens=32, verify_new_tokens=4)
    return out


def _copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


def _closed_port_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


def test_push_publishes_a_repo_that_loads_with_the_same_logits(hub, converted, tmp_path):
    result = push_folder(converted, "alice/tiny-attnres", token=TOKEN)
    published = hub.files("alice/tiny-attnres")
    assert set(published) == CONTRACT == set(result.files)
    for name, data in published.items():
        assert data == (converted / name).read_bytes(), name
    assert hub.repos["alice/tiny-attnres"].private is False
    assert result.commit_url and result.url.endswith("/alice/tiny-attnres")

    # What the hub holds is a complete model: download it and load it as a user would.
    download = tmp_path / "download"
    download.mkdir()
    for name, data in published.items():
        (download / name).write_bytes(data)
    ids = token_ids(1, 16)
    original = tiny_model("llama")
    loaded = AutoModelForCausalLM.from_pretrained(download, trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, original(ids).logits, atol=1e-4)


def test_cli_push_reads_the_login_cache_and_never_shows_the_token(hub, converted, tmp_path, caplog):
    token_file = tmp_path / "hf-home" / "token"
    token_file.parent.mkdir()
    token_file.write_text(TOKEN)
    caplog.set_level(logging.DEBUG)
    result = runner.invoke(
        app,
        ["push", str(converted), "alice/tiny-attnres", "--private", "--revision", "v1", "--commit-message", "first"],
    )
    assert result.exit_code == 0, result.output
    assert "Pushed" in result.output and "alice/tiny-attnres" in result.output
    repo = hub.repos["alice/tiny-attnres"]
    assert repo.private is True
    assert set(repo.branches["v1"]) == CONTRACT and repo.branches["main"] == {}
    assert repo.commits[-1]["header"]["summary"] == "first"
    # The token travels in the Authorization header of hub calls, and nowhere else.
    # The reachability check (HEAD of the endpoint's root) is not a hub call and carries no token.
    hub_calls = [
        r
        for r in hub.requests
        if not r.path.startswith("/lfs-upload/") and r.path not in PUBLIC and (r.method, r.path) != ("HEAD", "/")
    ]
    assert all("authorization" not in r.headers for r in hub.requests if (r.method, r.path) == ("HEAD", "/"))
    assert hub_calls and all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub_calls)
    assert not any(TOKEN.encode() in r.body for r in hub.requests)
    assert not any(TOKEN.encode() in data for data in repo.branches["v1"].values())
    assert TOKEN not in result.output and TOKEN not in caplog.text


def test_push_from_env_token_replaces_stale_weight_files(hub, converted, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    push_folder(converted, "alice/tiny-attnres")
    files = hub.files("alice/tiny-attnres")
    files["model-00001-of-00002.safetensors"] = b"stale shard of an earlier push"
    files["notes.txt"] = b"kept: not a weight file"
    push_folder(converted, "alice/tiny-attnres", commit_message="second")
    assert set(hub.files("alice/tiny-attnres")) == CONTRACT | {"notes.txt"}


def test_offline_push_says_unreachable_and_saved_locally(hub, converted, monkeypatch):
    monkeypatch.setattr(constants, "ENDPOINT", _closed_port_endpoint())
    result = runner.invoke(app, ["push", str(converted), "alice/tiny-attnres", "--token", TOKEN])
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert "unreachable" in message and "saved locally" in message and str(converted) in message
    assert "attnres push" in message and TOKEN not in result.output


def test_convert_push_to_hub(hub, tiny_llama_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(tiny_llama_folder), "-o", str(out), "--push-to-hub", "tiny-attnres"])
    assert result.exit_code == 0, result.output
    assert set(hub.files("alice/tiny-attnres")) == CONTRACT  # a bare NAME lands in the user's namespace
    assert TOKEN not in result.output


def test_convert_push_offline_keeps_the_saved_folder(hub, tiny_llama_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "ENDPOINT", _closed_port_endpoint())
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["convert", str(tiny_llama_folder), "-o", str(out), "--push-to-hub", "a/b", "--token", TOKEN]
    )
    assert result.exit_code == 2
    assert "unreachable" in result.output and "saved locally" in " ".join(result.output.split())
    assert check_push_ready(out)  # the folder is complete, ready for a later `attnres push`


def test_convert_without_a_token_fails_before_converting(hub, tiny_llama_folder, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(tiny_llama_folder), "-o", str(out), "--push-to-hub", "alice/x"])
    assert result.exit_code == 2
    assert "no HuggingFace token" in result.output and "hf auth login" in result.output
    assert not out.exists()


def test_incomplete_folder_is_refused_before_any_request(hub, converted, tmp_path):
    folder = _copy(converted, tmp_path)
    (folder / "modeling_attnres.py").unlink()
    weights = folder / "model-00001-of-00002.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "README.md").write_text("---\nbase_model: [unclosed\n---\n")
    with pytest.raises(HubError) as error:
        push_folder(folder, "alice/x", token=TOKEN)
    message = str(error.value)
    for expected in (
        "modeling_attnres.py is missing",
        "model-00001-of-00002.safetensors is truncated",
        "no vocabulary",
        "front matter",
    ):
        assert expected in message
    assert "nothing was uploaded" in message and hub.requests == []


def test_plain_model_folder_needs_a_card_then_pushes(hub, tiny_llama_folder, tmp_path):
    """A plain model (the baseline of an A/B fine-tune) pushes too, under the same checks minus the code."""
    folder = _copy(tiny_llama_folder, tmp_path)
    with pytest.raises(HubError, match="README.md"):
        push_folder(folder, "alice/baseline", token=TOKEN)
    (folder / "README.md").write_text("---\nlibrary_name: transformers\ntags: [attnres-baseline]\n---\n# baseline\n")
    push_folder(folder, "alice/baseline", token=TOKEN)
    assert set(hub.files("alice/baseline")) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "README.md",
    }
    (folder / "config.json").write_text("{}")
    with pytest.raises(HubError, match="no model_type"):
        push_folder(folder, "alice/baseline", token=TOKEN)


def test_folder_containing_the_token_is_refused(hub, converted, tmp_path):
    folder = _copy(converted, tmp_path)
    (folder / "training_args.json").write_text(json.dumps({"hub_token": TOKEN}))
    with pytest.raises(HubError) as error:
        push_folder(folder, "alice/x", token=TOKEN)
    assert "training_args.json contains your HuggingFace token" in str(error.value)
    assert TOKEN not in str(error.value) and hub.requests == []


def test_private_push_to_an_existing_public_repo_is_refused(hub, converted):
    push_folder(converted, "alice/public", token=TOKEN)
    before = dict(hub.files("alice/public"))
    with pytest.raises(HubError, match="already exists and is public"):
        push_folder(converted, "alice/public", token=TOKEN, private=True, commit_message="should not happen")
    assert hub.files("alice/public") == before and len(hub.repos["alice/public"].commits) == 1


def test_rejected_token_and_forbidden_namespace(hub, converted):
    with pytest.raises(HubError, match="rejected the token") as error:
        push_folder(converted, "alice/x", token="hf_WrongTokenWrongTokenWrongToken123")
    assert "WrongToken" not in str(error.value)
    hub.forbidden_namespaces.add("big-org")
    with pytest.raises(HubError, match="write access"):
        push_folder(converted, "big-org/x", token=TOKEN)


def test_invalid_repo_id():
    result = runner.invoke(app, ["push", ".", "not a repo id!"])
    assert result.exit_code == 2 and "not a valid repo id" in result.output


def test_scrub_hides_the_token_and_token_shaped_strings():
    assert scrub(f"failed with {TOKEN} in the URL", TOKEN) == "failed with *** in the URL"
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in scrub("Bearer hf_abcdefghijklmnopqrstuvwxyz")
