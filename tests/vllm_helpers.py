"""Converted tiny models for the vLLM tests (tests/test_vllm.py), and the offline engine run in a process of its
own: `python tests/vllm_helpers.py <folder> <request.json>` prints the greedy tokens vLLM produced as JSON;
`python tests/vllm_helpers.py cli serve ...` runs vLLM's own `vllm serve` (see `vllm_cli`).

vLLM starts its engine in worker processes (spawn), so the engine runs here, under the `__main__` guard, one
engine per model; the test process computes the references with transformers' `generate`."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from finetune_helpers import char_tokenizer  # noqa: E402
from tiny_models import CONFIGS, randomize_queries, tiny_model  # noqa: E402


def cpu_head_size(family: str) -> dict:
    """Config overrides giving heads of 32: vLLM's CPU attention takes head sizes 32, 64, 80..., not the tiny
    models' 16. A config that names its head size gets 32; one whose modules derive it from the hidden size gets
    2 heads (of 64 / 2), and as many key-value heads where it has them; latent attention (DeepSeek's MLA) has
    heads of qk_nope + qk_rope = 32 already."""
    config = CONFIGS[family]()
    if getattr(config, "kv_lora_rank", None):
        return {}
    if getattr(config, "head_dim", None) is not None:
        return dict(head_dim=32)
    grouped = dict(num_key_value_heads=2) if getattr(config, "num_key_value_heads", None) is not None else {}
    return dict(num_attention_heads=2, **grouped)


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# Prompts of different lengths submitted together; the last two share their first 36 tokens (prefix caching).
PROMPT_LENGTHS = (5, 17, 40, 44)
ENGINE = dict(  # a tiny model on a shared CPU: a small KV cache, chunks of 32 tokens (a 40-token prompt takes two)
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    gpu_memory_utilization=0.1,
    kv_cache_memory_bytes=64 << 20,
)
# On a CPU without AMX, vLLM forces a latent-attention model's (DeepSeek's) cache blocks to its CPU MLA kernel's 16
# tokens, which the attention a converted model runs through (multiples of 32) refuses: "No common block size for 16
# (CPU_ATTN: [MultipleOf(32)])". VLLM_MLA_DISABLE=1 (vLLM's own switch) keeps the plain attention's block size.
ENGINE_ENV = {"VLLM_MLA_DISABLE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the latter: `rank_weights`
# Tensor parallelism on vLLM's CPU build: one worker process per rank, each bound to a core of its own. On a machine
# with one NUMA node the engine needs the binding named ("Not enough allowed NUMA nodes to bind threads of 2 local
# CPUWorkers" otherwise).
TENSOR_PARALLEL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    made = [torch.randint(3, 128, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]
    made[3] = made[2][:36] + made[3][36:]
    return made


def converted_folder(family: str, folder: Path, block_size: int = 2, **conversion) -> Path:
    """A tiny random `family` model converted (block size 2: several blocks over 3 layers) with nonzero queries
    and key norms, so depth attention changes every token, saved with the character tokenizer and a chat template.
    CONVERSION: convert_model's options (`query_rank`, `additive`), whose tensors are drawn nonzero too."""
    from attnres_convert import convert_model, save_converted

    base = tiny_model(family, **cpu_head_size(family))
    parts = (
        ("weight",)
        + (("up", "down") if conversion.get("query_rank") else ())
        + (("gate",) * bool(conversion.get("additive")))
    )
    model = convert_model(copy.deepcopy(base), block_size=block_size, **conversion)
    model = randomize_queries(model, 0.5, seed=1, key_norms=0.3, parts=parts)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    save_converted(model, folder, tokenizer)
    return folder


def generate_tokens(
    folder: Path, token_lists: list[list[int]], max_new_tokens: int, past_end: bool = False
) -> list[list[int]]:
    """transformers' greedy `generate` on the folder (float32), one prompt at a time; it stops at the end token, or
    with PAST_END goes on past it as vLLM's `ignore_eos` does (`min_new_tokens` would instead forbid the end token,
    changing the argmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    if past_end:
        model.generation_config.eos_token_id = None
    outputs = []
    for tokens in token_lists:
        ids = torch.tensor([tokens])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
        outputs.append(out[0, len(tokens) :].tolist())
    return outputs


END_TOKEN = 2  # the tiny models' eos_token_id
TOKENS_LINE = "VLLM_TOKENS "  # how an engine run's answer starts on its standard output


def up_to_end(tokens: list[int]) -> list[int]:
    """The tokens up to and including the first end token: what `generate` returns of a longer greedy run."""
    return tokens[: tokens.index(END_TOKEN) + 1] if END_TOKEN in tokens else tokens


def run_engine(
    folder: Path,
    token_lists: list[list[int]],
    max_new_tokens: int,
    scratch: Path,
    timeout: float = 600,
    engine: dict | None = None,
    **env: str,
) -> subprocess.CompletedProcess:
    """This file's engine run (`vllm_tokens`, below) in a process of its own, one thread, ENV added to its
    environment, ENGINE's settings over ENGINE's defaults; the request is written to SCRATCH. `served_tokens`
    reads its answer."""
    request = scratch / "request.json"
    request.write_text(json.dumps({"prompts": token_lists, "max_new_tokens": max_new_tokens, "engine": engine or {}}))
    if (engine or {}).get("tensor_parallel_size", 1) > 1:
        env = {**TENSOR_PARALLEL_ENV, **env}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent), **ENGINE_ENV, **env}
    return subprocess.run(
        [sys.executable, __file__, str(folder), str(request)], capture_output=True, text=True, timeout=timeout, env=env
    )


def served_tokens(result: subprocess.CompletedProcess) -> list[list[int]] | None:
    """The tokens an engine run printed, or None where it printed none (it failed)."""
    line = next((line for line in result.stdout.splitlines() if line.startswith(TOKENS_LINE)), None)
    return None if line is None else json.loads(line.removeprefix(TOKENS_LINE))


def vllm_tokens(
    folder: str, token_lists: list[list[int]], max_new_tokens: int, engine: dict | None = None
) -> list[list[int]]:
    """vLLM's greedy tokens for all prompts submitted in one call (continuous batching), past any end token, printed
    (TOKENS_LINE), then each rank's weights (RANKS_LINE)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=folder, trust_remote_code=True, skip_tokenizer_init=True, **{**ENGINE, **(engine or {})})
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=False)
    results = llm.generate([TokensPrompt(prompt_token_ids=tokens) for tokens in token_lists], params, use_tqdm=False)
    tokens = [list(result.outputs[0].token_ids) for result in results]
    print(TOKENS_LINE + json.dumps(tokens), flush=True)
    print(RANKS_LINE + json.dumps(llm.collective_rpc(rank_weights)), flush=True)
    return tokens


RANKS_LINE = "VLLM_RANKS "  # each rank's weights, after the tokens (see `rank_weights`)


def rank_weights(worker) -> dict:
    """One rank's share of the served model (run in each worker by `collective_rpc`): the bytes of its weights as
    loaded, all and those of its linear layers (the serving class's `rank_bytes`), the worker's peak resident
    memory, and the classes of vLLM's layers in the model (fused ones: `QKVParallelLinear`, ...)."""
    import resource

    model = worker.model_runner.model
    layers = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("vllm.")})
    loaded = getattr(model, "rank_bytes", {})
    return {**loaded, "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "layers": layers}


def served_ranks(result: subprocess.CompletedProcess) -> list[dict] | None:
    """Each rank's `rank_weights` from an engine run, or None where it printed none."""
    line = next((line for line in result.stdout.splitlines() if line.startswith(RANKS_LINE)), None)
    return None if line is None else json.loads(line.removeprefix(RANKS_LINE))


def vllm_cli(argv: list[str]) -> None:
    """vLLM's own `vllm` command (`vllm serve ...`). vllm-cpu 0.32.0's command asks for the version of a
        distribution named `vllm`, which the CPU build installs as `vllm-cpu`, and fails before parsing its arguments
        (`No package metadata was found for vllm`); that one lookup is answered as vLLM's platform detection answers it
    (`vllm_version_matches_substr`: vllm-cpu's version + "+cpu")."""
    import importlib.metadata

    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"  # as vLLM's own platform detection names the CPU build

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


def cpu_heads(config, by_heads: bool = False) -> None:
    """Heads of 32, in place, on CONFIG and its text config (vLLM reads one, the model may read the other): vLLM's
    CPU attention takes 32, 64, 80..., not the tiny 16. A config that names its head size gets 32 (unless BY_HEADS:
    a model whose output projection is hidden x hidden whatever the head size, Helium); one whose modules derive it
    from the hidden size (64) gets 2 heads; latent attention (qk_nope + qk_rope = 32) is left as it is."""
    for each in {id(c): c for c in (config, config.get_text_config())}.values():
        values = {
            **each.to_dict(),
            **{name: read(each, name) for name in ("num_attention_heads", "num_key_value_heads")},
        }
        if values.get("kv_channels") is not None:  # JetMoE's head size
            each.kv_channels = 32
            continue
        if values.get("kv_lora_rank"):
            continue
        if values.get("head_dim") is not None:
            try:
                each.head_dim = 32
            except AttributeError:  # a property derived from the hidden size (Falcon): set through the heads
                pass
            else:
                if not by_heads:
                    continue
        if values.get("num_attention_heads") is not None:
            each.num_attention_heads = 2
        if values.get("num_key_value_heads") is not None:
            each.num_key_value_heads = min(values["num_key_value_heads"], 2)


def read(config, name: str):
    """CONFIG's attribute NAME through its attribute map (GPT-BigCode's n_head), or None; per-layer attributes
    (Gemma 4's head_dim) refuse a global read, so the head size is read from to_dict instead."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error
        return None


def type_folder(model_type: str, folder: Path):
    """The coverage sweep's tiny model of MODEL_TYPE with heads of 32, converted, queries and key norms drawn at
    random, saved to FOLDER. Returns the converted model."""
    from tiny_models import randomize_queries

    from attnres_convert import save_converted
    from attnres_convert.conversion.coverage import random_model
    from attnres_convert.conversion.surgery import BlockSizeError, convert_model
    from attnres_convert.conversion.tiny_configs import tiny_config

    for by_heads in (False, True, None):  # None: the coverage model as it is (a head size that is no head's)
        config = tiny_config(model_type)
        if by_heads is not None:
            cpu_heads(config, by_heads)
        try:
            model = random_model(config)
            try:
                converted = convert_model(copy.deepcopy(model), block_size=3)
            except BlockSizeError:
                converted = convert_model(copy.deepcopy(model), full=True)
            break
        except Exception:
            if by_heads is None:
                raise
    randomize_queries(converted, 0.5, seed=1, key_norms=0.3)
    save_converted(converted, folder)
    return converted


if __name__ == "__main__":
    if sys.argv[1] == "cli":
        vllm_cli(sys.argv[2:])
        sys.exit(0)
    request = json.loads(Path(sys.argv[2]).read_text())
    vllm_tokens(sys.argv[1], request["prompts"], request["max_new_tokens"], request.get("engine"))
