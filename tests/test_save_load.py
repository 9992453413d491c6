"""Checkpoint contract: reloads through the package and through trust_remote_code in a Python where
attnres_convert cannot be imported; new parameter names; a plain tool refuses the folder."""

import json

import pytest
import torch
from isolated import run_isolated
from safetensors import safe_open
from tiny_models import randomize_queries, tiny_model, token_ids

from attnres_convert import load_converted, save_converted
from attnres_convert.conversion.surgery import convert_model
from attnres_convert.io.saving import SHIPPED_CODE


@pytest.mark.parametrize(
    "family", ["llama", "gpt2", "gpt_neox_parallel", "gemma2", "granite", "gemma4_text", "gemma4_moe"]
)
def test_folder_reloads_in_package_and_without_it(family, tmp_path, monkeypatch):
    """The folder alone runs the built-in paths, which the package runs under ATTNRES_KERNEL=eager: the same bits.
    The package's default (its token-major buffer for few tokens) agrees to float32 rounding."""
    model = randomize_queries(convert_model(tiny_model(family), block_size=3).eval(), 0.1, key_norms=0.1, add=True)
    out = save_converted(model, tmp_path / "converted")
    ids = token_ids()
    with torch.no_grad():
        default = model(ids).logits
        monkeypatch.setenv("ATTNRES_KERNEL", "eager")
        expected = model(ids).logits
    torch.testing.assert_close(default, expected, rtol=1e-4, atol=1e-4)  # float32 rounding, other summation order
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")

    for name in SHIPPED_CODE + ("config.json", "model.safetensors", "generation_config.json"):
        assert (out / name).is_file(), name

    reloaded = load_converted(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)

    result = run_isolated(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == "AttnResForCausalLM", type(model)
        assert "transformers_modules" in type(model).__module__, type(model).__module__
        with torch.no_grad():
            logits = model(data["ids"]).logits
        assert torch.equal(logits, data["logits"]), (logits - data["logits"]).abs().max()
        print("REMOTE-OK")
        """
    )
    assert "REMOTE-OK" in result.stdout, result.stderr[-3000:]


def test_new_parameters_follow_production_names_and_base_names_are_kept(tmp_path):
    base = tiny_model("llama")
    base_names = set(base.state_dict())
    out = save_converted(convert_model(base, block_size=2), tmp_path / "m")
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    new = keys - base_names
    expected_new = {
        f"model.layers.{i}.{p}_res_{kind}.weight"
        for i in range(3)
        for p in ("self_attention", "mlp")
        for kind in ("proj", "norm")
    } | {"model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight"}
    assert new == expected_new
    assert base_names - {"lm_head.weight"} <= keys  # tied head may be stored once
    assert shapes["model.layers.0.self_attention_res_proj.weight"] == (1, 64)
    assert shapes["model.layers.0.mlp_res_norm.weight"] == (64,)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnres" and config["architectures"] == ["AttnResForCausalLM"]
    assert config["block_size"] == 2 and config["source_scaling"] == "count"
    # the base type is recorded beside, not inside, text_config (see test below)
    assert config["base_model_type"] == "llama" and "model_type" not in config["text_config"]
    assert config["text_config"]["hidden_size"] == 64
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_attnres.AttnResForCausalLM"


def test_parallel_residual_layers_have_no_mlp_params(tmp_path):
    model = convert_model(tiny_model("gpt_neox_parallel"))
    names = set(model.state_dict())
    assert "gpt_neox.layers.0.self_attention_res_proj.weight" in names
    assert not any("mlp_res_" in n for n in names)


def test_a_tool_that_does_not_know_attnres_refuses_the_folder(tmp_path):
    out = save_converted(convert_model(tiny_model("llama")), tmp_path / "m")
    result = run_isolated(
        f"""
        from transformers import AutoModelForCausalLM, LlamaForCausalLM
        for load in (lambda: AutoModelForCausalLM.from_pretrained({str(out)!r}),
                     lambda: LlamaForCausalLM.from_pretrained({str(out)!r})):
            try:
                model = load()
            except Exception as error:
                print("REFUSED", type(error).__name__)
            else:
                print("LOADED", type(model).__name__)
        """
    )
    assert result.stdout.count("REFUSED") == 2, result.stdout + result.stderr[-2000:]


def test_loading_keeps_trained_queries_and_zeroes_missing_ones(tmp_path):
    """post-init must not overwrite loaded weights, and must zero queries absent from the checkpoint."""
    model = randomize_queries(convert_model(tiny_model("llama")), 0.1, key_norms=0.1, add=True)
    out = save_converted(model, tmp_path / "m")
    reloaded = load_converted(out)
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    from safetensors.torch import load_file, save_file

    weights = load_file(out / "model.safetensors")
    weights = {k: v for k, v in weights.items() if "_res_proj" not in k}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    partial = load_converted(out)
    for name, param in partial.named_parameters():
        if name.endswith("_res_proj.weight"):
            assert torch.count_nonzero(param) == 0, name


def test_published_folder_is_readable_like_a_plain_save(tmp_path):
    import os

    mask = os.umask(0o022)
    try:
        out = save_converted(convert_model(tiny_model("llama")), tmp_path / "m")
    finally:
        os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.iterdir())


def test_saving_never_changes_the_process_umask(tmp_path, monkeypatch):
    """Reading the umask by setting it would give files other threads create meanwhile mode 0666: saving
    reads it without touching it, and still publishes the modes the umask asks for."""
    import os

    from attnres_convert.io import saving

    assert saving.current_umask() == _umask_from_proc_or_set()
    mask = os.umask(0o027)
    calls = []
    real_umask = os.umask
    monkeypatch.setattr(os, "umask", lambda value: calls.append(value) or real_umask(value))
    try:
        out = save_converted(convert_model(tiny_model("llama")), tmp_path / "m")
    finally:
        real_umask(mask)
    assert calls == []
    assert out.stat().st_mode & 0o777 == 0o750
    assert all(p.stat().st_mode & 0o777 == 0o640 for p in out.iterdir() if p.is_file())


def _umask_from_proc_or_set() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
