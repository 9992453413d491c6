"""The `attnres` command line: thin Typer commands over the attnres_convert library."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from attnres_convert.cli_kit import (  # noqa: F401 - shared by every command
    EXIT_BAD_INPUT,
    EXIT_FAILED_CHECK,
    PrivateOption,
    PushToHubOption,
    TokenOption,
    VerboseOption,
    console,
    err_console,
    fail,
    interrupts,
    missing_package_exits,
    options_from,
    output_complete,
    scrubbed,
    stages,
    training_errors,
    user_error_kinds,
    user_errors,
    whole_process,
    written_files,
)
from attnres_convert.cli_tables import (  # noqa: F401
    depth_table,
    eval_table,
    finetune_table,
    generate_note,
    summary_table,
    throughput_line,
    verification_table,
)
from attnres_convert.cli_training import ab_command, eval_command, finetune_command
from attnres_convert.conversion.options import ConvertOptions, canonical_dtype

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(
    name="attnres",
    help="Convert pretrained PreNorm causal LMs to Block Attention Residuals, exactly; fine-tune; share.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from attnres_convert import __version__

        print(f"attnres {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the attnres version and exit.", is_eager=True, callback=_print_version),
    ] = False,
) -> None:
    """Keep `attnres` a command group even while it has one command."""


def check_push_options(repo_id: str | None, token: str | None) -> None:
    """Before a long job: a bad repo id or a missing token fails now, not after the model is built."""
    if repo_id is None:
        return
    from attnres_convert.hub.push import check_repo_id, resolve_token

    with user_errors():
        check_repo_id(repo_id)
        resolve_token(token)


def push_saved(folder: Path, repo_id: str, **kwargs) -> None:
    """Push a saved folder and say where it went (errors: exit 2, the folder stays saved locally)."""
    from attnres_convert.hub.push import push_folder

    with (
        user_errors(),
        stages(
            f"pushing to {repo_id}", f"{folder} is unchanged, and a hub commit is made whole or not at all"
        ) as stage,
        stage(f"Pushing {folder} to {repo_id}"),
    ):
        result = push_folder(folder, repo_id, **kwargs)
    console.print(f"[green]Pushed[/] {len(result.files)} files to [bold]{result.url}[/] ({result.revision})")
    if result.commit_url:
        console.print(f"commit: {result.commit_url}", highlight=False)


@app.command()
@options_from(ConvertOptions, panel="Conversion options")
def convert(
    source: Annotated[
        Optional[str],
        typer.Argument(help="Hub id, local model folder or .gguf file. Default: embedded SmolLM2-135M-Instruct."),
    ] = None,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Output folder (written only once the model is complete).")
    ] = ...,
    push_to_hub: PushToHubOption = None,
    private: PrivateOption = False,
    token: TokenOption = None,
    verbose: VerboseOption = False,
    options: ConvertOptions = None,
) -> None:
    """Convert a PreNorm causal LM to Block AttnRes and check it reproduces the original."""
    from attnres_convert.conversion.arguments import check_arguments

    with user_errors():  # before torch is imported: a wrong path or a taken folder is answered at once
        check_arguments(source, output, options)
    check_push_options(push_to_hub, token)
    from attnres_convert.io.threads import cpu_threads, torch_threads, usable_cores

    threads, why = cpu_threads()  # one per idle core: a busy machine slows the verification by its load alone
    if verbose or threads < usable_cores():
        err_console.print(f"{threads} torch thread{'s' if threads != 1 else ''} ({why})", highlight=False)
    with user_errors(), stages("convert", f"nothing was written to {output}") as stage, torch_threads(threads):
        from attnres_convert import convert as run_convert

        result = run_convert(source, output, options, stage=stage, progress=stage.progress)
    if not push_to_hub:
        output_complete(f"{result.output} is complete")
    console.print(summary_table(result.summary))
    if result.verification is not None:
        console.print(verification_table(result.verification))
        if generate_note(result.verification):
            console.print(generate_note(result.verification), highlight=False)
    if result.verification_budget and (verbose or result.budget_mattered):
        console.print(f"verification {result.verification_budget}", highlight=False)
    console.print(f"[green]Saved[/] {result.source} as Block AttnRes to [bold]{result.output}[/]")
    if push_to_hub:
        push_saved(result.output, push_to_hub, private=private, token=token)
        output_complete(f"{result.output} is complete and pushed to {push_to_hub}")


@app.command()
def push(
    folder: Annotated[Path, typer.Argument(help="A folder written by `attnres convert` or `attnres finetune`.")],
    repo_id: Annotated[str, typer.Argument(help="Hub repo: NAME or NAMESPACE/NAME (created if missing).")],
    private: PrivateOption = False,
    revision: Annotated[
        Optional[str], typer.Option("--revision", help="Branch to push to (created from main if missing).")
    ] = None,
    commit_message: Annotated[Optional[str], typer.Option("--commit-message", help="Commit message.")] = None,
    token: TokenOption = None,
) -> None:
    """Upload a converted or fine-tuned model folder to the HuggingFace hub, after checking it loads."""
    if not folder.expanduser().is_dir():  # before the hub libraries are imported
        fail(f"{folder} is not a folder. Pass the output folder of `attnres convert` or `attnres finetune`.")
    push_saved(folder, repo_id, private=private, revision=revision, commit_message=commit_message, token=token)


@app.command("inspect")
def inspect_command(
    model: Annotated[
        Optional[str],
        typer.Argument(
            help="A converted folder, or a plain model (hub id, folder, .gguf) to convert in memory. Default: embedded SmolLM2."
        ),
    ] = None,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            "--plot",
            metavar="OUT.png",
            help="Write the depth weights to OUT.png, the same against uniform to OUT-relative.png, and per-sublayer "
            "magnitudes and gradients (residual sum against AttnRes) to OUT-magnitudes.png.",
        ),
    ] = None,
    text: Annotated[
        Optional[Path], typer.Option("--text", help="Text to average over (default: a built-in sample).")
    ] = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=2, help="Use at most this many tokens of the text.")
    ] = 256,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Allow a plain model's own code to run.")
    ] = False,
) -> None:
    """Show the AttnRes structure and the learned depth-attention weights; plot them with --plot."""
    from attnres_convert.io.paths import resolve_source

    if text is not None and not text.is_file():
        fail(f"--text {text}: no such file.")
    with user_errors():  # before torch is imported
        resolve_source(model)
    with user_errors(), stages("inspect", "nothing was written") as stage, stage("Inspecting"):
        from attnres_convert.analysis.inspection import inspect_source

        result = inspect_source(
            model,
            text=text.read_text(errors="replace") if text else None,
            max_tokens=max_tokens,
            plot=str(plot) if plot else None,
            trust_remote_code=trust_remote_code,
        )
    inspection = result.inspection
    console.print(summary_table(inspection.summary))
    console.print(depth_table(inspection.depth))
    for note in inspection.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    for path in result.plots:
        console.print(f"[green]Wrote[/] {path}")


from attnres_convert.analysis.bench_settings import QUICK_SETTINGS_TEXT, ROUND_COST  # noqa: E402 - the help's facts

BenchDevice = Enum("BenchDevice", {name: name for name in ("cpu", "cuda")}, type=str)
BenchKernels = Enum("BenchKernels", {name: name for name in ("eager", "triton", "cpu")}, type=str)


@app.command("bench")
def bench_command(
    model: Annotated[
        Optional[str],
        typer.Argument(help="Hub id, local model folder or .gguf file. Default: embedded SmolLM2-135M-Instruct."),
    ] = None,
    device: Annotated[BenchDevice, typer.Option(help="Where both models run.")] = BenchDevice.cpu,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="float32, bfloat16 or float16 (fp32, bf16, fp16) \\[default: float32 on cpu, bfloat16 on cuda].",
            show_default=False,
        ),
    ] = None,
    kernels: Annotated[
        Optional[BenchKernels],
        typer.Option(
            help="The converted model's depth mix (ATTNRES_KERNEL) \\[default: as set, auto].", show_default=False
        ),
    ] = None,
    compile_: Annotated[bool, typer.Option("--compile", help="Run both models under torch.compile.")] = False,
    batch: Annotated[int, typer.Option(help="Sequences per prefill and training step.")] = 1,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence of a prefill and a training step.")] = 512,
    decode_tokens: Annotated[
        int, typer.Option(help="Greedy tokens generated with the KV cache, after a 32-token prompt.")
    ] = 64,
    rounds: Annotated[
        int, typer.Option(help=f"Timed rounds, each running both models once, after one warm-up round. {ROUND_COST}")
    ] = 5,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick", help=f"A rough look: {QUICK_SETTINGS_TEXT} (where left at their defaults), no memory measure."
        ),
    ] = False,
    threads: Annotated[
        Optional[int], typer.Option(help="torch threads on CPU \\[default: torch's].", show_default=False)
    ] = None,
    measure: Annotated[
        str, typer.Option(help="What to measure, comma-separated: prefill, decode, train, memory.")
    ] = "prefill,decode,train,memory",
    block_size: Annotated[
        Optional[int], typer.Option(help="Convert with this block size S \\[default: convert's].", show_default=False)
    ] = None,
    full: Annotated[bool, typer.Option("--full", help="Convert to Full AttnRes (S = 1).")] = False,
    json_file: Annotated[
        Optional[Path], typer.Option("--json", metavar="FILE", help="Write the results as JSON to FILE.")
    ] = None,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the results as Markdown (the docs' tables).")
    ] = False,
) -> None:
    """Convert MODEL and measure it against the original: prefill, decoding, a training step, peak memory."""
    from attnres_convert.analysis.bench_settings import (
        BenchSettings,
        check_values,
        estimate,
        output_problem,
        quick_settings,
        runs_total,
    )
    from attnres_convert.io.paths import resolve_source

    settings = BenchSettings(
        device=device.value,
        dtype=dtype,
        kernels=kernels.value if kernels else None,
        compile=compile_,
        batch=batch,
        seq_len=seq_len,
        decode_tokens=decode_tokens,
        rounds=rounds,
        threads=threads,
        measure=tuple(m.strip() for m in measure.split(",") if m.strip()),
        block_size=block_size,
        full=full,
    )
    with user_errors():  # before torch is imported: every setting the command can check by itself
        source = resolve_source(model)
        if dtype is not None:
            settings.dtype = canonical_dtype(dtype, "--dtype", allowed=("float32", "bfloat16", "float16"))
        if quick:
            settings = quick_settings(settings)
        check_values(settings)
    if json_file is not None and (problem := output_problem(json_file)):
        fail(f"--json {json_file}: cannot write there ({problem}).")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    err_console.print(estimate(settings, source.kind == "default", os.cpu_count() or 1, load), highlight=False)
    from attnres_convert.analysis.bench import run_bench
    from attnres_convert.analysis.bench_report import console_table, write_json
    from attnres_convert.analysis.bench_report import markdown as to_markdown

    command = "attnres bench " + shlex.join(sys.argv[2:]) if len(sys.argv) > 1 and sys.argv[1] == "bench" else None
    with user_errors(), stages("bench") as stage:
        runs: list = []  # the line of timed runs, shown from the first run on

        def on_run(name: str) -> None:
            if not runs:
                runs.append(stage.items("timed runs (both models)", runs_total(settings)))
            runs[0]()

        result = run_bench(model, settings, stage=stage, on_run=on_run, command=command)
    data = result.to_dict()
    print(to_markdown(data), end="") if markdown else console.print(console_table(data))
    if json_file is not None:
        write_json(data, json_file)
        err_console.print(f"[green]Wrote[/] {escape(str(json_file))}")


kernels_app = typer.Typer(help="The depth-mix kernels: build the C++ ones ahead of time.", no_args_is_help=True)
app.add_typer(kernels_app, name="kernels")


@kernels_app.command("build")
def kernels_build() -> None:
    """Compile the C++ depth-mix kernels now; the default path then runs them for float32 inference on CPU."""
    import time

    from .kernels import cpu as depth_kernels_cpu

    start = time.perf_counter()
    with user_errors():  # a compiler without OpenMP: a warning saying what to install
        with stages() as stage, stage("Building the C++ depth-mix kernels (once per machine)"):
            try:
                kernels = depth_kernels_cpu.build()
            except RuntimeError as error:
                fail(str(error), EXIT_FAILED_CHECK)
    console.print(
        f"[green]C++ depth-mix kernels ready[/] ({time.perf_counter() - start:.0f} s): {escape(str(kernels.__file__))}; "
        "float32 inference on CPU runs them",
        highlight=False,
    )


recipes_app = typer.Typer(help="Fine-tuning recipes: list, show and validate them.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")


@app.command("upgrade")
def upgrade_command(
    folder: Annotated[Path, typer.Argument(help="A folder converted by an earlier attnres.")],
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Where to write it (default: replace FOLDER).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUTPUT.")] = False,
    trust_remote_code: Annotated[
        bool, typer.Option(help="Run the folder's own code once, to check the new code against it.")
    ] = False,
) -> None:
    """Re-save a converted folder with this release's code (two files), checked exactly against its own code."""
    from attnres_convert.conversion.upgrade import upgrade_folder

    with user_errors(), stages() as stage, stage(f"Upgrading {folder}"):
        result = upgrade_folder(folder, output, overwrite, trust_remote_code)
    console.print(
        f"[green]Saved[/] {escape(str(result.folder))}: this release's code ({', '.join(result.files)}), logits equal "
        "to the folder's own code on the probe tokens",
        highlight=False,
    )


# The commands that train and evaluate (cli_training.py).
app.command("eval")(eval_command)
app.command("finetune")(finetune_command)
app.command("ab")(ab_command)


@app.command("architectures")
def architectures_command(
    model_types: Annotated[
        Optional[list[str]],
        typer.Argument(help="Model types to check (all causal-LM model types when none is given).", show_default=False),
    ] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the table as Markdown.")] = False,
    write: Annotated[
        Optional[Path],
        typer.Option("--write", help="Replace the coverage table in this Markdown file (e.g. docs/architectures.md)."),
    ] = None,
    variants: Annotated[
        bool, typer.Option("--variants/--no-variants", help="Also check non-default config variants.")
    ] = True,
) -> None:
    """Which causal-LM model types of the installed transformers convert exactly (tiny random models, no download)."""
    if write is not None and model_types:
        fail("--write rewrites the whole table: run it without model types.")
    if write is not None and not write.is_file():
        fail(f"--write {write}: no such file. Give an existing Markdown file; the table goes between its markers.")
    from attnres_convert.io import model_types as light

    known = light.causal_lm_model_types() if model_types else None  # a misspelt type answered before torch
    if known is None:
        from attnres_convert.conversion import coverage  # transformers' model-type lists import torch

        known = set(coverage.causal_lm_model_types())
    unknown = [t for t in model_types or [] if t not in known]
    if unknown:
        import difflib

        close = [match for name in unknown for match in difflib.get_close_matches(name, sorted(known), n=2)]
        hint = f"Did you mean {' or '.join(close)}? " if close else ""
        fail(
            f"not a causal-LM model type of this transformers: {', '.join(unknown)}. {hint}Run without arguments for all."
        )
    from rich.progress import MofNCompleteColumn

    from attnres_convert.conversion import coverage

    rows = len(model_types or coverage.causal_lm_model_types())
    total = rows + (len(coverage.VARIANTS) if variants and not model_types else 0)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as progress:
        task = progress.add_task("checking", total=total)
        started = [0]

        def step(name: str) -> None:  # called as each row starts
            progress.update(task, completed=started[0], description=name)
            started[0] += 1

        report = coverage.walk(model_types or None, variants=variants and not model_types, progress=step)
    if write is not None:
        text = write.read_text()
        write.write_text(coverage.replace_table(text, coverage.markdown(report)))
        err_console.print(f"[green]Wrote[/] the coverage table to {escape(str(write))}")
    if markdown:
        print(coverage.markdown(report))
    elif write is None:
        colours = {"converted": "green", "refused": "yellow", "not built": "red"}
        table = Table(title=f"transformers {report.transformers_version}: causal-LM model types")
        for column in ("model type", "status", "structure found or reason"):
            table.add_column(column, overflow="fold")
        for row in report.rows:
            table.add_row(escape(row.label), f"[{colours[row.status]}]{row.status}[/]", escape(row.detail))
        console.print(table)
    console.print(report.summary(), highlight=False)


@recipes_app.command("list")
def recipes_list() -> None:
    """The shipped recipes."""
    from rich.padding import Padding

    from attnres_convert.errors import first_line
    from attnres_convert.finetune.recipe import RecipeError, load_recipe, recipes_dir, shipped_recipes

    # A recipe per entry, its name first on its line: the name is what the user types and is never cut; the
    # rest wraps to the terminal (a table's five columns cut names at 80).
    console.print(f"Recipes in {escape(str(recipes_dir()))} (attnres recipes show NAME prints one):", highlight=False)
    for name, path in shipped_recipes().items():
        console.print()
        try:
            recipe = load_recipe(path)
        except RecipeError as error:
            console.print(f"[bold]{escape(name)}[/] [red]invalid:[/] {escape(first_line(error))}", highlight=False)
            continue
        console.print(
            f"[bold]{escape(name)}[/]: {escape(recipe.model.describe())}, trains {recipe.train.trainable}, {recipe.train.steps} steps",
            highlight=False,
        )
        if recipe.description:
            console.print(Padding(escape(recipe.description), (0, 0, 0, 2)), highlight=False)


@recipes_app.command("show")
def recipes_show(name: Annotated[str, typer.Argument(help="A shipped recipe name or a recipe file.")]) -> None:
    """Print a recipe as written (with its comments)."""
    from attnres_convert.finetune.recipe import find_recipe

    with user_errors():
        path = find_recipe(name)
    print(path.read_text(), end="")


@recipes_app.command("validate")
def recipes_validate(
    recipe: Annotated[str, typer.Argument(help="A recipe file or a shipped recipe name.")],
    overrides: Annotated[
        Optional[list[str]], typer.Argument(help="key.path=value overrides.", show_default=False)
    ] = None,
    show: Annotated[
        bool, typer.Option("--show", help="Also print the resolved recipe (every field, overrides applied) as YAML.")
    ] = False,
) -> None:
    """Check a recipe (schema, data files, model source, sequence length) without loading or writing anything."""
    from attnres_convert.finetune.preflight import check_recipe, existing_output_problem
    from attnres_convert.finetune.recipe import load_recipe

    with user_errors():
        parsed = load_recipe(recipe, list(overrides or []))
        check_recipe(parsed, check_output=False)
    taken = existing_output_problem(parsed)
    refused = f"`attnres finetune` refuses it as it stands: {taken}" if taken is not None else None
    if show:  # printed as is, never wrapped to the terminal: what looks like YAML parses as YAML, verdict included
        print(parsed.to_yaml().rstrip("\n"))
        print(f"# valid: {recipe}")
        if refused:
            print(f"# note: {' '.join(refused.split())}")
        return
    console.print(f"[green]valid:[/] {escape(recipe)}", highlight=False)
    console.print(escape(parsed.headline()), highlight=False)
    if refused:
        console.print(f"[yellow]note:[/] {escape(refused)}", highlight=False)
    console.print("--show prints the resolved recipe (every field) as YAML.", highlight=False)


def _terminate(signum, frame) -> None:
    # SIGTERM unwinds like Ctrl-C (temporary folders are removed, checkpoints closed), exit code 128 + 15.
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    with whole_process(), missing_package_exits():
        app()


if __name__ == "__main__":
    sys.exit(main())
