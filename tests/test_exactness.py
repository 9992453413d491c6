"""Conversion reproduces the original model: logits, cached greedy generation, padding (tiny random
configs of the table's families and of families only discovery finds, fp32)."""

import copy

import pytest
import torch
from tiny_models import CONFIGS, tiny_model, token_ids

from attnres_convert.conversion.surgery import convert_model, resolve_block_size, structure_of_model

FAMILIES = sorted(CONFIGS)


def block_sizes(model) -> list[int]:
    """S = 1, an odd S, the default S and S = L (deduplicated)."""
    structure = structure_of_model(model)
    total = structure.num_sublayers
    return sorted({1, 3 if total >= 3 else 1, resolve_block_size(structure), total})


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_at_every_block_size(family):
    base = tiny_model(family)
    ids = token_ids()
    with torch.no_grad():
        reference = base(ids).logits
    for size in block_sizes(base):
        converted = convert_model(copy.deepcopy(base), block_size=size).eval()
        with torch.no_grad():
            logits = converted(ids).logits
        delta = (logits - reference).abs().max().item()
        assert delta <= 1e-4, f"{family} S={size}: max |delta logit| {delta:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_cache_is_identical(family):
    base = tiny_model(family)
    prompt = token_ids(batch=1, length=12, seed=1)
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = base.generate(prompt, **kwargs)
    converted = convert_model(copy.deepcopy(base)).eval()
    cached = converted.generate(prompt, use_cache=True, **kwargs)
    uncached = converted.generate(prompt, use_cache=False, **kwargs)
    assert cached.tolist() == expected.tolist()
    assert uncached.tolist() == cached.tolist()


# Recurrent models whose own forward ignores the attention mask: their recurrence reads the pad tokens, so a padded
# sequence is not the sequence alone in the original either (and RWKV decodes a batch wrongly itself, see
# tests/test_hybrids.py). The converted model is held to the original's own padded logits instead.
MASK_IGNORED = {"rwkv", "xlstm"}


@pytest.mark.parametrize("family", sorted(MASK_IGNORED))
def test_left_padded_batch_of_a_model_that_ignores_the_mask_is_the_originals(family):
    batch = torch.cat([torch.zeros(1, 5, dtype=torch.long), token_ids(1, 7, seed=2)], dim=1)
    with torch.no_grad():
        want = tiny_model(family)(batch, attention_mask=(batch != 0).long()).logits
        got = convert_model(tiny_model(family), block_size=3).eval()(batch, attention_mask=(batch != 0).long()).logits
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - MASK_IGNORED))
def test_left_padded_batch_equals_each_sample_alone(family):
    model = convert_model(tiny_model(family), block_size=3).eval()
    short, long = token_ids(1, 7, seed=2), token_ids(1, 12, seed=3)
    batch = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    batch[0, 5:], mask[0, 5:] = short[0], 1
    batch[1], mask[1] = long[0], 1
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    together = model.generate(batch, attention_mask=mask, **kwargs)
    alone_short = model.generate(short, **kwargs)
    alone_long = model.generate(long, **kwargs)
    assert together[0, 5:].tolist() == alone_short[0].tolist()
    assert together[1].tolist() == alone_long[0].tolist()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() does; GPT-2 needs it for learned positions
    with torch.no_grad():
        padded_logits = model(batch, attention_mask=mask, position_ids=positions).logits[0, 5:]
        alone_logits = model(short).logits[0]
    assert (padded_logits - alone_logits).abs().max().item() <= 1e-4
