"""What an `attnres ab --retrofit-after` study costs on this machine, measured before running it.

    OMP_NUM_THREADS=1 python benchmarks/retrofit_cost.py ab-retrofit-cpu --retrofit-after 100,200,400,800 --seeds 3 --from-scratch
    ... --workdir WORK        what `--reuse --workdir WORK` would still train (kept, resumed and extended runs)

Plans the study as the command would (every refusal included), times training steps of its two arms (the plain
baseline and AttnRes, the same architectures from scratch and continued) interleaved in one process on one
thread, as `attnres ab --throughput` does, and one held-out evaluation of each; then counts the study's steps and
evaluations and prints its duration on one core (divide by the cores for --jobs on an otherwise idle machine).
With --workdir, only what `--reuse` would train there counts: a finished run nothing, an unfinished one the steps
after its checkpoint, a shorter one (a wsd or constant schedule) the steps after the checkpoint it is extended from.
A busy machine slows every timing alike: read the load average it prints beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def setup_and_evaluation_seconds(recipe, repeats: int) -> tuple[float, float]:
    """What a run spends before its first step (its model built, the text read and tokenised), and one held-out
    evaluation of its starting model (median of REPEATS), as a run evaluates."""
    from attnres_convert.finetune.accelerator import make_accelerator
    from attnres_convert.finetune.data import build_corpus
    from attnres_convert.finetune.evaluation import heldout_loss_across_processes
    from attnres_convert.finetune.starting_model import load_starting_model

    began = time.perf_counter()
    start = load_starting_model(recipe)
    corpus = build_corpus(recipe, start.tokenizer, recipe.data.seq_len * 4)
    setup = time.perf_counter() - began
    accelerator = make_accelerator(recipe)
    batch = recipe.eval.batch_size or recipe.train.micro_batch
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        heldout_loss_across_processes(start.model, corpus.eval, accelerator, batch)
        times.append(time.perf_counter() - began)
    return setup, statistics.median(times)


def count_runs(study, reuse: bool) -> list[tuple[str, str, tuple]]:
    """(label, arm, (runs to train, runs, steps to train, evaluations)) per kind of run of the study
    (`retrofit.study_plan`): every run in full, or (REUSE) what `--reuse` would still train in its work folder."""
    from attnres_convert.finetune.retrofit import eval_steps, study_plan

    rows: dict[str, tuple[str, list[int]]] = {}
    for label, recipe, start in study_plan(study, reuse):
        arm = "attnres" if recipe.model.convert else "baseline"  # the timed arm it runs like
        counts = rows.setdefault(label, (arm, [0, 0, 0, 0]))[1]
        counts[1] += 1
        if start is not None:
            counts[0] += 1
            counts[2] += recipe.train.steps - start
            counts[3] += sum(1 for step in eval_steps(recipe) if step > start or step == 0 == start)
    return [(label, arm, tuple(counts)) for label, (arm, counts) in rows.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--retrofit-after", required=True)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--from-scratch", action="store_true")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per arm (after two warm-up rounds)")
    parser.add_argument("--evals", type=int, default=2, help="timed evaluations per arm")
    parser.add_argument("--workdir", type=Path, help="count only what --reuse would train in this work folder")
    args = parser.parse_intermixed_args()

    import torch

    torch.set_num_threads(1)
    from attnres_convert.finetune.ab import arm_recipe, interleaved_throughput, parse_after
    from attnres_convert.finetune.retrofit import ARMS, plan_study

    after = parse_after(args.retrofit_after)
    overrides = (["model.from_scratch=true"] if args.from_scratch else []) + args.overrides
    with tempfile.TemporaryDirectory() as work:
        study = plan_study(args.recipe, overrides, after, args.seeds, args.from_scratch, Path(work))
        seed = study.seeds[0]
        wall, cpu = time.perf_counter(), time.process_time()
        speeds = interleaved_throughput(study.data, overrides, ARMS, args.steps, study.scratch_work, seed)
        scratch = {arm.name: arm_recipe(study.data, overrides, arm, seed, study.scratch_work) for arm in ARMS}
        timed = {name: setup_and_evaluation_seconds(recipe, args.evals) for name, recipe in scratch.items()}
        setups, evals = {name: t[0] for name, t in timed.items()}, {name: t[1] for name, t in timed.items()}
        # The share of a core the timings had: below 1 on a machine busy with other work.
        share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    base = study.base
    tokens = base.train.micro_batch * base.train.grad_accum * base.data.seq_len
    step = {name: tokens / speed for name, speed in speeds.items()}
    if args.workdir is not None:  # the same study, planned in the work folder --reuse reads
        study = plan_study(args.recipe, overrides, after, args.seeds, args.from_scratch, args.workdir.resolve())
    runs = count_runs(study, reuse=args.workdir is not None)
    load = os.getloadavg()
    print(
        f"Machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min); one thread, "
        f"which had {share:.2f} of a core while timed (CPU time / wall time)"
    )
    print(
        f"Per training step ({tokens:,} tokens, median of {args.steps}, interleaved): "
        + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in step.items())
    )
    print("Per held-out evaluation: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in evals.items()))
    print("Per run, before its first step: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in setups.items()))
    print()
    print("| runs | to train (of) | steps | evaluations | one core, as timed | one whole core (x share) |")
    print("|---|---|---|---|---|---|")
    total = 0.0
    for label, arm, (trained, count, steps, evaluations) in runs:
        seconds = trained * setups[arm] + steps * step[arm] + evaluations * evals[arm]
        total += seconds
        print(
            f"| {label} | {trained} ({count}) | {steps:,} | {evaluations} | {seconds / 3600:.2f} h | {seconds * share / 3600:.2f} h |"
        )
    print(
        f"| total | | | | {total / 3600:.2f} h ({total / 60:.0f} min) | {total * share / 3600:.2f} h ({total * share / 60:.0f} min) |"
    )


if __name__ == "__main__":
    main()
