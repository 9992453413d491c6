"""Keep the AttnRes tensors' names out of reach of the base model's checkpoint renaming rules.

transformers v5 renames checkpoint keys with per-family regex rules when it loads a model (Mixtral's
`.block_sparse_moe.` -> `.mlp.`, fused experts...) and applies the rules reversed when it saves one, so the
folder keeps the original checkpoint format. Those rules are written for the base model's own names: reversed,
Mixtral's `.mlp.` (an unescaped regex) also matches `.mlp_res_proj` and would save the trained query as
`block_sparse_moe.res_proj`, which the next load does not find (the query silently starts at zero again).

A rule may still move an AttnRes tensor with its module (a prefix change such as `model.layers.` ->
`model.language_model.layers.` applies to the whole layer), but never change the tensor's own name
(`mlp_res_proj.weight`): every rule the converted model loads or saves with is wrapped so that such a
renaming does not happen.
"""

from __future__ import annotations

import re

# The AttnRes tensors' own names, relative to the module that holds them (sublayers `self_attention`, `mlp`,
# `mlp_2`..., the output aggregation `output_attn`; `down` and `up` of input-dependent queries, an additive `gate`).
ATTNRES_TENSOR = re.compile(
    r"(?:^|\.)((?:(?:self_attention|mlp)(?:_\d+)?|output_attn)_res_(?:proj\.(?:weight|down|up|gate)|norm\.weight))$"
)


class _NameGuard:
    """Mixed in before a transformers WeightTransform class: a renaming that would change an AttnRes tensor's
    own name leaves the key as it is; reversing the transform (for saving) keeps the guard."""

    __slots__ = ()

    def rename_source_key(self, source_key: str):
        renamed, pattern = super().rename_source_key(source_key)
        own = ATTNRES_TENSOR.search(source_key)
        if own is not None and renamed != source_key:
            name = own.group(1)
            if renamed != name and not renamed.endswith("." + name):
                return source_key, None
        return renamed, pattern

    def reverse_transform(self):
        return guarded(super().reverse_transform())


# Process-wide on purpose: one guarded subclass per transform class (a pure function of that class, never stale).
_GUARDED: dict[type, type] = {}


def guarded(transform):
    """TRANSFORM, its class switched (in place) to a subclass that cannot rename an AttnRes tensor's own name."""
    cls = type(transform)
    if isinstance(transform, _NameGuard):
        return transform
    subclass = _GUARDED.get(cls)
    if subclass is None:
        subclass = type(f"AttnResGuarded{cls.__name__}", (_NameGuard, cls), {"__slots__": (), "__module__": __name__})
        _GUARDED[cls] = subclass
    transform.__class__ = subclass
    return transform


def guard_all(transforms):
    """The list, every transform guarded; None stays None."""
    return None if transforms is None else [guarded(transform) for transform in transforms]


def default_save_conversions(model):
    """What transformers reverts when it saves a model that from_pretrained did not load: the registered rules of
    every base model inside (no legacy rules, no prefix changes), or None where there are none."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return conversions or None
