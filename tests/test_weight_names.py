"""The AttnRes tensors keep their names through transformers' checkpoint renaming rules: Mixtral's reversed
`.mlp.` -> `.block_sparse_moe.` (an unescaped regex) must not save `mlp_res_proj` as `block_sparse_moe.res_proj`,
whichever way the folder is written (the user's own save_pretrained, save_converted, a reloaded model saved
again), and no family's rules may rename them."""

import torch
from isolated import run_isolated
from safetensors import safe_open
from tiny_models import randomize_queries, tiny_model, token_ids
from transformers.conversion_mapping import _build_checkpoint_conversion_mapping

from attnres_convert import load_converted, save_converted
from attnres_convert.conversion.surgery import convert_model
from attnres_convert.modeling.modeling_attnres import guarded


def _trained_mixtral():
    model = convert_model(tiny_model("mixtral"), block_size=3).eval()
    # as after training: non-zero queries, key norms away from one
    return randomize_queries(model, 0.3, seed=3, key_norms=0.3, add=True)


def _attnres_tensors(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters() if "_res_" in name}


def _stored_keys(folder) -> set[str]:
    keys = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as handle:
            keys |= set(handle.keys())
    return keys


def test_mixtral_attnres_tensors_survive_saving(tmp_path, monkeypatch):
    model = _trained_mixtral()
    expected = _attnres_tensors(model)
    assert any(name.endswith("mlp_res_proj.weight") for name in expected)
    folders = {name: tmp_path / name for name in ("save_pretrained", "save_converted", "saved_again")}
    model.save_pretrained(folders["save_pretrained"])  # what a user does with the converted model
    save_converted(model, folders["save_converted"])
    # A loaded folder saved again (fine-tune outputs): the rules then come from the load.
    load_converted(folders["save_converted"]).save_pretrained(folders["saved_again"])
    for folder in folders.values():
        stored = _stored_keys(folder)
        assert set(expected) <= stored, (folder.name, sorted(set(expected) - stored))
        assert not any("block_sparse_moe.res_" in key for key in stored)
        assert any(".block_sparse_moe.experts.0.w1." in key for key in stored)  # the base keeps its checkpoint format

    ids = token_ids()
    monkeypatch.setenv("ATTNRES_KERNEL", "eager")  # the built-in paths, which a folder runs without attnres
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"ids": ids, "logits": logits, "tensors": expected}, tmp_path / "expected.pt")
    result = run_isolated(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        for folder in {[str(f) for f in folders.values()]!r}:
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            params = dict(model.named_parameters())
            for name, tensor in data["tensors"].items():
                assert torch.equal(params[name], tensor), (folder, name)
            with torch.no_grad():
                logits = model(data["ids"]).logits
            assert torch.equal(logits, data["logits"]), (folder, (logits - data["logits"]).abs().max())
        print("REMOTE-OK")
        """
    )
    assert "REMOTE-OK" in result.stdout, result.stderr[-3000:]


ATTNRES_KEYS = [
    f"{prefix}{layer}.{name}_res_{kind}.weight"
    for prefix in (
        "model.layers.",
        "transformer.h.",
        "gpt_neox.layers.",
        "model.decoder.layers.",
        "model.language_model.layers.",
    )
    for layer in (0, 11)
    for name in ("self_attention", "mlp", "mlp_2", "self_attention_2")
    for kind in ("proj", "norm")
] + [
    f"{base}.output_attn_res_{kind}.weight"
    for base in ("model", "transformer", "gpt_neox", "model.decoder")
    for kind in ("proj", "norm")
]


def _own_name(key: str) -> str:
    return ".".join(key.split(".")[-2:])


def test_no_family_rule_renames_an_attnres_tensor():
    """Every model type's rules, forward (loading) and reversed (saving), guarded as the converted model guards
    them: an AttnRes key may move with its module (a prefix change), its own name never changes. Unguarded,
    Mixtral's reversed rule does rename it, so this test sees the defect it guards against."""
    mapping = _build_checkpoint_conversion_mapping()
    mixtral_reverse = [rule.reverse_transform() for rule in mapping["mixtral"]]
    assert any(
        rule.rename_source_key("model.layers.0.mlp_res_proj.weight")[0] != "model.layers.0.mlp_res_proj.weight"
        for rule in mixtral_reverse
    )
    checked = 0
    for model_type, rules in mapping.items():
        for rule in rules or ():
            try:
                reverse = rule.reverse_transform()
            except ValueError:  # quantization rules: never reversed
                reverse = None
            for transform in (rule, reverse):
                if transform is None:
                    continue
                transform = guarded(transform)
                for key in ATTNRES_KEYS:
                    renamed, _ = transform.rename_source_key(key)
                    assert renamed.endswith(_own_name(key)), (model_type, transform, key, renamed)
                    checked += 1
            if reverse is not None:  # reversing a guarded rule keeps the guard
                renamed, _ = guarded(rule).reverse_transform().rename_source_key("model.layers.0.mlp_res_proj.weight")
                assert renamed.endswith("mlp_res_proj.weight"), (model_type, rule)
    assert checked > 10_000
