"""The guarantees that cost a saved folder or a second precision, on one representative of each structural class
that the cheaper checks do not already save and reload (test_save_load: Llama dense, GPT-2, GPT-NeoX parallel
residual, Gemma 2 sandwich norms, Granite multipliers; test_weight_names: Mixtral MoE; test_remote_code: a model
with its own code). Every model type of the coverage walk is checked there for logits, cached and uncached
greedy generation and left padding; test_exactness does so at several block sizes for the families of
tiny_models.py.

Per representative: the bf16 model converts (proven at its own precision) and passes the verification that
`attnres convert --dtype bfloat16` applies; the fp32 conversion with trained-looking AttnRes parameters and the
bf16 conversion are saved, and a Python without this package loads both folders and gets the same logits."""

import pytest
import torch
from isolated import run_isolated
from tiny_models import randomize_queries, tiny_model, token_ids
from transformers import AutoModelForCausalLM

from attnres_convert import save_converted
from attnres_convert.conversion.surgery import convert_model
from attnres_convert.conversion.verify import capture_reference, compare

REPRESENTATIVES = {
    "deepseek_v3": "MoE with a shared expert after a dense first layer (layers of two kinds), latent attention",
    "qwen3_moe": "MoE whose block returns (output, router logits)",
    "cohere": "parallel residual on one norm, qk-norm, logit scale",
    "falcon_new": "parallel residual with two norms",
    "glm4": "sandwich norms (a norm after each sublayer)",
    "gemma3_text": "sliding-window and global layers alternating, sandwich norms, embedding scale",
    "gemma4_text": "a gate that reads the raw stream times the layer's per-layer input, layer scalars, KV sharing",
    "gemma4_moe": "a router reading the flattened raw stream for its experts, a norm of the sum of MLP and experts",
    "opt": "LayerNorm with biases, the MLP as a chain of modules",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each representative converted in fp32 (trained-looking AttnRes parameters) and in bf16, saved."""
    root = tmp_path_factory.mktemp("families")
    ids = token_ids(batch=2, length=16, seed=4)
    folders, expected, reports = {}, {}, {}
    for family in REPRESENTATIVES:
        base = tiny_model(family)
        base.save_pretrained(root / f"{family}-original")  # bf16 as users load it (modules kept in fp32 stay so)
        half = AutoModelForCausalLM.from_pretrained(root / f"{family}-original", dtype=torch.bfloat16).eval()
        reference = capture_reference(half, ids[:1], new_tokens=8)
        converted_half = convert_model(half, block_size=3).eval()
        reports[family] = compare(reference, converted_half)
        converted = randomize_queries(convert_model(base, block_size=3).eval(), 0.2, seed=5, key_norms=0.2, add=True)
        for label, model in (("fp32", converted), ("bf16", converted_half)):
            folder = save_converted(model, root / f"{family}-{label}")
            # A folder without this package runs its built-in paths, which the package runs under
            # ATTNRES_KERNEL=eager (its own default for few tokens sums in another order: equal to ~1e-5).
            with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
                patch.setenv("ATTNRES_KERNEL", "eager")
                expected[str(folder)] = model(ids).logits
            folders[(family, label)] = folder
    torch.save({"ids": ids, "logits": expected}, root / "expected.pt")
    return root, folders, reports


@pytest.mark.parametrize("family", sorted(REPRESENTATIVES))
def test_bf16_conversion_passes_the_half_precision_verification(family, saved):
    report = saved[2][family]
    assert report.dtype == "bfloat16"
    assert report.passed, (family, report.failures())


@pytest.mark.slow
def test_saved_folders_load_without_this_package_with_the_same_logits(saved):
    root, folders, _ = saved
    result = run_isolated(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(root / "expected.pt")!r})
        for folder, want in data["logits"].items():
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert model.dtype == want.dtype, (folder, model.dtype)
            with torch.no_grad():
                got = model(data["ids"]).logits
            assert torch.equal(got, want), (folder, (got.float() - want.float()).abs().max())
        print("REMOTE-OK", len(data["logits"]))
        """
    )
    assert f"REMOTE-OK {len(folders)}" in result.stdout, result.stderr[-3000:]
