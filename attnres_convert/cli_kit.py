"""The machinery every `attnres` command shares: error rendering and exit codes, Ctrl-C handling, the Rich
stage display (with the driven libraries kept quiet), and --help without value metavars on flags.

A new command uses `user_errors()` (errors the user can fix: one line, exit 2), `stages(WHAT, LEFT_BEHIND)`
for long work (progress lines, Ctrl-C says which stage of WHAT stopped and what is left), `interrupts()`
where it shows no stage display, and `training_errors()` for a training launch; `options_from(MODEL)` turns an
options model's fields into a command's options.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text


def _stderr_console() -> Console:
    """The console of progress lines and messages. Its live displays (spinners, bars redrawn in place) need a
    terminal: Rich takes FORCE_COLOR (or TTY_COMPATIBLE=1) for one even where stderr is a pipe or a file, and
    would write every frame into it (`⠋ Reading config 0:00:00` lines in a log). Where stderr is not a terminal
    the console is not one either (colours kept as asked), so the stage lines are printed once, plain, as they
    end; TTY_INTERACTIVE=1 asks for the frames anyway."""
    console = Console(stderr=True)
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    if console.is_terminal and not tty and os.environ.get("TTY_INTERACTIVE") != "1":
        return Console(stderr=True, force_terminal=False, color_system=console.color_system)
    return console


err_console = _stderr_console()
console = Console()  # the commands' standard output (one object: cli.py's and cli_training.py's)


def _readable_value_types() -> None:
    """Typer 0.29 shows `<bool>` beside every flag in --help, as if it took a value: a flag shows none. It
    shows a repeatable argument (`overrides...`) as `<list[str]>`, Python's type, not what is typed: each
    value is a `<str>`, and the `...` beside the name already says there may be several."""
    from typer.core import TyperArgument, TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "readable", False):  # None: a typer before 0.29, which shows no types
        return

    def option_type(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    shown_argument = TyperArgument.display_type_rich

    def argument_type(self, ctx):
        text = shown_argument(self, ctx)
        if text and text.startswith("<list[") and text.endswith("]>"):
            return "<" + text[len("<list[") : -len("]>")] + ">"
        return text

    option_type.readable = argument_type.readable = True
    TyperOption.display_type_rich = option_type
    TyperArgument.display_type_rich = argument_type


_readable_value_types()

EXIT_BAD_INPUT = 2
EXIT_FAILED_CHECK = 1


def scrubbed(text: str) -> str:
    """TEXT without a HuggingFace token (HF_TOKEN's value or anything shaped like one)."""
    from attnres_convert.errors import scrub

    return scrub(text, os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    # Escaped: a path or an upstream message with [brackets] is text, not Rich markup.
    err_console.print(f"[bold red]error:[/] {escape(scrubbed(message))}", highlight=False)
    raise typer.Exit(code)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(scrubbed(str(message)))}", highlight=False)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Errors the user can fix: a message, exit code 2, no traceback."""
    from attnres_convert.errors import VerificationError

    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning  # "warning: ..." lines, e.g. for a pickle-only checkpoint
            yield
    except VerificationError as error:
        fail(str(error), EXIT_FAILED_CHECK)
    except Exception as error:
        if not isinstance(error, user_error_kinds()):
            raise
        fail(str(error))


@contextlib.contextmanager
def missing_package_exits() -> Iterator[None]:
    """A missing optional package raised by the import a command makes before its own error handling (the
    recipe schema, pydantic): the message that names it and its pip command, exit code 2."""
    from attnres_convert.optional import MissingPackageError

    try:
        yield
    except MissingPackageError as error:
        err_console.print(f"[bold red]error:[/] {escape(scrubbed(str(error)))}", highlight=False)
        sys.exit(EXIT_BAD_INPUT)


def written_files(folder, *names: str) -> str:
    """Those of NAMES that FOLDER holds, for a command's closing line (no picture where matplotlib is missing)."""
    return ", ".join(name for name in names if (folder / name).exists())


def user_error_kinds() -> tuple[type[Exception], ...]:
    """The exception classes that are the user's to fix. Found without importing torch: an error class
    whose module was never imported cannot have been raised."""
    from attnres_convert.errors import AttnResError

    kinds = [AttnResError]
    for module, name in (
        ("attnres_convert.conversion.surgery", "BlockSizeError"),
        ("attnres_convert.architectures", "UnsupportedModelError"),
    ):
        if module in sys.modules:
            kinds.append(getattr(sys.modules[module], name))
    return tuple(kinds)


@contextlib.contextmanager
def interrupts(
    what: str | Callable[[], str], left_behind: str | Callable[[], str] = "nothing was written"
) -> Iterator[None]:
    """Ctrl-C (or SIGTERM) while WHAT (text, or a function saying it at that moment) runs: one line saying
    what stopped and what is LEFT_BEHIND (text, or a function saying it once the stack has unwound), exit
    128 + signal. Temporary folders are removed as the stack unwinds."""
    describe = what if callable(what) else lambda: what
    left = left_behind if callable(left_behind) else lambda: left_behind
    try:
        yield
    except KeyboardInterrupt:
        err_console.print(f"[yellow]interrupted:[/] {escape(describe())} stopped; {escape(left())}.", highlight=False)
        raise typer.Exit(130) from None
    except SystemExit as stop:
        if stop.code == 128 + signal.SIGTERM:
            err_console.print(
                f"[yellow]terminated:[/] {escape(describe())} stopped; {escape(left())}.", highlight=False
            )
        raise


# Set by cli.main (the installed command, `python -m attnres_convert`): only a whole process may take over its
# signals; a command run in another program (CliRunner, tests) leaves them alone.
_own_process: list[bool] = []


@contextlib.contextmanager
def whole_process() -> Iterator[None]:
    """The command line run as its own process (cli.main): `output_complete` may take over Ctrl-C, and once the
    command has returned, Ctrl-C and SIGTERM are ignored (`ignore_signals_at_exit`)."""
    _own_process.append(True)
    try:
        yield
    finally:
        ignore_signals_at_exit()


def output_complete(what: str) -> None:
    """The command has written everything (WHAT: e.g. 'outputs/x is complete'). A Ctrl-C or SIGTERM from now on
    undoes nothing: the command goes on to exit 0, printing one note saying so (exit code 130 with no line would
    leave the user guessing whether the output is whole). Its own process only (see whole_process)."""
    import threading

    if not _own_process:
        return

    if threading.current_thread() is not threading.main_thread():
        return

    def after_completion(signum, frame) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # one note; the exit is moments away
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        err_console.print(
            f"[yellow]note:[/] {name} after the command had finished: {escape(what)}; nothing was undone.",
            highlight=False,
        )

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, after_completion)


def ignore_signals_at_exit() -> None:
    """The interpreter's shutdown (a second or more after torch ran) restores SIGINT's default action, so a Ctrl-C
    then would kill the process with code 130 and no line, after the command has finished. Ignored instead: the
    command has ended, and only the exit is left (Python leaves an ignored signal ignored as it shuts down)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def training_errors(
    main: bool, interrupted: Callable[[Exception], str] = lambda error: escape(str(error))
) -> Iterator[None]:
    """Errors of a training command, raised in every process of a launch; only the main process prints.

    Interrupted (a checkpoint was saved, or a run replacing an earlier one was discarded): exit 128 + signal,
    like an interrupted shell job, with INTERRUPTED(error) as the message. A failed training check: exit 1;
    other user errors: exit 2.
    """
    from attnres_convert.finetune.stopping import TrainingError, TrainingInterrupted

    try:
        yield
    except TrainingInterrupted as error:
        if main:
            err_console.print(f"[yellow]interrupted:[/] {interrupted(error)}", highlight=False)
        raise typer.Exit(128 + error.signum) from None
    except Exception as error:
        if not isinstance(error, user_error_kinds()):
            raise
        code = EXIT_FAILED_CHECK if isinstance(error, TrainingError) else EXIT_BAD_INPUT
        if main:
            fail(str(error), code)
        raise typer.Exit(code) from None


class _WhenCounting(ProgressColumn):
    """A column shown only on tasks that count something: bytes (`bytes=True`) or items (`items=True`, a
    library's bar); plain stage lines show none. AMOUNT: the bytes column for bytes, the items one for items."""

    def __init__(self, column: ProgressColumn, items: ProgressColumn | None = None):
        super().__init__()
        self.column, self.items = column, items

    def render(self, task):
        if task.fields.get("items"):
            return (self.items or self.column).render(task)
        return self.column.render(task) if task.fields.get("bytes") else Text("")


def stage_columns() -> list[ProgressColumn]:
    """A stage's line: spinner, name, elapsed; a counting line adds a bar, bytes or items done, and an ETA
    from its average pace (80 columns hold the longest stage name with all of them)."""
    from attnres_convert.io.console import AverageTimeRemaining

    return [
        SpinnerColumn(),
        TextColumn("{task.description}"),
        _WhenCounting(BarColumn(bar_width=12)),
        _WhenCounting(DownloadColumn(), items=MofNCompleteColumn()),
        _WhenCounting(AverageTimeRemaining(prefix="ETA ")),
        TimeElapsedColumn(),
    ]


@contextlib.contextmanager
def stages(what: str = "the command", left_behind: str = "nothing was written") -> Iterator:
    """A Rich progress display with one line per stage of a long job, the libraries it drives kept quiet
        (io.console.quiet_libraries); `stage.progress(name, total)` adds a line with a bar over TOTAL bytes,
        whose context value advances it, and `stage.items(name, total)` a line counting items, returning the
    function that advances it. Ctrl-C removes the running lines (no frozen spinner) and says which
        stage of WHAT stopped and what is LEFT_BEHIND."""
    from attnres_convert.io.console import library_bars_to, quiet_libraries, shorten_middle

    running: list[str] = []
    stopped: list[str] = []  # the innermost stage a Ctrl-C stopped, named in the message

    def describe() -> str:
        where = stopped[:1] or running[-1:]
        return f"{what} ({where[0].lower()})" if where else what

    with contextlib.ExitStack() as stack:
        stack.enter_context(interrupts(describe, left_behind))
        progress = Progress(*stage_columns(), console=err_console, transient=False)
        progress.start()
        interrupted: list[bool] = []

        # Stopped by Ctrl-C: the display goes without Progress.stop's empty line (printed when piped), so the
        # message follows the last stage line directly, as docs/first-run.md shows it.
        def finish() -> None:
            if not interrupted:
                progress.stop()
                return
            progress.live.stop()
            if not progress.console.is_interactive and any(task.visible for task in progress.tasks):
                progress.console.print()  # piped: end the last stage line, and no more

        stack.callback(finish)
        stack.enter_context(quiet_libraries())

        @contextlib.contextmanager
        def bytes_bar(name: str, total: int) -> Iterator:
            task = progress.add_task(name, total=total, bytes=True)
            yield lambda nbytes: progress.advance(task, nbytes)

        @contextlib.contextmanager
        def stage(name: str) -> Iterator[None]:
            task = progress.add_task(name, total=1)
            running.append(name)
            try:
                yield
            except BaseException:
                stopped.append(name)  # a stopped stage is not shown as done
                raise
            else:
                progress.update(task, completed=1)
            finally:
                running.remove(name)

        def library_bar(description: str, total: int | None):  # a tqdm bar of transformers, datasets, ...
            task = progress.add_task(f"  {shorten_middle(description, 28)}", total=total, items=True)
            return (lambda n: progress.advance(task, n)), (lambda: progress.update(task, visible=False))

        def items_bar(name: str, total: int):  # a line counting items (runs, steps) with its average-pace ETA
            task = progress.add_task(name, total=total, items=True)
            return lambda n=1: progress.advance(task, n)

        stack.enter_context(library_bars_to(library_bar))
        stage.progress = bytes_bar
        stage.items = items_bar
        try:
            yield stage
        except KeyboardInterrupt:
            for task in progress.tasks:
                if not task.finished:
                    progress.update(task.id, visible=False)
            if not any(task.visible for task in progress.tasks):
                # Nothing left to show: the display goes without leaving an empty line above the message.
                progress.live.transient = True
            interrupted.append(True)
            raise


def options_from(model: type, parameter: str = "options", panel: str = "Options"):
    """Add MODEL's fields (ConvertOptions.model_fields) to a command as options and pass them to it as one MODEL.

    Each field is `--field-name` with the field's description as help; a bool that defaults to True is
    `--name/--no-name`; a Literal is a choice. Fields with json_schema_extra={"cli": False} stay library-only.
    """
    import functools
    import inspect
    import re
    from enum import Enum
    from typing import Annotated, Literal, get_args, get_origin

    from .conversion.options import OptionsError

    def option(name, field):
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        if annotation is bool:
            flag = f"{flag}/--no-{name.replace('_', '-')}" if field.default else flag
        description, metavar = field.description, None
        if get_origin(annotation) is Literal:  # a short metavar keeps the help readable at 80 columns
            metavar = name.upper()
            # A field whose model takes aliases (a dtype: bf16 for bfloat16) is text the model checks; others a choice.
            takes_aliases = field.aliases
            annotation = (
                str if takes_aliases else Enum(name, {value: value for value in get_args(annotation)}, type=str)
            )
            if not all(choice in description for choice in get_args(field.annotation)):  # the help names the choices
                description = f"{description} One of: {', '.join(get_args(field.annotation))}."
        info = typer.Option(
            flag, help=description, metavar=metavar, show_default=field.default is not None, rich_help_panel=panel
        )
        default = (
            annotation(field.default)
            if isinstance(annotation, type) and issubclass(annotation, Enum)
            else field.default
        )
        return inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[annotation, info], default=default
        )

    fields = {name: f for name, f in model.model_fields.items() if (f.json_schema_extra or {}).get("cli", True)}

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        kept = [p for p in signature.parameters.values() if p.name != parameter]
        added = [option(name, field) for name, field in fields.items()]

        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in fields}
            values = {name: v.value if isinstance(v, Enum) else v for name, v in values.items()}
            try:  # a value out of range (--query-rank -1) is a usage error with the field's name, not a traceback
                options = model.build(**values) if hasattr(model, "build") else model(**values)
            except OptionsError as error:  # named as typed: --num-blocks, not num_blocks
                message = str(error)
                for name in fields:
                    message = re.sub(rf"(?<![\w-]){name}(?![\w-])", "--" + name.replace("_", "-"), message)
                fail(message)
            return command(*args, **kwargs, **{parameter: options})

        wrapper.__signature__ = signature.replace(parameters=kept + added)
        return wrapper

    return decorate


# Hub options shared by every command that writes a model folder (convert, finetune).
PushToHubOption = Annotated[
    Optional[str], typer.Option("--push-to-hub", metavar="REPO_ID", help="Upload the saved folder to this hub repo.")
]
PrivateOption = Annotated[bool, typer.Option("--private", help="Create the hub repo as private.")]
VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Show every setting and detail, not only the result.")
]
TokenOption = Annotated[
    Optional[str],
    typer.Option(
        "--token", help="HuggingFace token with write access (default: HF_TOKEN, else the `hf auth login` cache)."
    ),
]
