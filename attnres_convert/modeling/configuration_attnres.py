"""Configuration of a Block AttnRes model converted from a PreNorm causal LM: the base model's own config kept whole
as the `text_config` sub-config (generation and caches see the base architecture), plus the depth-attention settings.
Its `model_type` is its own, so a tool that does not know AttnRes refuses the folder rather than load it as the base
model without the new weights. Ships next to converted weights: imports transformers and the standard library only.
"""

from __future__ import annotations

from transformers import AutoConfig, PreTrainedConfig

try:  # transformers >= 5.20 builds a sub-config from its spec; before, this config builds it (`build_sub_config`)
    from transformers.configuration_utils import SubConfigSpec
except ImportError:
    SubConfigSpec = None


class AttnResConfig(PreTrainedConfig):
    r"""
    Args:
        text_config (`dict` or `PreTrainedConfig`): the base model's config. Its weights keep their original names.
        block_size (`int`): S, the number of *sublayers* (attention and MLP each count as one) per block; 1 is Full
            AttnRes.
        source_scaling (`str`): "count": a sublayer reads n * (softmax mix of its n sources), exactly the base model's
            residual sum at zero queries (conversion is exact). "mean": the plain mix, for models trained from scratch.
        query_rank (`int`): 0: static pseudo-queries w. r > 0: input-dependent queries w + B A x / rms(x) (B zero at
            conversion, so the converted model is still exactly the base model).
        additive (`bool`): a reader reads its stream plus a gate (zero at conversion) times its mix of completed blocks.
        base_model_type (`str`): the base model's `model_type`, for people and tools reading config.json.
        stream_width (`int`, *optional*): d, the residual stream's width as conversion read it from the layers.
        structure (`dict`): the plan the forward executes (modeling_attnres.ModelPlan), as found and proven layer by
            layer at conversion.
    """

    model_type = "attnres"
    # text_config is built by its model_type (Llama where none): by transformers >= 5.20, else by __post_init__.
    if SubConfigSpec is not None:
        sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}
    else:
        sub_configs = {"text_config": AutoConfig}

    text_config: dict | PreTrainedConfig | None = None
    block_size: int = 8
    source_scaling: str = "count"
    query_rank: int = 0
    additive: bool = False
    base_model_type: str | None = None
    stream_width: int | None = None
    structure: dict | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if isinstance(self.text_config, dict) and "model_type" not in self.text_config:
            if not self.base_model_type:
                raise ValueError("AttnResConfig: text_config has no model_type and base_model_type is not set")
            self.text_config = {**self.text_config, "model_type": self.base_model_type}
        self.text_config = build_sub_config(self.text_config, "llama")
        super().__post_init__(**kwargs)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.source_scaling not in ("count", "mean"):
            raise ValueError(f"source_scaling must be 'count' or 'mean', got {self.source_scaling!r}")
        if isinstance(self.query_rank, bool) or not isinstance(self.query_rank, int) or self.query_rank < 0:
            raise ValueError(f"query_rank must be a whole number >= 0 (0: static queries), got {self.query_rank!r}")
        self.base_model_type = self.text_config.model_type
        self.tie_word_embeddings = bool(getattr(self.text_config, "tie_word_embeddings", False))  # as the base's

    def get_text_config(self, decoder=None, encoder=None) -> PreTrainedConfig:
        """The language model's config (an image-text base's own text config), where vLLM reads the sizes."""
        text = super().get_text_config(decoder=decoder, encoder=encoder)
        return text if text is self else text.get_text_config(decoder=decoder, encoder=encoder)

    # The base config is saved without its `model_type` (kept as `base_model_type`): else a base config class such
    # as LlamaConfig would find its type nested in config.json and load the folder as a plain Llama.
    @staticmethod
    def _hide_base_type(data: dict) -> dict:
        if isinstance(data.get("text_config"), dict):
            data["text_config"] = {k: v for k, v in data["text_config"].items() if k != "model_type"}
        return data

    def to_dict(self) -> dict:
        return self._hide_base_type(super().to_dict())

    def to_diff_dict(self) -> dict:
        return self._hide_base_type(super().to_diff_dict())


def build_sub_config(value, default_model_type: str):
    """VALUE (a config, a dict or None) as the sub-config transformers' SubConfigSpec builds from it, for a
    transformers without SubConfigSpec: a dict by its `model_type` (else DEFAULT_MODEL_TYPE), None as that type's
    defaults. Where transformers has one, VALUE unchanged: transformers builds it."""
    if SubConfigSpec is not None or isinstance(value, PreTrainedConfig):
        return value
    if value is None:
        return AutoConfig.for_model(default_model_type)
    if not isinstance(value, dict):
        raise TypeError(f"a sub-config must be a dict, a PreTrainedConfig or None, got {type(value)}")
    settings = dict(value)
    return AutoConfig.for_model(settings.pop("model_type", default_model_type), **settings)


__all__ = ["AttnResConfig"]
