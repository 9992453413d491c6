"""An image-text model (Gemma 3: SigLIP tower, projector, Gemma 3 language model; Gemma 4, whose language model's
per-layer-input gate reads the raw stream) converted in place: only the
language model's decoder layers get AttnRes parameters, the vision tower and projector keep their weights, and
a forward on image + text gives the original's logits, and `generate` on image + text gives the original's
greedy tokens and step scores (the base class prepares the inputs: pixels in the prefill only, Gemma 3's
bidirectional mask over each image). `attnres convert` on a saved image-text folder copies its processor files,
and the output loads with the processor and generates exactly."""

import torch

from attnres_convert.architectures import describe
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
    tower = {
        name: p.clone() for name, p in original.named_parameters() if "vision_tower" in name or "projector" in name
    }

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


def _tiny_gemma3_processor(config):
    """A Gemma 3 processor built locally (no hub): a word-level tokenizer whose image tokens have the tiny
    config's ids, and the Gemma 3 image processor at the tiny tower's image size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ImageProcessor, Gemma3Processor, PreTrainedTokenizerFast

    words = {w: 4 + i for i, w in enumerate("a b c d e f g h".split())}
    vocab = {
        "<pad>": 0,
        "<eos>": 1,
        "<bos>": 2,
        "<unk>": 3,
        **words,
        "<start_of_image>": config.boi_token_id,
        "<end_of_image>": config.eoi_token_id,
        "<image_soft_token>": config.image_token_id,
    }
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    size = config.vision_config.image_size
    image_processor = Gemma3ImageProcessor(size={"height": size, "width": size})
    return Gemma3Processor(image_processor, tokenizer, image_seq_length=config.mm_tokens_per_image)


def test_convert_an_image_text_folder_loads_with_its_processor_and_generates_exactly(tmp_path):
    """`attnres convert` on a saved Gemma 3 image-text folder with its processor: the output folder holds the
    processor's files unchanged, `AutoProcessor` builds the processor from it, and the converted model, loaded
    with `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`, generates from image + text what
    the original generates (tokens, and step logits within 1e-4); the card says that only the language model
    changed."""
    import numpy as np
    from PIL import Image
    from transformers import AutoModelForCausalLM, AutoProcessor

    from attnres_convert import convert

    image_tokens = {"boi_token_id": 250, "eoi_token_id": 251, "image_token_id": 252}  # inside the tiny vocabulary
    original = _build("gemma3", image_tokens).eval()
    processor = _tiny_gemma3_processor(original.config)
    source, out = tmp_path / "gemma3", tmp_path / "gemma3-attnres"
    original.save_pretrained(source)
    processor.save_pretrained(source)
    processor_names = [
        name for name in ("preprocessor_config.json", "processor_config.json") if (source / name).is_file()
    ]
    assert processor_names

    convert(str(source), out, dtype="float32")

    for name in processor_names:
        assert (out / name).read_bytes() == (source / name).read_bytes()
    card = (out / "README.md").read_text()
    assert "Only the language model changed" in card and "language_model.layers" in card
    size = original.config.vision_config.image_size
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8))
    text = "a b <start_of_image> c d"
    options = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = original.generate(**processor(images=image, text=text, return_tensors="pt"), **options)
    loaded_processor = AutoProcessor.from_pretrained(out)
    inputs = loaded_processor(images=image, text=text, return_tensors="pt")
    assert "pixel_values" in inputs and int((inputs["input_ids"] == original.config.image_token_id).sum()) == 4
    converted = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(converted).__name__ == "AttnResForCausalLM"
    got = converted.generate(**inputs, **options)
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.logits, want.logits, strict=True):
        assert (step_got - step_want).abs().max().item() <= 1e-4


def _tiny_gemma4_image_text():
    """A tiny Gemma 4 image-text model (its default config has no vision tower: one is given here), with its
    language model's per-layer inputs and layer scalars, and an image of 4 x 4 patches pooled into 4 soft tokens."""
    import transformers as T

    from attnres_convert.conversion.tiny_configs import tiny_config

    vision = T.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    text = tiny_config("gemma4_text")
    assert text.hidden_size_per_layer_input  # the gate that reads the raw stream is there
    config = T.Gemma4Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=250,
        boi_token_id=251,
        eoi_token_id=252,
    )
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        for layer, scalar in zip(model.model.language_model.layers, (0.5, 2.0)):  # as checkpoints set them
            layer.layer_scalar.fill_(scalar)
    side, patch = 4, 4
    pixels = torch.rand(1, side * side, 3 * patch * patch, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[[x, y] for y in range(side) for x in range(side)]])
    ids = torch.tensor([[2, 7, 8, 251] + [250] * 4 + [252, 9, 10, 11]])
    return model, ids, {"pixel_values": pixels, "image_position_ids": positions}


def test_gemma4_image_text_converts_exactly_with_its_raw_stream_gate():
    import copy

    original, ids, image = _tiny_gemma4_image_text()
    assert type(original).__name__ == "Gemma4ForConditionalGeneration"
    tower = {name: p.clone() for name, p in original.named_parameters() if "vision" in name}
    options = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = original(ids, **image).logits
    want_generated = original.generate(input_ids=ids, **image, **options)

    converted = convert_model(copy.deepcopy(original), block_size=3).eval()
    plan = converted._attnres_plan
    assert plan.layers == "language_model.layers" and plan.layer_scalars == (0.5, 2.0)
    gate = plan.sublayers(0)[-1]
    assert describe(gate) == (
        "stream -> per_layer_input_gate -> act_fn -> * per_layer_input -> per_layer_projection "
        "-> post_per_layer_input_norm"
    )
    params = dict(converted.named_parameters())
    assert tower and all(torch.equal(params[name], value) for name, value in tower.items())
    with torch.no_grad():
        got = converted(ids, **image).logits
        other = converted(
            ids, pixel_values=image["pixel_values"].flip(-1), image_position_ids=image["image_position_ids"]
        ).logits
    assert (got - want).abs().max().item() <= 1e-4
    assert (other - got).abs().max().item() > 1e-3  # the image reaches the language model
    generated = converted.generate(input_ids=ids, **image, **options)
    assert torch.equal(generated.sequences, want_generated.sequences)
    for step_got, step_want in zip(generated.logits, want_generated.logits, strict=True):
        assert (step_got - step_want).abs().max().item() <= 1e-4
