"""gpu-check's report as Markdown (gpu-check.md), and the name its copy in benchmarks/results takes."""

from __future__ import annotations

import math
import re
import time

from .gpu_check_mix import mix_markdown


def markdown(report: dict) -> str:
    env = report["environment"]
    packages = env.get("packages", {})
    lines = [
        f"# attnres gpu-check: {env.get('gpu', report['device'])}",
        "",
        f"`{report['command']}`: {report['seconds']:.0f} s of a {report['deadline_s']:.0f} s deadline"
        f"{' (--quick: tiny shapes)' if report['quick'] else ''}, {env.get('date', '')}.",
        "",
        "| environment | |",
        "| --- | --- |",
    ]
    for key in ("gpu", "capability", "gpu_memory_gib", "torch_cuda", "python", "cpu_count"):
        if env.get(key) is not None:
            lines.append(f"| {key} | {env[key]} |")
    lines += [f"| {name} | {version or 'not installed'} |" for name, version in packages.items()]
    lines += ["", "| stage | status | seconds (budget) | note |", "| --- | --- | --- | --- |"]
    for stage in report["stages"]:
        note = (stage["error"] or "").replace("|", "/")[:400]
        lines.append(
            f"| {stage['name']} | {stage['status']} | {stage['seconds']:.0f} ({stage['budget_s']:.0f}) | {note} |"
        )
    stages = {s["name"]: s for s in report["stages"]}
    rows = stages.get("exactness", {}).get("result", {}).get("rows", [])
    if rows:
        lines += [
            "",
            "## Exactness (converted against the original, on the device)",
            "",
            "| model | dtype | depth mix | max abs logit diff | KL | top-1 | greedy | result |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['dtype']} | {r['kernels']} | | | | | error: {r['error']} |")
                continue
            greedy = "identical" if r["greedy_identical"] else f"differs at {r['first_divergence']}"
            lines.append(
                f"| {r['model']} | {r['dtype']} | {r['kernels']} | {r['max_abs_logit_diff']:.2e} | {r['kl']:.2e} | "
                f"{r['top1_agreement']:.2%} | {greedy} ({r['new_tokens']}) | {'pass' if r['passed'] else 'FAIL'} |"
            )
    bench_rows = []
    for stage in report["stages"]:
        if not stage["name"].startswith("bench"):
            continue
        res = stage["result"]
        for name, run in res.get("runs", {}).items():
            mix = f"{res['kernels']}{' + compile' if res['compile'] else ''}"
            for row in run.get("rows", []):
                bench_rows.append(
                    f"| {name} | {res['dtype']} | {mix} | {row['label']} | {_num(row['original'])} | "
                    f"{_num(row['converted'])} {row['unit']} | {row['ratio']:.3f} |"
                )
            if run.get("status") != "ok":
                bench_rows.append(f"| {name} | {res['dtype']} | {mix} | {run['status']} | | | |")
    if bench_rows:
        lines += [
            "",
            "## attnres bench (ratio: converted / original, > 1 slower or bigger)",
            "",
            "| model | dtype | depth mix | measure | original | converted | ratio |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *bench_rows,
        ]
    lines += mix_markdown(stages.get("depth-mix-kernels", {}).get("result", {}))
    arms = stages.get("ab", {}).get("result", {}).get("arms", [])
    if arms:
        lines += [
            "",
            f"## From-scratch A/B ({stages['ab']['result']['steps']} steps)",
            "",
            "| arm | final held-out loss | delta to baseline |",
            "| --- | --- | --- |",
        ]
        for arm in arms:
            delta = arm.get("delta_final")
            mean = delta.get("mean") if isinstance(delta, dict) else delta
            lines.append(f"| {arm['name']} | {_num(arm.get('eval_loss_final'))} | {_num(mean)} |")
    return "\n".join(lines) + "\n"


def _num(value) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "" if value is None else str(value)
    return f"{value:.4g}"


def results_name(report: dict) -> str:
    """gpu-check-<gpu>-<date>: the name a GPU run's reports get in benchmarks/results."""
    gpu = report["environment"].get("gpu") or report["device"]
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return f"gpu-check-{slug}-{time.strftime('%Y%m%d', time.gmtime())}"
