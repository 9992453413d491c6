"""The A/B: does AttnRes pay? One recipe, run twice from the same start with the same data order.

    baseline  the recipe with model.convert=false: the original model, same trainable budget except the
              AttnRes parameters (e.g. the same LoRA adapters)
    attnres   the recipe as written: converted, the AttnRes parameters train alongside

Reported (held-out loss, nats per token, on the recipe's held-out text): the original model (the baseline's
step-0 evaluation), the converted model at step 0 (must equal the original), both after training, and the
training tokens/s of each. `--sweep` adds AttnRes variants (each a comma-separated list of overrides)
against the same baseline.

    python benchmarks/ab.py recipes/ab-smollm2-shakespeare.yaml --name ab-smollm2-shakespeare
    python benchmarks/ab.py recipes/ab-smollm2-shakespeare.yaml --name sweep \\
        --sweep train.attnres_lr=1e-2 --sweep train.attnres_lr=1e-1,train.schedule=wsd

Writes benchmarks/results/NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from attnres_convert.finetune.metrics import read_metrics  # noqa: E402
from attnres_convert.finetune.recipe import apply_overrides, find_recipe, parse_recipe, read_yaml  # noqa: E402
from attnres_convert.finetune.training import finetune  # noqa: E402


def arm_recipe(data: dict, overrides: list[str], out: Path):
    return parse_recipe(
        apply_overrides(data, [*overrides, f"output.dir={out}", "output.save_model=false", "output.overwrite=true", "eval.at_start=true"])
    )


def finished(recipe, out: Path) -> bool:
    """An arm already run with exactly this recipe (`--reuse`): its run folder is complete."""
    saved = out / "recipe.yaml"
    return (out / "final_metrics.json").is_file() and saved.is_file() and saved.read_text() == recipe.to_yaml()


def run_arm(name: str, data: dict, overrides: list[str], workdir: Path, console, reuse: bool = False) -> dict:
    out = workdir / name
    recipe = arm_recipe(data, overrides, out)
    if reuse and finished(recipe, out):
        if console:
            console.print(f"{name}: reusing the finished run in {out}")
        return summarize_arm(name, overrides, out)
    if console:
        console.rule(f"[bold]{name}[/]: {' '.join(overrides) or 'recipe as written'}")
    result = finetune(recipe, console=console)
    del result
    gc.collect()
    return summarize_arm(name, overrides, out)


def summarize_arm(name: str, overrides: list[str], out: Path) -> dict:
    final = json.loads((out / "final_metrics.json").read_text())
    records = read_metrics(out / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    return {
        "name": name,
        "overrides": overrides,
        "converted": final["converted"],
        "eval_loss_step0": evals[0]["loss"],
        "eval_loss_final": final["eval_loss"],
        "eval_perplexity_final": final["eval_perplexity"],
        "eval_curve": [(r["step"], r["loss"]) for r in evals],
        "train_loss_last": final["train_loss_last"],
        "tokens": final["tokens"],
        "tokens_per_s": final["tokens_per_s"],
        "train_seconds": final["train_seconds"],
        "trainable_parameters": final["trainable_parameters"],
        "attnres_parameters": final["attnres_parameters"],
        "train_curve": [(r["step"], r["loss"]) for r in records if r["kind"] == "train"],
    }


def arm_name(extra: list[str]) -> str:
    return "attnres" + "".join(f"_{o.replace('/', '-')}" for o in extra)


def throughput(data: dict, arms: list[tuple[str, list[str]]], steps: int, workdir: Path) -> dict[str, float]:
    """Training tokens/s of each arm, measured interleaved in one process on the same batch (one step of
    each arm in turn, alternating the order), so a busy machine slows every arm alike. Median of `steps`."""
    import statistics
    import time

    import torch

    from attnres_convert.finetune.optim import apply_lora, make_optimizer, select_trainable
    from attnres_convert.finetune.starting_model import load_starting_model
    from attnres_convert.finetune.training import token_loss

    built = []
    for name, overrides in arms:
        recipe = arm_recipe(data, overrides, workdir / f"throughput-{name}")
        model = load_starting_model(recipe).model
        if recipe.train.trainable == "lora":
            model = apply_lora(model, recipe.lora, recipe.train.seed)
        select_trainable(model, recipe.train.trainable)
        built.append((name, model.train(), make_optimizer(model, recipe)))
    micro, length = recipe.train.micro_batch, recipe.data.seq_len
    vocab = built[0][1].get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (micro, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": None, "predictions": micro * (length - 1)}
    times: dict[str, list[float]] = {name: [] for name, _, _ in built}
    for round_ in range(steps + 2):  # two warm-up rounds
        for name, model, optimizer in built if round_ % 2 == 0 else reversed(built):
            began = time.perf_counter()
            loss, _ = token_loss(model, batch, "cpu")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if round_ >= 2:
                times[name].append(time.perf_counter() - began)
    return {name: micro * length / statistics.median(values) for name, values in times.items()}


def _one_thread() -> None:
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def markdown(report: dict) -> str:
    base = report["baseline"]
    lines = [
        f"# A/B: {report['recipe']} ({report['steps']} steps, {base['tokens']:,} training tokens per arm)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['machine']}; torch {report['torch']}, {report['threads']} thread(s) per arm, "
        f"{report.get('jobs', 1)} arm(s) at a time (tokens/s depend on what else the machine was running).",
        "",
        "| model | held-out loss | perplexity | Δ vs baseline | trainable params | tokens/s (run) | tokens/s (interleaved) |",
        "|---|---|---|---|---|---|---|",
        f"| original (no training) | {base['eval_loss_step0']:.4f} | {_ppl(base['eval_loss_step0']):.2f} | | | | |",
    ]
    for arm in report["attnres"]:
        lines.append(
            f"| converted, step 0{_label(arm)} | {arm['eval_loss_step0']:.4f} | {_ppl(arm['eval_loss_step0']):.2f} | "
            f"{arm['eval_loss_step0'] - base['eval_loss_step0']:+.2e} vs original | | | |"
        )
        break
    lines.append(
        f"| baseline after training | {base['eval_loss_final']:.4f} | {base['eval_perplexity_final']:.2f} | | "
        f"{base['trainable_parameters']:,} | {base['tokens_per_s']:,.0f} | {_speed(base)} |"
    )
    for arm in report["attnres"]:
        lines.append(
            f"| AttnRes after training{_label(arm)} | {arm['eval_loss_final']:.4f} | {arm['eval_perplexity_final']:.2f} | "
            f"{arm['eval_loss_final'] - base['eval_loss_final']:+.4f} | {arm['trainable_parameters']:,} "
            f"(AttnRes {arm['attnres_parameters']:,}) | {arm['tokens_per_s']:,.0f} | {_speed(arm)} |"
        )
    lines += ["", "Held-out loss during training (step: baseline / AttnRes variants):", ""]
    steps = [s for s, _ in base["eval_curve"]]
    header = "| step | baseline | " + " | ".join(_label(a).strip(" ()") or "AttnRes" for a in report["attnres"]) + " |"
    lines += [header, "|---" * (2 + len(report["attnres"])) + "|"]
    for index, step in enumerate(steps):
        cells = [f"{base['eval_curve'][index][1]:.4f}"]
        for arm in report["attnres"]:
            curve = dict(arm["eval_curve"])
            cells.append(f"{curve[step]:.4f}" if step in curve else "")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _speed(arm: dict) -> str:
    value = arm.get("tokens_per_s_interleaved")
    return f"{value:,.0f}" if value else ""


def _ppl(loss: float) -> float:
    import math

    return math.exp(loss)


def _label(arm: dict) -> str:
    return f" ({', '.join(arm['overrides'])})" if arm["overrides"] else ""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="Recipe file or shipped recipe name.")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides for both arms.")
    parser.add_argument("--name", default="ab", help="Result file name (benchmarks/results/NAME.json|md).")
    parser.add_argument("--sweep", action="append", default=[], help="An AttnRes variant: comma-separated overrides (repeatable).")
    parser.add_argument("--no-plain", action="store_true", help="With --sweep: skip the AttnRes arm with no extra overrides.")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--workdir", default=None, help="Where the runs write (default: a temporary folder).")
    parser.add_argument("--jobs", type=int, default=1, help="Run this many arms at once, each in its own 1-thread process.")
    parser.add_argument("--throughput", type=int, default=0, metavar="STEPS",
                        help="Also time STEPS training steps of every arm interleaved in one process (fair tokens/s).")
    parser.add_argument("--reuse", action="store_true", help="Keep arms already finished in --workdir with the same recipe.")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    import torch
    import transformers
    from rich.console import Console

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    console = None if args.quiet else Console(stderr=True)
    data = read_yaml(find_recipe(args.recipe))
    recipe = parse_recipe(apply_overrides(data, args.overrides))
    if recipe.train.trainable == "attnres":
        raise SystemExit("the A/B needs a recipe that trains something besides AttnRes (train.trainable: lora or full)")
    variants = ([] if args.no_plain else [[]]) + [[o for o in v.split(",") if o] for v in args.sweep]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="attnres-ab-"))
    jobs = [("baseline", [*args.overrides, "model.convert=false"])]
    jobs += [(arm_name(extra), [*args.overrides, *extra]) for extra in variants]
    if args.jobs > 1:
        # Arms in parallel processes, one thread each: on a shared CPU this beats one process per arm in turn.
        import concurrent.futures
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_one_thread) as pool:
            futures = [pool.submit(run_arm, name, data, overrides, workdir, None, args.reuse) for name, overrides in jobs]
            summaries = [future.result() for future in futures]
    else:
        summaries = [run_arm(name, data, overrides, workdir, console, args.reuse) for name, overrides in jobs]
    baseline, arms = summaries[0], summaries[1:]
    for arm, extra in zip(arms, variants):
        arm["overrides"] = extra
    if args.throughput:
        if console:
            console.print(f"Measuring training throughput: {args.throughput} interleaved steps per arm ...")
        measured = throughput(data, jobs, args.throughput, workdir)
        for summary, (name, _) in zip(summaries, jobs):
            summary["tokens_per_s_interleaved"] = measured[name]
    report = _write(args, recipe, baseline, arms)
    if console:
        console.print(markdown(report))
    return report


def _write(args, recipe, baseline, arms) -> dict:
    import torch

    report = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "command": "python benchmarks/ab.py " + " ".join(sys.argv[1:]),
        "steps": recipe.train.steps,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": 1 if args.jobs > 1 else torch.get_num_threads(),
        "jobs": args.jobs,
        "baseline": baseline,
        "attnres": arms,
    }
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    if arms:
        (results / f"{args.name}.md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    main()
