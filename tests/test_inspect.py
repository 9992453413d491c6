"""`attnres inspect`: depth-attention weights (staircase of sources, rows sum to 1, uniform at zero
queries), original-vs-converted profiles (the "original" really is the base model: its stream and
gradients match the plain model's), and the PNGs it writes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from matplotlib.image import imread
from tiny_models import randomize_queries, tiny_model, token_ids
from typer.testing import CliRunner

from attnres_convert import convert_model, save_converted
from attnres_convert.analysis.inspection import depth_weights, inspect_model, original_behaviour, sublayer_profile
from attnres_convert.analysis.plots import depth_heatmaps, loss_curve_plot, magnitude_profiles
from attnres_convert.block_sizes import source_ranges
from attnres_convert.cli import app
from attnres_convert.modeling.modeling_attnres import AttnResQuery

runner = CliRunner()


def test_depth_weights_follow_the_block_structure():
    model = randomize_queries(convert_model(tiny_model("llama", num_hidden_layers=4), block_size=3), 0.3, seed=0)
    depth = depth_weights(model, token_ids(2, 16))
    total = 8
    assert depth.matrix.shape == (total + 1, 1 + 3)  # embedding + ceil(8 / 3) blocks
    assert (
        depth.readers[0] == "layer 0 attention" and depth.readers[1] == "layer 0 mlp" and depth.readers[-1] == "output"
    )
    for row, sources in zip(depth.matrix, source_ranges(total, 3)):
        read = ~np.isnan(row)
        assert read.sum() == len(sources)
        assert np.isclose(row[read].sum(), 1.0, atol=1e-5)
        # each source sits in its block's column: the embedding in 0, outputs a..b in block (a - 1) // S + 1
        assert sorted(np.flatnonzero(read)) == sorted(0 if a == 0 else (a - 1) // 3 + 1 for a, _ in sources)
    assert not np.allclose(depth.matrix[-1][~np.isnan(depth.matrix[-1])], 0.25)  # learned, not uniform


def test_zero_queries_read_uniformly_and_parallel_layers_are_one_sublayer():
    model = convert_model(tiny_model("gpt_neox_parallel"), block_size=1)
    inspection = inspect_model(model, token_ids(1, 12), profiles=False)
    assert inspection.queries_zero and "uniformly" in inspection.notes[0]
    assert inspection.kinds == ["attention+mlp"] * 3
    for row in inspection.depth.matrix:
        read = row[~np.isnan(row)]
        assert np.allclose(read, 1.0 / len(read))


def test_original_profile_is_the_base_model():
    """With learned queries the converted model differs; zeroing them gives back the base model exactly:
    the stream each attention sublayer reads is the base model's hidden state, and the gradients of each
    sublayer's parameters are the base model's."""
    base = tiny_model("llama")
    ids = token_ids(1, 20)
    model = randomize_queries(convert_model(copy.deepcopy(base), block_size=2), 0.3, seed=0)
    before = [m.weight.clone() for m in model.modules() if isinstance(m, AttnResQuery)]
    with original_behaviour(model):
        original = sublayer_profile(model, ids)
    after = [m.weight for m in model.modules() if isinstance(m, AttnResQuery)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the learned queries are back
    converted = sublayer_profile(model, ids)
    assert not np.allclose(original.stream_rms, converted.stream_rms)

    out = base(ids, labels=ids, output_hidden_states=True)
    out.loss.backward()
    hidden_rms = [h.pow(2).mean(-1).sqrt().mean().item() for h in out.hidden_states[:3]]
    np.testing.assert_allclose(original.stream_rms[0::2], hidden_rms, rtol=1e-4)
    np.testing.assert_allclose(original.loss, out.loss.item(), rtol=1e-5)
    for layer_index, layer in enumerate(base.model.layers):
        attention = [p.grad for m in (layer.input_layernorm, layer.self_attn) for p in m.parameters()]
        mlp = [p.grad for m in (layer.post_attention_layernorm, layer.mlp) for p in m.parameters()]
        for params, index in ((attention, 2 * layer_index), (mlp, 2 * layer_index + 1)):
            norm = sum(float(g.pow(2).sum()) for g in params) ** 0.5
            assert np.isclose(original.grad_norm[index], norm, rtol=1e-4), (index, original.grad_norm[index], norm)
    assert all(p.grad is None for p in model.parameters())  # the inspection leaves no gradients behind


def test_plots_are_written_and_readable(tmp_path):
    model = randomize_queries(convert_model(tiny_model("llama", num_hidden_layers=4), block_size=2), 0.3, seed=0)
    inspection = inspect_model(model, token_ids(1, 16), "tiny")
    heatmap = depth_heatmaps(inspection.depth, tmp_path / "depth.png", "tiny")
    relative = depth_heatmaps(inspection.depth, tmp_path / "relative.png", "tiny", relative=True)
    profile = magnitude_profiles(inspection.original, inspection.converted, inspection.kinds, tmp_path / "mag.png")
    curve = loss_curve_plot(
        [{"step": s, "loss": 3 - s / 100, **({"eval_loss": 3.1 - s / 120} if s % 10 == 0 else {})} for s in range(51)],
        tmp_path / "sub" / "loss.png",
    )
    for path in (heatmap, relative, profile, curve):
        image = imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # not a blank canvas


def test_cli_inspect_converted_folder(tmp_path):
    folder = tmp_path / "converted"
    save_converted(randomize_queries(convert_model(tiny_model("qwen3"), block_size=2), 0.3, seed=0), folder)
    text = tmp_path / "sample.txt"
    text.write_text("unused without a tokenizer, but it must exist")
    result = runner.invoke(
        app, ["inspect", str(folder), "--plot", str(tmp_path / "out.png"), "--text", str(text), "--max-tokens", "24"]
    )
    assert result.exit_code == 0, result.output
    for expected in ("qwen3", "block size S", "parameters added", "L2 mlp", "output", "pseudo-random"):
        assert expected in result.output
    for name in ("out.png", "out-relative.png", "out-magnitudes.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name
        assert f"Wrote{tmp_path / name}" in "".join(result.output.split())  # Rich may wrap a long path


def test_cli_inspect_plain_model_converts_in_memory(tmp_path):
    folder = tmp_path / "plain"
    tiny_model("gemma2").save_pretrained(folder)
    result = runner.invoke(app, ["inspect", str(folder)])
    assert result.exit_code == 0, result.output
    assert "converted in memory" in " ".join(result.output.split())
    assert not list(tmp_path.glob("*.png"))  # no --plot, no files


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--text", "missing.txt"], "no such file"),
        (["--max-tokens", "1"], "'--max-tokens': Input should be greater than or equal to 2"),
    ],
)
def test_cli_inspect_bad_input(tmp_path, args, needle):
    folder = tmp_path / "plain"
    tiny_model("llama").save_pretrained(folder)
    result = runner.invoke(app, ["inspect", str(folder), *args])
    assert result.exit_code == 2 and needle in " ".join(result.output.split()), result.output
