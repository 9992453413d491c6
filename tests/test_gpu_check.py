"""`make gpu-check`'s plumbing, on the CPU: `make gpu-check DEVICE=cpu QUICK=1` runs every stage on tiny shapes and
writes a JSON and a Markdown report whose numbers are sane; the deadline records the stages it leaves out."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnres_convert.analysis import gpu_check
from attnres_convert.analysis.gpu_check import REPORT_RESERVE_S, STAGES, Stage, StageFailure, StageSkipped, run_check

ROOT = Path(__file__).resolve().parents[1]


def test_the_deadline_records_what_it_leaves_out(tmp_path):
    lines = []
    report = run_check(
        "cpu",
        quick=True,
        out=tmp_path,
        deadline_s=REPORT_RESERVE_S + 1,
        stages=["environment", "models"],
        say=lines.append,
    )
    assert [(s["name"], s["status"]) for s in report["stages"]] == [
        ("environment", "not reached"),
        ("models", "not reached"),
    ]
    assert all("before the deadline" in s["error"] for s in report["stages"])
    assert json.loads((tmp_path / "gpu-check.json").read_text())["stages"] == report["stages"]
    markdown = (tmp_path / "gpu-check.md").read_text()
    assert "| environment | not reached |" in markdown and "| models | not reached |" in markdown
    assert any("not reached" in line for line in lines)


def test_a_failing_stage_records_its_error_and_the_next_one_runs(tmp_path, monkeypatch):
    def broken(check, limit):
        raise ZeroDivisionError("division by zero")

    def partial(check, limit):
        raise StageFailure("2 of 3 rows differ", {"rows": [1, 2, 3]})

    def fine(check, limit):
        return {"limit": limit}

    def short(check, limit):
        return {"rows": [1], "not_reached": ["llama-3.2-1b bfloat16"]}

    def no_tool(check, limit):
        raise StageSkipped("pytest is not installed")

    monkeypatch.setattr(
        gpu_check,
        "STAGES",
        [
            Stage("broken", 30, broken),
            Stage("partial", 30, partial),
            Stage("fine", 30, fine),
            Stage("short", 30, short),
            Stage("no-tool", 30, no_tool),
            Stage("gpu", 30, fine, cuda_only="needs CUDA"),
        ],
    )
    report = run_check("cpu", quick=True, out=tmp_path, deadline_s=600, say=lambda line: None)
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["broken"]["status"] == "failed" and stages["broken"]["error"] == "ZeroDivisionError: division by zero"
    assert stages["partial"]["status"] == "failed" and stages["partial"]["result"] == {"rows": [1, 2, 3]}
    assert (
        stages["fine"]["status"] == "ok" and stages["fine"]["result"]["limit"] == 30
    )  # its budget, inside the deadline
    assert (
        stages["short"]["status"] == "partial"
        and stages["short"]["error"] == "budget spent before: llama-3.2-1b bfloat16"
    )
    assert stages["no-tool"]["status"] == "skipped" and stages["no-tool"]["error"] == "pytest is not installed"
    assert stages["gpu"]["status"] == "skipped" and stages["gpu"]["error"] == "CUDA only: needs CUDA"
    assert "ZeroDivisionError" in (tmp_path / "gpu-check.log").read_text()  # the traceback, for the details
    assert "| broken | failed |" in (tmp_path / "gpu-check.md").read_text()
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "cli"), "--stages", "fine"]) == 0
    with pytest.raises(SystemExit):
        gpu_check.main(["--stages", "nonsense"])


@pytest.mark.slow
@pytest.mark.extended
def test_quick_cpu_check_runs_every_stage_and_reports_sane_numbers(tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "gpu-check",
            "DEVICE=cpu",
            "QUICK=1",
            f"PYTHON={sys.executable}",
            f"GPU_CHECK_OUT={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == [s.name for s in STAGES]
    for stage in STAGES:  # on a CPU: every stage ran, except those that need CUDA, which say why
        expected = "skipped" if stage.cuda_only else "ok"
        assert stages[stage.name]["status"] == expected, stages[stage.name]
    assert report["seconds"] < report["deadline_s"]

    packages = report["environment"]["packages"]
    assert all(packages[name] for name in ("torch", "transformers", "accelerate", "typer", "rich"))

    rows = stages["exactness"]["result"]["rows"]
    assert {(r["model"], r["dtype"]) for r in rows} == {
        (m, d) for m in ("smollm2-135m", "llama-3.2-1b") for d in ("float32", "bfloat16")
    }
    for row in rows:
        assert row["passed"] and row["greedy_identical"] and row["top1_agreement"] == 1.0, row
        if row["dtype"] == "float32":
            assert row["max_abs_logit_diff"] <= 1e-3, row

    for model, run in stages["bench-eager"]["result"]["runs"].items():
        assert run["status"] == "ok", (model, run)
        names = {row["name"]: row for row in run["rows"]}
        assert set(names) == {"prefill", "decode", "train_step", "train_step_peak_memory"}
        for row in names.values():
            assert row["original"] > 0 and row["converted"] > 0, row
            assert math.isclose(row["ratio"], row["converted"] / row["original"], rel_tol=1e-6), row
            assert 0.05 < row["ratio"] < 50, row  # a tiny model on a loaded CPU is noisy, never off by 50x
        assert (out / run["json"]).is_file()

    tests = stages["cuda-tests"]["result"]  # no GPU here: every CUDA test is collected and skipped, none fails
    assert tests["files"] == ["tests/test_kernels_cuda.py"] and tests.get("skipped", 0) > 0 and not tests.get("failed")

    ab = stages["ab"]["result"]
    arms = {arm["name"]: arm for arm in ab["arms"]}
    assert set(arms) == {"baseline", "attnres"} and ab["steps"] == 6
    start = [arm["eval"][0] for arm in arms.values()]
    assert start[0][0] == start[1][0] == 0 and math.isclose(start[0][1], start[1][1], abs_tol=1e-4)  # same start: exact
    for arm in arms.values():
        losses = [loss for _, loss in arm["eval"]]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], arm  # six steps already learn
    assert (out / ab["report"]).is_file()

    markdown = (out / "gpu-check.md").read_text()
    for stage in STAGES:
        assert f"| {stage.name} | {stages[stage.name]['status']} |" in markdown
    assert "## Exactness" in markdown and "## attnres bench" in markdown and "## From-scratch A/B" in markdown
