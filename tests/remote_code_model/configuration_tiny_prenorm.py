"""A model type transformers does not ship: the fixture for converting a model with its own code (auto_map)."""

from transformers import PretrainedConfig


class TinyPreNormConfig(PretrainedConfig):
    model_type = "tiny_prenorm"

    def __init__(
        self,
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        norm_eps=1e-5,
        max_positions=1024,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.norm_eps = norm_eps
        self.max_positions = max_positions
        super().__init__(**kwargs)
