"""A config that names its sizes its own way (d_model, n_vocab, n_layer), as many repositories with their own code
do: no `hidden_size`, `vocab_size` or `num_hidden_layers` for a tool to read."""

from transformers import PretrainedConfig


class OwnNamesConfig(PretrainedConfig):
    model_type = "own_names_lm"

    def __init__(self, n_vocab=112, d_model=48, n_layer=3, n_head=4, d_ff=96, ln_eps=1e-5, n_ctx=512, **kwargs):
        self.n_vocab = n_vocab
        self.d_model = d_model
        self.n_layer = n_layer
        self.n_head = n_head
        self.d_ff = d_ff
        self.ln_eps = ln_eps
        self.n_ctx = n_ctx
        super().__init__(**kwargs)
