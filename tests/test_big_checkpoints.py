"""Big checkpoints: streamed conversion file to file, shards, the index written last, a kill leaving nothing,
memory that does not grow with the model, verification within a memory budget, device_map loading."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from reliability_helpers import sharded_tensors
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_models import randomize_queries, tiny_model, token_ids

from attnres_convert import convert, convert_model, load_converted, save_converted
from attnres_convert.conversion import memory_budget
from attnres_convert.conversion.streaming import plan_stream
from attnres_convert.errors import AttnResError
from attnres_convert.io import shards

INDEX = "model.safetensors.index.json"
SHARD = 40_000  # bytes: a tiny llama (3 layers, hidden 64) spreads over several shards


def _saved(family: str, folder: Path, **save_kwargs) -> torch.nn.Module:
    model = tiny_model(family)
    model.save_pretrained(folder, **save_kwargs)
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_streamed_conversion_writes_what_the_in_memory_conversion_writes(family, tmp_path):
    """A tied head (GPT-2), a sharded input: the streamed folder holds the same tensors as a save of the model
    converted in memory, and loads to the same logits."""
    base = _saved(family, tmp_path / "plain", max_shard_size="50KB")
    result = convert(
        tmp_path / "plain",
        tmp_path / "streamed",
        block_size=2,
        max_shard_size=SHARD,
        verify_tokens=32,
        verify_new_tokens=4,
    )
    assert result.verification.passed and result.verification.max_abs_logit_diff == 0.0
    reference = convert_model(base, block_size=2)
    save_converted(reference, tmp_path / "memory")

    streamed = sharded_tensors(tmp_path / "streamed")
    in_memory = load_file(tmp_path / "memory" / "model.safetensors")
    assert streamed.keys() == in_memory.keys()
    for name, tensor in in_memory.items():
        assert torch.equal(streamed[name], tensor), name
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(load_converted(tmp_path / "streamed").eval()(ids).logits, reference.eval()(ids).logits)


def test_moe_experts_stream_under_their_checkpoint_names(tmp_path):
    """Mixtral's experts are fused in memory and stored one by one: the streamed folder copies them as stored,
    keeps the AttnRes parameters under the contract's names, and every tensor loads (none missing)."""
    base = _saved("mixtral", tmp_path / "plain")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert(tmp_path / "plain", tmp_path / "out", block_size=2, verify_tokens=32, verify_new_tokens=4)
    assert not [w for w in caught if "not streamed" in str(w.message)]
    names = set(sharded_tensors(tmp_path / "out"))
    assert set(load_file(tmp_path / "plain" / "model.safetensors")) <= names
    assert "model.layers.0.mlp_res_proj.weight" in names
    loaded, info = type(convert_model(tiny_model("mixtral"))).from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, base.eval()(ids).logits)


def test_shards_respect_the_size_and_the_index_names_every_tensor(tmp_path):
    _saved("llama", tmp_path / "plain")
    convert(tmp_path / "plain", tmp_path / "out", max_shard_size=SHARD, verify=False)
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and files == sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert files == shards.shard_names(len(files))
    for file in files:
        with safe_open(tmp_path / "out" / file, "pt") as handle:
            names = list(handle.keys())
            nbytes = sum(handle.get_tensor(n).nbytes for n in names)
        assert nbytes <= SHARD or len(names) == 1, (file, nbytes)
        assert all(index["weight_map"][n] == file for n in names)
    # The AttnRes parameters have a shard of their own, the last one.
    attnres = {n for n in index["weight_map"] if "_res_" in n or "output_attn_res" in n}
    assert {index["weight_map"][n] for n in attnres} == {files[-1]}
    assert set(load_file(tmp_path / "out" / files[-1])) == attnres
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sharded_tensors(tmp_path / "out").values())


def test_dtype_change_is_applied_tensor_by_tensor(tmp_path):
    base = _saved("llama", tmp_path / "plain")  # float32
    convert(tmp_path / "plain", tmp_path / "out", dtype="bfloat16", verify=False)
    tensors = sharded_tensors(tmp_path / "out")
    for name, param in base.state_dict().items():
        assert tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name], param.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_chunked_dtype_conversion_matches_torch(tmp_path, monkeypatch):
    """A tensor larger than the chunk is converted chunk by chunk, with the same rounding as .to()."""
    monkeypatch.setattr(shards, "CHUNK_BYTES", 1000)
    values = torch.randn(37, 111)
    from safetensors.torch import save_file

    save_file({"w": values}, tmp_path / "in.safetensors")
    (stored,) = shards.read_header(tmp_path / "in.safetensors")
    shards.write_shard(tmp_path / "out.safetensors", [shards.OutputTensor.stored(stored, torch.float16)])
    assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], values.to(torch.float16))


def test_checkpoint_with_extra_tensors_is_converted_in_memory(tmp_path):
    """Tensors the model does not have are dropped on load, as from_pretrained does: the in-memory path,
    with a warning saying why."""
    from safetensors.torch import save_file

    _saved("llama", tmp_path / "plain")
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    save_file(
        {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)},
        tmp_path / "plain" / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.warns(UserWarning, match="converted in memory, not streamed.*inv_freq"):
        result = convert(tmp_path / "plain", tmp_path / "out", verify_new_tokens=4)
    assert result.verification.passed
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_file(tmp_path / "out" / "model.safetensors")


def test_index_is_written_after_every_shard(tmp_path, monkeypatch):
    seen = []
    real = shards.write_shard

    def spy(path, tensors, advance=lambda n: None):
        seen.append((path.parent / INDEX).exists())
        real(path, tensors, advance)

    monkeypatch.setattr(shards, "write_shard", spy)
    _saved("llama", tmp_path / "plain")
    convert(tmp_path / "plain", tmp_path / "out", max_shard_size=SHARD, verify=False)
    assert len(seen) >= 4 and not any(seen)


KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from attnres_convert import convert
    from attnres_convert.io import shards
    real = shards.write_shard
    def slow(path, tensors, advance=lambda n: None):
        real(path, tensors, advance)
        if path.name.startswith("model-00002"):
            Path(sys.argv[3]).write_text("two shards written")
            time.sleep(120)
    shards.write_shard = slow
    convert(sys.argv[1], sys.argv[2], max_shard_size=40_000, verify=False)
    """
)


def test_kill_during_a_sharded_save_leaves_nothing_at_the_output(tmp_path):
    _saved("llama", tmp_path / "plain")
    out, marker = tmp_path / "out", tmp_path / "marker"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(tmp_path / "plain"), str(out), str(marker)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None, "the save ended before it was killed"
        assert time.monotonic() < deadline, "the save never reached its second shard"
        time.sleep(0.1)
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert len(partial) == 1 and list(partial[0].glob("model-00002-of-*.safetensors"))
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not out.exists()
    # The next run removes the killed run's leftovers and writes the whole folder.
    convert(tmp_path / "plain", out, max_shard_size=SHARD, verify=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert load_converted(out) is not None


MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys
    from attnres_convert import convert
    from attnres_convert.conversion.memory_budget import current_rss, peak_rss, reset_peak_rss
    import attnres_convert.conversion.convert  # everything imported before the baseline
    assert reset_peak_rss(), "this system cannot reset the peak RSS"
    baseline = current_rss()
    convert(sys.argv[1], sys.argv[2], max_shard_size="20MB", verify=False, dtype=sys.argv[3])
    print(json.dumps({"baseline": baseline, "peak": peak_rss()}))
    """
)


@pytest.mark.slow
@pytest.mark.extended
def test_streamed_conversion_memory_does_not_grow_with_the_model(tmp_path):
    """A 130 MB model (float32, two 65 MB matrices) converts, kept and re-dtyped, with a peak resident memory
    that grows by well under one of its matrices: tensors are copied by the kernel or converted in 16 MB chunks."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak RSS from a point in time")
    import transformers as T

    config = T.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        skeleton = T.AutoModelForCausalLM.from_config(config)
    from safetensors.torch import save_file

    (tmp_path / "plain").mkdir()
    config.save_pretrained(tmp_path / "plain")
    state = {name: torch.full(p.shape, 0.5) for name, p in skeleton.state_dict().items()}
    model_bytes = sum(t.nbytes for t in state.values())
    save_file(state, tmp_path / "plain" / "model.safetensors", metadata={"format": "pt"})
    del state
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    for dtype in ("auto", "bfloat16"):
        run = subprocess.run(
            [sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "plain"), str(tmp_path / dtype), dtype],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        probe = json.loads(run.stdout.strip().splitlines()[-1])
        grown = probe["peak"] - probe["baseline"]
        print(f"{dtype}: model {model_bytes / 1e6:.0f} MB, peak RSS grew by {grown / 1e6:.1f} MB")
        assert grown < 48e6, (dtype, grown)
    assert len(list((tmp_path / "auto").glob("*.safetensors"))) >= 3


def test_verification_streams_a_model_larger_than_the_budget(tmp_path, monkeypatch):
    """With a budget smaller than the model, both models are loaded with the layers beyond the budget left in
    their files (Accelerate's offload), and the check still passes on the same logits."""
    _saved("llama", tmp_path / "plain")
    monkeypatch.setattr(memory_budget, "current_rss", lambda: 0)  # the budget then covers the weights alone
    loads = []
    real = memory_budget.VerifyBudget.load_kwargs
    monkeypatch.setattr(
        memory_budget.VerifyBudget, "load_kwargs", lambda self, folder: loads.append(real(self, folder)) or loads[-1]
    )
    budget = memory_budget.OVERHEAD + 300_000  # the model is ~560 KB: at most two layers fit
    result = convert(tmp_path / "plain", tmp_path / "out", max_memory=budget, verify_new_tokens=4)
    assert result.verification.passed and result.verification.max_abs_logit_diff == 0.0
    assert "streamed from the files" in result.verification_budget and "--max-memory" in result.verification_budget
    assert result.verification.tokens == memory_budget.STREAMED_TOKENS
    assert [kwargs["device_map"] for kwargs in loads] == ["auto", "auto"]
    assert not any(p.name.startswith(".attnres-offload-") for p in tmp_path.iterdir())


def test_default_budget_is_chosen_from_free_memory_and_said(tmp_path):
    _saved("llama", tmp_path / "plain")
    result = convert(tmp_path / "plain", tmp_path / "out", verify_new_tokens=4)
    assert (
        "80% of the free memory" in result.verification_budget and "whole model in memory" in result.verification_budget
    )


def test_too_small_a_budget_says_what_is_needed(tmp_path):
    _saved("llama", tmp_path / "plain")
    with pytest.raises(AttnResError, match=r"too small for this model.*Give --max-memory \d.*or more.*--no-verify"):
        convert(tmp_path / "plain", tmp_path / "out", max_memory="1KB")
    assert not (tmp_path / "out").exists()


def test_bad_sizes_are_refused_before_any_work(tmp_path):
    _saved("llama", tmp_path / "plain")
    for kwargs, flag in (
        ({"max_shard_size": "five gigs"}, "--max-shard-size"),
        ({"max_memory": "-3GB"}, "--max-memory"),
    ):
        with pytest.raises(AttnResError, match=flag):
            convert(tmp_path / "plain", tmp_path / "out", **kwargs)


@pytest.mark.parametrize("remote_code", [False, True])
def test_device_map_auto_keeps_layers_whole_and_gives_the_same_logits(remote_code, tmp_path):
    """Big-model loading as users do it: device_map="auto" with a CPU limit (the rest offloaded to disk), through
    the package or through trust_remote_code, gives the logits and cached greedy tokens of the model in memory."""
    from transformers import AutoModelForCausalLM

    model = convert_model(tiny_model("llama"), block_size=3).eval()
    randomize_queries(model, 1.0)
    ids = token_ids()
    with torch.no_grad():
        expected, generated = model(ids).logits, model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    save_converted(model, tmp_path / "m", max_shard_size="100KB")
    load = AutoModelForCausalLM.from_pretrained if remote_code else type(model).from_pretrained
    kwargs = {"trust_remote_code": True} if remote_code else {}
    for cpu in ("300KB", "100KB"):
        loaded = load(
            tmp_path / "m",
            device_map="auto",
            max_memory={"cpu": cpu},
            offload_folder=str(tmp_path / "offload"),
            **kwargs,
        )
        placed = loaded.hf_device_map
        assert "disk" in placed.values()
        assert not [name for name in placed if ".layers." in name and name.count(".") > 2], placed  # no layer split
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, expected)
            assert torch.equal(loaded.generate(ids[:1], max_new_tokens=6, do_sample=False), generated)


def test_no_split_modules_name_the_converted_layer_classes():
    model = convert_model(tiny_model("qwen3"))
    assert type(model.model.layers[0]).__name__ in model._no_split_modules
    assert "Qwen3DecoderLayer" in model._no_split_modules


def test_meta_device_loading_allocates_nothing(tmp_path):
    """The streamed plan builds the converted model on the meta device: no tensor memory at all."""
    _saved("llama", tmp_path / "plain")
    from attnres_convert.io.sources import load_config, resolve_source

    plan = plan_stream(tmp_path / "plain", load_config(resolve_source(str(tmp_path / "plain"))))
    assert {p.device.type for p in plan.skeleton.parameters()} == {"meta"}


def test_finetune_output_is_sharded_and_a_bad_size_is_refused_before_training(tmp_path):
    from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus

    from attnres_convert.finetune.recipe import RecipeError, parse_recipe
    from attnres_convert.finetune.training import finetune

    model, corpus = tiny_model_folder(tmp_path / "tiny"), write_corpus(tmp_path / "corpus")
    with pytest.raises(RecipeError, match="max_shard_size"):
        parse_recipe(tiny_recipe(model, corpus, tmp_path / "bad", output={"max_shard_size": "lots"}))
    recipe = tiny_recipe(
        model, corpus, tmp_path / "run", train={"steps": 2}, eval={"every": 0}, output={"max_shard_size": "40KB"}
    )
    result = finetune(parse_recipe(recipe))
    files = sorted(p.name for p in result.model_dir.glob("*.safetensors"))
    assert len(files) >= 3 and (result.model_dir / INDEX).is_file()
    trained = sharded_tensors(result.model_dir)
    reloaded = load_converted(result.model_dir)
    assert all(
        torch.equal(reloaded.get_parameter(name), tensor) for name, tensor in trained.items() if "_res_proj" in name
    )


@pytest.mark.extended
def test_streamed_sharded_folder_loads_without_this_package(tmp_path):
    """What users of a converted big model run: from_pretrained(trust_remote_code=True) of the sharded folder in
    a Python where attnres_convert cannot be imported, with device_map="auto" and disk offload; the logits
    equal the original model's."""
    from isolated import run_isolated

    base = _saved("llama", tmp_path / "plain", max_shard_size="100KB")
    convert(tmp_path / "plain", tmp_path / "out", max_shard_size=SHARD, verify=False)
    ids = token_ids()
    with torch.no_grad():
        torch.save({"ids": ids, "logits": base.eval()(ids).logits}, tmp_path / "expected.pt")
    result = run_isolated(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        for kwargs in ({{}}, {{"device_map": "auto", "max_memory": {{"cpu": "200KB"}}, "offload_folder": {str(tmp_path / "off")!r}}}):
            model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "out")!r}, trust_remote_code=True, **kwargs).eval()
            with torch.no_grad():
                logits = model(data["ids"]).logits
            assert torch.equal(logits, data["logits"]), (kwargs, (logits - data["logits"]).abs().max())
        print("REMOTE-OK")
        """
    )
    assert "REMOTE-OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize(
    ("family", "overrides", "layers"),
    [
        ("llama", {"num_hidden_layers": 8}, 2),  # one kind of layer: two of them
        ("gemma3_text", {"num_hidden_layers": 8}, 6),  # five sliding-window layers, then a global one
        ("qwen3_moe", {"num_hidden_layers": 6, "mlp_only_layers": [0, 1, 2]}, 4),  # three dense MLPs, then experts
    ],
)
def test_structure_is_proven_on_the_smallest_faithful_miniature(family, overrides, layers):
    """The streamed path proves the structure on a miniature that keeps every kind of decoder layer of the model
    (up to the first layer of the last new kind) and no more, with per-layer config entries cut to match."""
    from tiny_models import CONFIGS

    from attnres_convert.conversion.streaming import _miniature, proven_plan

    tiny = CONFIGS[family]().to_dict()
    config = type(CONFIGS[family]())(**{**tiny, **overrides, "layer_types": None})  # layer types for all the layers
    small = _miniature(config)
    assert small.num_hidden_layers == layers
    if getattr(config, "layer_types", None) is not None:
        assert small.layer_types == config.layer_types[:layers] and set(small.layer_types) == set(config.layer_types)
    plan = proven_plan(config)
    assert not isinstance(plan, str), plan
    assert plan.num_layers == config.num_hidden_layers


def test_a_structure_the_miniature_does_not_prove_is_converted_in_memory(tmp_path, monkeypatch):
    """The proof runs while the base tensors are copied; when it fails, the copy is thrown away (nothing of it
    reaches the output) and the model is converted in memory, where the structure is proven on its weights."""
    from attnres_convert.conversion import streaming
    from attnres_convert.conversion.proof import StructureError

    def unproven(model):
        raise StructureError("layer 1 differs by 0.5")

    _saved("llama", tmp_path / "plain")
    monkeypatch.setattr(streaming, "find_plan", unproven)
    with pytest.warns(
        UserWarning, match="not streamed: its structure could not be proven on a miniature.*layer 1 differs"
    ):
        result = convert(tmp_path / "plain", tmp_path / "out", verify_new_tokens=4)
    assert result.verification.passed
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == ["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]


HUB_CACHE_CONVERT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("error", message=".*not streamed")  # the in-memory path would fail this run
    from attnres_convert import convert
    convert("tiny-org/tiny-llama", sys.argv[1], max_shard_size=40_000, verify_new_tokens=4)
    """
)


@pytest.mark.slow
@pytest.mark.extended
def test_hub_id_streams_from_the_hf_cache(tmp_path):
    """A hub id whose snapshot is in the HF cache (offline): streamed from the cached files, with the folder's output."""
    _saved("llama", tmp_path / "plain")
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf-cache" / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots").mkdir()
    (tmp_path / "plain").rename(repo / "snapshots" / revision)
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", HUB_CACHE_CONVERT, str(tmp_path / "from-hub")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    convert(repo / "snapshots" / revision, tmp_path / "from-folder", max_shard_size=40_000, verify=False)
    hub, folder = tmp_path / "from-hub", tmp_path / "from-folder"
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) >= 4 and sorted(p.name for p in hub.glob("*.safetensors")) == files  # the streamed layout
    assert (hub / INDEX).read_text() == (folder / INDEX).read_text()
    assert all((hub / f).read_bytes() == (folder / f).read_bytes() for f in files)
    configs = [json.loads((out / "config.json").read_text()) for out in (hub, folder)]
    assert configs[0]["text_config"].pop("_name_or_path") == "tiny-org/tiny-llama"  # the base model's name, as loaded
    configs[1]["text_config"].pop("_name_or_path")
    assert configs[0] == configs[1]
