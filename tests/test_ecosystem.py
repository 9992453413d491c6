"""A converted model works with the tools users already have: transformers pipelines, generate (greedy,
seeded sampling, beams, token budgets), PEFT (LoRA trains, the adapter saves and reloads) and `.to()`
across dtypes and devices. Tiny random models; the pipeline uses the real SmolLM2 tokenizer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny_models import save_plain_and_converted, tiny_model, token_ids
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from attnres_convert import convert_model, load_converted, save_converted

PROMPT = "To be, or not to be, that is the question:"


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder):
    return AutoTokenizer.from_pretrained(smollm2_folder)


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory):
    """A tiny Llama with SmolLM2's vocabulary, saved plain and converted, each with the tokenizer."""
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    base = tiny_model("llama", vocab_size=len(tokenizer), tie_word_embeddings=True, **ids)
    return save_plain_and_converted(base, tokenizer, tmp_path_factory.mktemp("ecosystem"), block_size=2)


def test_text_generation_pipeline(folders):
    plain, converted = folders
    generator = pipeline("text-generation", model=str(converted), trust_remote_code=True)
    assert type(generator.model).__name__ == "AttnResForCausalLM"
    out = generator(PROMPT, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    reference = pipeline("text-generation", model=str(plain))(PROMPT, max_new_tokens=12, do_sample=False)[0][
        "generated_text"
    ]
    assert out.startswith(PROMPT) and len(out) > len(PROMPT)
    assert out == reference  # the converted model is the original until trained
    if generator.tokenizer.pad_token_id is None:  # transformers 5.16.1 reads no pad token from the GGUF's tokenizer
        generator.tokenizer.pad_token_id = generator.model.config.get_text_config().eos_token_id  # as it advises
    batch = generator([PROMPT, "Now is the winter"], max_new_tokens=5, do_sample=False, batch_size=2)
    assert [len(item) for item in batch] == [1, 1]


@pytest.fixture(scope="module")
def pair():
    base = tiny_model("qwen3")
    return base, convert_model(copy.deepcopy(base), block_size=3).eval()


def test_generate_sampling_beams_and_budget(pair):
    base, model = pair
    prompt = token_ids(2, 10, seed=4)
    mask = torch.ones_like(prompt)
    sample = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=16, pad_token_id=0)

    def sampled(m, seed):
        torch.manual_seed(seed)
        return m.generate(prompt, attention_mask=mask, **sample)

    first, again, other = sampled(model, 7), sampled(model, 7), sampled(model, 8)
    assert torch.equal(first, again) and not torch.equal(first, other)  # seeded sampling is reproducible
    assert torch.equal(first, sampled(base, 7))  # and draws what the original draws
    beams = dict(num_beams=3, num_return_sequences=2, do_sample=False, max_new_tokens=8, pad_token_id=0)
    out = model.generate(prompt, attention_mask=mask, **beams)
    assert out.shape == (4, 18)
    assert torch.equal(out, base.generate(prompt, attention_mask=mask, **beams))
    for budget in (1, 5):
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=budget, do_sample=False, pad_token_id=0)
        assert out.shape[1] - prompt.shape[1] <= budget and out.shape[1] > prompt.shape[1]


def _assert_sane(logits, reference):
    """Close to the float32 reference as a distribution: finite, same top-1 almost everywhere, small KL."""
    assert torch.isfinite(logits).all()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(reference, -1), log_target=True, reduction="batchmean")
    assert kl < 0.05, kl


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def test_dtype_and_device_moves(pair, tmp_path):
    base, model = pair
    ids = token_ids(1, 16)
    reference = _logits(model, ids)
    moved = copy.deepcopy(model).to(torch.bfloat16)
    assert {p.dtype for p in moved.parameters()} == {torch.bfloat16}
    _assert_sane(_logits(moved, ids), reference)
    assert moved.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0).shape == (1, 20)
    back = moved.to(torch.float32)  # float32 again, with the bf16-rounded weights
    assert {p.dtype for p in back.parameters()} == {torch.float32}
    _assert_sane(_logits(back, ids), reference)

    # meta and back: no state hides outside parameters and buffers (non-persistent buffers such as rotary
    # frequencies are not in a state dict, for any HF model: they are copied by name).
    state = copy.deepcopy(model.state_dict())
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    empty = copy.deepcopy(model).to("meta")
    assert all(p.is_meta for p in empty.parameters())
    empty = empty.to_empty(device="cpu")
    empty.load_state_dict(state)
    for name, value in buffers.items():
        empty.get_buffer(name).copy_(value)
    assert torch.equal(_logits(empty, ids), reference)

    # loading straight into bfloat16 from a saved folder works as well
    save_converted(model, tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16 and torch.isfinite(_logits(loaded, ids)).all()


def test_peft_lora_trains_saves_and_reloads(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    base_folder = tmp_path / "attnres"
    save_converted(convert_model(tiny_model("llama"), block_size=2), base_folder)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        # the depth-attention queries of the decoder layers train with the adapter and are saved with it
        modules_to_save=["self_attention_res_proj", "mlp_res_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(load_converted(base_folder), config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("mlp_res_proj" in n for n in trainable)
    assert not any(n.endswith("q_proj.base_layer.weight") for n in trainable)
    ids = token_ids(4, 24, seed=3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    queries = [p for n, p in model.named_parameters() if "mlp_res_proj.modules_to_save" in n]
    assert any(q.abs().sum() > 0 for q in queries)  # the depth routing learned something

    model.eval()
    expected = _logits(model, ids)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_converted(base_folder), tmp_path / "adapter").eval()
    assert torch.allclose(_logits(reloaded, ids), expected, atol=1e-5)
    merged = reloaded.merge_and_unload()
    assert torch.allclose(_logits(merged, ids), expected, atol=1e-4)


def test_peft_modules_to_save_reaches_the_output_aggregation():
    from peft import LoraConfig, get_peft_model

    saved = ["output_attn_res_proj", "mlp_res_proj"]
    model = get_peft_model(
        convert_model(tiny_model("llama"), block_size=2),
        LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=saved, task_type="CAUSAL_LM"),
    )
    ids = token_ids(2, 12)
    model(input_ids=ids, labels=ids).loss.backward()
    for name in saved:
        copies = [p for n, p in model.named_parameters() if f"{name}.modules_to_save" in n]
        assert copies and all(p.grad is not None and p.grad.abs().sum() > 0 for p in copies), name
