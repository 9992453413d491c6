"""A config that names its sizes its own way (`width`, `depth`, `vocab`, `heads`, `context`: no hidden_size,
num_hidden_layers or vocab_size), as many repositories with their own code do. `post_norm` makes the blocks
post-norm (a model AttnRes cannot convert)."""

from transformers import PretrainedConfig


class TinyTrunkConfig(PretrainedConfig):
    model_type = "tiny_trunk"

    def __init__(self, vocab=96, width=48, depth=3, heads=4, context=64, post_norm=False, **kwargs):
        self.vocab = vocab
        self.width = width
        self.depth = depth
        self.heads = heads
        self.context = context
        self.post_norm = post_norm
        super().__init__(**kwargs)
