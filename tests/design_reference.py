"""A plain reference of Block AttnRes written from the design page, independent of the package: the sources each
sublayer reads and the depth mix, and whole forwards of a tiny Llama and a parallel-residual GPT-NeoX built
from them (the tests compare converted models against these)."""

import torch


def design_sources(reader: int, block_size: int, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sources of sublayer `reader` (1-based; L + 1 is the output aggregation), straight from
    docs/design.md: the embedding, every completed block (sum of its outputs), and the running partial
    sum of the reader's own block when it is not the first sublayer of that block."""
    block, position = divmod(reader - 1, block_size)
    sources = [outputs[0]]
    for b in range(block):
        sources.append(sum(outputs[b * block_size + 1 : (b + 1) * block_size + 1]))
    if position >= 1:
        sources.append(sum(outputs[block * block_size + 1 : reader]))
    return sources


def reference_mix(sources, query, key_norm, eps, scaling="count"):
    keys = torch.stack(sources)  # [n, B, T, D]
    normed = keys / torch.sqrt(keys.pow(2).mean(-1, keepdim=True) + eps) * key_norm
    alpha = torch.softmax((normed * query.reshape(-1)).sum(-1), dim=0)
    return (len(sources) if scaling == "count" else 1) * (alpha.unsqueeze(-1) * keys).sum(0)


def reference_llama(model, ids, block_size, scaling="count"):
    base, eps = model.model, model.config.text_config.rms_norm_eps
    outputs = [base.embed_tokens(ids)]
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    rotary = base.rotary_emb(outputs[0], positions)
    for j, layer in enumerate(base.layers):
        h = reference_mix(
            design_sources(2 * j + 1, block_size, outputs),
            layer.self_attention_res_proj.weight,
            layer.self_attention_res_norm.weight,
            eps,
            scaling,
        )
        outputs.append(layer.self_attn(layer.input_layernorm(h), position_embeddings=rotary, attention_mask=None)[0])
        h = reference_mix(
            design_sources(2 * j + 2, block_size, outputs),
            layer.mlp_res_proj.weight,
            layer.mlp_res_norm.weight,
            eps,
            scaling,
        )
        outputs.append(layer.mlp(layer.post_attention_layernorm(h)))
    h = reference_mix(
        design_sources(len(outputs), block_size, outputs),
        base.output_attn_res_proj.weight,
        base.output_attn_res_norm.weight,
        eps,
        scaling,
    )
    return model.lm_head(base.norm(h))


def reference_neox_parallel(model, ids, block_size):
    base, eps = model.gpt_neox, model.config.text_config.layer_norm_eps
    outputs = [base.embed_in(ids)]
    rotary = base.rotary_emb(outputs[0], torch.arange(ids.shape[1]).unsqueeze(0))
    for j, layer in enumerate(base.layers):
        h = reference_mix(
            design_sources(j + 1, block_size, outputs),
            layer.self_attention_res_proj.weight,
            layer.self_attention_res_norm.weight,
            eps,
        )
        attn = layer.attention(layer.input_layernorm(h), attention_mask=None, position_embeddings=rotary)[0]
        outputs.append(attn + layer.mlp(layer.post_attention_layernorm(h)))
    h = reference_mix(
        design_sources(len(outputs), block_size, outputs),
        base.output_attn_res_proj.weight,
        base.output_attn_res_norm.weight,
        eps,
    )
    return model.lm_head(base.final_layer_norm(h))
