"""The coverage walk: every causal-LM model type of transformers, built tiny, converted and checked (logits
within 1e-4, greedy generation with the KV cache identical, cached = uncached, left-padded batch within 1e-4), or
refused with a reason. Converted model types can only grow (tests/coverage_floor.json), on whatever transformers is
installed; docs/architectures.md shows the table this code produces with the locked transformers (constraints.txt)."""

import json
from pathlib import Path

import pytest
import transformers

from attnres_convert.conversion import coverage

ROOT = Path(__file__).resolve().parents[1]
FLOOR = json.loads((ROOT / "tests" / "coverage_floor.json").read_text())
DOC = ROOT / "docs" / "architectures.md"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
]  # the walk builds and converts every causal-LM model type of transformers


@pytest.fixture(scope="module")
def report():
    return coverage.walk()


def floor_for(installed_types: set[str]) -> tuple[set[str], set[str]]:
    """The floor's model types and variant labels that the installed transformers has: a type an older release
    lacks (or a newer one dropped) is not counted against it; every other one must still convert."""
    types = set(FLOOR["converted"]) & installed_types
    variants = {label for label in FLOOR["converted_variants"] if label.split(" (")[0] in installed_types}
    return types, variants


def test_floor_counts_only_the_installed_model_types():
    variant_type = FLOOR["converted_variants"][0].split(" (")[0]
    types, variants = floor_for({"llama", variant_type, "no_such_type"})
    assert types == {"llama", variant_type}
    assert variants == {label for label in FLOOR["converted_variants"] if label.startswith(variant_type + " (")}
    assert floor_for({"no_such_type"}) == (set(), set())
    assert floor_for(set(coverage.causal_lm_model_types()))[0] <= set(FLOOR["converted"])


def test_converted_model_types_never_go_down(report):
    installed = set(coverage.causal_lm_model_types())
    expected_types, expected_variants = floor_for(installed)
    converted = set(report.converted_types())
    lost = sorted(expected_types - converted)
    details = {row.label: row.detail for row in report.rows if row.model_type in lost}
    assert not lost, f"no longer converted exactly on transformers {transformers.__version__}: {details}"
    assert len(converted) >= max(60, len(expected_types))
    variants = {row.label for row in report.rows if row.variant and row.status == "converted"}
    assert expected_variants <= variants, sorted(expected_variants - variants)


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


# Model types whose refusal is a limit of AttnRes itself, by the mechanism that makes them so: the only refusals.
DESIGN_REFUSALS = (
    "encoder",
    "post-norm",
    "hyper-connections",
    "several residual streams",
    "not a sum of sublayer outputs",
    "not a causal LM on its own",
    "its own attention residuals",
    "not one decoder stack",
    "not a PreNorm sublayer",
    "reversible",
    "a delayed add has no equivalent",
    "not one step of one residual stream",
    "every reader of its stream is a scale-invariant norm",
)


@pytest.mark.locked_versions  # the counts are those of the locked transformers (constraints.txt)
def test_every_model_type_builds_and_every_refusal_is_a_design_refusal(report):
    types = [row for row in report.rows if not row.variant]
    assert not [row.label for row in types if row.status == "not built"]
    assert len(report.converted_types()) >= 130
    undesigned = {
        row.label: row.detail
        for row in report.rows
        if row.status == "refused" and not any(reason in row.detail for reason in DESIGN_REFUSALS)
    }
    assert not undesigned, undesigned


@pytest.mark.locked_versions  # `make test-latest` / `make test-lowest` deselect it: the table is the lock's
def test_docs_table_is_the_walk(report):
    document = DOC.read_text()
    assert f"transformers {report.transformers_version}:" in (coverage.table_in(document) or ""), (
        f"docs/architectures.md was not generated with the installed transformers {transformers.__version__}: "
        "install the locked versions (`make install`, constraints.txt), or, when the lock moved, regenerate it "
        "with `attnres architectures --write docs/architectures.md`"
    )
    assert coverage.table_in(document) == coverage.markdown(report), (
        "docs/architectures.md is stale: run `attnres architectures --write docs/architectures.md`"
    )


def test_the_summary_counts_model_types_and_variants_apart(monkeypatch):
    """`attnres architectures` ends with the README's numbers: model types (their default configs), then the
    config variants apart, never one sum of rows."""
    from typer.testing import CliRunner

    from attnres_convert import cli

    rows = [
        coverage.CoverageRow("llama", "", "converted", "x", 0.1),
        coverage.CoverageRow("olmo2", "", "refused", "y", 0.1),
        coverage.CoverageRow("gpt2", "", "converted", "z", 0.1),
        coverage.CoverageRow("llama", "tied head", "converted", "x", 0.1),
        coverage.CoverageRow("gemma3", "sliding", "refused", "y", 0.1),
    ]
    report = coverage.CoverageReport(rows, transformers.__version__)
    assert report.summary() == "3 model types: 2 converted, 1 refused, 0 not built; 2 config variants: 1 converted"
    monkeypatch.setattr(coverage, "walk", lambda *args, **kwargs: report)
    result = CliRunner().invoke(cli.app, ["architectures"])
    assert result.exit_code == 0, result.output
    assert " ".join(result.output.split()).endswith(report.summary()), result.output  # wherever Rich wrapped it
