"""Bad input: every row gets exit code 2, a message naming the input and the fix, and nothing at
the output path (not even a temporary folder beside it). Real files, real CLI (CliRunner on `cli.app`)."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
import transformers as T
from reliability_helpers import (
    assert_user_error,
    copy_model,
    edit_config,
    leftovers,
    read_only_folder,
    run_attnres,
    run_cli,
    save_config_only,
    truncate,
)
from tiny_models import olmo2_config

# ---------------------------------------------------------------- the source


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    out = tmp_path / "out"
    result = run_cli("convert", missing, "-o", out)
    assert_user_error(result, str(missing), "no such file or folder", "check the path", out=out)


def test_missing_gguf_file(tmp_path):
    missing = tmp_path / "model.gguf"
    out = tmp_path / "out"
    assert_user_error(run_cli("convert", missing, "-o", out), str(missing), "no such file", out=out)


def test_folder_that_is_not_a_model(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("not a model")
    out = tmp_path / "out"
    result = run_cli("convert", folder, "-o", out)
    assert_user_error(result, str(folder), "not a model folder", "config.json", "save_pretrained", out=out)


def test_file_that_is_not_a_model(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    out = tmp_path / "out"
    assert_user_error(run_cli("convert", path, "-o", out), str(path), "not a .gguf file", "model folder", out=out)


def test_config_that_is_not_json(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{ this is not json")
    out = tmp_path / "out"
    assert_user_error(run_cli("convert", folder, "-o", out), "config.json", "not valid JSON", out=out)


def test_config_without_weights(tmp_path, tiny_llama_folder):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_llama_folder / "config.json", folder)
    out = tmp_path / "out"
    result = run_cli("convert", folder, "-o", out)
    assert_user_error(result, str(folder), "no weights", "save_pretrained", out=out)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors(tmp_path, tiny_llama_folder, damage):
    folder = copy_model(tiny_llama_folder, tmp_path / f"{damage}-model")
    weights = folder / "model.safetensors"
    if damage == "truncated":
        truncate(weights, 0.5)
    elif damage == "garbage":
        weights.write_bytes(b"\x00\x01 definitely not safetensors " * 100)
    else:
        weights.write_bytes(b"")
    out = tmp_path / "out"
    result = run_cli("convert", folder, "-o", out)
    assert_user_error(result, str(folder), "could not load the weights", "truncated or corrupt", "re-download", out=out)


def test_truncated_gguf(tmp_path, smollm2_path):
    """The real SmolLM2 GGUF cut after 3 MB (inside its metadata and tokenizer)."""
    path = tmp_path / "SmolLM2-truncated.gguf"
    with open(smollm2_path, "rb") as source:
        path.write_bytes(source.read(3_000_000))
    out = tmp_path / "out"
    result = run_cli("convert", path, "-o", out)
    assert_user_error(result, str(path), "truncated, corrupt", "re-download", out=out)


@pytest.mark.parametrize(
    "content", [b"", b"GGUF\x03\x00\x00\x00" + b"\xff" * 40, os.urandom(4096)], ids=["empty", "bad-header", "random"]
)
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    out = tmp_path / "out"
    result = run_cli("convert", path, "-o", out)
    assert_user_error(result, str(path), "GGUF", "re-download", out=out)


# ---------------------------------------------------------------- the architecture


def _opt_post_norm():
    return T.OPTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        vocab_size=128,
        word_embed_proj_dim=32,
        do_layer_norm_before=False,
    )


def _exaone4():
    return T.Exaone4Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )


def _bert():
    return T.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )


def _t5():
    return T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=128)


def _bart():
    return T.BartConfig(
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        vocab_size=128,
    )


@pytest.mark.parametrize(
    "make, needles",
    [
        (_opt_post_norm, ["do_layer_norm_before=False", "post-norm"]),
        (olmo2_config, ["OLMo-2", "post-norm"]),
        (_bert, ["BERT", "encoder"]),
        (_t5, ["T5", "encoder-decoder"]),
        (_bart, ["BART", "encoder-decoder"]),
    ],
    ids=["opt-post-norm", "olmo2-not-prenorm", "bert-encoder", "t5-encoder-decoder", "bart-encoder-decoder"],
)
def test_refused_architectures(tmp_path, make, needles):
    """Refused from the config alone, before any weights are read; the message says why and what is supported."""
    folder = save_config_only(tmp_path / "model", make())
    out = tmp_path / "out"
    result = run_cli("convert", folder, "-o", out)
    assert_user_error(result, str(folder), *needles, "attnres architectures", out=out)


def test_unsupported_architecture_with_weights(tmp_path):
    """A complete tiny EXAONE-4 (weights too): its attention reads the residual stream without a norm before it
    (post-norm), so no structure reproduces its layers; the refusal names the layer and why, after loading, and
    nothing is written."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "tiny-exaone4"
    AutoModelForCausalLM.from_config(_exaone4()).save_pretrained(folder)
    out = tmp_path / "out"
    result = run_cli("convert", folder, "-o", out)
    # The reason ends as a sentence before the pointer to the coverage table.
    assert_user_error(
        result,
        str(folder),
        "exaone4",
        "decoder layer 0",
        "post-norm",
        "per-layer-input gate does). `attnres architectures` lists",
        out=out,
    )


def test_made_up_model_type(tmp_path, tiny_llama_folder):
    folder = edit_config(copy_model(tiny_llama_folder, tmp_path / "mystery"), model_type="made_up_lm")
    out = tmp_path / "out"
    result = run_cli("convert", folder, "-o", out)
    assert_user_error(result, str(folder), "made_up_lm", "does not know", "attnres architectures", out=out)


def test_gpt2_with_cross_attention(tmp_path, tiny_llama_folder):
    folder = save_config_only(
        tmp_path / "gpt2-x", T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, add_cross_attention=True)
    )
    out = tmp_path / "out"
    assert_user_error(run_cli("convert", folder, "-o", out), "add_cross_attention", "cross-attention", out=out)


def test_already_converted_model(tmp_path, tiny_llama_folder):
    out1 = tmp_path / "converted"
    assert run_cli("convert", tiny_llama_folder, "-o", out1, "--no-verify").exit_code == 0
    out2 = tmp_path / "again"
    result = run_cli("convert", out1, "-o", out2)
    assert_user_error(result, str(out1), "already an AttnRes model", "original model", out=out2)


# ---------------------------------------------------------------- the hub without network


@pytest.fixture
def silent_endpoint():
    """A loopback address that takes the connection and never answers: a hub behind a black hole, without
    sending anything off this machine."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)  # connections wait in the backlog; none is ever accepted or answered
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["refused", "black-hole"])
def test_hub_id_without_network_fails_fast(tmp_path, kind, request):
    """A hub id with no hub: the installed command answers in seconds (not after minutes of retries),
    says the hub is unreachable and how to go on offline. Both a refused connection and a black hole."""
    endpoint = "http://127.0.0.1:9" if kind == "refused" else request.getfixturevalue("silent_endpoint")
    out = tmp_path / "out"
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0"}
    env.pop("HF_TOKEN", None)
    start = time.monotonic()
    result = run_attnres("convert", "some-org/some-model", "-o", out, env=env, timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    # The TCP check says "unreachable"; where something accepts the connection but is no hub, the HTTP
    # error is reported instead ("is it reachable from here?"). Either way: the id, the cause, the way out.
    assert "'some-org/some-model'" in message and "reachable" in message, message
    assert "local" in message and "a .gguf file instead" in message, message
    assert "Traceback" not in result.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s"  # about 5 s of imports + a 3 s connect timeout
    assert leftovers(out) == []


# ---------------------------------------------------------------- block size / block count


BLOCK_SIZE_CASES = [
    (["--block-size", "0"], ["--block-size must be >= 1", "got 0"]),
    (["--block-size", "-2"], ["--block-size must be >= 1", "got -2"]),
    (["--block-size", "2.5"], ["--block-size", "valid integer"]),
    (["--block-size", "two"], ["--block-size", "valid integer"]),
    (["--block-size", "7"], ["block size 7", "6 sublayers", "at most 6"]),
    (["--num-blocks", "0"], ["--num-blocks must be >= 1", "got 0"]),
    (["--num-blocks", "-3"], ["--num-blocks must be >= 1"]),
    (["--num-blocks", "1.5"], ["--num-blocks", "valid integer"]),
    (["--num-blocks", "99"], ["99 blocks", "6 sublayers", "at most 6"]),
    (["--block-size", "2", "--full"], ["only one of", "--block-size", "--full"]),
    (["--block-size", "2", "--num-blocks", "3"], ["only one of", "--num-blocks"]),
]


@pytest.mark.parametrize("args, needles", BLOCK_SIZE_CASES, ids=[" ".join(args) for args, _ in BLOCK_SIZE_CASES])
def test_bad_block_size(tmp_path, tiny_llama_folder, args, needles):
    out = tmp_path / "out"
    assert_user_error(run_cli("convert", tiny_llama_folder, "-o", out, *args), *needles, out=out)


# ---------------------------------------------------------------- the output


def test_output_missing(tiny_llama_folder):
    assert_user_error(run_cli("convert", tiny_llama_folder), "--output")


def test_output_exists_without_overwrite(tmp_path, tiny_llama_folder):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("convert", tiny_llama_folder, "-o", out)
    assert_user_error(result, str(out), "already exists", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_overwrite_refuses_a_folder_attnres_did_not_write(tmp_path, tiny_llama_folder):
    """`--overwrite` replaces an earlier attnres output only: `-o ~ --overwrite` must not delete a home folder."""
    out = tmp_path / "documents"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    result = run_cli("convert", tiny_llama_folder, "-o", out, "--overwrite")
    assert_user_error(result, str(out), "not an attnres model folder", "choose another path")
    assert (out / "thesis.tex").read_text() == "years of work"


def test_output_is_a_file(tmp_path, tiny_llama_folder):
    out = tmp_path / "out.txt"
    out.write_text("a file")
    for extra in ([], ["--overwrite"]):
        assert_user_error(run_cli("convert", tiny_llama_folder, "-o", out, *extra), str(out), "is a file")
        assert out.read_text() == "a file"


def test_output_below_a_file(tmp_path, tiny_llama_folder):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    out = blocker / "sub" / "out"
    assert_user_error(run_cli("convert", tiny_llama_folder, "-o", out), str(blocker), "is a file")
    assert blocker.read_text() == "a file"


def test_output_is_the_input_folder(tmp_path, tiny_llama_folder):
    folder = copy_model(tiny_llama_folder, tmp_path / "model")
    before = sorted(p.name for p in folder.iterdir())
    for extra in ([], ["--overwrite"]):
        assert_user_error(run_cli("convert", folder, "-o", folder, *extra), str(folder), "input model folder")
    assert sorted(p.name for p in folder.iterdir()) == before


def test_output_is_a_symlink(tmp_path, tiny_llama_folder):
    target = tmp_path / "target"
    target.mkdir()
    out = tmp_path / "link"
    out.symlink_to(target)
    assert_user_error(run_cli("convert", tiny_llama_folder, "-o", out, "--overwrite"), str(out), "symbolic link")
    assert out.is_symlink() and list(target.iterdir()) == []


def test_output_in_a_read_only_folder(tmp_path, tiny_llama_folder):
    """Read-only for real: root ignores permission bits, so as root the folder is made immutable (chattr +i),
    otherwise chmod 555. check_output creates a probe entry instead of trusting os.access."""
    parent = tmp_path / "locked"
    with read_only_folder(parent) as locked:
        if not locked:
            pytest.skip("running as root on a filesystem without the immutable attribute")
        for out in (parent / "out", parent / "deeper" / "out"):
            result = run_cli("convert", tiny_llama_folder, "-o", out)
            assert_user_error(result, str(out), str(parent), "not writable", "choose an output path you can write to")
        assert list(parent.iterdir()) == []


@pytest.mark.parametrize("out", ["/sys/attnres-test-output", "/proc/attnres-test-output"])
def test_output_on_a_read_only_filesystem(tiny_llama_folder, out):
    """/sys and /proc refuse new folders even for root, while os.access says they are writable."""
    if not Path(out).parent.is_dir() or Path(out).exists():
        pytest.skip(f"{Path(out).parent} is not a pseudo-filesystem here")
    assert_user_error(run_cli("convert", tiny_llama_folder, "-o", out), out, "not writable", "choose an output path")
    assert not Path(out).exists()


def test_check_output_does_not_trust_os_access(tmp_path, monkeypatch):
    """The library call alone: a folder os.access calls writable but where mkdir fails is refused."""
    from attnres_convert.errors import OutputError
    from attnres_convert.io.saving import check_output

    if not Path("/sys").is_dir() or not os.access("/sys", os.W_OK):
        pytest.skip("needs /sys where os.access says writable")
    with pytest.raises(OutputError, match="not writable"):
        check_output("/sys/attnres-out")
    assert check_output(tmp_path / "fine") == tmp_path / "fine"
    assert list(tmp_path.iterdir()) == []  # the probe is gone


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in-memory"])
def test_a_conversion_that_verification_rejects_writes_nothing(tmp_path, tiny_llama_folder, monkeypatch, stream):
    """A model converted all the way and then found inexact (one decoder layer's weight moved after conversion:
    in the streamed folder's shard, or on the converted model in memory) is refused by the verification with
    exit 1 and leaves no output folder, complete or partial, nor a temporary one beside it."""
    from safetensors.torch import load_file, save_file

    from attnres_convert.conversion import convert as convert_module

    name = "model.layers.1.mlp.down_proj.weight"
    if stream:
        real_write = convert_module.write_streamed

        def write_then_damage(tmp, *args, **kwargs):
            plan = real_write(tmp, *args, **kwargs)
            shard = next(path for path in Path(tmp).glob("*.safetensors") if name in load_file(path))
            tensors = load_file(shard)
            tensors[name] = tensors[name] + 0.5
            save_file(tensors, shard, metadata={"format": "pt"})
            return plan

        monkeypatch.setattr(convert_module, "write_streamed", write_then_damage)
    else:
        real_convert = convert_module.convert_model

        def convert_then_damage(base, **kwargs):
            model = real_convert(base, **kwargs)
            with torch.no_grad():
                dict(model.named_parameters())[name].add_(0.5)
            return model

        monkeypatch.setattr(convert_module, "convert_model", convert_then_damage)
    out = tmp_path / "out"
    args = ["convert", tiny_llama_folder, "-o", out, "--dtype", "float32"] + ([] if stream else ["--no-stream"])
    result = run_cli(*args)
    # A failed check, not bad input: exit code 1 (EXIT_FAILED_CHECK).
    assert_user_error(result, "does not reproduce the original", "Nothing was saved", out=out, code=1)


def test_a_model_whose_code_fails_during_conversion_writes_nothing(tmp_path, tiny_llama_folder, monkeypatch):
    """The model's own code raising in the middle of the conversion (as a forward that does not fit the probe
    inputs does) is a refusal naming the model and the upstream error: exit 2, no traceback, no output folder."""
    from attnres_convert.conversion import convert as convert_module

    real_convert = convert_module.convert_model

    def convert_until_the_forward_fails(base, **kwargs):
        layer = base.model.layers[1]
        layer.mlp.forward = lambda x: x[..., :3]  # returns the wrong width: the stream add fails
        return real_convert(base, **kwargs)

    monkeypatch.setattr(convert_module, "convert_model", convert_until_the_forward_fails)
    out = tmp_path / "out"
    result = run_cli("convert", tiny_llama_folder, "-o", out, "--dtype", "float32", "--no-stream")
    assert_user_error(result, str(tiny_llama_folder), "failed while it was being converted", "RuntimeError", out=out)
