"""A model with its own code whose class names no LM head (no `get_output_embeddings`, a head not called
`lm_head`), keeps its stack under its own names and its layer count under its own config key: discovery finds
the head from the modules (the one Linear from the hidden size to the vocabulary) and the stack from the
module tree, and the conversion is exact (logits, greedy generation with the cache). Where the modules do not
tell (two heads to the vocabulary, nested in a module of their own), the head is the one whose output the model
returns as its logits."""

import pytest
import torch
from remote_code_model.configuration_tiny_prenorm import TinyPreNormConfig
from remote_code_model.modeling_tiny_prenorm import TinyPreNormModel
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from attnres_convert.conversion.surgery import convert_model


class OwnNamesForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TinyPreNormConfig
    base_model_prefix = ""  # no prefix either: the base model is the one child besides the head

    def __init__(self, config):
        super().__init__(config)
        self.backbone = TinyPreNormModel(config)
        self.to_logits = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.embed

    def get_output_embeddings(self):
        return None

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        past_key_values = cache if cache is not None else past_key_values
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        logits = self.to_logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values)


class TwoHeadsForCausalLM(OwnNamesForCausalLM):
    """A next-token head and a draft head (multi-token prediction), both Linears to the vocabulary, in one
    ModuleDict: only the next-token head makes the logits."""

    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.backbone = TinyPreNormModel(config)
        self.heads = nn.ModuleDict(
            {
                "draft": nn.Linear(config.hidden_size, config.vocab_size, bias=False),
                "next": nn.Linear(config.hidden_size, config.vocab_size, bias=False),
            }
        )
        self.post_init()

    @property
    def to_logits(self):
        return self.heads["next"]


def _model(cls=OwnNamesForCausalLM):
    config = TinyPreNormConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64
    )
    config.n_blocks = config.num_hidden_layers  # its own key as well
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape) * 0.1)
    return model


def test_head_and_stack_are_found_without_get_output_embeddings():
    original = _model()
    assert original.get_output_embeddings() is None
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = original(ids).logits
    tokens = original.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
    )

    converted = convert_model(_model(), block_size=2).eval()
    plan = converted._attnres_plan
    assert (plan.base_model, plan.layers, plan.lm_head, plan.final_norm) == (
        "backbone",
        "blocks",
        "to_logits",
        "final_norm",
    )
    with torch.no_grad():
        assert (converted(ids).logits - logits).abs().max().item() <= 1e-4
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(converted.generate(ids, **kwargs), tokens)
    assert torch.equal(converted.generate(ids, use_cache=False, **kwargs), tokens)


def test_head_is_found_from_the_logits_where_the_modules_do_not_tell():
    original = _model(TwoHeadsForCausalLM)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        logits = original(ids).logits
    tokens = original.generate(ids, **kwargs)

    converted = convert_model(_model(TwoHeadsForCausalLM), block_size=2).eval()
    plan = converted._attnres_plan
    assert (plan.base_model, plan.lm_head) == ("backbone", "heads.next")
    assert converted.get_output_embeddings() is converted.heads["next"]
    with torch.no_grad():
        assert (converted(ids).logits - logits).abs().max().item() <= 1e-4
    assert torch.equal(converted.generate(ids, **kwargs), tokens)


def test_no_head_that_makes_the_logits_is_refused_with_the_reason():
    from attnres_convert.architectures import UnsupportedModelError

    class ScaledByHand(TwoHeadsForCausalLM):  # logits from both heads summed: neither one's output is the logits
        def forward(self, input_ids=None, **kwargs):
            out = self.backbone(input_ids=input_ids)
            hidden = out.last_hidden_state
            return CausalLMOutputWithPast(logits=self.heads["next"](hidden) + self.heads["draft"](hidden))

    with pytest.raises(
        UnsupportedModelError,
        match="names no LM head: get_output_embeddings returns none and not exactly one .* no single one of its Linear modules outputs the model.s logits",
    ):
        convert_model(_model(ScaledByHand), block_size=2)


def test_head_is_found_from_the_logits_where_the_config_names_no_vocabulary():
    """A config that names its vocabulary its own way (no `vocab_size`): the head is still the Linear whose output
    is the logits, whatever the config says."""
    original = _model(TwoHeadsForCausalLM)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = original(ids).logits
    model = _model(TwoHeadsForCausalLM)
    model.config.n_vocab = model.config.vocab_size
    del model.config.vocab_size
    assert not hasattr(model.config, "vocab_size")
    converted = convert_model(model, block_size=2).eval()
    assert converted._attnres_plan.lm_head == "heads.next"
    with torch.no_grad():
        assert (converted(ids).logits - logits).abs().max().item() <= 1e-4
