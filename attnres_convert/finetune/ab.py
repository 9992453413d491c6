"""`attnres ab`: does AttnRes pay? One recipe, trained as a baseline and as AttnRes from the same start.

    baseline  the recipe with model.convert=false: the original model, the same trainable budget except the
              AttnRes parameters (the same LoRA adapters, or every base weight for trainable: full)
    attnres   the recipe as written: converted (exact at step 0), the AttnRes parameters train alongside
    sweep     AttnRes variants, each a list of extra overrides (`--sweep "train.attnres_lr=1e-3 model.full=true"`)

Every arm runs once per seed (train.seed, train.seed + 1, ...): same seed, same LoRA initialisation and the
same data order in every arm, so the difference between two arms at one seed is paired. The output
folder holds `ab.json` (every arm's held-out curve per seed and its mean), `ab.md` (the table: final
held-out loss, delta to the baseline as mean and spread over the seeds) and `ab.png` (the curves). It is
written atomically at the end; the arms' run folders stay in the work folder, where `reuse` finds arms
already finished with the same recipe, and resumes unfinished ones from their last checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

# The report's files and how they are written and shown: ab_report.py (re-exported here for callers of ab).
from .ab_report import AB_JSON, AB_MD, AB_PNG, compute_equivalent_lines, console_report, markdown, write_report  # noqa: F401
from .metrics import METRICS, read_metrics
from .recipe import RecipeError, apply_overrides, find_recipe, parse_recipe, read_yaml
from .study import (  # noqa: F401 - the arms and their runs, shared with the retrofit study
    ARM_SETTINGS,
    Arm,
    arm_recipe,
    check_output,
    finished,
    folder_name,
    live,
    machine,
    plan_start,
    plan_summary,
    run_one,
    run_tasks,
)


def plan_arms(sweep: list[list[str]], plain: bool = True) -> list[Arm]:
    """baseline, attnres (unless `plain` is false) and one arm per sweep entry, named after its overrides."""
    arms = [Arm("baseline", ("model.convert=false",))]
    if plain:
        arms.append(Arm("attnres", ()))
    names = {arm.name for arm in arms}
    for extra in sweep:
        if not extra:
            raise RecipeError("--sweep: an arm needs at least one override (key.path=value)")
        name = "attnres " + " ".join(extra)
        if name in names:
            raise RecipeError(f"--sweep: the arm {' '.join(extra)!r} is given twice")
        names.add(name)
        arms.append(Arm(name, tuple(extra)))
    return arms


RETROFIT_OPTION = "--retrofit-after"


def parse_after(text: str) -> list[int]:
    """'100,200' -> [100, 200] (sorted, each once); anything but positive whole numbers is refused."""
    values = []
    for item in text.replace(",", " ").split():
        if not item.isdigit() or int(item) < 1:
            raise RecipeError(
                f"{RETROFIT_OPTION}: {item!r} is not a positive whole number of pretraining steps (e.g. {RETROFIT_OPTION} 100,200)"
            )
        values.append(int(item))
    if not values:
        raise RecipeError(
            f"{RETROFIT_OPTION}: give at least one number of pretraining steps (e.g. {RETROFIT_OPTION} 100,200)"
        )
    return sorted(set(values))


def retrofit_steps(text: str, *, sweep=None, no_plain: bool = False, throughput: int = 0) -> list[int]:
    """`--retrofit-after TEXT` with the other `attnres ab` options: its N, or the options it cannot take refused."""
    given = [name for name, value in (("--no-plain", no_plain), ("--throughput", throughput)) if value]
    if given:
        raise RecipeError(
            f"{', '.join(given)}: not available with {RETROFIT_OPTION} (its arms are the baseline, the recipe's AttnRes "
            "and the --sweep arms of the continued phase)"
        )
    return parse_after(text)


@dataclass
class RunSummary:
    """One arm at one seed, read back from its run folder."""

    seed: int
    eval: list[tuple[int, float]]
    train: list[tuple[int, float]]
    eval_loss_final: float
    tokens: int
    tokens_per_s: float | None
    train_seconds: float
    trainable_parameters: int
    attnres_parameters: int
    converted: bool
    grad_norm: list[tuple[int, float]] = field(default_factory=list)
    attnres_grad_norm: list[tuple[int, float]] = field(default_factory=list)
    eval_stderr_final: float | None = None  # the final evaluation's standard error (None: not recorded)
    # Every evaluation record by step, per-sequence losses included: for the paired standard error; not in ab.json.
    records: dict[int, dict] = field(default_factory=dict, repr=False)

    def summary(self) -> dict:
        """The run as ab.json holds it."""
        return {k: v for k, v in vars(self).items() if k != "records"}


def read_run(folder: Path, seed: int) -> RunSummary:
    final = json.loads((folder / "final_metrics.json").read_text())
    records = read_metrics(folder / METRICS)
    trains = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    return RunSummary(
        seed=seed,
        eval=[(r["step"], r["loss"]) for r in records if r["kind"] == "eval"],
        train=[(r["step"], r["loss"]) for r in trains],
        eval_loss_final=final["eval_loss"],
        tokens=final["tokens"],
        tokens_per_s=final["tokens_per_s"],
        train_seconds=final["train_seconds"],
        trainable_parameters=final["trainable_parameters"],
        attnres_parameters=final["attnres_parameters"],
        converted=final["converted"],
        grad_norm=[(r["step"], r["grad_norm"]) for r in trains if r.get("grad_norm") is not None],
        attnres_grad_norm=[
            (r["step"], r["attnres_grad_norm"]) for r in trains if r.get("attnres_grad_norm") is not None
        ],
        eval_stderr_final=evals[-1].get("loss_se") if evals else None,
        records={r["step"]: r for r in evals},
    )


def paired(values: list[float]) -> dict:
    """Mean and spread of per-seed deltas (sample standard deviation; 0 with one seed)."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "per_seed": values,
    }


def _mean_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _mean_curve(runs: list[RunSummary]) -> list[tuple[int, float]]:
    steps = sorted(set.intersection(*(set(dict(r.eval)) for r in runs)))
    return [(step, statistics.fmean(dict(r.eval)[step] for r in runs)) for step in steps]


def arm_report(arm: Arm, runs: list[RunSummary], baseline: list[RunSummary] | None) -> dict:
    """The arm's entry of ab.json: its curves per seed, their mean, and its paired delta to the baseline."""
    speeds = [r.tokens_per_s for r in runs if r.tokens_per_s]
    entry = {
        "name": arm.name,
        "overrides": list(arm.overrides),
        "converted": runs[0].converted,
        "eval": _mean_curve(runs),
        "eval_loss_final": statistics.fmean(r.eval_loss_final for r in runs),
        "eval_stderr_final": _mean_or_none([r.eval_stderr_final for r in runs]),
        "tokens": runs[0].tokens,
        "tokens_per_s": statistics.fmean(speeds) if speeds else None,
        "trainable_parameters": runs[0].trainable_parameters,
        "attnres_parameters": runs[0].attnres_parameters,
        "runs": [r.summary() for r in runs],
    }
    if baseline is not None and not arm.is_baseline:
        base = {r.seed: r for r in baseline}
        entry["delta_final"] = paired([r.eval_loss_final - base[r.seed].eval_loss_final for r in runs])
        entry["delta_final"]["eval_se"], entry["delta_final"]["eval_se_paired"] = final_difference_se(runs, baseline)
        steps = [s for s, _ in entry["eval"] if all(s in dict(base[r.seed].eval) for r in runs)]
        entry["delta_curve"] = [
            (s, paired([dict(r.eval)[s] - dict(base[r.seed].eval)[s] for r in runs])) for s in steps
        ]
    return entry


def tokens_to_reach(curve: list[tuple[int, float]], target: float, tokens_per_step: float) -> float | None:
    """Training tokens after which CURVE (held-out loss by step) first comes down to TARGET, interpolated
    linearly between the two evaluations around the crossing; None if it never does."""
    for (step_a, loss_a), (step_b, loss_b) in zip(curve, curve[1:]):
        if loss_a <= target:
            return step_a * tokens_per_step
        if loss_b <= target:
            fraction = (loss_a - target) / (loss_a - loss_b)
            return (step_a + fraction * (step_b - step_a)) * tokens_per_step
    if curve and curve[-1][1] <= target:
        return curve[-1][0] * tokens_per_step
    return None


def compute_equivalent(
    baseline_curve: list[tuple[int, float]],
    arm_final: float,
    tokens: int,
    steps: int,
    arm_curve: list[tuple[int, float]] | None = None,
) -> dict:
    """The paper's headline figure: how many training tokens the baseline needs, on its own held-out curve,
    to reach the arm's final loss, as a multiple of the arm's tokens (None: the baseline never gets there).
    With ARM_CURVE, also the other way round, which has a value when the baseline never gets there: the tokens
    after which the arm reaches the baseline's final loss, and the baseline's tokens as a multiple of them."""
    needed = tokens_to_reach(baseline_curve, arm_final, tokens / steps)
    figure = {
        "target_loss": arm_final,
        "arm_tokens": tokens,
        "baseline_tokens": needed,
        "ratio": needed / tokens if needed is not None else None,
    }
    if arm_curve is not None:
        reached = tokens_to_reach(arm_curve, baseline_curve[-1][1], tokens / steps)
        figure["arm_tokens_to_baseline_final"] = reached
        figure["ratio_at_baseline_final"] = tokens / reached if reached else None
    return figure


def noise_reasons(mean: float, std: float, seeds: int, eval_se: float | None) -> list[str]:
    """Why a mean difference over SEEDS paired seeds is within the run's noise (empty: it stands out): one seed (no
    spread to judge it by), |Δ| no larger than the seeds' spread STD, or no larger than the evaluation's standard
    error EVAL_SE of the difference (the held-out text is a sample too). The A/B and the retrofit study both
    claim no savings then."""
    size, reasons = abs(mean), []
    if seeds == 1:
        reasons.append("one seed")
    elif size <= std:
        reasons.append(f"|Δ| {size:.4f} <= the seeds' spread {std:.4f}")
    if eval_se is not None and size <= eval_se:
        reasons.append(f"|Δ| {size:.4f} <= the evaluation's standard error {eval_se:.4f}")
    return reasons


def seed_difference_se(first: dict | None, second: dict | None) -> tuple[float | None, bool]:
    """The evaluation's standard error of one seed's loss difference, from the two runs' evaluation records at
    the same step, and whether it is paired: over the held-out sequences' own differences when both runs recorded
    the same sequences (`sequence_losses`; sequences hard for one run are hard for the other), else the two
    errors combined as if independent, which overstates it (runs written before sequences were recorded)."""
    from .evaluation import paired_difference_se  # imports torch: not before the CLI has checked its arguments

    if first is None or second is None:
        return None, False
    counts = first.get("sequence_predictions")
    if counts and counts == second.get("sequence_predictions") and "sequence_losses" in second:
        return paired_difference_se(first["sequence_losses"], second["sequence_losses"], counts), True
    if first.get("loss_se") is None or second.get("loss_se") is None:
        return None, False
    return math.hypot(first["loss_se"], second["loss_se"]), False


def difference_se(pairs: list[tuple[dict | None, dict | None]]) -> tuple[float | None, bool]:
    """The evaluation's standard error of a mean over seeds of a loss difference (`seed_difference_se` per seed:
    sqrt(sum of their squares) / seeds), and whether every seed's is paired. None when a seed has none."""
    errors = [seed_difference_se(a, b) for a, b in pairs]
    if not errors or any(se is None for se, _ in errors):
        return None, False
    return math.sqrt(sum(se * se for se, _ in errors)) / len(errors), all(p for _, p in errors)


def final_difference_se(runs: list[RunSummary], baseline: list[RunSummary]) -> tuple[float | None, bool]:
    """`difference_se` of the final evaluations: each run's last against its seed's baseline at the same step."""
    base = {r.seed: r.records for r in baseline}
    last = {r.seed: max(r.records, default=None) for r in runs}
    return difference_se([(base[r.seed].get(last[r.seed]), r.records.get(last[r.seed])) for r in runs])


def within_noise(entry: dict) -> str | None:
    """Why the arm's final difference to the baseline is within this run's noise (`noise_reasons`: the seeds'
    spread is the sample standard deviation of the per-seed Δ, the evaluation's standard error the mean Δ's,
    `difference_se`), or None when it stands out."""
    delta = entry.get("delta_final")
    if delta is None:
        return None
    return "; ".join(noise_reasons(delta["mean"], delta["std"], len(delta["per_seed"]), delta.get("eval_se"))) or None


def add_compute_equivalents(entries: list[dict], steps: int) -> None:
    """Every AttnRes arm's compute-equivalent figure against the baseline (entries[0]): from the mean curves,
    and per seed from that seed's baseline curve; `noise` says why it is no claim, where it is not one."""
    base = entries[0]
    base_runs = {r["seed"]: r for r in base["runs"]}
    for entry in entries[1:]:
        figure = compute_equivalent(base["eval"], entry["eval_loss_final"], entry["tokens"], steps, entry["eval"])
        per_seed = [
            compute_equivalent(base_runs[r["seed"]]["eval"], r["eval_loss_final"], r["tokens"], steps, r["eval"])
            for r in entry["runs"]
        ]
        figure["per_seed"] = [f["ratio"] for f in per_seed]
        figure["per_seed_at_baseline_final"] = [f["ratio_at_baseline_final"] for f in per_seed]
        figure["noise"] = within_noise(entry)
        entry["compute_equivalent"] = figure


# --- the live table -------------------------------------------------------------------------------


def _live_folder(folder: Path) -> Path:
    """Where the run of FOLDER is being written: an arm run again over an earlier run folder (the arms run
    with output.overwrite) writes into a hidden folder beside it until it has finished."""
    from ..io.saving import partial_prefix

    staged = []
    for path in folder.parent.glob(f"{partial_prefix(folder)}*"):
        try:
            staged.append((path.joinpath(METRICS).stat().st_mtime, path))
        except OSError:  # not a run folder, or swapped in or removed meanwhile
            pass
    return max(staged)[1] if staged else folder


def _progress_of(folder: Path) -> tuple[int | None, float | None, bool]:
    """(last step, last held-out loss, finished) of a run folder being written, without disturbing it."""
    path = folder / METRICS
    if not path.is_file():
        return None, None, False
    try:
        records = read_metrics(path)
    except OSError:
        return None, None, False
    steps = [r["step"] for r in records if r.get("kind") == "train"]
    evals = [r["loss"] for r in records if r.get("kind") == "eval"]
    return (steps[-1] if steps else 0), (evals[-1] if evals else None), (folder / "final_metrics.json").is_file()


def live_table(arms: list[Arm], seeds: list[int], workdir: Path, steps: int, title: str):
    """Rich table of every arm x seed: step reached, last held-out loss, its difference to the baseline's
    at the same seed. Re-read from the run folders' metrics.jsonl at each refresh (the arms may run in
    other processes)."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("arm", "seed", "step", "held-out loss", "Δ vs baseline", "state"):
        table.add_column(column, justify="left" if column in ("arm", "state") else "right")
    base_loss: dict[int, dict[int, float]] = {}
    for seed in seeds:
        path = _live_folder(workdir / folder_name(arms[0], seed)) / METRICS
        with contextlib.suppress(OSError):  # swapped in meanwhile: the next refresh reads it
            base_loss[seed] = {r["step"]: r["loss"] for r in read_metrics(path) if r.get("kind") == "eval"}
    for arm in arms:
        for seed in seeds:
            folder = _live_folder(workdir / folder_name(arm, seed))
            step, loss, done = _progress_of(folder)
            delta = ""
            if loss is not None and not arm.is_baseline:
                with contextlib.suppress(OSError):  # a staged run swapped in meanwhile
                    evals = [r for r in read_metrics(folder / METRICS) if r.get("kind") == "eval"]
                    reference = base_loss.get(seed, {}).get(evals[-1]["step"])
                    delta = f"{loss - reference:+.4f}" if reference is not None else ""
            state = "[green]done[/]" if done else ("running" if step is not None else "[dim]waiting[/]")
            table.add_row(
                arm.name,
                str(seed),
                f"{step}/{steps}" if step is not None else "",
                f"{loss:.4f}" if loss else "",
                delta,
                state,
            )
    return table


# --- running --------------------------------------------------------------------------------------


def interleaved_throughput(
    data: dict, common: list[str], arms: list[Arm], steps: int, workdir: Path, seed: int
) -> dict[str, float]:
    """Training tokens/s of every arm, timed in one process on the same batch, one step of each arm in
    turn (alternating the order), median of `steps` after two warm-up rounds: a busy machine slows every arm
    alike, which the runs' own tokens/s (often from different moments, or parallel jobs) do not ensure."""
    import time

    import torch

    from ..io.text import token_loss
    from .optim import apply_lora, make_optimizer, select_trainable
    from .starting_model import load_starting_model

    built = []
    for arm in arms:
        recipe = arm_recipe(data, common, arm, seed, workdir)
        model = load_starting_model(recipe).model
        if recipe.train.trainable == "lora":
            model = apply_lora(model, recipe.lora, recipe.train.seed)
        select_trainable(model, recipe.train.trainable)
        built.append((arm.name, model.train(), make_optimizer(model, recipe)))
    micro, length = recipe.train.micro_batch, recipe.data.seq_len
    vocab = built[0][1].get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (micro, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": None, "predictions": micro * (length - 1)}
    times: dict[str, list[float]] = {name: [] for name, _, _ in built}
    for round_ in range(steps + 2):
        for name, model, optimizer in built if round_ % 2 == 0 else reversed(built):
            began = time.perf_counter()
            loss, _ = token_loss(model, batch, "cpu")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if round_ >= 2:
                times[name].append(time.perf_counter() - began)
    return {name: micro * length / statistics.median(values) for name, values in times.items()}


@dataclass
class ABResult:
    output: Path
    report: dict


def run_ab(
    recipe: str | os.PathLike,
    overrides: list[str] | None = None,
    *,
    sweep: list[list[str]] | None = None,
    seeds: int = 1,
    output: str | os.PathLike | None = None,
    workdir: str | os.PathLike | None = None,
    plain: bool = True,
    jobs: int = 1,
    reuse: bool = False,
    overwrite: bool = False,
    throughput: int = 0,
    from_scratch: bool = False,
    console=None,
    command: str | None = None,
) -> ABResult:
    """Run every arm at every seed, then write OUTPUT/ab.json, ab.md and ab.png (atomically).

    `jobs > 1` trains that many arms at once in worker processes of one thread each (on a CPU, two
    one-thread processes finish two arms sooner than one two-thread process does one after the other).
    `throughput > 0` also times that many training steps of every arm interleaved in one process (on the
    CPU; `tokens_per_s_interleaved` in the report).
    `from_scratch` (the recipe field model.from_scratch) starts every arm from the same random initialisation
    of the source's config instead of its weights (finetune/scratch.py).
    Under `accelerate launch` every process takes part in every arm (jobs must be 1); the main one writes."""
    overrides = (["model.from_scratch=true"] if from_scratch else []) + list(overrides or [])
    path = find_recipe(recipe)
    data = read_yaml(path)
    base = parse_recipe(apply_overrides(data, overrides))
    if base.train.trainable == "attnres":
        raise RecipeError(
            "train.trainable: the A/B needs a recipe that trains something besides AttnRes (lora or full): "
            "the baseline trains the same budget without AttnRes, and with trainable: attnres it would train nothing"
        )
    if seeds < 1:
        raise RecipeError(f"--seeds: must be >= 1 (got {seeds})")
    if jobs < 1:
        raise RecipeError(f"--jobs: must be >= 1 (got {jobs})")
    from accelerate import PartialState  # imports torch: after the checks above, which answer at once

    state = PartialState()
    if jobs > 1 and state.num_processes > 1:
        raise RecipeError("--jobs: under accelerate launch every process trains every arm together; use --jobs 1")
    out = Path(output or default_output(path)).expanduser().resolve()
    check_output(out, overwrite)
    work = Path(workdir).expanduser().resolve() if workdir else out.with_name(out.name + "-runs")
    arms = plan_arms(sweep or [], plain)
    seed_list = [base.train.seed + index for index in range(seeds)]
    for arm in arms:  # every arm's recipe is valid before the first one trains
        arm_recipe(data, overrides, arm, seed_list[0], work)
    if base.model.from_scratch:
        check_scratch_arms(data, overrides, arms, seed_list[0], work)
    jobs_list = [(arm, seed) for seed in seed_list for arm in arms]  # seed-major: a first paired delta early

    main = state.is_main_process
    title = f"A/B: {path.stem} ({base.train.steps} steps, {len(seed_list)} seed(s))"
    show = console is not None and main
    if show:
        entries = []
        for arm, seed in jobs_list:
            arm_run = arm_recipe(data, overrides, arm, seed, work)
            entries.append((arm_run.train.steps, plan_start(arm_run, reuse, finished(arm_run))))
        console.print(f"{title}: {plan_summary(entries)}", highlight=False)
    with live(console if show else None, lambda: live_table(arms, seed_list, work, base.train.steps, title)):
        run_tasks([(run_one, (data, overrides, arm, seed, str(work), reuse)) for arm, seed in jobs_list], jobs)
    state.wait_for_everyone()
    runs = {arm: [read_run(work / folder_name(arm, seed), seed) for seed in seed_list] for arm in arms}
    arm_entries = [arm_report(arm, runs[arm], runs[arms[0]]) for arm in arms]
    if throughput and main:
        speeds = interleaved_throughput(data, overrides, arms, throughput, work, seed_list[0])
        for entry in arm_entries:
            entry["tokens_per_s_interleaved"] = speeds[entry["name"]]
    add_compute_equivalents(arm_entries, base.train.steps)
    report = {
        "recipe": str(recipe),
        "from_scratch": base.model.from_scratch,
        "overrides": overrides,
        "command": command or "",
        "steps": base.train.steps,
        "seeds": seed_list,
        "machine": machine(jobs),
        "workdir": str(work),
        "arms": arm_entries,
    }
    if main:
        from ..io.saving import atomic_folder

        atomic_folder(out, lambda folder: write_report(report, folder), owned=True)
    state.wait_for_everyone()
    return ABResult(out, report)


def default_output(recipe_path: Path) -> Path:
    """outputs/ab-RECIPE, the prefix not doubled for a recipe named ab-... (outputs/ab-scratch-cpu, not ab-ab-...)."""
    stem = recipe_path.stem
    return Path("outputs") / (stem if stem.startswith("ab-") else f"ab-{stem}")


def check_scratch_arms(data: dict, common: list[str], arms: list[Arm], seed: int, workdir: Path) -> None:
    """Build every arm's starting model once before any arm trains: a config that is not PreNorm, sizes that
    make no model or a block size the model does not have fail now, not after the baseline has trained."""
    from .preflight import check_recipe
    from .starting_model import load_starting_model

    for arm in arms:
        recipe = arm_recipe(data, common, arm, seed, workdir)
        check_recipe(recipe, check_output=False)
        try:
            del load_starting_model(recipe).model
        except RecipeError as error:
            raise RecipeError(f"arm {arm.name!r}: {error}") from None
        gc.collect()
