"""Model cards: the front matter parses as YAML and carries what the hub needs; the body has the
loading instructions, the conversion settings and the verification / held-out numbers."""

from __future__ import annotations

import json

import yaml
from tiny_models import tiny_model

from attnres_convert import convert
from attnres_convert.conversion.surgery import convert_model, summarize
from attnres_convert.io.card import baseline_card, card_identity, finetune_card, read_front_matter
from attnres_convert.modeling import SHIPPED_CODE


def _split(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    _, meta, body = card.split("---\n", 2)
    return yaml.safe_load(meta), body


def test_conversion_card(tmp_path):
    base = tmp_path / "base"
    tiny_model("llama").save_pretrained(base)
    (base / "README.md").write_text("---\nbase_model: acme/tiny-llama\nlicense: mit\n---\n# tiny\n")
    out = tmp_path / "out"
    convert(str(base), out, block_size=3, verify_tokens=32, verify_new_tokens=4)
    meta, body = _split((out / "README.md").read_text())
    assert meta["base_model"] == "acme/tiny-llama" and meta["license"] == "mit"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"attnres", "block-attnres"} <= set(meta["tags"])
    assert card_identity(out) == ("acme/tiny-llama", "mit")  # a fine-tune of this folder keeps them
    assert "trust_remote_code=True" in body
    assert 'revision="COMMIT", trust_remote_code=True' in body  # remote code pinned to the commit a reader read
    lines = sum(len((out / name).read_text().splitlines()) for name in SHIPPED_CODE)  # what the folder holds
    assert f"{len(SHIPPED_CODE)} files, `configuration_attnres.py` and `modeling_attnres.py`, {lines:,} lines" in body
    assert "vllm serve PATH_OR_REPO --trust-remote-code" in body  # docs/serving.md
    assert "benchmarks/vllm_serving.py --original BASE_FOLDER --converted THIS_FOLDER" in body
    assert "block size S = 3 sublayers, 2 blocks" in body
    assert "| sublayer 5 | y0, y1:3, y4 |" in body and "| output | y0, y1:3, y4:6 |" in body  # design table
    report = json.loads((out / "attnres_conversion.json").read_text())["verification"]
    assert f"| {report['max_abs_logit_diff']:.2e} | {report['kl']:.2e} | {report['top1_agreement']:.2%} |" in body


def test_finetune_card():
    summary = summarize(convert_model(tiny_model("llama"), block_size=2))
    recipe = {
        "train": {"steps": 200, "lr": 3e-4, "attnres_lr": 1e-2},
        "data": {"seq_len": 256, "train": {"files": ["shakespeare:*"]}},
    }
    history = [
        {"step": s, "loss": 3.0 - s / 400, **({"eval_loss": 3.1 - s / 500} if s % 50 == 0 else {})} for s in range(201)
    ]
    card = finetune_card(
        summary,
        name="SmolLM2-135M-Instruct",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="apache-2.0",
        recipe=recipe,
        metrics={
            "original": {"loss": 3.2809, "perplexity": 26.6},
            "fine-tuned": {"loss": 2.9571, "perplexity": 19.246},
        },
        eval_data="Hamlet and Macbeth",
        train_data="40 plays",
        history=history,
    )
    assert read_front_matter(card)  # what `attnres push` checks
    meta, body = _split(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["license"] == "apache-2.0"
    assert meta["base_model_relation"] == "finetune" and "fine-tuned" in meta["tags"]
    assert meta["model-index"][0]["name"] == "SmolLM2-135M-Instruct-attnres"
    results = meta["model-index"][0]["results"][0]
    assert results["dataset"]["name"] == "Hamlet and Macbeth"
    assert {m["type"]: m["value"] for m in results["metrics"]} == {"loss": 2.9571, "perplexity": 19.246}
    assert "| original | 3.281 | 26.6 |" in body and "| fine-tuned | 2.957 | 19.25 |" in body
    assert "![training and held-out loss](loss_curve.png)" in body and "| 200 | 2.5 | 2.7 |" in body
    recipe_yaml = body.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(recipe_yaml) == recipe
    assert "block size S = 2 sublayers, 3 blocks" in body and "trust_remote_code=True" in body


def test_cards_never_carry_a_token():
    summary = summarize(convert_model(tiny_model("llama")))
    card = finetune_card(
        summary,
        name="x",
        base_model=None,
        license=None,
        metrics={},
        loss_curve=None,
        recipe={"hub": {"token": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123"}},
    )
    assert "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123" not in card
    meta, _ = _split(card)
    assert meta["license"] == "other" and "base_model" not in meta and "model-index" not in meta


def test_baseline_card_is_a_plain_model_card():
    card = baseline_card(
        name="SmolLM2-135M-Instruct",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="apache-2.0",
        recipe={"model": {"convert": False}},
        metrics={"before": {"loss": 3.28, "perplexity": 26.6}, "fine-tuned": {"loss": 3.01, "perplexity": 20.3}},
        loss_curve=None,
    )
    meta, body = _split(card)
    assert "attnres" not in meta["tags"] and "attnres-baseline" in meta["tags"]
    assert meta["model-index"][0]["results"][0]["metrics"][1] == {
        "type": "perplexity",
        "value": 20.3,
        "name": "held-out perplexity",
    }
    assert "trust_remote_code" not in body and "| fine-tuned | 3.01 | 20.3 |" in body
