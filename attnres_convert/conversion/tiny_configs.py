"""A tiny config for every causal-LM model type: what the coverage walk builds.

The default config of a model type is shrunk where it has the usual size attributes (hidden 64, 2 layers,
vocabulary 256, few experts). Three things the plain shrink does not cover are handled generically:

* per-layer attributes: lists with one entry per layer (`layer_types`, `mlp_layer_types`, an
  `intermediate_size` list, ...), `per_layer_config` and lists of layer indices are cut down to two layers
  picked so that both kinds appear where the default mixes kinds (a hybrid keeps an attention layer and a
  linear-attention layer);
* composite configs (image-text, audio-text): each sub-config (`text_config`, `vision_config`, ...) is
  shrunk the same way;
* what no rule can guess (validators, odd names) is in `TYPE_OVERRIDES`, keyed by model type.
"""

from __future__ import annotations

LAYERS = 2

# Overrides applied where the default config has the attribute (through its attribute_map too).
SHRINK = dict(
    hidden_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=256,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    shared_expert_intermediate_size=32,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    rotary_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=4,
    vocab_size_per_layer_input=256,
    hidden_size_per_layer_input=16,
    # state-space mixers (Mamba-2 style: heads x head size = expand x hidden)
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    mamba_d_state=16,
    ssm_state_size=16,
    mamba_chunk_size=8,
    mamba_dt_rank=8,
    mamba_d_ssm=128,
    moe_shared_expert_intermediate_size=32,
)
# Sizes shrunk only where the default sets them: None or 0 there switches the feature off.
ONLY_WHERE_SET = ("sliding_window", "hidden_size_per_layer_input")
# Attributes of a sub-config that are not a language model's (vision and audio towers): shrunk there only.
TOWER_SHRINK = dict(
    image_size=32,
    patch_size=8,
    num_channels=3,
    depth=2,
    num_layers=2,
    embed_dim=64,
    num_heads=4,
    out_hidden_size=64,
    projection_dim=64,
    vision_output_dim=64,
    num_global_layers=1,
    num_blocks=2,
    nemo_conv_channels=64,
    depthwise_separable_out_channel=64,
    ext_pw_out_channel=64,
    adapter_in_dim=64,
    adapter_input_size=64,
    adapter_out_dim=64,
    hidden_size_global=64,
    downsample_hidden_size=32,
)
# Per-layer list attributes whose entries name a layer's kind: the layers to keep are chosen from these.
KIND_LISTS = ("layer_types", "layers_block_type", "mlp_layer_types", "layers_type", "block_types")

# What the generic shrink cannot guess, by model type (of the config or of a sub-config).
TYPE_OVERRIDES: dict[str, dict] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    },
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "max_seq_len": 256,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"hidden_size": 64, "ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 0, "n_output_layers": 1, "n_recurrent_loops": 1},
    # sliding layers: head_dim = qk_nope_head_dim (32, their per-layer override) + qk_rope_head_dim (16)
    "dots3_note_text": {"head_dim": 48, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4},
    "gemma3": {"mm_tokens_per_image": 4},  # 4 x 4 patches of the tiny tower pooled to 2 x 2 image tokens
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma4_assistant": {
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "num_kv_shared_layers": LAYERS,
        }
    },
    "gemma4_unified_assistant": {
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "num_kv_shared_layers": LAYERS,
        }
    },
    "blt": {
        "encoder_hash_byte_group_vocab": 64,
        "encoder_hash_byte_group_size": [3, 4],
        "local_attention_window_len": 8,
        "num_hidden_layers": LAYERS,
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "inkling2_text": {
        "unpadded_vocab_size": 256,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "sliding_window_size": 4,
        "d_rel": 4,
        "rel_extent": 8,
    },
    "inkling2_loop_text": {
        "unpadded_vocab_size": 256,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "sliding_window_size": 4,
        "d_rel": 4,
        "rel_extent": 8,
    },
    "longcat_flash": {
        "num_layers": 2,
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 32,
        "moe_topk": 2,
        "zero_expert_num": 2,
    },
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # the default has no attention layer
    "nemotron_h": {
        "chunk_size": 8,
        "num_hidden_layers": 4,  # one layer of each kind: Mamba-2, MoE, attention, MLP
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 64, "attention_window_size": 4},
    "xlstm": {"num_blocks": LAYERS, "num_heads": 4, "qk_dim_factor": 1.0},  # its cache assumes qk = v head size
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "state_size": 16, "chunk_size": 8},
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "hc_lowrank": 8,
        "ple_embed_dim": 16,
        "ngram_vocab_size_base": 256,
        "split_ngram_parts": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 16]},
    "xlnet": {"d_model": 64, "n_layer": 2, "n_head": 4, "d_head": 16, "d_inner": 128, "mem_len": 8},
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },  # a shared block tied
    "zaya": {"num_experts_per_tok": 1},
}

# Default configs of the installed transformers that fail their own validators, and what makes them pass.
DEFAULT_FIXES: dict[str, dict] = {
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}}
}


def tiny_config(model_type: str, **overrides):
    """The default config of MODEL_TYPE, shrunk to a tiny model (overrides applied last)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type, **_default_fixes(model_type))
    return AutoConfig.for_model(model_type, **{**shrunk_values(default), **overrides})


def _default_fixes(model_type: str) -> dict:
    """What a default config needs to pass its own validators (gemma4_assistant's default fails them)."""
    return DEFAULT_FIXES.get(model_type, {})


def shrunk_values(default, tower: bool = False) -> dict:
    """The keyword arguments that shrink the config DEFAULT (a sub-config too: TOWER for a vision or audio
    one)."""
    rules = {**SHRINK, **(TOWER_SHRINK if tower else {})}
    values = {key: value for key, value in rules.items() if _has(default, key)}
    if _peek(default, "kv_lora_rank") is not None and "num_key_value_heads" in values:
        values["num_key_value_heads"] = values["num_attention_heads"]  # multi-head latent attention: no GQA
    for key in ONLY_WHERE_SET:
        if not _peek(default, key):
            values.pop(key, None)
    layers = _peek(default, "num_hidden_layers")
    if isinstance(layers, int) and layers > LAYERS:
        values.update(_per_layer_values(default, layers))
    for name in getattr(default, "sub_configs", {}) or {}:
        sub = getattr(default, name, None)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            values[name] = {**_settings(sub), **shrunk_values(sub, tower=name != "text_config")}
    return _merged(values, TYPE_OVERRIDES.get(getattr(default, "model_type", ""), {}))


def _settings(config) -> dict:
    """CONFIG's to_dict without the generic settings it holds at their defaults and its class does not declare
    (`_name_or_path`, `output_attentions`): a sub-config class of transformers 5.16.1 (Dbrx's FFN config)
    refuses those as unknown keywords, and every release gives them the same defaults without."""
    import dataclasses

    from transformers import PreTrainedConfig

    generic = PreTrainedConfig().to_dict()
    declared = {field.name for field in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    return {
        key: value
        for key, value in config.to_dict().items()
        if key in declared or key == "model_type" or key not in generic or value != generic[key]
    }


def _merged(values: dict, overrides: dict) -> dict:
    """VALUES with OVERRIDES applied, sub-config dicts merged key by key."""
    merged = dict(values)
    for key, value in overrides.items():
        both_dicts = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merged(merged[key], value) if both_dicts else value
    return merged


def _per_layer_values(default, layers: int) -> dict:
    """Per-layer attributes cut to the kept layers (both kinds kept where the default mixes kinds)."""
    keep = _layers_to_keep(default, layers)
    values = {}
    for key, value in _attributes(default).items():
        if key in SHRINK and key != "intermediate_size":
            continue
        if isinstance(value, (list, tuple)) and len(value) == layers and not isinstance(value[0], (list, dict)):
            values[key] = [_shrunk_entry(key, value[i]) for i in keep]
        elif key.endswith(("layer_ids", "layer_indices")) and isinstance(value, (list, tuple)):
            values[key] = [keep.index(i) for i in value if i in keep]
    per_layer = default.to_dict().get("per_layer_config")  # as written: layer index -> overrides
    if isinstance(per_layer, dict) and per_layer:
        values["per_layer_config"] = {
            new: {k: _shrunk_per_layer(default, k, v, per_layer[old]) for k, v in per_layer[old].items()}
            for new, i in enumerate(keep)
            if (old := _layer_key(per_layer, i)) is not None
        }
    return values


def _layers_to_keep(default, layers: int) -> list[int]:
    """Layer 0 and the first layer of another kind than layer 0's (else layer 1)."""
    for key in KIND_LISTS:
        kinds = _peek(default, key)
        if isinstance(kinds, (list, tuple)) and len(kinds) == layers:
            other = next((i for i, kind in enumerate(kinds) if kind != kinds[0]), None)
            if other is not None:
                return [0, other]
    return list(range(LAYERS))


def _shrunk_entry(key: str, value):
    """One layer's entry of a per-layer list: sizes shrink, kinds and flags stay."""
    if key == "intermediate_size" and isinstance(value, int):
        return SHRINK["intermediate_size"]
    return value


def _shrunk_per_layer(default, key: str, value, overrides: dict | None = None):
    """A per-layer override of a size: the shrunk size, doubled or halved as the override is larger or smaller
    than the global value, so the layers still differ."""
    if key not in SHRINK or not isinstance(value, int):
        return value
    base = _peek(default, key)
    if key == "num_key_value_heads" and value == (overrides or {}).get("num_attention_heads"):
        return _shrunk_per_layer(default, "num_attention_heads", value)  # MLA: as many kv heads as heads
    if not isinstance(base, int) or value == base:
        return SHRINK[key]
    return SHRINK[key] * 2 if value > base else max(1, SHRINK[key] // 2)


def _layer_key(per_layer: dict, index: int):
    for key in per_layer:
        if str(key).isdigit() and int(key) == index:
            return key
    return None


def _attributes(config) -> dict:
    """The config's own attributes (not its sub-configs), without the per-layer access check."""
    return {
        key: _peek(config, key) for key in config.to_dict() if key not in (getattr(config, "sub_configs", {}) or {})
    }


def _peek(config, key: str, default=None):
    """An attribute of CONFIG, read without transformers' per-layer ambiguity check (heterogeneous configs)."""
    reader = getattr(config, "_getattr_without_heterogeneous_validation", None)
    try:
        return reader(key, default) if reader is not None else getattr(config, key, default)
    except Exception:  # noqa: BLE001 - a derived property that cannot be computed: treated as absent
        return default


def _has(config, key: str) -> bool:
    if isinstance(getattr(type(config), key, None), property):
        return False  # derived values
    return _peek(config, key, _MISSING) is not _MISSING


_MISSING = object()
