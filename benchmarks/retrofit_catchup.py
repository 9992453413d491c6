"""The catch-up curve of a retrofit study, and how much of an ideal retrofit it earns.

    python benchmarks/retrofit_catchup.py WORK [--after 800] [--scratch benchmarks/results/retrofit-ab-retrofit-cpu.json]
        [-o benchmarks/results/retrofit-catchup]

WORK is the work folder of `attnres ab RECIPE --retrofit-after N ... retrofit.steps=T` (OUT-runs): it reads the
pretraining runs (`scratch/baseline/seed-*`) and the continued runs (`after-N/{baseline,attnres}/seed-*`) as far as
they have got, so a study still running can be read; a seed counts where both of its arms have an evaluation (a run still going is read from its partial folder).
Every AttnRes arm of the continued phase is reported against the continued baseline: the recipe's (`attnres`) and
each `--sweep` arm (`attnres__model.query_rank_8`, ...).

- **Lead** at each continued evaluation step: baseline - AttnRes held-out loss, per seed, then mean and sample
  standard deviation over the seeds; the evaluation's standard error of the difference as `attnres ab` takes it.
- **AttnRes's compute multiplier m** on this model and text, from the from-scratch leads of an earlier study
  (`--scratch`, its `after[*].scratch`: the lead at pretraining step t): the baseline's pretraining curve (the mean of
  WORK's pretraining runs, linear between evaluations) reaches AttnRes's loss at t, L_base(t) - lead, at step t*;
  m = t* / t, where t* falls inside the curve. m is the mean of those.
- **Ideal lead** after T continued steps: `L(T) - L(m T)`, L the continued baseline's curve (its longest seed) from
  the base at N: what a retrofit earning AttnRes's multiplier on its continued tokens alone would lead by. L is the
  least-squares fit `a + b ln(T)` to that curve's evaluations (each moves by the evaluation's standard error), so
  the ideal lead is `-b ln(m)` at every T; where m T lies past the last evaluation the fit extrapolates (marked).
  **Retrofit efficiency** = lead / ideal lead.

Writes OUT.json, OUT.md and OUT.png (left: each arm's lead per continued step with the seeds' range, and the ideal
lead; right: the efficiency).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnres_convert.finetune.ab import difference_se


def evals(folder: Path) -> dict[int, dict]:
    """{step: evaluation record} of a run's metrics.jsonl (held-out loss, its standard error, per sequence)."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if r.get("kind") == "eval"}


def runs(arm: Path) -> dict[str, dict[int, dict]]:
    """{seed-K: evaluations} of an arm's runs; a run still going writes into a hidden partial folder
    (.seed-K.partial-*), read where it holds more evaluations than a finished or interrupted seed-K."""
    found: dict[str, dict] = {}
    for folder in sorted(arm.glob("seed-*")) + sorted(arm.glob(".seed-*.partial-*")):
        seed = folder.name.lstrip(".").split(".partial-")[0]
        curve = evals(folder)
        if len(curve) > len(found.get(seed, {})):
            found[seed] = curve
    return found


def log_fit(curve: dict[int, float]) -> tuple[float, float]:
    """(a, b) of the least-squares fit L = a + b ln(step) over the curve's evaluations after step 0: a smooth
    stand-in for a continued run's loss, whose evaluations move by their standard error from one to the next."""
    points = [(math.log(step), loss) for step, loss in curve.items() if step > 0]
    mean_x, mean_y = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def step_reaching(curve: dict[int, float], loss: float) -> float | None:
    """The first step at which a falling curve reaches LOSS (linear between evaluations), or None."""
    steps = sorted(curve)
    for a, b in zip(steps, steps[1:]):
        if curve[a] >= loss >= curve[b] and curve[a] != curve[b]:
            return a + (b - a) * (curve[a] - loss) / (curve[a] - curve[b])
    return None


def mean_curve(curves: list[dict[int, dict]]) -> dict[int, float]:
    shared = set.intersection(*(set(c) for c in curves)) if curves else set()
    return {s: statistics.fmean(c[s]["loss"] for c in curves) for s in sorted(shared)}


def multiplier(pretraining: dict[int, float], scratch_json: Path) -> tuple[float | None, list[dict]]:
    study = json.loads(scratch_json.read_text())
    points = []
    for entry in study.get("after", []):
        scratch = entry.get("scratch") or {}
        step, lead = scratch.get("step"), (scratch.get("lead") or {}).get("mean")
        if step is None or lead is None or step not in pretraining:
            continue
        reached = step_reaching(pretraining, pretraining[step] - lead)
        points.append({"step": step, "lead": lead, "baseline_steps": reached, "m": reached / step if reached else None})
    found = [p["m"] for p in points if p["m"] is not None]
    return (statistics.fmean(found) if found else None), points


def analyse(work: Path, after: int, scratch_json: Path) -> dict:
    pre = [evals(p) for p in sorted((work / "scratch" / "baseline").glob("seed-*"))]
    pretraining = mean_curve([c for c in pre if c])
    m, points = multiplier(pretraining, scratch_json)
    continued_work = work / f"after-{after}"
    baseline = runs(continued_work / "baseline")
    # The continued baseline's curve for the fit: the seed that has gone furthest (a study still running has seeds
    # at different steps).
    longest = max((s for s in baseline if baseline[s]), key=lambda s: len(baseline[s]), default=None)
    continued = {step: record["loss"] for step, record in baseline[longest].items()} if longest else {}
    fit = log_fit(continued) if sum(1 for step in continued if step > 0) >= 3 else None
    names = sorted(p.name for p in continued_work.iterdir() if p.is_dir() and p.name != "baseline")
    arms = {name: arm_rows(baseline, runs(continued_work / name), m, fit, continued) for name in names}
    return {
        "work": str(work),
        "after": after,
        "multiplier": m,
        "multiplier_points": points,
        "pretraining_steps": max(pretraining) if pretraining else None,
        "arms": {name: arm for name, arm in arms.items() if arm["rows"]},
    }


def arm_rows(baseline: dict, arm: dict, m: float | None, fit, continued: dict) -> dict:
    """One AttnRes arm's lead over the continued baseline at every step some seed has reached in both."""
    seeds = sorted(s for s in baseline if baseline[s] and arm.get(s))
    rows = []
    # Every step some seed has reached in both arms; a row says which seeds it averages (a study still running).
    reached = {s: set(baseline[s]) & set(arm[s]) for s in seeds}
    for step in sorted(set().union(*reached.values())):
        present = [s for s in seeds if step in reached[s]]
        leads = [baseline[s][step]["loss"] - arm[s][step]["loss"] for s in present]
        se, _ = difference_se([(baseline[s][step], arm[s][step]) for s in present])
        # The ideal lead from the fit: L(T) - L(m T) = -b ln(m), the same at every T for this form; where m T lies
        # past the last evaluation the fit extrapolates (marked).
        ideal = -fit[1] * math.log(m) if m and fit and step else None
        extrapolated = bool(m and step and m * step > max(continued))
        mean = statistics.fmean(leads)
        rows.append(
            {
                "step": step,
                "seeds": present,
                "lead": {"mean": mean, "std": statistics.stdev(leads) if len(leads) > 1 else None, "per_seed": leads},
                "eval_se": se,
                "ideal_lead": ideal,
                "ideal_extrapolated": extrapolated,
                "efficiency": (mean / ideal) if ideal else None,
            }
        )
    return {"seeds": seeds, "rows": rows}


def markdown(result: dict, command: str) -> str:
    m = result["multiplier"]
    multiplier_text = f"{m:.2f}" if m else "not measurable from these runs"
    lines = [
        f"```bash\n{command}\n```",
        "",
        f"Continued from the save after {result['after']} pretraining steps; AttnRes's compute multiplier "
        f"m = {multiplier_text}. The lead is the continued baseline's held-out loss minus the arm's.",
    ]
    for name, arm in result["arms"].items():
        lines += arm_table(name, arm, result["after"])
    return "\n".join(lines) + "\n"


def arm_table(name: str, arm: dict, after: int) -> list[str]:
    seeds = ", ".join(s.removeprefix("seed-") for s in arm["seeds"])
    lines = [
        "",
        f"### `{name}` (seeds {seeds})",
        "",
        "| continued steps (seeds) | continued / pretraining tokens | lead (mean ± sd; per seed) | eval SE | ideal lead | efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for row in arm["rows"]:
        lead = row["lead"]
        sd = f" ± {lead['std']:.4f}" if lead["std"] is not None else ""
        seeds = ", ".join(f"{x:+.4f}" for x in lead["per_seed"])
        ideal = (
            ""
            if row["ideal_lead"] is None
            else f"{row['ideal_lead']:+.4f}" + (" (extrapolated)" if row["ideal_extrapolated"] else "")
        )
        eff = "" if row["efficiency"] is None else f"{row['efficiency']:.2f}"
        lines.append(
            f"| {row['step']} ({len(row['seeds'])}) | {row['step'] / after:.2f} | {lead['mean']:+.4f}{sd} ({seeds}) | "
            f"{'' if row['eval_se'] is None else format(row['eval_se'], '.4f')} | {ideal} | {eff} |"
        )
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, arm in result["arms"].items():
        rows = [r for r in arm["rows"] if r["step"] > 0]
        steps = [r["step"] for r in rows]
        (line,) = left.plot(steps, [r["lead"]["mean"] for r in rows], marker="o", label=f"{name} (mean)")
        low, high = [min(r["lead"]["per_seed"]) for r in rows], [max(r["lead"]["per_seed"]) for r in rows]
        left.fill_between(steps, low, high, alpha=0.15, color=line.get_color())
        right.plot(steps, [r["efficiency"] for r in rows], marker="o", color=line.get_color(), label=name)
    rows = max((arm["rows"] for arm in result["arms"].values()), key=len)
    steps = [r["step"] for r in rows if r["step"] > 0]
    ideal = [r["ideal_lead"] for r in rows if r["step"] > 0]
    left.plot(steps, ideal, linestyle="--", color="black", label="ideal retrofit (m on continued tokens)")
    left.axhline(0, color="grey", linewidth=0.8)
    left.set(xlabel="continued steps", ylabel="lead (nats/token)", title=f"Retrofit after {result['after']} steps")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    right.axhline(0, color="grey", linewidth=0.8)
    right.set(xlabel="continued steps", ylabel="lead / ideal lead", title="Retrofit efficiency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--after", type=int, default=800)
    parser.add_argument("--scratch", type=Path, default=Path("benchmarks/results/retrofit-ab-retrofit-cpu.json"))
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/retrofit-catchup"))
    args = parser.parse_args()
    result = analyse(args.work, args.after, args.scratch)
    command = "python benchmarks/retrofit_catchup.py " + " ".join(
        [str(args.work), f"--after {args.after}", f"--scratch {args.scratch}", f"-o {args.output}"]
    )
    result["command"] = command
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(markdown(result, command))
    if result["arms"]:
        plot(result, args.output.with_suffix(".png"))
    print(markdown(result, command))


if __name__ == "__main__":
    main()
