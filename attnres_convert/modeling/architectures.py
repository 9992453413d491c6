"""Which modules form each residual sublayer, per model family, declaratively.

A sublayer is what adds one output to the residual stream: one or more branches, each
`post(module(norm(h)))`, summed. A parallel-residual layer (GPT-NeoX with use_parallel_residual, Phi-1/2,
GPT-J) has one sublayer with two branches read from the same input. Norms applied to a branch's output
(Gemma 2/3 post-norms, residual dropouts) belong to the branch.

Adding a family is a few lines here; the generic decoder-layer forward in modeling_attnres.py reads it.
This file ships next to converted weights: it imports nothing outside the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class UnsupportedModelError(ValueError):
    """The model cannot be converted exactly; the message says why and what is supported."""


@dataclass(frozen=True)
class Branch:
    norm: str  # attribute of the decoder layer: the PreNorm that reads the residual stream
    module: str  # attention or MLP module
    post: tuple[str, ...] = ()  # modules applied to the branch output before it joins the stream
    attention: bool = False  # receives the layer's call arguments (mask, positions, cache)


@dataclass(frozen=True)
class Sublayer:
    name: str  # prefix of its AttnRes parameters: "self_attention" or "mlp"
    branches: tuple[Branch, ...]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    base_model: str = "model"  # attribute of the *ForCausalLM holding the decoder stack
    lm_head: str = "lm_head"
    layers: str = "layers"  # attribute of the base model: the decoder layers
    final_norm: str = "norm"
    eps_attrs: tuple[str, ...] = ("rms_norm_eps",)
    sequential: tuple[Sublayer, ...] = ()
    parallel: tuple[Sublayer, ...] = ()  # used when `parallel_flag` is true in the config
    parallel_flag: str | None = None
    always_parallel: bool = False
    notes: str = ""
    extra_checks: tuple[tuple[str, object, str], ...] = field(default=())  # (config attr, bad value, why)

    def sublayers(self, config) -> tuple[Sublayer, ...]:
        if self.always_parallel or (self.parallel_flag and getattr(config, self.parallel_flag, False)):
            return self.parallel
        return self.sequential

    def eps(self, config) -> float:
        for attr in self.eps_attrs:
            value = getattr(config, attr, None)
            if value is not None:
                return float(value)
        raise UnsupportedModelError(f"{self.name}: config has none of {self.eps_attrs} (the norm eps)")


def _attn(norm, module="self_attn", post=()):
    return Branch(norm, module, tuple(post), attention=True)


def _mlp(norm, module="mlp", post=()):
    return Branch(norm, module, tuple(post))


def _sequential(attn: Branch, mlp: Branch) -> tuple[Sublayer, ...]:
    return (Sublayer("self_attention", (attn,)), Sublayer("mlp", (mlp,)))


_LLAMA_LIKE = _sequential(_attn("input_layernorm"), _mlp("post_attention_layernorm"))

FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma"),
        sequential=_LLAMA_LIKE,
        notes="Llama, SmolLM2, Mistral, Mixtral, Qwen2/3 (+MoE), Gemma (embedding scaling happens before layer 0)",
    ),
    Family(
        "phi3",
        ("phi3",),
        sequential=_sequential(
            _attn("input_layernorm", post=("resid_attn_dropout",)),
            _mlp("post_attention_layernorm", post=("resid_mlp_dropout",)),
        ),
        notes="Phi-3: residual dropouts belong to the branch",
    ),
    Family(
        "gemma2",
        ("gemma2", "gemma3_text"),
        sequential=_sequential(
            _attn("input_layernorm", post=("post_attention_layernorm",)),
            _mlp("pre_feedforward_layernorm", post=("post_feedforward_layernorm",)),
        ),
        notes="Gemma 2, Gemma 3 text: the norms after each sublayer belong to the sublayer",
    ),
    Family(
        "gpt2",
        ("gpt2",),
        base_model="transformer",
        layers="h",
        final_norm="ln_f",
        eps_attrs=("layer_norm_epsilon",),
        sequential=_sequential(_attn("ln_1", "attn"), _mlp("ln_2")),
        extra_checks=(("add_cross_attention", True, "cross-attention layers read an encoder, not the stream"),),
        notes="GPT-2: LayerNorm, learned positions (added before layer 0)",
    ),
    Family(
        "gpt_neox",
        ("gpt_neox",),
        base_model="gpt_neox",
        final_norm="final_layer_norm",
        eps_attrs=("layer_norm_eps",),
        sequential=_sequential(
            _attn("input_layernorm", "attention", post=("post_attention_dropout",)),
            _mlp("post_attention_layernorm", post=("post_mlp_dropout",)),
        ),
        parallel=(
            Sublayer(
                "self_attention",
                (
                    _attn("input_layernorm", "attention", post=("post_attention_dropout",)),
                    _mlp("post_attention_layernorm", post=("post_mlp_dropout",)),
                ),
            ),
        ),
        parallel_flag="use_parallel_residual",
        notes="GPT-NeoX / Pythia: parallel residual is one sublayer with two branches",
    ),
    Family(
        "phi",
        ("phi",),
        final_norm="final_layernorm",
        eps_attrs=("layer_norm_eps",),
        parallel=(
            Sublayer(
                "self_attention",
                (_attn("input_layernorm", post=("resid_dropout",)), _mlp("input_layernorm", post=("resid_dropout",))),
            ),
        ),
        always_parallel=True,
        notes="Phi-1/1.5/2: parallel attention and MLP on one shared LayerNorm",
    ),
)

# Known families that cannot be converted exactly, and why.
REFUSED: dict[str, str] = {
    "olmo2": "OLMo-2 is post-norm: it normalises sublayer outputs but feeds the raw residual stream into "
    "attention and the MLP, so the stream is read by something that is not a scale-invariant norm",
    "olmo3": "OLMo-3 is post-norm like OLMo-2: the residual stream is read without a PreNorm",
    "bert": "BERT is an encoder (bidirectional, post-norm), not a causal LM",
    "roberta": "RoBERTa is an encoder (bidirectional, post-norm), not a causal LM",
    "t5": "T5 is an encoder-decoder; only decoder-only causal LMs are supported",
    "bart": "BART is an encoder-decoder; only decoder-only causal LMs are supported",
}


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_for(config) -> Family:
    """The family of a base config, or UnsupportedModelError saying why and what is supported."""
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(supported_model_types())
    for family in FAMILIES:
        if model_type in family.model_types:
            for attr, bad, why in family.extra_checks:
                if getattr(config, attr, None) == bad:
                    raise UnsupportedModelError(f"{model_type} with {attr}={bad!r} cannot be converted: {why}.")
            return family
    if model_type in REFUSED:
        reason = REFUSED[model_type]
    elif getattr(config, "is_encoder_decoder", False):
        reason = f"{model_type} is an encoder-decoder; only decoder-only PreNorm causal LMs are supported"
    else:
        reason = f"model type {model_type!r} is not a supported PreNorm decoder family"
    raise UnsupportedModelError(f"{reason}. Supported model types: {supported}.")
