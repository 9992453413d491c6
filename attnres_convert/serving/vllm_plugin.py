"""vLLM's entry point into attnres (group `vllm.general_plugins`, declared in pyproject.toml).

vLLM calls `register` in every process it starts, before it resolves a model's architecture, so a converted
folder (`architectures: ["AttnResForCausalLM"]`) is served by `vllm_model.AttnResForCausalLMVllm` with no flag.
The class is named as a string, which vLLM imports only when a converted model is loaded: registering costs
nothing to an engine serving anything else, and registering twice replaces the entry with the same one."""

from __future__ import annotations

ARCHITECTURE = "AttnResForCausalLM"
MODEL_CLASS = "attnres_convert.serving.vllm_model:AttnResForCausalLMVllm"


def register() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
