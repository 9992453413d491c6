"""The `attnres` commands that train and evaluate: eval, finetune and ab (cli.py registers them)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from attnres_convert.cli_kit import (
    PrivateOption,
    PushToHubOption,
    TokenOption,
    VerboseOption,
    console,
    err_console,
    fail,
    interrupts,
    output_complete,
    stages,
    training_errors,
    user_errors,
    written_files,
)
from attnres_convert.cli_tables import eval_table, finetune_table, throughput_line
from attnres_convert.conversion.options import canonical_dtype


def is_main_process() -> bool:
    # Under `accelerate launch` every process runs this command; only rank 0 talks to the user.
    return int(os.environ.get("RANK", "0")) == 0


def eval_command(
    model: Annotated[
        Optional[str],
        typer.Argument(
            help="A converted folder, hub id, model folder or .gguf file. Default: embedded SmolLM2-135M-Instruct."
        ),
    ] = None,
    data: Annotated[
        list[str],
        typer.Option(
            "--data",
            metavar="FILE",
            help="Held-out text: .txt/.md, .jsonl/.json, .parquet files, globs, or shakespeare:NAME (repeatable).",
        ),
    ] = ...,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")] = 256,
    max_tokens: Annotated[
        Optional[int], typer.Option("--max-tokens", help="Read at most this many tokens of text.")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per forward pass.")] = 1,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="auto keeps the checkpoint's dtype; or float32, bfloat16, float16 (fp32, bf16, fp16).",
        ),
    ] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Allow the model's own code to run.")
    ] = False,
) -> None:
    """Held-out loss and perplexity of a plain or converted model, to compare the two with one tool."""
    import json

    from attnres_convert.io.files import checked_files
    from attnres_convert.io.paths import resolve_source

    with user_errors():  # before torch is imported: every argument the command can check by itself
        resolve_source(model)
        dtype = canonical_dtype(dtype, "--dtype")
        checked_files(data, "--data")
    if seq_len < 2:
        fail(f"--seq-len must be at least 2, got {seq_len}")
    if batch_size < 1:
        fail(f"--batch-size must be at least 1, got {batch_size}")
    if max_tokens is not None and max_tokens < seq_len:
        fail(
            f"--max-tokens {max_tokens} is not enough for one sequence of --seq-len {seq_len}: give at least {seq_len}"
        )
    with user_errors(), stages("eval") as stage, stage("Evaluating"):
        from attnres_convert.analysis.evaluate import evaluate

        result = evaluate(
            model,
            data,
            seq_len=seq_len,
            max_tokens=max_tokens,
            batch_size=batch_size,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
        )
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    table = eval_table(result)
    console.print(table)


def finetune_command(
    recipe: Annotated[
        str, typer.Argument(help="A recipe YAML file, or the name of a shipped recipe (attnres recipes list).")
    ],
    overrides: Annotated[
        Optional[list[str]],
        typer.Argument(help="key.path=value overrides, e.g. train.lr=1e-4 train.steps=50.", show_default=False),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in output.dir from its last checkpoint.")
    ] = False,
    extend: Annotated[
        bool,
        typer.Option(
            "--extend",
            help="Continue the shorter run in output.dir to a larger train.steps, from its latest checkpoint whose "
            "learning rates the longer schedule shares (train.schedule wsd or constant); it is replaced once the "
            "longer run finishes.",
        ),
    ] = False,
    push_to_hub: PushToHubOption = None,
    private: PrivateOption = False,
    token: TokenOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Continued pretraining of a converted model (or, with model.convert=false, of the original)."""
    from attnres_convert.finetune.recipe import load_recipe
    from attnres_convert.io.console import quiet_libraries

    overrides = list(overrides or [])
    if push_to_hub:
        overrides += [f"output.push_to_hub={push_to_hub}"] + (["output.private=true"] if private else [])
    main = is_main_process()
    with training_errors(main), interrupts("finetune (before training started)"):
        parsed = load_recipe(recipe, overrides)  # schema and overrides: answered before torch is imported
        from attnres_convert.finetune.preflight import check_recipe

        check_recipe(parsed, resume=resume, token=token, extend=extend)
    from attnres_convert.finetune.run_folder import left_behind

    left = lambda: left_behind(Path(parsed.output.dir).expanduser())  # noqa: E731 - Ctrl-C before step 1, or a second one
    with training_errors(main), interrupts("finetune", left), quiet_libraries():  # one progress bar: the training one
        from attnres_convert.finetune.training import finetune

        result = finetune(
            parsed,
            resume=resume,
            extend=extend,
            console=err_console if main else None,
            token=token,
            verbose=verbose,
            threads="auto",
        )
    if not main:
        return
    output_complete(f"the run in {result.output} is complete")
    metrics = result.metrics
    table = finetune_table(metrics)
    console.print(table)
    if metrics["tokens_per_s"]:
        console.print(throughput_line(metrics), highlight=False)
    console.print(
        f"[green]Run folder[/] [bold]{escape(str(result.output))}[/] ({written_files(result.output, 'metrics.jsonl', 'loss_curve.png', 'final_metrics.json')})"
    )
    if result.model_dir is not None:
        console.print(f"[green]Model[/] [bold]{escape(str(result.model_dir))}[/]")
    if result.pushed is not None:
        console.print(f"[green]Pushed[/] to [bold]{result.pushed.url}[/]")


def ab_command(
    recipe: Annotated[str, typer.Argument(help="A recipe that trains lora or full (e.g. ab-smollm2-shakespeare).")],
    overrides: Annotated[
        Optional[list[str]], typer.Argument(help="key.path=value overrides for every arm.", show_default=False)
    ] = None,
    sweep: Annotated[
        Optional[list[str]],
        typer.Option(
            "--sweep",
            metavar="OVERRIDES",
            help='An extra AttnRes arm: space- or comma-separated overrides, e.g. "train.attnres_lr=1e-3" (repeatable).',
        ),
    ] = None,
    seeds: Annotated[
        int, typer.Option("--seeds", help="Run every arm with train.seed, train.seed+1, ...: deltas paired per seed.")
    ] = 1,
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output",
            "-o",
            help="Output folder (default outputs/ab-RECIPE, or outputs/RECIPE for a recipe named ab-...).",
        ),
    ] = None,
    workdir: Annotated[
        Optional[Path], typer.Option("--workdir", help="Where the arms' run folders go (default OUTPUT-runs).")
    ] = None,
    no_plain: Annotated[
        bool, typer.Option("--no-plain", help="With --sweep: no AttnRes arm without extra overrides.")
    ] = False,
    jobs: Annotated[
        int, typer.Option("--jobs", help="Train this many arms at once, in one-thread worker processes (CPU).")
    ] = 1,
    reuse: Annotated[
        bool,
        typer.Option(
            "--reuse",
            help="Keep arms already finished in the work folder with the same recipe; resume unfinished ones from "
            "their last checkpoint (checkpoint.every=K among the overrides).",
        ),
    ] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier A/B output folder.")] = False,
    throughput: Annotated[
        int,
        typer.Option(
            "--throughput",
            metavar="STEPS",
            help="Also time STEPS training steps of every arm interleaved in one process (fair tokens/s).",
        ),
    ] = 0,
    from_scratch: Annotated[
        bool,
        typer.Option(
            "--from-scratch",
            help="Every arm starts from the same random initialisation of the config (model.from_scratch=true).",
        ),
    ] = False,
    retrofit_after: Annotated[
        Optional[str],
        typer.Option(
            "--retrofit-after",
            metavar="N[,N...]",
            help="Retrofit study: pretrain the baseline from scratch once per seed, save it after each "
            "N steps, and A/B the retrofit from each save (the recipe's retrofit section); with --from-scratch, the from-scratch lead beside it.",
        ),
    ] = None,
) -> None:
    """A/B: the recipe trained as a baseline and as AttnRes from the same start and data order.

    The baseline is model.convert=false with the same trainable budget; --sweep adds AttnRes arms. Writes ab.json, ab.md, ab.png."""
    from attnres_convert.finetune.ab import run_ab
    from attnres_convert.finetune.recipe import load_recipe
    from attnres_convert.io.console import quiet_libraries

    for name, value in (("--seeds", seeds), ("--jobs", jobs)):  # before torch and transformers are imported
        if value < 1:
            fail(f"{name}: must be >= 1 (got {value})")
    if throughput < 0:
        fail(f"--throughput: must be >= 0 (got {throughput})")
    main = is_main_process()
    arms = [[o for o in entry.replace(",", " ").split() if o] for entry in (sweep or [])]
    interrupted = (
        "Finished arms are kept in the work folder: run the same command with --reuse to train only the others "
        "(an unfinished arm resumes from its last checkpoint, with checkpoint.every=K among the overrides)."
    )
    after = None
    with training_errors(main):  # the recipe and overrides: answered before torch is imported
        load_recipe(recipe, list(overrides or []))
        if retrofit_after is not None:
            from attnres_convert.finetune.ab import retrofit_steps

            after = retrofit_steps(retrofit_after, sweep=sweep, no_plain=no_plain, throughput=throughput)
    command = "attnres ab " + shlex.join(sys.argv[2:]) if len(sys.argv) > 1 and sys.argv[1] == "ab" else None
    with (
        training_errors(main, lambda error: f"{escape(str(error).split(';')[0])}. {interrupted}"),
        interrupts("ab", "f" + interrupted[1:].rstrip(".")),
        quiet_libraries(),
    ):
        if after is not None:
            from attnres_convert.finetune.retrofit import run_retrofit

            result = run_retrofit(
                recipe,
                list(overrides or []),
                after=after,
                seeds=seeds,
                from_scratch=from_scratch,
                output=output,
                workdir=workdir,
                jobs=jobs,
                reuse=reuse,
                overwrite=overwrite,
                console=err_console if main else None,
                command=command,
                sweep=arms,
            )
        else:
            result = run_ab(
                recipe,
                list(overrides or []),
                sweep=arms,
                seeds=seeds,
                output=output,
                workdir=workdir,
                plain=not no_plain,
                jobs=jobs,
                reuse=reuse,
                overwrite=overwrite,
                throughput=throughput,
                from_scratch=from_scratch,
                console=err_console if main else None,
                command=command,
            )
    if not main:
        return
    from attnres_convert.finetune.ab import console_report

    if after is not None:  # the study's own report: a table per N (retrofit.md holds it, and every A/B's)
        from rich.markdown import Markdown

        console.print(Markdown((result.output / "retrofit.md").read_text()))
        console.print(
            f"[green]Retrofit study[/] [bold]{escape(str(result.output))}[/] ({written_files(result.output, 'retrofit.json', 'retrofit.md', 'retrofit.png')}, after-N/)"
        )
        return
    console.print(console_report(result.report, result.output), highlight=False)
    console.print(
        f"[green]A/B[/] [bold]{escape(str(result.output))}[/] ({written_files(result.output, 'ab.json', 'ab.md', 'ab.png')})"
    )
