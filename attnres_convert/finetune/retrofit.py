"""`attnres ab RECIPE --retrofit-after N[,N...]`: what a retrofit gains, by how long its base was pretrained.

Per seed, the recipe's baseline (model.convert=false) is trained from scratch once, over the recipe's whole
schedule (train.steps), and its model is saved after each N steps (`snapshots/step-N` in that run folder).
Then, per N, the paired A/B of `attnres ab` starts from that model: the baseline continued, and the same
model converted (exact at step 0) and continued, with the recipe's `retrofit` section (retrofit.steps
continued steps, its learning rates and what trains), the same optimiser and the same data order. The
continued runs read the training stream on from step N (data.start_step), so every continued step sees
text the base never saw, the text the from-scratch runs see at steps N+1 .. N + retrofit.steps.

With `--sweep`, each entry is one more AttnRes arm of the continued phase (its overrides on top of the
continued recipe: a recipe lever such as retrofit.attnres_lr or train.attnres_first_steps), continued from the
same saves as the others and paired with the same continued baseline.

With `--from-scratch` the AttnRes arm is also trained from scratch over the same schedule: its lead over the
pretraining run (which is the from-scratch baseline, the same run) at step N + retrofit.steps is the
from-scratch lead at the tokens the retrofit has seen.

Lead = baseline - AttnRes held-out loss at the same seed (positive: AttnRes ahead). A lead is called a saving
only with two seeds or more, when its mean exceeds both the seeds' sample standard deviation and the
evaluation's standard error (`savings_claim`).

The output folder holds retrofit.json, retrofit.md and retrofit.png (lead against N, lead against the
continued steps), `after-N/ab.*` (each N's A/B report, as `attnres ab` writes it) and, with the from-scratch
arms, `from-scratch/ab.*`; written atomically at the end. The run folders go to the work folder, where
`--reuse` finds what has already finished (a pretraining run counts only with a snapshot at every N, a
continued run only if it finished after the snapshot it starts from was written; an unfinished continued run
resumes from a checkpoint written after that snapshot).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..io.base_code import ship_model_code
from .ab import RETROFIT_OPTION as OPTION
from .ab import (
    Arm,
    add_compute_equivalents,
    arm_recipe,
    arm_report,
    check_scratch_arms,
    difference_se,
    final_difference_se,
    finished,
    folder_name,
    live_table,
    noise_reasons,
    paired,
    plan_arms,
    read_run,
    run_tasks,
    write_report,
)
from .recipe import Recipe, RecipeError, apply_overrides, find_recipe, parse_recipe, read_yaml
from .scratch import SCRATCH_FIELDS
from .study import check_output, continuation, live, machine, plan_start, plan_summary, run_one, train_arm
from .training import FinetuneRecipe, TrainingError

RETROFIT_JSON, RETROFIT_MD, RETROFIT_PNG = "retrofit.json", "retrofit.md", "retrofit.png"
SNAPSHOTS = "snapshots"
BASELINE, ATTNRES = Arm("baseline", ("model.convert=false",)), Arm("attnres", ())
ARMS = [BASELINE, ATTNRES]


@dataclass
class Study:
    recipe: str
    data: dict
    overrides: list[str]
    base: Recipe
    after: list[int]
    seeds: list[int]
    scratch_arms: bool
    work: Path
    levers: list[Arm] = field(default_factory=list)  # the --sweep arms, continued phase only

    @property
    def continued_arms(self) -> list[Arm]:
        return [*ARMS, *self.levers]

    @property
    def scratch_overrides(self) -> list[str]:
        """The from-scratch runs: the retrofit section left out, so that changing it does not retrain them."""
        return [*self.overrides, "retrofit={}"]

    @property
    def continued(self) -> int:
        return self.base.retrofit.steps

    @property
    def scratch_work(self) -> Path:
        return self.work / "scratch"

    def after_work(self, n: int) -> Path:
        return self.work / f"after-{n}"

    def snapshot(self, seed: int, n: int) -> Path:
        return self.scratch_work / folder_name(BASELINE, seed) / SNAPSHOTS / f"step-{n}"

    def continued_overrides(self, seed: int, n: int) -> list[str]:
        """The recipe turned into the continued phase after N steps: the snapshot as the source (no longer from
        scratch), the retrofit section's settings, the training stream read on from step N."""
        retrofit = self.base.retrofit
        overrides = [
            *self.overrides,
            f"model.source={self.snapshot(seed, n)}",
            "model.from_scratch=false",
            *(f"model.{name}=null" for name in SCRATCH_FIELDS),
            "model.tokenizer=source",
            f"train.steps={retrofit.steps}",
            f"train.trainable={retrofit.trainable}",
            f"data.start_step={n}",
            "retrofit={}",  # copied into train above: the run folder's recipe says what trained
        ]
        for name in ("lr", "attnres_lr", "warmup_steps", "schedule"):
            value = getattr(retrofit, name)
            if value is not None:
                overrides.append(f"train.{name}={value}")
        return overrides


def lever_override(override: str) -> str:
    """A --sweep arm's override as the continued run takes it: `retrofit.X=V` is `train.X=V` there (the continued
    recipe copies the retrofit section into train), except `retrofit.steps`, which every arm shares."""
    key, _, value = override.partition("=")
    if not key.startswith("retrofit."):
        return override
    name = key.removeprefix("retrofit.")
    if name == "steps":
        raise RecipeError(
            "--sweep: retrofit.steps is the same for every arm of the study (their leads are paired step by step); "
            "set it for the whole study (retrofit.steps=N after the recipe)"
        )
    return f"train.{name}={value}"


def eval_steps(recipe: Recipe) -> set[int]:
    every, steps = recipe.eval.every, recipe.train.steps
    return {0, steps} | (set(range(every, steps, every)) if every else set())


def plan_study(
    recipe,
    overrides: list[str],
    after: list[int],
    seeds: int,
    scratch_arms: bool,
    work: Path,
    sweep: list[list[str]] | None = None,
) -> Study:
    """Every refusal before anything trains, each naming the field to change."""
    data = read_yaml(find_recipe(recipe))
    base = parse_recipe(apply_overrides(data, overrides))
    train = base.train
    if not base.model.from_scratch:
        source = "the embedded SmolLM2-135M-Instruct" if base.model.is_default else base.model.source
        raise RecipeError(
            f"{OPTION}: the study pretrains its baseline from scratch, but model.from_scratch is false (model.source is "
            f"{source}, pretrained weights). Use a from-scratch recipe (model.from_scratch: true, e.g. ab-retrofit-cpu) or "
            f"--from-scratch; to retrofit a pretrained model, run `attnres ab RECIPE` without {OPTION}"
        )
    if base.data.train.dataset and base.data.max_tokens is None:
        raise RecipeError(
            f"data.max_tokens: {OPTION} on a dataset needs data.max_tokens set, so that the pretraining and the continued "
            "runs read the same text (each reads only what it needs otherwise, and the continued runs read on from step N)"
        )
    if base.retrofit.steps is None:
        raise RecipeError(
            f"retrofit.steps: required by {OPTION} (the continued steps from each pretrained model), e.g. retrofit.steps=400"
        )
    past = [n for n in after if n > train.steps]
    if past:
        raise RecipeError(
            f"{OPTION}: {', '.join(map(str, past))} pretraining steps is past the recipe's schedule (train.steps = {train.steps}); "
            f"set train.steps={max(after)} or more, or give smaller N"
        )
    if seeds < 1:
        raise RecipeError(f"--seeds: must be >= 1 (got {seeds})")
    # Named as `attnres ab --sweep` names them; a lever's retrofit.* settings are the continued runs' train.*.
    levers = [Arm(arm.name, tuple(map(lever_override, arm.overrides))) for arm in plan_arms(sweep or [])[len(ARMS) :]]
    seed_list = [train.seed + i for i in range(seeds)]
    study = Study(str(recipe), data, overrides, base, after, seed_list, scratch_arms, work, levers)
    if scratch_arms:
        needed = max(after) + study.continued
        if needed > train.steps:
            raise RecipeError(
                f"train.steps: the from-scratch arms give the same-token lead at N + retrofit.steps = {needed} steps, past "
                f"train.steps = {train.steps}; set train.steps={needed}, or leave out --from-scratch"
            )
        missing = [n + study.continued for n in after if n + study.continued not in eval_steps(base)]
        if missing:
            raise RecipeError(
                f"eval.every: the from-scratch arms are compared with the retrofit at steps {', '.join(map(str, missing))} "
                f"(N + retrofit.steps), which eval.every = {base.eval.every} does not evaluate; choose an eval.every that divides them"
            )
    for arm in ARMS:  # the pretraining (and from-scratch) arms
        arm_recipe(data, study.scratch_overrides, arm, study.seeds[0], study.scratch_work)
    for n in after:  # the continued arms: refused now, not after the pretraining
        for arm in study.continued_arms:
            try:
                arm_recipe(data, study.continued_overrides(study.seeds[0], n), arm, study.seeds[0], study.after_work(n))
            except RecipeError as error:
                raise RecipeError(
                    f"retrofit: the continued phase after {n} steps (the recipe's train fields, retrofit's in their place): {error}"
                ) from None
    check_scratch_arms(data, study.scratch_overrides, ARMS, study.seeds[0], study.scratch_work)
    return study


# --- training -------------------------------------------------------------------------------------


class Pretraining(FinetuneRecipe):
    """The baseline from scratch, its model saved after each of SNAPSHOT_STEPS steps (in the run folder,
    so that a run replacing an earlier one swaps its snapshots in with it)."""

    def __init__(self, recipe: Recipe, snapshot_steps: list[int], **kwargs):
        super().__init__(recipe, **kwargs)
        self.snapshot_steps = set(snapshot_steps)

    def train_step(self):
        stats = super().train_step()
        if self.state.step in self.snapshot_steps:
            self.snapshot()
        return stats

    def snapshot(self) -> Path:
        from ..io.saving import atomic_folder

        accelerator = self.accelerator
        state_dict = (
            accelerator.get_state_dict(self.model) if self.distributed == "FSDP" else None
        )  # every process gathers
        path = self.folder / SNAPSHOTS / f"step-{self.state.step}"
        if self.main:
            model = accelerator.unwrap_model(self.model)

            def write(folder: Path) -> None:
                model.save_pretrained(folder, state_dict=state_dict)
                ship_model_code(model, folder)
                self.start.tokenizer.save_pretrained(folder)

            atomic_folder(path, write, owned=True)
        accelerator.wait_for_everyone()
        return path


def has_snapshots(folder: Path, after: list[int]) -> bool:
    return all((folder / SNAPSHOTS / f"step-{n}" / "config.json").is_file() for n in after)


def _pretrain_one(data: dict, overrides: list[str], seed: int, workdir: str, after: list[int], reuse: bool) -> None:
    """The baseline from scratch at one seed, with its snapshots (in this process or a worker process)."""
    import gc

    recipe = arm_recipe(data, overrides, BASELINE, seed, Path(workdir))
    if reuse and finished(recipe) and has_snapshots(Path(recipe.output.dir), after):
        return
    try:
        Pretraining(recipe, after).run()
    except (RecipeError, TrainingError) as error:
        raise type(error)(f"pretraining, seed {seed}: {error}") from None
    gc.collect()


def continued_is_current(recipe: Recipe, snapshot: Path) -> bool:
    """A continued run finished with this recipe after its starting save was written: a pretraining run again
    (another recipe, or another set of N) rewrites the saves, and every run continued from them trains again."""
    final = Path(recipe.output.dir) / "final_metrics.json"
    try:
        return finished(recipe) and final.stat().st_mtime_ns > (snapshot / "config.json").stat().st_mtime_ns
    except OSError:
        return False


def _continue_one(
    data: dict, overrides: list[str], arm: Arm, seed: int, workdir: str, reuse: bool, snapshot: str
) -> None:
    """One arm continued from a save (in this process or a worker process): with REUSE, kept if it finished after
    the save was written, resumed from a checkpoint written after it, a shorter run extended from one (a
    larger retrofit.steps with retrofit.schedule wsd or constant), else trained again."""
    recipe = arm_recipe(data, overrides, arm, seed, Path(workdir))
    if reuse and continued_is_current(recipe, Path(snapshot)):
        return
    train_arm(recipe, arm, seed, continuation(recipe, newer_than=Path(snapshot) / "config.json") if reuse else None)


def study_plan(study: Study, reuse: bool) -> list[tuple[str, Recipe, int | None]]:
    """Every run of the study, in the order they train: (what it is, its recipe, the step it trains from: None
    when `reuse` keeps it). A pretraining run is kept or trained whole (it does not resume), and a seed whose
    pretraining trains again trains its continued runs again from step 0 (their save is rewritten)."""
    plan, kept_bases = [], {}
    for seed in study.seeds:
        recipe = arm_recipe(study.data, study.scratch_overrides, BASELINE, seed, study.scratch_work)
        kept_bases[seed] = reuse and finished(recipe) and has_snapshots(Path(recipe.output.dir), study.after)
        plan.append(("pretraining (baseline from scratch)", recipe, None if kept_bases[seed] else 0))
    if study.scratch_arms:
        for seed in study.seeds:
            recipe = arm_recipe(study.data, study.scratch_overrides, ATTNRES, seed, study.scratch_work)
            plan.append(("AttnRes from scratch", recipe, plan_start(recipe, reuse, finished(recipe))))
    for seed in study.seeds:
        for n in study.after:
            for arm in study.continued_arms:
                recipe = arm_recipe(study.data, study.continued_overrides(seed, n), arm, seed, study.after_work(n))
                snapshot = study.snapshot(seed, n)
                start = (
                    plan_start(recipe, reuse, continued_is_current(recipe, snapshot), snapshot / "config.json")
                    if kept_bases[seed]
                    else 0
                )
                plan.append((f"{arm.name} continued", recipe, start))
    return plan


def run_retrofit(
    recipe: str | os.PathLike,
    overrides: list[str] | None = None,
    *,
    after: list[int],
    seeds: int = 1,
    from_scratch: bool = False,
    output: str | os.PathLike | None = None,
    workdir: str | os.PathLike | None = None,
    jobs: int = 1,
    reuse: bool = False,
    overwrite: bool = False,
    console=None,
    command: str | None = None,
    sweep: list[list[str]] | None = None,
):
    """Pretrain, snapshot, continue both arms (and every SWEEP arm) from every snapshot (and the from-scratch AttnRes arm with
    FROM_SCRATCH), then write the study's report. Returns ab.ABResult (OUT, the report)."""
    from .ab import ABResult

    overrides = list(overrides or [])
    if from_scratch:
        overrides = ["model.from_scratch=true", *overrides]
    if jobs < 1:
        raise RecipeError(f"--jobs: must be >= 1 (got {jobs})")
    path = find_recipe(recipe)
    out = Path(output or f"outputs/retrofit-{path.stem}").expanduser().resolve()
    work = Path(workdir).expanduser().resolve() if workdir else out.with_name(out.name + "-runs")
    study = plan_study(recipe, overrides, after, seeds, from_scratch, work, sweep)
    check_output(out, overwrite, RETROFIT_JSON)
    from accelerate import PartialState

    state = PartialState()
    if jobs > 1 and state.num_processes > 1:
        raise RecipeError("--jobs: under accelerate launch every process trains every arm together; use --jobs 1")
    data, seed_list, steps = study.data, study.seeds, study.base.train.steps
    scratch = study.scratch_overrides
    first = [(_pretrain_one, (data, scratch, seed, str(study.scratch_work), after, reuse)) for seed in seed_list]
    if from_scratch:
        first += [(run_one, (data, scratch, ATTNRES, seed, str(study.scratch_work), reuse)) for seed in seed_list]
    then = [
        (
            _continue_one,
            (
                data,
                study.continued_overrides(seed, n),
                arm,
                seed,
                str(study.after_work(n)),
                reuse,
                str(study.snapshot(seed, n)),
            ),
        )
        for seed in seed_list
        for n in after
        for arm in study.continued_arms
    ]

    def tables():
        from rich.console import Group

        scratch = ARMS if from_scratch else [BASELINE]
        shown = [live_table(scratch, seed_list, study.scratch_work, steps, f"Pretraining from scratch ({steps} steps)")]
        shown += [
            live_table(
                study.continued_arms, seed_list, study.after_work(n), study.continued, f"Retrofit after {n} steps"
            )
            for n in after
        ]
        return Group(*shown)

    show = console is not None and state.is_main_process
    if show:
        entries = [(recipe.train.steps, start) for _, recipe, start in study_plan(study, reuse)]
        console.print(f"Retrofit study: {plan_summary(entries)}", highlight=False)
    with live(console if show else None, tables):
        run_tasks(first, jobs)  # the continued runs start from the pretraining's snapshots
        run_tasks(then, jobs)
    state.wait_for_everyone()
    report, sub_reports = study_report(study, command or "", jobs)
    if state.is_main_process:
        from ..io.saving import atomic_folder

        atomic_folder(out, lambda folder: write_study(report, sub_reports, folder), owned=True)
    state.wait_for_everyone()
    return ABResult(out, report)


# --- the report -----------------------------------------------------------------------------------


def savings_claim(lead: dict, eval_se: float | None) -> dict:
    """Whether a lead (paired over seeds) supports a claim: the A/B's noise rule (`ab.noise_reasons`)."""
    reasons = noise_reasons(lead["mean"], lead["std"], len(lead["per_seed"]), eval_se)
    if reasons:
        return {"claim": False, "why": "; ".join(reasons)}
    return {"claim": True, "why": "AttnRes ahead" if lead["mean"] > 0 else "AttnRes behind"}


def _lead(base: dict[int, float], arm: dict[int, float], seeds: list[int]) -> dict:
    return paired([base[s] - arm[s] for s in seeds])


def arm_lead(runs: list, base_runs: list) -> dict:
    """One continued AttnRes arm against the continued baseline: its final loss, lead, lead curve and verdict."""
    seeds = [r.seed for r in base_runs]
    base_final = {r.seed: r.eval_loss_final for r in base_runs}
    base_curves = {r.seed: dict(r.eval) for r in base_runs}
    arm_final = {r.seed: r.eval_loss_final for r in runs}
    arm_curves = {r.seed: dict(r.eval) for r in runs}
    steps = sorted(set.intersection(*(set(c) for c in [*base_curves.values(), *arm_curves.values()])))
    lead = _lead(base_final, arm_final, seeds)
    eval_se, eval_se_paired = final_difference_se(runs, base_runs)
    return {
        "attnres_final": statistics.fmean(arm_final.values()),
        "lead_final": lead,
        "lead_curve": [
            (step, _lead({s: base_curves[s][step] for s in seeds}, {s: arm_curves[s][step] for s in seeds}, seeds))
            for step in steps
        ],
        "eval_se": eval_se,
        "eval_se_paired": eval_se_paired,
        "verdict": savings_claim(lead, eval_se),
    }


def study_report(study: Study, command: str, jobs: int) -> tuple[dict, dict[str, dict]]:
    """retrofit.json, and the A/B reports of every N (and of the from-scratch arms) keyed by their folder."""
    seeds, base = study.seeds, study.base
    tokens_per_step = base.train.micro_batch * base.train.grad_accum * base.data.seq_len
    machine_info = machine(jobs)
    sub_reports: dict[str, dict] = {}
    scratch_runs = {}
    if study.scratch_arms:
        scratch_runs = {
            arm.name: {s: read_run(study.scratch_work / folder_name(arm, s), s) for s in seeds} for arm in ARMS
        }
        entries = [
            arm_report(arm, [scratch_runs[arm.name][s] for s in seeds], [scratch_runs["baseline"][s] for s in seeds])
            for arm in ARMS
        ]
        add_compute_equivalents(entries, base.train.steps)
        sub_reports["from-scratch"] = {
            "recipe": f"{study.recipe} (from scratch)",
            "from_scratch": True,
            "overrides": study.overrides,
            "command": command,
            "steps": base.train.steps,
            "seeds": seeds,
            "machine": machine_info,
            "workdir": str(study.scratch_work),
            "arms": entries,
        }
    points = []
    for n in study.after:
        work = study.after_work(n)
        arms = study.continued_arms
        runs = {arm.name: [read_run(work / folder_name(arm, s), s) for s in seeds] for arm in arms}
        entries = [arm_report(arm, runs[arm.name], runs["baseline"]) for arm in arms]
        add_compute_equivalents(entries, study.continued)
        sub_reports[f"after-{n}"] = {
            "recipe": f"{study.recipe} after {n} pretraining steps",
            "from_scratch": False,
            "overrides": study.continued_overrides(seeds[0], n),
            "command": command,
            "steps": study.continued,
            "seeds": seeds,
            "machine": machine_info,
            "workdir": str(work),
            "arms": entries,
        }
        base_final = {r.seed: r.eval_loss_final for r in runs["baseline"]}
        base_curves = {r.seed: dict(r.eval) for r in runs["baseline"]}
        leads = {arm.name: arm_lead(runs[arm.name], runs["baseline"]) for arm in arms[1:]}
        plain = leads.pop(ATTNRES.name)
        point = {
            "after": n,
            "pretraining_tokens": n * tokens_per_step,
            "continued_tokens": study.continued * tokens_per_step,
            "baseline_at_start": statistics.fmean(base_curves[s][0] for s in seeds)
            if all(0 in base_curves[s] for s in seeds)
            else None,
            "baseline_final": statistics.fmean(base_final.values()),
            **plain,
            "token_equivalent": entries[1]["compute_equivalent"],
            "levers": [
                {
                    "arm": arm.name,
                    "overrides": list(arm.overrides),
                    **leads[arm.name],
                    "token_equivalent": entry["compute_equivalent"],
                }
                for arm, entry in zip(study.levers, entries[2:])
            ],
        }
        if study.scratch_arms:
            at = n + study.continued
            base_at = {s: dict(scratch_runs["baseline"][s].eval)[at] for s in seeds}
            arm_at = {s: dict(scratch_runs["attnres"][s].eval)[at] for s in seeds}
            scratch_lead = _lead(base_at, arm_at, seeds)
            scratch_se, scratch_paired = difference_se(
                [
                    (scratch_runs["baseline"][s].records.get(at), scratch_runs["attnres"][s].records.get(at))
                    for s in seeds
                ]
            )
            point["scratch"] = {
                "step": at,
                "tokens": at * tokens_per_step,
                "lead": scratch_lead,
                "eval_se": scratch_se,
                "eval_se_paired": scratch_paired,
                "verdict": savings_claim(scratch_lead, scratch_se),
            }
        points.append(point)
    report = {
        "recipe": study.recipe,
        "command": command,
        "overrides": study.overrides,
        "seeds": seeds,
        "pretraining_steps": base.train.steps,
        "continued_steps": study.continued,
        "tokens_per_step": tokens_per_step,
        "retrofit": base.retrofit.model_dump(),
        "sweep": [list(arm.overrides) for arm in study.levers],
        "from_scratch_arms": study.scratch_arms,
        "machine": machine_info,
        "workdir": str(study.work),
        "after": points,
    }
    return report, sub_reports


def write_study(report: dict, sub_reports: dict[str, dict], folder: Path) -> None:
    from ..analysis.plots import plot_unless_missing, retrofit_plot

    (folder / RETROFIT_JSON).write_text(json.dumps(report, indent=2))
    (folder / RETROFIT_MD).write_text(markdown(report))
    plot_unless_missing(lambda: retrofit_plot(report, folder / RETROFIT_PNG), f"{RETROFIT_PNG} (the study's curves)")
    for name, sub in sub_reports.items():
        (folder / name).mkdir()
        write_report(sub, folder / name)


def _spread(lead: dict) -> str:
    if len(lead["per_seed"]) == 1:
        return f"{lead['mean']:+.4f}"
    return f"{lead['mean']:+.4f} ± {lead['std']:.4f} ({', '.join(f'{v:+.4f}' for v in lead['per_seed'])})"


def _se(lead: dict) -> str:
    if lead["eval_se"] is None:
        return ""
    return f"{lead['eval_se']:.4f}" + (" (paired)" if lead.get("eval_se_paired") else "")


def _verdict(verdict: dict) -> str:
    return verdict["why"] if verdict["claim"] else f"no savings claim ({verdict['why']})"


def _ratios(figure: dict) -> tuple[str, str]:
    one = "not reached" if figure["ratio"] is None else f"{figure['ratio']:.2f}x"
    other = (
        "not reached" if figure.get("ratio_at_baseline_final") is None else f"{figure['ratio_at_baseline_final']:.2f}x"
    )
    return one, other


def markdown(report: dict) -> str:
    seeds, machine = report["seeds"], report["machine"]
    continued, per_step = report["continued_steps"], report["tokens_per_step"]
    scratch = report["from_scratch_arms"]
    lines = [
        f"# Retrofit study: {report['recipe']} (pretraining schedule {report['pretraining_steps']} steps, "
        f"{continued} continued steps, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})",
        "",
        f"Command: `{report['command']}`" if report["command"] else "",
        "",
        f"Machine: {machine['cpu']}{', ' + machine['accelerator'] if machine['accelerator'] else ''}; torch {machine['torch']}, "
        f"{machine['threads_per_arm']} thread(s) per run, {machine['jobs']} run(s) at a time.",
        "",
        f"Per seed, the baseline was pretrained from scratch and saved after N steps ({per_step:,} tokens a step); from "
        f"each save the baseline continued and the same model converted to AttnRes and continued, {continued} steps each, "
        "on the text after step N. Lead = baseline - AttnRes held-out loss at the same seed (nats per token, positive: "
        "AttnRes ahead): mean ± sample standard deviation (per seed). Eval SE: the evaluation's standard error of the "
        "mean lead (paired: from the held-out sequences' own differences; otherwise the arms' errors as if "
        "independent, for runs that recorded no per-sequence losses). A lead is a saving only with two seeds or "
        "more and a mean beyond both the spread and the SE.",
        "",
        "| N | baseline at N | lead after the continued steps | eval SE | baseline tokens to AttnRes's final loss | "
        "AttnRes tokens to the baseline's final loss | verdict |"
        + (" from-scratch lead at N + continued | verdict |" if scratch else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if scratch else ""),
    ]
    for point in report["after"]:
        one, other = _ratios(point["token_equivalent"])
        start = f"{point['baseline_at_start']:.4f}" if point["baseline_at_start"] is not None else ""
        se = _se(point)
        row = f"| {point['after']} | {start} | {_spread(point['lead_final'])} | {se} | {one} | {other} | {_verdict(point['verdict'])} |"
        if scratch:
            s = point["scratch"]
            row += f" {_spread(s['lead'])} (step {s['step']}) | {_verdict(s['verdict'])} |"
        lines.append(row)
    lines += [
        "",
        "Token equivalents (mean curves of the continued runs): the continued tokens the baseline needs to reach "
        "AttnRes's final loss, as a multiple of AttnRes's; and the baseline's continued tokens as a multiple of those "
        'after which AttnRes reaches the baseline\'s final loss. "Not reached": not within the run. A ratio beside '
        '"no savings claim" is noise, not a saving.',
        "",
        "Lead during the continued steps (mean over the seeds):",
        "",
        "| continued step | " + " | ".join(f"after {p['after']}" for p in report["after"]) + " |",
        "|---" * (1 + len(report["after"])) + "|",
    ]
    curves = [dict((step, lead["mean"]) for step, lead in p["lead_curve"]) for p in report["after"]]
    for step in sorted(set().union(*curves)):
        lines.append(f"| {step} | " + " | ".join(f"{c[step]:+.4f}" if step in c else "" for c in curves) + " |")
    if report.get("sweep"):
        lines += [
            "",
            "The continued phase's arms (--sweep: the plain AttnRes arm and each lever, against the same continued "
            "baseline):",
            "",
            "| N | arm | AttnRes final loss | lead after the continued steps | eval SE | verdict |",
            "|---|---|---|---|---|---|",
        ]
        for point in report["after"]:
            for name, arm in [("attnres (the recipe)", point), *((lever["arm"], lever) for lever in point["levers"])]:
                se = _se(arm)
                lines.append(
                    f"| {point['after']} | {name} | {arm['attnres_final']:.4f} | {_spread(arm['lead_final'])} | {se} | "
                    f"{_verdict(arm['verdict'])} |"
                )
    lines += [
        "",
        "Each N's A/B report: `after-N/ab.md`" + ("; the from-scratch arms: `from-scratch/ab.md`." if scratch else "."),
    ]
    return "\n".join(lines) + "\n"
