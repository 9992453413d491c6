"""`attnres bench` (analysis/bench.py): a tiny model converted and measured against its original, the JSON
written and read back (both numbers and their ratio in every row, consistent with each other), the Markdown
the docs are made from, and bad input refused before anything is measured or written. Never asserts on
seconds: they are whatever this machine gives."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
import torch
from reliability_helpers import assert_user_error, run_cli, save_config_only
from tiny_models import olmo2_config

from attnres_convert.analysis.bench import BenchError, BenchSettings, check_settings, run_bench, runs_total
from attnres_convert.analysis.bench_report import markdown, read_json

TINY = ["--batch", "2", "--seq-len", "12", "--decode-tokens", "3", "--rounds", "2"]


def _check_rows(result: dict, names: list[str]) -> None:
    assert [row["name"] for row in result["rows"]] == names
    for row in result["rows"]:
        assert row["original"] > 0 and row["converted"] > 0, row
        assert row["ratio"] == pytest.approx(row["converted"] / row["original"])
        if row["unit"] == "s":
            rounds = result["settings"]["rounds"]
            assert len(row["original_runs"]) == len(row["converted_runs"]) == rounds
            paired = sorted(b / a for a, b in zip(row["original_runs"], row["converted_runs"]))
            assert paired[0] <= row["paired_ratio"] <= paired[-1]
    decode = next((row for row in result["rows"] if row["name"] == "decode"), None)
    if decode is not None:
        tokens = result["settings"]["decode_tokens"]
        assert decode["original_tokens_per_s"] == pytest.approx(tokens / decode["original"])
        assert decode["converted_tokens_per_s"] == pytest.approx(tokens / decode["converted"])


def test_bench_measures_both_models_loaded_from_their_folders(tiny_llama_folder):
    """The library call: prefill, decode and a training step, each as both medians and their ratio; the converted
    model is the class its folder ships (remote code), the original the folder's own; on_run sees every run."""
    runs = []
    settings = BenchSettings(
        batch=2, seq_len=12, decode_tokens=3, prompt_tokens=4, rounds=2, measure=("prefill", "decode", "train")
    )
    result = run_bench(str(tiny_llama_folder), settings, on_run=runs.append).to_dict()
    _check_rows(result, ["prefill", "decode", "train_step"])
    assert len(runs) == runs_total(settings) == 3 * 2 * 3 and set(runs) == {"original", "converted"}
    assert result["conversion"]["converted_class"].startswith("transformers_modules.")
    assert result["conversion"]["num_sublayers"] == 6 and result["conversion"]["params_added"] > 0
    assert result["settings"]["dtype"] == "float32" and result["machine"]["torch"] == torch.__version__
    assert json.loads(json.dumps(result)) == result  # plain JSON values only


@pytest.mark.slow
def test_bench_command_writes_json_that_renders_the_docs_table(tiny_llama_folder, tmp_path, monkeypatch):
    """`attnres bench --json`: every measure (peak memory from a fresh process per model), the command and the
    machine recorded; the JSON read back renders the Markdown table with both numbers and the ratio."""
    out = tmp_path / "results" / "bench.json"
    args = ["bench", str(tiny_llama_folder), *TINY, "--kernels", "eager", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["attnres", *args])  # what the command records as how it was run
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    data = read_json(out)
    assert data["command"] == "attnres " + shlex.join(args)
    _check_rows(data, ["prefill", "decode", "train_step", "train_step_peak_memory"])
    assert data["settings"]["kernels"] == "eager" and data["settings"]["batch"] == 2
    assert data["rows"][-1]["unit"] == "MiB"
    for word in ("prefill", "decode", "train step", "tok/s", "MiB"):
        assert word in result.output
    page = markdown(data)
    assert page.startswith("```bash\nattnres bench") and data["machine"]["processor"] in page
    for row in data["rows"]:  # the ratio, or where the timings cannot carry one (a busy machine), 'noise' and why
        shown = (
            f"| {row['ratio']:.3f} |"
            if not row.get("noise")
            else f"{row['label']}: the ratio is noise, not a result: {row['noise']}"
        )
        assert f"| {row['label']} |" in page and shown in page, page
    assert list(out.parent.iterdir()) == [out]  # the JSON alone: no temporary file left beside it


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--device", "tpu"], ["--device", "tpu"]),
        (["--dtype", "float64"], ["--dtype", "float64"]),
        (["--kernels", "triton"], ["--kernels triton", "cuda"]),
        (["--kernels", "cpu", "--dtype", "bfloat16"], ["--kernels cpu", "float32"]),
        (["--compile", "--kernels", "cpu"], ["--kernels cpu", "--compile"]),
        (["--rounds", "0"], ["--rounds 0", "at least 1"]),
        (["--measure", "prefill,speed"], ["--measure", "prefill"]),
    ],
    ids=[
        "unknown-device",
        "unknown-dtype",
        "triton-on-cpu",
        "cpu-kernels-bf16",
        "compile-with-kernels",
        "no-rounds",
        "unknown-measure",
    ],
)
def test_bad_settings_are_refused_before_anything_runs(tiny_llama_folder, tmp_path, args, needles):
    out = tmp_path / "bench.json"
    result = run_cli("bench", tiny_llama_folder, *args, "--json", out)
    assert_user_error(result, *needles)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_named(tiny_llama_folder, tmp_path):
    out = tmp_path / "bench.json"
    assert_user_error(
        run_cli("bench", tiny_llama_folder, "--device", "cuda", "--json", out), "--device cuda", "--device cpu"
    )
    assert not out.exists()
    with pytest.raises(BenchError, match="--device cuda"):
        check_settings(BenchSettings(device="cuda"))


def test_a_model_that_cannot_be_converted_writes_nothing(tmp_path):
    folder = save_config_only(tmp_path / "olmo2", olmo2_config())
    out = tmp_path / "bench.json"
    result = run_cli("bench", folder, *TINY, "--json", out)
    assert_user_error(result, str(folder), "post-norm")
    assert not out.exists()


def test_a_missing_model_and_an_unwritable_json_are_named(tmp_path, tiny_llama_folder):
    missing = tmp_path / "no-such-model"
    assert_user_error(run_cli("bench", missing, "--json", tmp_path / "b.json"), str(missing))
    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert_user_error(run_cli("bench", tiny_llama_folder, "--json", folder), "--json", "is a folder")
    assert not (tmp_path / "b.json").exists()


def test_json_is_written_whole_with_the_usual_file_mode(tmp_path):
    import os

    from attnres_convert.analysis.bench_report import write_json
    from attnres_convert.io.saving import current_umask

    path = write_json({"rows": []}, tmp_path / "deep" / "bench.json")
    assert json.loads(path.read_text()) == {"rows": []}
    assert path.stat().st_mode & 0o777 == 0o666 & ~current_umask()
    assert os.listdir(path.parent) == ["bench.json"]


def test_docs_blocks_are_made_from_the_results_file(tmp_path):
    """A page's `<!-- bench: FILE -->` block becomes FILE's table, with the command naming where FILE is kept; the
    text around it is left alone, and filling it again changes nothing."""
    from attnres_convert.analysis.bench_report import fill_bench_blocks, write_json

    result = {
        "model": "m",
        "command": "attnres bench m --rounds 3 --json /tmp/x.json",
        "notes": [],
        "settings": {"device": "cpu", "dtype": "float32", "kernels": "eager", "compile": False, "rounds": 3},
        "machine": {
            "processor": "Some CPU",
            "cpu_count": 2,
            "torch_threads": 2,
            "torch": "2.x",
            "transformers": "5.x",
            "date": "2026-01-01 00:00 UTC",
        },
        "rows": [
            {
                "name": "prefill",
                "label": "prefill 1 x 8 tokens",
                "unit": "s",
                "original": 0.5,
                "converted": 0.51,
                "ratio": 1.02,
                "paired_ratio": 1.019,
            },
            {
                "name": "decode",
                "label": "decode 4 tokens (KV cache)",
                "unit": "s",
                "original": 0.2,
                "converted": 0.21,
                "ratio": 1.05,
                "paired_ratio": 1.04,
                "original_tokens_per_s": 20.0,
                "converted_tokens_per_s": 19.05,
            },
            {
                "name": "train_step_peak_memory",
                "label": "peak",
                "unit": "MiB",
                "original": 100.0,
                "converted": 107.0,
                "ratio": 1.07,
            },
        ],
    }
    write_json(result, tmp_path / "results" / "b.json")
    page = "intro\n<!-- bench: results/b.json -->\nstale table\n<!-- /bench -->\nafter\n"
    filled = fill_bench_blocks(page, tmp_path)
    assert filled.startswith(
        "intro\n<!-- bench: results/b.json -->\n```bash\nattnres bench m --rounds 3 --json results/b.json\n```"
    )
    assert "stale table" not in filled and filled.endswith("<!-- /bench -->\nafter\n")
    for cells in (
        "| prefill 1 x 8 tokens | 0.500 s | 0.510 s | 1.020 | 1.019 |",
        "| decode 4 tokens (KV cache) | 20.0 tok/s | 19.1 tok/s | 1.050 | 1.040 |",
        "| peak | 100 MiB | 107 MiB | 1.070 |  |",
    ):
        assert cells in filled
    assert "Some CPU, 2 cores, 2 torch threads" in filled
    assert fill_bench_blocks(filled, tmp_path) == filled


def _fabricated(original_runs, converted_runs, load, cores=2, threads=2) -> dict:
    """A bench result whose prefill row has these timings, measured on a machine with this load."""
    from attnres_convert.analysis.timing import compared, ratio_noise

    row = {"name": "prefill", "label": "prefill 1 x 128 tokens", "unit": "s", **compared(original_runs, converted_runs)}
    machine = {
        "processor": "AMD EPYC",
        "cpu_count": cores,
        "torch_threads": threads,
        "torch": "2.13.0",
        "transformers": "5.19.0",
        "date": "2026-11-28",
        "load_average_start": [load, load, load],
        "load_average_end": [load, load, load],
    }
    if (why := ratio_noise(row, machine)) is not None:
        row["noise"] = why
    settings = {"device": "cpu", "dtype": "float32", "kernels": "auto", "rounds": len(original_runs)}
    return {
        "model": "SmolLM2-135M-Instruct",
        "settings": settings,
        "machine": machine,
        "conversion": {},
        "rows": [row],
        "notes": [],
    }


def _printed(result: dict) -> str:
    import io

    from rich.console import Console

    from attnres_convert.analysis.bench_report import console_table

    console = Console(width=80, file=io.StringIO(), color_system=None)
    console.print(console_table(result))
    return console.file.getvalue()


def test_a_ratio_the_noise_allows_no_reading_of_is_printed_as_noise_with_why():
    """`bench --quick` on a busy machine: one round each, load average 4.1 on 2 cores, the converted model timed 3.7x
    faster. The ratio is not printed as a result: the table says noise, and a note says why and what to do."""
    busy = _fabricated([0.400], [0.109], load=4.1)
    text = _printed(busy)
    assert "0.273" not in text and "noise" in text, text
    flat = " ".join(text.split())
    assert (
        "prefill 1 x 128 tokens: the ratio is noise, not a result: one timed round on a busy machine (load average 4.1 on 2"
        in flat
    ), text
    assert "--rounds" in flat, text
    md = markdown(busy)
    assert "| noise | noise |" in md and "0.273" not in md and "the ratio is noise" in md, md

    spread = _fabricated(
        [0.40, 0.41, 0.39, 0.40, 0.40], [0.41, 0.20, 0.42, 0.40, 0.43], load=0.1
    )  # a fast phase in round 2
    text = " ".join(_printed(spread).split())
    assert "noise" in text and "its 5 rounds gave ratios from 0.49 to 1.08" in text, text

    steady = _fabricated(
        [0.40, 0.41, 0.39, 0.40, 0.40], [0.41, 0.42, 0.40, 0.41, 0.42], load=4.1
    )  # busy, but 5 steady rounds
    assert "noise" not in _printed(steady) and f"{steady['rows'][0]['ratio']:.3f}" in _printed(steady)
    idle = _fabricated([0.400], [0.404], load=0.2)  # one round on an idle machine: a rough look, printed
    assert "noise" not in _printed(idle) and "1.010" in _printed(idle)
