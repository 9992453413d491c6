"""Serving converted models with vLLM (docs/serving.md): greedy tokens equal transformers' `generate` on the same
folder for a batch of prompts of different lengths submitted together, family by family; the families vLLM
cannot serve refused with the family, the reason and the fallback; tensor parallelism (each rank holding its
shard), vLLM's compiled forward, an image-text base's language model; the OpenAI-compatible server.

Marked `vllm`: `make test-vllm` runs them in .venv-vllm (vLLM's CPU build); `make test` leaves them out. Each
engine start takes 30-80 s on two cores, so each model gets one engine and every prompt goes in one call."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm")

import vllm_helpers  # noqa: E402
from vllm_helpers import (  # noqa: E402
    CHAT_TEMPLATE,
    ENGINE,
    converted_folder,
    generate_tokens,
    prompts,
    up_to_end,
)

HELPERS = Path(__file__).with_name("vllm_helpers.py")
NEW_TOKENS = 16
# Llama, Qwen3, Mistral, Gemma 3, Phi-3, GPT-NeoX (parallel residual) and two mixtures of experts; then the head's
# and the attention's own scalars (Gemma 2's soft caps, Granite's multipliers, Cohere's logit scale), GPT-2's
# Conv1D projections and DeepSeek-V3's latent attention (values narrower than keys, its cache one key and value per
# head). The hybrid stacks (Mamba / linear-attention layers) are refused, see HYBRIDS. benchmarks/vllm_sweep.py
# runs every other converting type the same way (docs/serving.md's table).
SERVED = [
    "llama",
    "qwen3",
    "mistral",
    "gemma3_text",
    "phi3",
    "gpt_neox_parallel",
    "qwen3_moe",
    "mixtral",
    "gemma2",
    "granite",
    "cohere",
    "gpt2",
    "deepseek_v3",
]
HYBRIDS = ["jamba", "falcon_h1", "qwen3_next"]


def engine_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HELPERS.parent), **vllm_helpers.ENGINE_ENV}


def run_engine(folder: Path, token_lists: list[list[int]], tmp_path: Path) -> subprocess.CompletedProcess:
    return vllm_helpers.run_engine(folder, token_lists, NEW_TOKENS, tmp_path)


@pytest.mark.parametrize("family", SERVED)
def test_vllm_greedy_tokens_equal_generate(family, tmp_path):
    folder = converted_folder(family, tmp_path / family)
    token_lists = prompts()
    expected = generate_tokens(folder, token_lists, NEW_TOKENS)
    result = run_engine(folder, token_lists, tmp_path)
    assert result.returncode == 0, f"{family}: vLLM failed:\n{result.stderr[-4000:]}"
    served = vllm_helpers.served_tokens(result)
    assert served is not None, f"{family}: vLLM printed no tokens:\n{result.stdout[-4000:]}"
    assert [len(tokens) for tokens in served] == [NEW_TOKENS] * len(token_lists)
    assert [up_to_end(tokens) for tokens in served] == expected, family


def test_input_dependent_queries_and_the_additive_mix_serve_as_generate(tmp_path):
    """A model with both runs the plain-tensor depth mix (BlockState), as vLLM's compiled forward does for all."""
    folder = converted_folder("llama", tmp_path / "plain-mix", query_rank=4, additive=True)
    token_lists = prompts()
    expected = generate_tokens(folder, token_lists, NEW_TOKENS)
    result = run_engine(folder, token_lists, tmp_path)
    assert result.returncode == 0, f"vLLM failed:\n{result.stderr[-4000:]}"
    assert [up_to_end(tokens) for tokens in vllm_helpers.served_tokens(result)] == expected


def _loaded(family: str, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    folder = converted_folder(family, tmp_path / family)
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)


@pytest.mark.parametrize("family", SERVED + HYBRIDS)
def test_servability_is_decided_per_layer(family, tmp_path):
    """Every served family has one attention per layer that goes through transformers' attention interface (vLLM's
    own test of a module); each hybrid has a layer without one, named in the reason."""
    from vllm.model_executor.models.transformers.fusers.attention import interface_call

    from attnres_convert.serving.vllm_support import unservable_reason

    reason = unservable_reason(_loaded(family, tmp_path), interface_call)
    if family in SERVED:
        assert reason is None
    else:
        # Falcon-H1 runs Mamba-2 beside attention in every layer: its base class says it carries a state.
        assert "recurrent state" in reason and "which vLLM's paged KV cache does not hold" in reason, reason
        assert reason.startswith("decoder layer 0 (") or family == "falcon_h1", reason


def test_a_hybrid_is_refused_by_the_engine_with_family_reason_and_fallback(tmp_path):
    folder = converted_folder("jamba", tmp_path / "jamba")
    result = run_engine(folder, prompts()[:1], tmp_path)
    assert result.returncode != 0
    log = result.stdout + result.stderr  # vLLM's worker logs the error on stdout
    assert "vLLM cannot serve this AttnRes model (base family 'jamba'): decoder layer 0 (" in log
    assert "Fallback: serve it with transformers' `generate`" in log


def test_a_folder_whose_code_predates_the_plan_is_refused_naming_the_release(tmp_path):
    """A folder whose shipped code keeps its layout under another name than the `_attnres_plan` the serving class
    reads (as code older than that plan does): `generate` still runs it, vLLM refuses it naming the attnres release
    and the command that re-saves it."""
    from attnres_convert.serving.vllm_support import release

    folder = converted_folder("llama", tmp_path / "llama")
    code = folder / "modeling_attnres.py"
    assert "_attnres_plan" in code.read_text()
    code.write_text(code.read_text().replace("_attnres_plan", "_attnres_layout"))
    assert len(generate_tokens(folder, prompts()[:1], 4)[0]) >= 1  # the folder itself still works in transformers
    result = run_engine(folder, prompts()[:1], tmp_path)
    assert result.returncode != 0
    log = result.stdout + result.stderr
    assert (
        "vLLM cannot serve this AttnRes model (base family 'llama'): its modeling code predates the plan vLLM "
        "serving reads"
    ) in log, log[-3000:]
    assert f"re-save it with attnres >= {release()}'s code (`attnres upgrade FOLDER --trust-remote-code`" in log


# ---- tensor parallelism, compiled graphs, image-text bases ------------------------------------------------------

# Two ranks, a core each. Llama runs compiled (vLLM's default, `enforce_eager=False`: its torch.compile of the
# forward, one graph for every batch size), the others eager.
PARALLEL = [("llama", True), ("qwen3", False), ("qwen3_moe", False), ("gemma3_text", False)]
FUSED_NORM = {
    "llama": "TPAwareRMSNorm",
    "qwen3": "TPAwareRMSNorm",
    "qwen3_moe": "TPAwareRMSNorm",
    "gemma3_text": "TPAwareGemmaRMSNorm",
}


def expected_rank_bytes(folder: Path, tensor_parallel: int) -> dict:
    """What each rank should hold of the converted model as transformers loads it: every weight once (a tied head
    once), the base model's linear layers and experts' 3D weights in 1 / TP shards, the input embedding and the head
    in 1 / TP of their vocabulary padded to a multiple of 64 (vLLM's vocabulary layers), the rest whole."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    base = model.get_submodule(model._attnres_plan.base_model)
    linear = {id(m.weight): m.weight for m in base.modules() if type(m) is torch.nn.Linear}
    linear.update({id(m.bias): m.bias for m in base.modules() if type(m) is torch.nn.Linear and m.bias is not None})
    experts = {id(p): p for name, p in base.named_parameters() if ".experts." in name and p.dim() == 3}
    tables = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    size = lambda params: sum(p.numel() * p.element_size() for p in params.values())  # noqa: E731
    whole = size({id(p): p for p in model.parameters()})
    sharded = size(linear) + size(experts)
    padded = lambda p: -(-p.shape[0] // 64) * 64 * p[0].numel() * p.element_size()  # noqa: E731
    vocabulary = sum(padded(p) // tensor_parallel for p in tables.values())
    rank = whole - sharded - size(tables) + sharded // tensor_parallel + vocabulary
    return {"all": rank, "linear": size(linear) // tensor_parallel}


@pytest.mark.parametrize("family, compiled", PARALLEL)
def test_tensor_parallel_2_serves_generates_tokens_each_rank_holding_its_shard(family, compiled, tmp_path):
    folder = converted_folder(family, tmp_path / family)
    token_lists = prompts()
    expected = generate_tokens(folder, token_lists, NEW_TOKENS)
    engine = {"tensor_parallel_size": 2, "enforce_eager": not compiled}
    result = vllm_helpers.run_engine(folder, token_lists, NEW_TOKENS, tmp_path, engine=engine)
    assert result.returncode == 0, f"{family}: vLLM failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    served = vllm_helpers.served_tokens(result)
    assert [up_to_end(tokens) for tokens in served] == expected, family
    ranks = vllm_helpers.served_ranks(result)
    want = expected_rank_bytes(folder, 2)
    assert [{k: rank[k] for k in want} for rank in ranks] == [want, want], (family, ranks)
    # fused as vLLM's Transformers backend fuses: q, k and v one sharded layer, the norms vLLM's
    assert all({"QKVParallelLinear", FUSED_NORM[family]} <= set(rank["layers"]) for rank in ranks), ranks
    if compiled:  # vLLM compiled the forward (its log names the saved graph), for each rank
        assert result.stdout.count("saved AOT compiled function") == 2, result.stdout[-3000:]


def test_a_layers_experts_load_as_soon_as_the_checkpoint_has_given_them_all(tmp_path):
    """vLLM's weight iterator gives a mixture of experts' checkpoint one expert matrix at a time; each layer's are
    stacked into its 3D weights and loaded once the last of them is read (in any order), not held to the end."""
    import copy

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from attnres_convert.serving.vllm_weights import load_checkpoint

    folder = converted_folder("qwen3_moe", tmp_path / "moe")
    reference = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    model = copy.deepcopy(reference)
    for param in model.parameters():
        param.data.zero_()
    names = [n for f in sorted(folder.glob("*.safetensors")) for n in safe_open(f, "pt").keys()]
    first_experts = [n for n in names if ".layers.0.mlp.experts." in n]
    merged = [n for n, p in reference.named_parameters() if ".layers.0.mlp.experts." in n and p.dim() == 3]
    assert len(first_experts) > 2 * len(merged) > 0, (first_experts, merged)
    seen, checked = set(), []

    def weights():
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as tensors:
                for name in reversed(list(tensors.keys())):  # experts 3, 2, 1, 0: not the stacking order
                    if seen >= set(first_experts):  # layer 0's experts all read: already in place
                        checked.extend(torch.equal(model.get_parameter(n), reference.get_parameter(n)) for n in merged)
                    seen.add(name)
                    yield name, tensors.get_tensor(name)

    loaded = load_checkpoint(model, weights())
    assert checked and all(checked), checked
    assert loaded >= {n for n, _ in reference.named_parameters()}
    for name, param in reference.named_parameters():
        assert torch.equal(model.get_parameter(name), param), name


def test_a_model_the_fusers_cannot_run_is_built_again_unfused_and_serves_the_same_tokens(tmp_path):
    """vLLM's fusers rewrite a module's forward from its source. Where the rewritten forward fails the probe at
    engine start (AXK1's fused q, k and v at TP 2 split into the wrong sizes), the model is built again with vLLM's
    unfused parallel layers, says so in a warning naming the fused modules, and serves transformers' tokens."""
    folder = tmp_path / "axk1"
    vllm_helpers.type_folder("axk1", folder)  # the serving sweep's model of the type
    token_lists = prompts()
    expected = generate_tokens(folder, token_lists, NEW_TOKENS, past_end=True)
    result = vllm_helpers.run_engine(folder, token_lists, NEW_TOKENS, tmp_path, engine={"tensor_parallel_size": 2})
    assert result.returncode == 0, f"vLLM failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert vllm_helpers.served_tokens(result) == expected
    log = result.stdout + result.stderr
    assert "; serving axk1 without vLLM's fused layers (" in log, log[-3000:]
    ranks = vllm_helpers.served_ranks(result)
    assert len(ranks) == 2 and all(
        "QKVParallelLinear" not in rank["layers"] and "ColumnParallelLinear" in rank["layers"] for rank in ranks
    ), ranks


def test_a_base_model_without_a_tensor_parallel_plan_is_refused_at_tp_2(tmp_path):
    folder = converted_folder("gpt2", tmp_path / "gpt2")
    engine = {"tensor_parallel_size": 2}
    result = vllm_helpers.run_engine(folder, prompts()[:1], 4, tmp_path, engine=engine)
    assert result.returncode != 0
    log = result.stdout + result.stderr
    assert (
        "vLLM cannot serve this AttnRes model (base family 'gpt2'): tensor parallelism needs the base model's "
        "tensor-parallel plan (`base_model_tp_plan` in its config), which transformers' GPT2Config does not define; "
        "serve it with --tensor-parallel-size 1"
    ) in log, log[-3000:]


def test_pipeline_parallelism_is_refused_by_vllm(tmp_path):
    """The serving class does not declare vLLM's SupportsPP (a depth mix reads every earlier block), so vLLM
    refuses before any model is built."""
    folder = converted_folder("llama", tmp_path / "llama")
    result = vllm_helpers.run_engine(folder, prompts()[:1], 4, tmp_path, engine={"pipeline_parallel_size": 2})
    assert result.returncode != 0
    assert "Pipeline parallelism is not supported for this model" in result.stderr, result.stderr[-3000:]


def test_an_image_text_base_serves_its_language_model_exactly(tmp_path):
    """Gemma 3 with its vision tower, converted: vLLM reads the language model's sizes (the config's
    `get_text_config()`) and serves text in, text out, as `generate` does on the folder, whole and at TP 2."""
    from transformers import AutoConfig

    folder = tmp_path / "gemma3"
    vllm_helpers.type_folder("gemma3", folder)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert config.text_config.model_type == "gemma3" and config.get_text_config().model_type == "gemma3_text"
    token_lists = prompts()
    expected = generate_tokens(folder, token_lists, NEW_TOKENS, past_end=True)
    for tensor_parallel in (1, 2):
        engine = {"tensor_parallel_size": tensor_parallel}
        result = vllm_helpers.run_engine(folder, token_lists, NEW_TOKENS, tmp_path, engine=engine)
        assert result.returncode == 0, result.stdout[-3000:]
        assert vllm_helpers.served_tokens(result) == expected, tensor_parallel


# ---- the OpenAI-compatible server --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.fixture
def server(tmp_path):
    """`vllm serve <converted folder> --trust-remote-code` on a free loopback port; stopped afterwards."""
    folder = converted_folder("llama", tmp_path / "llama")
    port = _free_port()
    flags = [
        "--dtype",
        ENGINE["dtype"],
        "--enforce-eager",
        "--max-model-len",
        str(ENGINE["max_model_len"]),
        "--max-num-seqs",
        str(ENGINE["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(ENGINE["max_num_batched_tokens"]),
        "--gpu-memory-utilization",
        str(ENGINE["gpu_memory_utilization"]),
        "--kv-cache-memory-bytes",
        str(ENGINE["kv_cache_memory_bytes"]),
    ]
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            str(HELPERS),
            "cli",
            "serve",
            str(folder),
            "--trust-remote-code",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *flags,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=engine_env(),
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert process.poll() is None, "vllm serve exited:\n" + (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (
                "vllm serve not up in 400 s:\n" + (tmp_path / "server.log").read_text()[-4000:]
            )
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(2)
        yield folder, base, process
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the server's own process group (start_new_session)
            process.wait(timeout=30)
        log.close()


def test_openai_server_answers_as_generate(server):
    from transformers import AutoTokenizer

    folder, base, process = server
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = ["Hello", "The quick brown fox jumps", "To be, or not to be, that is the question:"]
    chats = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a residual?"}],
    ]
    common = dict(model=str(folder), max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_token_ids=True)
    with concurrent.futures.ThreadPoolExecutor(len(texts) + len(chats)) as pool:
        completions = [pool.submit(_post, f"{base}/v1/completions", dict(common, prompt=text)) for text in texts]
        chat_answers = [
            pool.submit(_post, f"{base}/v1/chat/completions", dict(common, messages=chat)) for chat in chats
        ]
        completions = [future.result() for future in completions]
        chat_answers = [future.result() for future in chat_answers]
    prompt_ids = [tokenizer(text).input_ids for text in texts]
    prompt_ids += [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        for chat in chats
    ]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    answers = completions + chat_answers
    assert [status for status, _ in answers] == [200] * len(answers), answers
    assert [
        body["choices"][0]["prompt_token_ids"] if "prompt_token_ids" in body["choices"][0] else body["prompt_token_ids"]
        for _, body in answers
    ] == prompt_ids
    served = [body["choices"][0]["token_ids"] for _, body in answers]
    assert [up_to_end(tokens) for tokens in served] == generate_tokens(folder, prompt_ids, NEW_TOKENS)
    # The text is the tokens decoded, as a chat message for the chat endpoint (vLLM's incremental detokenizer puts
    # the character tokenizer's joining space before the first token too).
    assert completions[0][1]["choices"][0]["text"].strip() == tokenizer.decode(served[0], skip_special_tokens=True)
    assert chat_answers[0][1]["choices"][0]["message"]["content"].strip() == tokenizer.decode(
        served[len(texts)], skip_special_tokens=True
    )

    # A prompt longer than the model's context gets vLLM's error; the server stays up and serves the next request.
    status, body = _post(f"{base}/v1/completions", dict(common, prompt="x" * 300))
    assert status == 400, body
    assert "maximum context length" in body["error"]["message"] or "max_model_len" in body["error"]["message"], body
    status, body = _post(f"{base}/v1/completions", dict(common, prompt=texts[0]))
    assert status == 200 and body["choices"][0]["token_ids"] == served[0]
    assert process.poll() is None


def test_the_plugin_registers_the_architecture_once_however_often_called():
    from importlib.metadata import entry_points

    from vllm import ModelRegistry

    from attnres_convert.serving import vllm_plugin

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "attnres"]
    assert entry.value == "attnres_convert.serving.vllm_plugin:register"
    entry.load()()
    entry.load()()  # vLLM calls it in every process it starts
    assert vllm_plugin.ARCHITECTURE in ModelRegistry.get_supported_archs()
    model_class = ModelRegistry._try_load_model_cls(vllm_plugin.ARCHITECTURE)
    assert model_class.__name__ == "AttnResForCausalLMVllm"
    assert model_class.__module__ == "attnres_convert.serving.vllm_model"
