"""The coverage walk: every causal-LM model type of transformers, built tiny, converted and checked (logits
within 1e-4, greedy generation with the KV cache identical, cached = uncached, left-padded batch within 1e-4), or
refused with a reason. Converted model types can only grow (tests/coverage_floor.json), and docs/architectures.md
shows the table this code produces."""

import json
from pathlib import Path

import pytest
import transformers

from attnres_convert.conversion import coverage

ROOT = Path(__file__).resolve().parents[1]
FLOOR = json.loads((ROOT / "tests" / "coverage_floor.json").read_text())
DOC = ROOT / "docs" / "architectures.md"
pytestmark = pytest.mark.slow  # the walk builds and converts every causal-LM model type of transformers


@pytest.fixture(scope="module")
def report():
    return coverage.walk()


def test_converted_model_types_never_go_down(report):
    converted = set(report.converted_types())
    lost = sorted(set(FLOOR["converted"]) - converted)
    details = {row.label: row.detail for row in report.rows if row.model_type in lost}
    assert not lost, f"no longer converted exactly: {details}"
    assert len(converted) >= max(60, len(FLOOR["converted"]))
    variants = {row.label for row in report.rows if row.variant and row.status == "converted"}
    assert set(FLOOR["converted_variants"]) <= variants, sorted(set(FLOOR["converted_variants"]) - variants)


def test_refusals_say_why(report):
    for row in report.rows:
        if row.status == "refused":
            assert len(row.detail) > 30, row
    by_label = {row.label: row for row in report.rows}
    assert "post-norm" in by_label["olmo2"].detail
    assert "encoder-decoder" in by_label["bart"].detail
    assert "encoder" in by_label["bert"].detail
    assert "concatenated with the input embeddings" in by_label["zamba"].detail
    assert "re-normalised at every sublayer" in by_label["minimax"].detail
    assert "do_layer_norm_before=False" in by_label["opt (post-norm (do_layer_norm_before=False))"].detail


def test_docs_table_is_the_walk(report):
    document = DOC.read_text()
    if report.transformers_version not in (coverage.table_in(document) or ""):
        pytest.skip(
            f"docs/architectures.md was generated with another transformers than {transformers.__version__}; "
            "regenerate it with `attnres architectures --write docs/architectures.md`"
        )
    assert coverage.table_in(document) == coverage.markdown(report), (
        "docs/architectures.md is stale: run `attnres architectures --write docs/architectures.md`"
    )
