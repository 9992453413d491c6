"""Tiny random configs of families and config variants (hidden 64, 3 layers), as the transformers tests do:
the 14 of the architecture table, and families whose structure only discovery finds (Granite's multipliers,
GLM-4's sandwich norms, Gemma 4's per-layer-input gate that reads the raw stream and its MoE block, OPT's MLP as a chain of modules, Cohere's parallel residual with qk-norm and a logit
scale, DeepSeek-V3's latent attention with a dense first layer then MoE with a shared expert, Falcon's new
decoder architecture with two norms in parallel), modules that add the residual themselves or take their input
twice (Bloom, MPT, CTRL), and state-space and hybrid stacks (Mamba; Jamba's Mamba and
attention layers with MoE every other layer; Falcon-H1's Mamba-2 and attention in parallel; Qwen3-Next's gated delta-net and attention layers)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers as T

_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=128, max_position_embeddings=256)
_DECODER = dict(
    _IDS, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
)
_NEOX = dict(_IDS, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)

CONFIGS = {
    "llama": lambda: T.LlamaConfig(**_DECODER),
    "mistral": lambda: T.MistralConfig(**_DECODER, sliding_window=None),
    "mixtral": lambda: T.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": lambda: T.Qwen2Config(**_DECODER),
    "qwen3": lambda: T.Qwen3Config(**_DECODER, head_dim=16),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(
        **_DECODER, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "gemma": lambda: T.GemmaConfig(**_DECODER, head_dim=16),
    "gemma2": lambda: T.Gemma2Config(**_DECODER, head_dim=16, sliding_window=8),
    "gemma3_text": lambda: T.Gemma3TextConfig(**_DECODER, head_dim=16, sliding_window=8),
    # Gemma 4: a third sublayer per layer whose gate reads the raw stream, times the layer's per-layer input; each
    # layer scales the stream it returns (AFTER_BUILD); the last two layers reuse earlier layers' KV states (KV
    # sharing), as the small Gemma 4 models do
    "gemma4_text": lambda: T.Gemma4TextConfig(
        **_DECODER | {"num_hidden_layers": 4},
        head_dim=16,
        global_head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128,
        num_kv_shared_layers=2,
    ),
    # Gemma 4's MoE models: the feed-forward sublayer normalises the sum of a dense MLP and experts that a router
    # (reading the flattened raw stream) picks; no per-layer inputs, keys that are the values on global layers
    "gemma4_moe": lambda: T.Gemma4TextConfig(
        **_DECODER | {"num_hidden_layers": 4},
        head_dim=16,
        global_head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        attention_k_eq_v=True,
    ),
    "phi3": lambda: T.Phi3Config(**_DECODER),
    "gpt2": lambda: T.GPT2Config(
        **_IDS | {"max_position_embeddings": 256}, n_embd=64, n_layer=3, n_head=4, n_positions=256
    ),
    "gpt_neox_parallel": lambda: T.GPTNeoXConfig(**_NEOX, use_parallel_residual=True),
    "gpt_neox_sequential": lambda: T.GPTNeoXConfig(**_NEOX, use_parallel_residual=False),
    "phi": lambda: T.PhiConfig(**_NEOX),
    "granite": lambda: T.GraniteConfig(
        **_DECODER, residual_multiplier=0.22, embedding_multiplier=12.0, logits_scaling=8.0
    ),
    "glm4": lambda: T.Glm4Config(**_DECODER, head_dim=16),
    "opt": lambda: T.OPTConfig(
        **_IDS, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4, word_embed_proj_dim=64
    ),
    "cohere": lambda: T.CohereConfig(**_DECODER, use_qk_norm=True, logit_scale=0.25),
    "deepseek_v3": lambda: T.DeepseekV3Config(
        **_DECODER | {"num_key_value_heads": 4},
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
    "falcon_new": lambda: T.FalconConfig(**_NEOX, new_decoder_architecture=True, num_kv_heads=2),
    # modules that add the residual themselves (Bloom's attention and MLP, MPT's MLP), or take their input twice (CTRL)
    "bloom": lambda: T.BloomConfig(**_IDS, hidden_size=64, n_layer=3, n_head=4),
    "mpt": lambda: T.MptConfig(**_IDS, d_model=64, n_layers=3, n_heads=4, max_seq_len=256),
    "gpt_neox_japanese": lambda: T.GPTNeoXJapaneseConfig(  # its last attention returns a bias the layer adds
        **_IDS, hidden_size=64, intermediate_multiple_size=2, num_hidden_layers=3, num_attention_heads=4
    ),
    "dbrx": lambda: T.DbrxConfig(  # blocks that hold their norms: attention between two norms, then the MoE FFN
        **_IDS,
        d_model=64,
        n_heads=4,
        n_layers=3,
        max_seq_len=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    "ctrl": lambda: T.CTRLConfig(**_IDS, n_embd=64, n_layer=3, n_head=4, dff=128, n_positions=256),
    # state-space and hybrid stacks: recurrent and convolution states travel in the cache
    "mamba": lambda: T.MambaConfig(**_IDS, hidden_size=64, num_hidden_layers=3, state_size=8, time_step_rank=8),
    "jamba": lambda: T.JambaConfig(
        **_DECODER,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    "falcon_h1": lambda: T.FalconH1Config(  # Mamba-2 in parallel with attention, the mixer's mask under its own name
        **_DECODER, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8
    ),
    # recurrent models whose layers hand their state back to the base model (which ignores the attention mask)
    "rwkv": lambda: T.RwkvConfig(
        vocab_size=128,
        context_length=256,
        hidden_size=64,
        num_hidden_layers=3,
        attention_hidden_size=64,
        intermediate_size=128,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "xlstm": lambda: T.xLSTMConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=3,
        num_heads=4,
        qk_dim_factor=1.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen3_next": lambda: T.Qwen3NextConfig(
        **_DECODER,
        head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
}


def _gemma4_layer_scalars(model) -> None:
    # Gemma 4's layers multiply the stream they return by a `layer_scalar` buffer that checkpoints set; not 1 here.
    for layer, scalar in zip(model.model.layers, (0.5, 1.7, 0.3, 2.5)):
        layer.layer_scalar.fill_(scalar)


# What a family's checkpoints hold that its init does not: set after building.
AFTER_BUILD = {"gemma4_text": _gemma4_layer_scalars, "gemma4_moe": _gemma4_layer_scalars}


def olmo2_config() -> T.Olmo2Config:
    """OLMo-2 (post-norm: norms after each sublayer), which the conversion refuses."""
    return T.Olmo2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )


def tiny_model(name: str, seed: int = 0, **overrides) -> T.PreTrainedModel:
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    # A larger init than the default 0.02 makes the residual stream and its norms matter, so an inexact
    # conversion shows up in the logits instead of hiding under tiny activations.
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
        if name in AFTER_BUILD:
            AFTER_BUILD[name](model)
    return model


def token_ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def randomize_queries(
    model,
    std: float,
    *,
    seed: int | None = None,
    parts: tuple[str, ...] = ("weight",),
    key_norms: float | None = None,
    add: bool = False,
):
    """Gives a converted model's depth attention the look of a trained one, so a test is not trivially exact
    at the zero queries of conversion: each pseudo-query (`*_res_proj`) becomes std * N(0, 1) and, with
    key_norms, each key norm (`*_res_norm`) 1 + key_norms * N(0, 1), drawn module by module in model order.

    seed: draw from a generator of its own (None: from torch's global one, as the test left it).
    parts: the tensors of each query to draw, in this order: "weight" (the static query), and with input-dependent
        queries "up" and "down".
    add: add the noise to the current values instead (queries and key norms alike).
    Modules are found by name, so a model loaded with trust_remote_code (other classes) is handled the same.
    Returns the model."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)

    def draw(param: torch.Tensor, scale: float, start: float) -> None:
        noise = (scale * torch.randn(param.shape, generator=generator)).to(param.dtype)
        if add:
            param.add_(noise)
        elif start:
            param.copy_(start + noise)
        else:
            param.copy_(noise)

    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("_res_proj"):
                for part in parts:
                    draw(getattr(module, part), std, 0.0)
            elif key_norms is not None and name.endswith("_res_norm"):
                draw(module.weight, key_norms, 1.0)
    return model


def save_plain_and_converted(base: T.PreTrainedModel, tokenizer, root: Path, block_size: int) -> tuple[Path, Path]:
    """The base model saved as it is (root/plain) and converted (root/attnres), each folder with the tokenizer:
    the pair a test compares (the base model itself is left unconverted)."""
    from attnres_convert import convert_model, save_converted

    base.save_pretrained(root / "plain")
    tokenizer.save_pretrained(root / "plain")
    save_converted(convert_model(copy.deepcopy(base), block_size=block_size), root / "attnres", tokenizer)
    return root / "plain", root / "attnres"


def with_kernels(mode: str, monkeypatch, fn):
    """fn() with ATTNRES_KERNEL=mode, which is unset again afterwards."""
    monkeypatch.setenv("ATTNRES_KERNEL", mode)
    try:
        return fn()
    finally:
        monkeypatch.delenv("ATTNRES_KERNEL")
