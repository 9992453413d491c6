"""GGUF inputs converted tensor by tensor, on the real embedded SmolLM2-135M GGUF (Q4_1): the streamed folder
holds bit for bit the tensors of the in-memory conversion, loads with trust_remote_code to the GGUF model's
logits, and the conversion's memory stays far below the dequantised model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from reliability_helpers import sharded_tensors
from safetensors.torch import load_file

from attnres_convert import convert_model

pytestmark = [pytest.mark.slow, pytest.mark.extended]

PROBE = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("error", message=".*not streamed")  # the in-memory fallback would fail the probe
    from attnres_convert import convert
    from attnres_convert.conversion.memory_budget import current_rss, peak_rss, reset_peak_rss
    import attnres_convert.conversion.convert, attnres_convert.io.gguf_stream, gguf  # imported before the baseline
    import transformers.modeling_gguf_pytorch_utils
    assert reset_peak_rss(), "this system cannot reset the peak RSS"
    baseline = current_rss()
    convert(sys.argv[1], sys.argv[2], verify=False)
    print(json.dumps({"grown": peak_rss() - baseline}))
    """
)


def test_gguf_streams_tensor_by_tensor_to_the_in_memory_result(smollm2_path, smollm2_folder, tmp_path):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak RSS from a point in time")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(smollm2_path), str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    grown = json.loads(run.stdout.strip().splitlines()[-1])["grown"]

    # What transformers dequantises in memory (the in-memory conversion saves these base tensors as they are).
    dequantised = load_file(smollm2_folder / "model.safetensors")
    model_bytes = sum(t.nbytes for t in dequantised.values())
    largest = max(t.nbytes for t in dequantised.values())
    print(
        f"dequantised model {model_bytes / 1e6:.0f} MB, largest tensor {largest / 1e6:.0f} MB, peak RSS grew by {grown / 1e6:.0f} MB"
    )
    # One tensor at a time, plus transformers' parse of the GGUF's metadata and tokenizer (~0.2 GB, transient).
    assert grown < largest + 250e6 and grown < 0.6 * model_bytes, grown

    streamed = sharded_tensors(out)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == 2  # the streamed layout: base tensors, then the AttnRes shard
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    in_memory = convert_model(base)
    expected = {**dequantised, **{n: t for n, t in in_memory.state_dict().items() if "_res_" in n}}
    assert streamed.keys() == expected.keys()
    unequal = [n for n, t in expected.items() if t.dtype != streamed[n].dtype or not torch.equal(t, streamed[n])]
    assert not unequal, unequal[:5]

    ids = torch.randint(3, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(loaded).__name__ == "AttnResForCausalLM"
    with torch.no_grad():
        difference = (loaded(ids).logits - base(ids).logits).abs().max().item()
    assert difference < 1e-4, difference
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["AttnResForCausalLM"] and config["dtype"] == "float32"
    assert (out / "tokenizer.json").is_file()


def test_a_gguf_the_stream_cannot_map_says_why(smollm2_path, monkeypatch):
    """An architecture transformers converts with its newer pipeline is not streamed; convert falls back to memory
    with this reason in its warning."""
    from attnres_convert.conversion.streaming import stream_input
    from attnres_convert.io.shards import NotStreamable
    from attnres_convert.io.sources import load_config, resolve_source
    from attnres_convert.transformers_compat import SINCE, has

    if not has(
        "is_gguf_arch_supported"
    ):  # every GGUF streams: see test_gguf_streams_tensor_by_tensor_to_the_in_memory_result
        pytest.skip(
            f"transformers {transformers.__version__} has no GGUF weight-conversion pipeline (since {SINCE['is_gguf_arch_supported'][0]})"
        )
    import transformers.integrations.gguf.utils as gguf_utils

    source = resolve_source(str(smollm2_path))
    monkeypatch.setattr(gguf_utils, "is_gguf_arch_supported", lambda arch: True)
    with pytest.raises(NotStreamable, match="GGUF architecture 'llama' with its weight-conversion pipeline"):
        stream_input(source, load_config(source), "auto", False)


def test_a_gguf_larger_than_the_budget_is_verified_from_its_dequantised_shards(smollm2_path, tmp_path, monkeypatch):
    """transformers loads a GGUF only whole, so with a budget smaller than the dequantised model (0.54 GB
    here) the original is read from the streamed output's base tensors (transformers' own name map and
    processors, bit-equal to its in-memory load: see above) with Accelerate streaming the layers from disk."""
    from attnres_convert import convert
    from attnres_convert.conversion import memory_budget

    monkeypatch.setattr(memory_budget, "current_rss", lambda: 0)  # the budget then covers the weights alone
    result = convert(smollm2_path, tmp_path / "out", max_memory=memory_budget.OVERHEAD + 300_000_000)
    assert "streamed from the files" in result.verification_budget
    record = json.loads((tmp_path / "out" / "attnres_conversion.json").read_text())["verification"]
    assert record["passed"] and record["max_abs_logit_diff"] == 0.0 and record["greedy_identical"]
    assert record["tokens"] == memory_budget.STREAMED_TOKENS
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the offload folders are gone


def test_a_gguf_converted_in_memory_saves_no_quantisation_config(smollm2_path, tmp_path):
    """transformers marks a GGUF model as quantised although its weights are dequantised on load; the saved
    folder holds plain float32 weights, and its config must not claim otherwise."""
    from attnres_convert import convert

    convert(smollm2_path, tmp_path / "out", verify=False, stream=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]


# Model types of transformers' tensor-by-tensor GGUF loader, with the architecture their GGUF files name.
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "gpt2": "gpt2",
    "bloom": "bloom",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "qwen2_moe": "qwen2moe",
    "nemotron": "nemotron",
    "mamba": "mamba",
    "falcon": "falcon",
    "cohere": "command-r",
}


@pytest.mark.parametrize("model_type", sorted(GGUF_ARCHITECTURES))
def test_gguf_names_are_those_of_transformers_loader(model_type):
    """The streamed names come from gguf's name map built once; transformers' get_gguf_hf_weights_map (which
    builds it for every module) gives the same map, processors' fallbacks and nested modules included."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from attnres_convert.conversion.coverage import tiny_config
    from attnres_convert.io.gguf_stream import _gguf_to_hf_names

    architecture = GGUF_ARCHITECTURES[model_type]
    config = tiny_config(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    def processor():
        return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())

    expected = get_gguf_hf_weights_map(model, processor())
    assert expected and _gguf_to_hf_names(model, processor(), architecture) == expected
