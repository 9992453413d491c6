"""An image-text model (Gemma 3: SigLIP tower, projector, Gemma 3 language model) converted in place: only the
language model's decoder layers get AttnRes parameters, the vision tower and projector keep their weights, and
a forward on image + text gives the original's logits, and `generate` on image + text gives the original's
greedy tokens and step scores (the base class prepares the inputs: pixels in the prefill only, Gemma 3's
bidirectional mask over each image)."""

import torch

from attnres_convert.conversion.coverage import _build
from attnres_convert.conversion.surgery import convert_model


def test_gemma3_image_text_logits_are_exact_and_the_tower_is_untouched():
    original = _build("gemma3", {})
    config = original.config
    ids = torch.tensor([[1, 7, 8] + [config.image_token_id] * config.mm_tokens_per_image + [9, 10, 11]])
    size = config.vision_config.image_size
    pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = original(ids, pixel_values=pixels).logits
    tower = {name: p.clone() for name, p in original.named_parameters() if "vision_tower" in name or "projector" in name}

    converted = convert_model(_build("gemma3", {}), block_size=3).eval()
    assert converted._attnres_plan.layers == "language_model.layers"
    new = [name for name, _ in converted.named_parameters() if "_res_" in name]
    assert new and all("language_model" in name or name.startswith("model.output_attn_res") for name in new), new
    params = dict(converted.named_parameters())
    assert tower and all(torch.equal(params[name], value) for name, value in tower.items())
    with torch.no_grad():
        got = converted(ids, pixel_values=pixels).logits
    assert (got - want).abs().max().item() <= 1e-4
    with torch.no_grad():  # the image matters: another image gives other logits
        other = converted(ids, pixel_values=pixels.flip(-1)).logits
    assert (other - got).abs().max().item() > 1e-3


def test_gemma3_generate_on_image_and_text_matches_the_original():
    original = _build("gemma3", {}).eval()
    config = original.config
    ids = torch.tensor([[1, 7, 8] + [config.image_token_id] * config.mm_tokens_per_image + [9, 10, 11]])
    size = config.vision_config.image_size
    pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = original.generate(input_ids=ids, pixel_values=pixels, **options)
    converted = convert_model(_build("gemma3", {}), block_size=3).eval()
    got = converted.generate(input_ids=ids, pixel_values=pixels, **options)
    assert torch.equal(got.sequences, want.sequences)
    assert got.sequences.shape[1] == ids.shape[1] + 5
    for step_got, step_want in zip(got.logits, want.logits, strict=True):
        assert (step_got - step_want).abs().max().item() <= 1e-4
    other = converted.generate(input_ids=ids, pixel_values=pixels.flip(-1), **options)
    assert (other.logits[0] - got.logits[0]).abs().max().item() > 1e-3  # the pixels reach the prefill
