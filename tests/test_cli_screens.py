"""What the command line shows: help that states the product's facts, argument errors answered before
torch is imported, every table and bar readable at 80 columns, an ETA from the run's average pace, the
libraries we drive kept quiet (and restored after), and Ctrl-C that says what stopped and leaves nothing.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from reliability_helpers import ONE_THREAD_ENV, ROOT, leftovers, squash
from rich.console import Console
from typer.testing import CliRunner

import attnres_convert
from attnres_convert import cli, cli_training

runner = CliRunner()
SPINNER = set("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏")


def flat(text: str) -> str:
    """TEXT without whitespace and box rules: a help sentence reads whole even where Rich wrapped it in a panel."""
    return squash(text.translate({ord(c): None for c in "│╭╮╰╯─"}))


def help_of(*command: str, columns: int = 80) -> str:
    result = runner.invoke(cli.app, [*command, "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


COMMANDS = [
    ("convert",),
    ("push",),
    ("inspect",),
    ("eval",),
    ("finetune",),
    ("ab",),
    ("architectures",),
    ("bench",),
    ("kernels", "build"),
    ("recipes", "list"),
    ("recipes", "show"),
    ("recipes", "validate"),
]


def declared_command(*command: str):
    import typer

    node = typer.main.get_command(cli.app)
    for name in command:
        node = node.commands[name]
    return node


def declared_helps(*command: str) -> list[str]:
    """The help texts the command's options and arguments declare, as Rich is to print them (`\\[` is a bracket)."""
    node = declared_command(*command)
    return [param.help.replace("\\[", "[") for param in node.params if getattr(param, "help", None)]


# A short reference of facts each --help must state (squashed: Rich wraps anywhere a space is).
HELP_FACTS = {
    ("convert",): ["*--output-o", "[required]", "GGUFde-quantised", "--verbose"],
    ("eval",): ["*--data", "[required]", "--seq-len<int>Tokenspersequence.[default:256]"],
    ("inspect",): ["OUT.png", "OUT-relative.png", "OUT-magnitudes.png"],
    ("finetune",): ["--verbose", "--resume"],
}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_help_is_true_and_fits_80_columns(command):
    text = help_of(*command)
    assert "<bool>" not in text  # a flag takes no value
    assert "list[" not in text  # a repeatable value is shown by what is typed (<str>, FILE), not Python's type
    assert all(len(line) <= 80 for line in text.splitlines()), text
    for (
        line
    ) in text.splitlines():  # a metavar such as <auto|float32|...> stands whole on its line, never split mid-word
        assert not re.search(r"<[^>]*$", line), f"a value type split across lines:\n{text}"
    # The description's paragraphs are sentences Rich wraps to the terminal: no line break of the source inside one.
    node = declared_command(*command)
    assert not re.search(r"[^\n]\n[^\n]", (node.help or "").strip()), f"line break inside a paragraph: {node.help!r}"
    for fact in HELP_FACTS.get(command, []):
        assert squash(fact) in flat(text), f"{fact!r} missing from `attnres {' '.join(command)} --help`:\n{text}"
    # Every declared help is printed whole: Rich would take an unescaped "[default: ...]" for markup and drop it.
    wide = flat(help_of(*command, columns=250))  # one line per option: no column interleaves with the help
    for declared in declared_helps(*command):
        assert squash(declared) in wide, f"{declared!r} printed cut in `attnres {' '.join(command)} --help`:\n{text}"


def test_inspect_plot_help_names_the_files_it_writes(tmp_path):
    """The help's three names are what `inspect --plot` writes."""
    from tiny_models import tiny_model

    from attnres_convert.analysis.inspection import inspect_source

    tiny_model("llama").save_pretrained(tmp_path / "plain")
    result = inspect_source(str(tmp_path / "plain"), plot=str(tmp_path / "OUT.png"), max_tokens=16)
    written = sorted(Path(p).name for p in result.plots)
    assert written == ["OUT-magnitudes.png", "OUT-relative.png", "OUT.png"]
    text = flat(help_of("inspect"))
    assert all(name in text for name in written)


def test_version():
    result = runner.invoke(cli.app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"attnres {attnres_convert.__version__}"


def test_misspelt_command_gets_a_suggestion():
    result = runner.invoke(cli.app, ["convrt"])
    assert result.exit_code == 2 and "Did you mean 'convert'?" in result.output


# ---------------------------------------------------------------- argument errors before torch


def _cli_in_subprocess(args: list[str], cwd: Path, columns: int = 200) -> subprocess.CompletedProcess:
    """`attnres ARGS` in a fresh interpreter that reports, on exit, whether torch / transformers were imported."""
    code = (
        "import sys\nfrom attnres_convert.cli import main\nsys.argv = ['attnres', *sys.argv[1:]]\n"
        "try:\n    main()\n    status = 0\nexcept SystemExit as stop:\n    status = stop.code\n"
        "print('IMPORTED', 'torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)\nsys.exit(status)\n"
    )
    env = {**os.environ, **ONE_THREAD_ENV, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


ARGUMENT_ERRORS = {
    "convert: no such path": (
        ["convert", "/nonexistent/folder", "-o", "out"],
        "no such file or folder: /nonexistent/folder",
    ),
    "convert: output taken": (["convert", "-o", "taken"], "output folder taken already exists"),
    "convert: --num-blocks 0": (["convert", "--num-blocks", "0", "-o", "out"], "--num-blocks must be >= 1"),
    "convert: two block choices": (
        ["convert", "--full", "--block-size", "2", "-o", "out"],
        "only one of --block-size, --num-blocks, --full (got --block-size, --full)",
    ),
    "convert: bad shard size": (
        ["convert", "--max-shard-size", "huge", "-o", "out"],
        "--max-shard-size 'huge' is not a size",
    ),
    "eval: misspelt play": (["eval", "--data", "shakespeare:hamlett"], "did you mean 'shakespeare:hamlet'?"),
    "eval: missing file": (["eval", "--data", "missing.txt"], "file missing.txt does not exist"),
    "inspect: no such path": (["inspect", "./nowhere"], "no such file or folder: ./nowhere"),
    "recipes validate: misspelt key": (
        ["recipes", "validate", "quickstart-cpu", "train.stpes=3"],
        "did you mean steps?",
    ),
    "finetune: misspelt key": (["finetune", "quickstart-cpu", "train.stpes=3"], "did you mean steps?"),
    "ab: misspelt key": (["ab", "quickstart-cpu", "train.stpes=3"], "did you mean steps?"),
    "finetune: missing data": (
        ["finetune", "quickstart-cpu", "data.train.files=[missing.txt]"],
        "missing.txt does not exist",
    ),
    "architectures: misspelt type": (["architectures", "lama"], "Did you mean llama"),
    "bench: no such path": (["bench", "/nonexistent/folder"], "no such file or folder: /nonexistent/folder"),
    "eval: a play without its prefix": (
        ["eval", "--data", "hamlet"],
        "file hamlet does not exist; for the Shakespeare play write 'shakespeare:hamlet'",
    ),
    "eval: not a model folder": (
        ["eval", "taken", "--data", "shakespeare:hamlet"],
        "taken is not a model folder: it has no config.json",
    ),
    "eval: --seq-len 1": (
        ["eval", "--seq-len", "1", "--data", "shakespeare:hamlet"],
        "--seq-len must be at least 2, got 1",
    ),
    "eval: --batch-size 0": (
        ["eval", "--batch-size", "0", "--data", "shakespeare:hamlet"],
        "--batch-size must be at least 1, got 0",
    ),
    "inspect: a run folder": (["inspect", "run"], "It is a fine-tuning run folder: its model is run/model. Pass that."),
    "bench: --rounds 0": (["bench", "--rounds", "0"], "--rounds 0: must be at least 1."),
    "bench: --seq-len 0": (["bench", "--seq-len", "0"], "--seq-len 0: must be at least 1."),
    "bench: unknown measure": (["bench", "--measure", "prefill,speed"], "--measure prefill,speed: choose from"),
    "bench: triton on cpu": (
        ["bench", "--kernels", "triton"],
        "--kernels triton runs the Triton kernels on CUDA tensors",
    ),
    "push: no such folder": (["push", "/nonexistent/folder", "alice/x"], "/nonexistent/folder is not a folder"),
    "ab: --seeds 0": (["ab", "quickstart-cpu", "--seeds", "0"], "--seeds: must be >= 1 (got 0)"),
    "eval: --max-tokens below a sequence": (
        ["eval", "--max-tokens", "10", "--data", "shakespeare:hamlet"],
        "--max-tokens 10 is not enough for one sequence of --seq-len 256",
    ),
    "convert: no such dtype": (
        ["convert", "--dtype", "bf17", "-o", "out"],
        "--dtype 'bf17' is not a data type we know: use auto, float32, bfloat16 or float16 (or bf16, fp16, fp32)",
    ),
    "eval: no such dtype": (
        ["eval", "--dtype", "fp8", "--data", "shakespeare:hamlet"],
        "--dtype 'fp8' is not a data type we know",
    ),
    "bench: no such dtype": (
        ["bench", "--dtype", "auto"],
        "--dtype 'auto' is not a data type we know: use float32, bfloat16 or float16",
    ),
    "finetune: no such dtype": (
        ["finetune", "quickstart-cpu", "model.dtype=bf17"],
        "model.dtype: 'bf17' is not a data type we know",
    ),
}


def test_model_types_read_from_the_source_are_the_imported_ones():
    """`attnres architectures TYPE` checks TYPE against transformers' mapping read with ast (io/model_types.py);
    on a release that declares it otherwise this fails, naming the difference."""
    from attnres_convert.conversion import coverage
    from attnres_convert.io import model_types

    assert model_types.causal_lm_model_types() == set(coverage.causal_lm_model_types())


@pytest.mark.parametrize("case", list(ARGUMENT_ERRORS))
def test_argument_errors_are_answered_without_importing_torch(tmp_path, case):
    args, message = ARGUMENT_ERRORS[case]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("a user's file")
    run = tmp_path / "run"  # a fine-tuning run folder: its model is in run/model
    (run / "model").mkdir(parents=True)
    (run / "recipe.yaml").write_text("{}")
    (run / "model" / "config.json").write_text("{}")
    result = _cli_in_subprocess(args, tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in " ".join(result.stderr.split()), result.stderr
    assert "IMPORTED False False" in result.stderr, f"torch or transformers imported before the error:\n{result.stderr}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "taken"]  # nothing written


def test_valid_recipe_is_validated_without_importing_torch(tmp_path):
    """The embedded GGUF's context length comes from its header, read without the gguf package or transformers."""
    result = _cli_in_subprocess(["recipes", "validate", "quickstart-cpu", f"output.dir={tmp_path / 'run'}"], tmp_path)
    assert result.returncode == 0 and "valid: quickstart-cpu" in result.stdout, result.stderr
    assert "IMPORTED False False" in result.stderr


def test_gguf_header_context_length_matches_transformers(smollm2_path):
    from transformers import AutoConfig

    from attnres_convert.io.paths import max_positions, resolve_source

    config = AutoConfig.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    assert max_positions(resolve_source(str(smollm2_path))) == config.max_position_embeddings


def test_validate_reports_an_output_dir_that_holds_a_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    (run / "checkpoints" / "step-0000002").mkdir(parents=True)
    result = runner.invoke(cli.app, ["recipes", "validate", "quickstart-cpu", f"output.dir={run}"])
    assert result.exit_code == 0, result.output
    assert "alreadyholdsarun" in squash(result.output)
    assert "--resume" in result.output


# ---------------------------------------------------------------- 80 columns


def render(renderable, width: int = 80) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def assert_unwrapped(lines: list[str], *pieces: str) -> None:
    """Every line fits 80 columns and each PIECE (a title, a cell) stands whole on one line."""
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    for piece in pieces:
        assert any(piece in line for line in lines), f"{piece!r} wrapped or missing:\n" + "\n".join(lines)


def test_conversion_tables_fit_80_columns():
    summary = SimpleNamespace(
        model_type="llama",
        num_layers=30,
        num_sublayers=60,
        block_size=8,
        num_blocks=8,
        sources_per_sublayer=[1, 9],
        output_sources=9,
        params_added=34_560,
        params_total=134_550_000,
        query_rank=8,
        additive=True,
    )
    report = SimpleNamespace(
        tokens=256,
        dtype="float32",
        new_tokens=32,
        max_abs_logit_diff=1.2e-5,
        kl=3.4e-9,
        top1_agreement=1.0,
        greedy_identical=True,
        first_divergence=None,
        passed=True,
    )
    assert_unwrapped(render(cli.summary_table(summary)), "Block AttnRes structure", "34,560 (0.0257%)")
    assert_unwrapped(render(cli.summary_table(summary)), "input-dependent, rank 8", "additive: stream + gated mix")
    assert_unwrapped(
        render(cli.verification_table(report)), "Verification against the original (256 tokens, float32)", "PASS"
    )


def test_depth_table_of_smollm2_shape_fits_80_columns():
    readers = [f"layer {layer} {kind}" for layer in range(30) for kind in ("attention", "mlp")] + ["output"]
    columns = ["embedding"] + [f"block {k}" for k in range(1, 9)]
    depth = SimpleNamespace(readers=readers, columns=columns, matrix=np.full((61, 9), 0.11), tokens=256)
    lines = render(cli.depth_table(depth))
    assert_unwrapped(lines, "L29 attn", "emb", "b8")
    assert len(lines) < 61 + 12  # one line per reader, a few for title, header and caption


def test_eval_and_finetune_tables_fit_80_columns():
    result = SimpleNamespace(
        model="SmolLM2-135M-Instruct (embedded, SmolLM2-135M-Instruct.Q4_1.gguf)",
        converted=False,
        tokens=1023,
        loss=3.2809,
        perplexity=26.601,
        sequences=4,
        seq_len=256,
        dtype="float32",
    )
    lines = render(cli.eval_table(result))
    assert_unwrapped(lines, "Held-out evaluation (4 x 256 tokens, float32)", "SmolLM2-135M-", "Q4_1.gguf)", "26.601")
    assert any("…" in line for line in lines)  # shortened in the middle, not wrapped
    metrics = {
        "steps": 1000,
        "tokens": 1_024_000,
        "processes": 1,
        "eval_loss_start": 3.28,
        "eval_perplexity_start": 26.6,
        "eval_loss": 3.01,
        "eval_perplexity": 20.3,
    }
    assert_unwrapped(render(cli.finetune_table(metrics)), "Fine-tuned 1000 steps, 1,024,000 tokens (1 process)")


def test_progress_lines_fit_80_columns():
    from attnres_convert.finetune.reporting import Reporter

    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    reporter = Reporter(console, True)
    with reporter.bar(total=1000, start=0):
        reporter.step(500, 3.1234, 1e-4, 12345.0)
        lines = render(reporter.progress.make_tasks_table(reporter.progress.tasks))
    assert_unwrapped(lines, "500/1000", "loss 3.1234", "ETA")


# ---------------------------------------------------------------- ETA


def test_eta_is_the_average_pace_of_the_run():
    from rich.progress import Progress

    from attnres_convert.io.console import AverageTimeRemaining

    now = [0.0]
    column = AverageTimeRemaining()
    progress = Progress(column, get_time=lambda: now[0], console=Console(file=io.StringIO()))
    task_id = progress.add_task("train", total=10, completed=2, resumed_at=2)
    task = progress.tasks[0]
    assert column.render(task).plain == "-:--:--"  # no step done yet
    now[0] = 80.0
    progress.update(task_id, completed=4)  # 2 steps in 80 s: 40 s a step, 6 to go
    assert column.render(task).plain == "0:04:00"
    now[0] = 100.0  # a quick step moves the average only a little: 3 steps in 100 s, 5 to go
    progress.update(task_id, completed=5)
    assert column.render(task).plain == "0:02:46"


# ---------------------------------------------------------------- quiet libraries


def test_quiet_libraries_silences_bars_logs_and_library_deprecations_then_restores_them():
    from tqdm.auto import tqdm
    from transformers.utils import logging

    from attnres_convert.io.console import quiet_libraries

    def bar_output() -> str:
        sink = io.StringIO()
        for _ in tqdm(range(3), desc="Loading weights", file=sink):
            pass
        return sink.getvalue()

    verbosity = logging.get_verbosity()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_libraries():
            assert bar_output() == ""
            assert logging.get_verbosity() == logging.ERROR
            warnings.warn_explicit("old API", DeprecationWarning, "x.py", 1, module="transformers.generation.utils")
            warnings.warn_explicit("ours", UserWarning, "x.py", 1, module="attnres_convert.io.sources")
        assert [str(w.message) for w in caught] == ["ours"]
    assert "Loading weights" in bar_output()
    assert logging.get_verbosity() == verbosity


def test_library_bars_reach_our_display_while_quiet():
    from tqdm.auto import tqdm

    from attnres_convert.io.console import library_bars_to, quiet_libraries

    seen = []

    def add_bar(description, total):
        line = {"description": description, "total": total, "done": 0, "finished": False}
        seen.append(line)
        return (lambda n: line.update(done=line["done"] + n)), (lambda: line.update(finished=True))

    sink = io.StringIO()
    with quiet_libraries(), library_bars_to(add_bar):
        assert list(tqdm(range(5), desc="Converting and de-quantizing GGUF tensors...", file=sink)) == list(range(5))
        with tqdm(total=10, desc="Writing model shards", file=sink) as bar:
            bar.update(4)
            bar.update(6)
    assert sink.getvalue() == ""
    assert seen == [
        {"description": "Converting and de-quantizing GGUF tensors", "total": 5, "done": 5, "finished": True},
        {"description": "Writing model shards", "total": 10, "done": 10, "finished": True},
    ]


def test_converting_prints_no_foreign_bar_or_warning(tmp_path, tiny_llama_folder):
    result = runner.invoke(
        cli.app, ["convert", str(tiny_llama_folder), "-o", str(tmp_path / "out")], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    for noise in ("it/s]", "Warning", "warn(", "DynamicCache(", "Loading weights", "Writing model shards"):
        assert noise not in result.output, result.output
    assert "memory budget" not in result.output  # only with --verbose or when it matters


# ---------------------------------------------------------------- Ctrl-C


def _sigint_as_in_a_terminal() -> None:
    """Ctrl-C reaches a command started from a shell: SIGINT unblocked and not ignored. The pytest process
    may hold it otherwise by the time this test runs (libraries it drove earlier ignore or block it around
    their worker processes), and a child inherits both, so Python would install no KeyboardInterrupt handler."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _libtorch_loaded(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see when torch is loaded")
@pytest.mark.parametrize("command", ["convert", "eval"])
def test_ctrl_c_says_what_stopped_and_leaves_nothing(tmp_path, tiny_llama_folder, command):
    out = tmp_path / "out"
    text = tmp_path / "held_out.txt"
    text.write_text("To be, or not to be, that is the question. " * 50)
    args = ["-o", str(out)] if command == "convert" else ["--data", str(text)]
    env = {**os.environ, **ONE_THREAD_ENV, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    process = subprocess.Popen(
        [sys.executable, "-m", "attnres_convert.cli", command, str(tiny_llama_folder), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_as_in_a_terminal,
    )
    deadline = time.monotonic() + 60
    while not _libtorch_loaded(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert f"interrupted: {command}" in stderr and "stopped;nothingwas" in squash(stderr), stderr
    assert "Traceback" not in stderr, stderr
    assert not SPINNER & set(stderr), f"a spinner frame was left on the screen:\n{stderr}"
    assert leftovers(out) == []


# ---------------------------------------------------------------- finetune: concise unless --verbose


def test_recipe_headline_names_what_matters():
    from attnres_convert.finetune.recipe import load_recipe

    line = load_recipe("quickstart-cpu", ["train.steps=7", "output.dir=outputs/x"]).headline()
    for piece in ("the embedded SmolLM2-135M-Instruct", "shakespeare:", "7 steps", "trains lora", "output outputs/x"):
        assert piece in line, line


@pytest.mark.slow
def test_finetune_prints_the_whole_recipe_only_with_verbose(tmp_path):
    from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus

    from attnres_convert.finetune.recipe import parse_recipe
    from attnres_convert.finetune.training import finetune

    model, corpus = tiny_model_folder(tmp_path / "tiny"), write_corpus(tmp_path / "corpus")
    shown = {}
    for verbose in (False, True):
        console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
        recipe = parse_recipe(
            tiny_recipe(model, corpus, tmp_path / f"run-{verbose}", train={"steps": 2}, eval={"every": 0})
        )
        finetune(recipe, console=console, verbose=verbose)
        shown[verbose] = console.export_text()
    # The headline names the run folder, whose tmp path may be long enough to wrap the line anywhere: read it as
    # the user does, with the line breaks taken out.
    headline = " ".join(shown[False].split())
    assert "Fine-tuning" in headline and "2 steps" in headline and "Resolved recipe" not in headline
    assert "Resolved recipe" in shown[True] and "checkpoint:" in shown[True]
    assert len(shown[False].splitlines()) < len(shown[True].splitlines()) - 20


def test_misspelt_model_type_gets_a_suggestion():
    result = runner.invoke(cli.app, ["architectures", "lamma"])
    assert result.exit_code == 2 and "Did you mean llama" in " ".join(result.output.split()), result.output


def test_stage_lines_with_a_byte_bar_fit_80_columns():
    from rich.progress import Progress

    from attnres_convert.cli_kit import stage_columns

    console = Console(width=80, file=io.StringIO(), color_system=None)
    progress = Progress(*stage_columns(), console=console)
    progress.add_task("Verifying against the original", total=1)
    progress.add_task("Writing shards", total=538_100_000, completed=200_000_000, bytes=True)
    progress.add_task("  Converting and de…F tensors", total=273, completed=100, items=True)
    lines = render(progress.make_tasks_table(progress.tasks))
    assert_unwrapped(lines, "Verifying against the original", "200.0/538.1 MB ETA 0:", "100/273")
    assert len(lines) == 3


# ---------------------------------------------------------------- what a command prints at 80 columns


def screen(monkeypatch, *args: str, width: int = 80) -> tuple[int, str]:
    """`attnres ARGS` as a terminal of WIDTH columns shows it: (exit code, the text on the screen)."""
    shown = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    monkeypatch.setattr(cli, "console", shown)
    monkeypatch.setattr(cli_training, "console", shown)  # eval, finetune and ab print there
    result = runner.invoke(cli.app, list(args), env={"COLUMNS": str(width)})
    return result.exit_code, shown.export_text() + result.stdout


def test_recipes_list_never_cuts_a_name(monkeypatch):
    from attnres_convert.finetune.recipe import shipped_recipes

    code, text = screen(monkeypatch, "recipes", "list")
    assert code == 0, text
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    named = {line.split(":")[0] for line in lines if line and not line.startswith(" ")}
    assert set(shipped_recipes()) <= named, text  # every name whole, first on its line
    assert "…" not in text
    words = " ".join(text.split())  # the descriptions whole, wherever Rich wrapped them
    assert "Embedded SmolLM2-135M-Instruct on Shakespeare (3 plays held out)" in words, text


def _yaml_of(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def test_recipes_validate_prints_a_verdict_and_the_recipe_only_with_show(monkeypatch, tmp_path):
    from attnres_convert.finetune.recipe import load_recipe

    # The recipe's output folder is relative to the working directory, where `make demo` may have left a run.
    monkeypatch.chdir(tmp_path)
    code, text = screen(monkeypatch, "recipes", "validate", "quickstart-cpu")
    assert code == 0 and "valid: quickstart-cpu" in text and "--show" in text, text
    assert "description:" not in text and len(text.splitlines()) <= 6, text
    code, text = screen(monkeypatch, "recipes", "validate", "quickstart-cpu", "train.steps=7", "--show")
    assert code == 0, text
    expected = load_recipe("quickstart-cpu", ["train.steps=7"]).model_dump(mode="json")
    assert _yaml_of(text) == expected  # the whole screen is YAML: the verdict is a comment
    assert "# valid: quickstart-cpu" in text
    # Piped, in a fresh process at 80 columns: the same YAML, unwrapped by Rich.
    result = _cli_in_subprocess(
        ["recipes", "validate", "quickstart-cpu", "train.steps=7", "--show"], tmp_path, columns=80
    )
    assert result.returncode == 0, result.stderr
    assert _yaml_of(result.stdout) == expected


# ---------------------------------------------------------------- dtypes by their usual names


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("f16", "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("float32", "float32"),
        ("auto", "auto"),
    ],
)
def test_dtype_aliases_mean_the_dtype_everywhere_one_is_taken(typed, meant):
    from attnres_convert.conversion.options import ConvertOptions, canonical_dtype
    from attnres_convert.finetune.recipe import load_recipe

    assert canonical_dtype(typed) == meant
    assert ConvertOptions.build(dtype=typed).dtype == meant
    if meant != "auto":
        assert load_recipe("quickstart-cpu", [f"model.dtype={typed}"]).model.dtype == meant


def test_mixed_precision_takes_the_dtype_names_too():
    from attnres_convert.finetune.recipe import load_recipe

    assert load_recipe("quickstart-cpu", ["train.mixed_precision=bfloat16"]).train.mixed_precision == "bf16"
    assert load_recipe("quickstart-cpu", ["train.mixed_precision=float16"]).train.mixed_precision == "fp16"


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "--dtype", "bf17", "-o", "out"],
        ["finetune", "quickstart-cpu", "model.dtype=bf17"],
        ["recipes", "validate", "quickstart-cpu", "model.dtype=bf17"],
    ],
)
def test_a_wrong_dtype_is_answered_in_our_words(tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 2, result.output
    words = " ".join(result.output.split())
    assert "'bf17' is not a data type we know" in words and "bf16" in words, words
    assert "Value error" not in words and "literal_error" not in words and "pydantic" not in words


def test_where_it_trains_is_said_in_words():
    from attnres_convert.finetune.training import where_it_trains

    assert where_it_trains("cpu", 1, "NO", "no") == "Training on cpu in 1 process, no mixed precision"
    assert (
        where_it_trains("cuda:0", 4, "FSDP", "bf16") == "Training on cuda:0 in 4 processes (FSDP), bf16 mixed precision"
    )
    assert where_it_trains("cpu", 2, "MULTI_CPU", "no") == "Training on cpu in 2 processes (DDP), no mixed precision"


@pytest.mark.filterwarnings("ignore:.*has no tokenizer")  # the tiny model ships none; not what this test is about
def test_convert_shows_its_stages_in_the_order_it_works(tmp_path, tiny_llama_folder):
    """The display agrees with the README: the converted folder is verified before it is put in place."""
    import contextlib

    from attnres_convert import convert

    out, seen = tmp_path / "out", []

    @contextlib.contextmanager
    def stage(name):
        seen.append((name, out.exists()))
        yield

    @contextlib.contextmanager
    def progress(name, total):
        seen.append((name, out.exists()))
        yield lambda nbytes: None

    convert(str(tiny_llama_folder), out, stage=stage, progress=progress)
    names = [name for name, _ in seen]
    assert names.index("Writing shards") < names.index("Verifying against the original"), names
    assert not any(name.startswith("Saving") for name in names), names
    assert dict(seen)["Verifying against the original"] is False  # OUT appears only after the verification
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("earlier_stage", [False, True])
def test_ctrl_c_names_the_stage_it_stopped_with_no_blank_line(monkeypatch, earlier_stage):
    """As docs/first-run.md shows it: `interrupted: convert (loading model) stopped; ...`, right under the last
    finished stage line (piped, Progress.stop would print an empty line first); the stopped stage is not left
    on the screen as if done."""
    import typer

    from attnres_convert import cli_kit

    shown = io.StringIO()
    monkeypatch.setattr(cli_kit, "err_console", Console(file=shown, width=80, color_system=None))
    with pytest.raises(typer.Exit) as stop:
        with cli_kit.stages("convert", "nothing was written to out") as stage:
            if earlier_stage:
                with stage("Reading config"):
                    pass
            with stage("Loading model"):
                raise KeyboardInterrupt
    assert stop.value.exit_code == 130
    lines = shown.getvalue().splitlines()
    assert lines[-1] == "interrupted: convert (loading model) stopped; nothing was written to out.", lines
    assert all(line.strip() for line in lines), lines  # no blank line
    assert [line.split()[:2] for line in lines[:-1]] == ([["Reading", "config"]] if earlier_stage else [])


# ---------------------------------------------------------------- bench: how long, and its lines piped


def test_bench_says_how_long_before_it_starts():
    from attnres_convert.analysis.bench_settings import (
        MEMORY_S,
        PACE_S,
        SETUP_S,
        BenchSettings,
        estimate,
        quick_settings,
    )

    idle = estimate(BenchSettings(threads=1), embedded=True, cores=2, load=0.5)
    round_s = 2 * sum(PACE_S.values())  # 1 thread, the default sizes: the measured pace
    total = SETUP_S + 6 * round_s + MEMORY_S
    assert f"about {total / 60:.0f} min with 1 thread(s), 6 rounds (one a warm-up) of about {round_s:.0f} s" in idle, (
        idle
    )
    assert "busy" not in idle and "--quick" in idle
    busy = estimate(BenchSettings(), embedded=True, cores=2, load=7.3)
    assert "This machine is busy (load average 7.3 on 2 cores)" in busy
    other = estimate(BenchSettings(), embedded=False, cores=2, load=0.1)
    assert "one of the embedded SmolLM2-135M would take about" in other and "bigger model" in other
    quick = quick_settings(BenchSettings())
    assert (quick.rounds, quick.seq_len, quick.decode_tokens, quick.measure) == (
        1,
        128,
        16,
        ("prefill", "decode", "train"),
    )
    assert quick_settings(BenchSettings(seq_len=256, measure=("prefill",))).seq_len == 256  # what the user set stays
    assert "--quick" not in estimate(quick, embedded=True, cores=2, load=0.1)
    assert estimate(quick, embedded=True, cores=2) < idle or True
    assert "rounds (one a warm-up) of about" in estimate(quick, embedded=True, cores=2)


@pytest.mark.parametrize(
    "source",
    [
        "",
        "/models/Meta-Llama-3.1-8B-Instruct-Q4_K_M-imatrix-long-name.gguf",
        "some-organisation-name/a-rather-long-model-repository-name-v2",
    ],
)
def test_bench_stage_lines_are_whole_piped_at_80_columns(tmp_path, source):
    from rich.progress import Progress

    from attnres_convert.analysis.bench import saving_stage
    from attnres_convert.cli_kit import stage_columns
    from attnres_convert.io.paths import ModelSource

    kind = "default" if not source else ("gguf" if source.endswith(".gguf") else "hub")
    model = ModelSource(
        kind,
        str(Path(source).parent) if kind == "gguf" else source or "/x",
        Path(source).name if kind == "gguf" else ("SmolLM2-135M-Instruct.Q4_1.gguf" if kind == "default" else None),
        given=source or None,
    )
    names = [
        saving_stage(model),
        "Converting",
        "Loading both models",
        "prefill",
        "decode",
        "train step",
        "peak memory of a training step (a process per model)",
    ]
    console = Console(width=80, file=io.StringIO(), color_system=None)  # piped: Rich crops a line at the width
    progress = Progress(*stage_columns(), console=console)
    for name in names:
        progress.add_task(name, total=1, completed=1)
    lines = render(progress.make_tasks_table(progress.tasks))
    assert_unwrapped(lines, *names)


# ---------------------------------------------------------------- Ctrl-C after the output is complete

# The installed command (cli.main) in a child process that sends itself SIGINT at a chosen moment: right after the
# "Saved" line is printed, or while the interpreter shuts down (an atexit hook), after the command has returned.
_CTRL_C_AFTER = r"""
import atexit, os, signal, sys, time
from attnres_convert import cli
moment = sys.argv[1]
def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # the handler runs here
if moment == "after-saved":
    printed = cli.console.print
    def print_then_ctrl_c(*args, **kwargs):
        printed(*args, **kwargs)
        if args and str(args[0]).startswith("[green]Saved"):
            ctrl_c()
    cli.console.print = print_then_ctrl_c
else:
    atexit.register(ctrl_c)
sys.argv = ["attnres", *sys.argv[2:]]
sys.exit(cli.main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["after-saved", "at-exit"])
def test_ctrl_c_after_convert_finished_exits_0_saying_the_output_is_complete(tmp_path, tiny_llama_folder, moment):
    out = tmp_path / "out"
    env = {**os.environ, **ONE_THREAD_ENV, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_AFTER, moment, "convert", str(tiny_llama_folder), "-o", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_sigint_as_in_a_terminal,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert "Saved" in done.stdout and (out / "config.json").is_file()
    assert "Traceback" not in done.stderr and "Aborted" not in done.stderr, done.stderr
    if moment == "after-saved":
        assert f"note: Ctrl-C after the command had finished: {out} is complete; nothing was undone." in done.stderr, (
            done.stderr
        )


# ---------------------------------------------------------------- piped: plain lines, no frames


@pytest.mark.slow
@pytest.mark.parametrize("forced", ["FORCE_COLOR=1", "TTY_COMPATIBLE=1"])
def test_piped_stage_lines_are_plain_even_where_colour_is_forced(tmp_path, tiny_llama_folder, forced):
    """stderr a pipe, with an environment that makes Rich take it for a terminal (CI sets FORCE_COLOR): every
    stage line once, no spinner frame, no line redrawn in place (cursor codes)."""
    name, value = forced.split("=")
    env = {**os.environ, **ONE_THREAD_ENV, "PYTHONPATH": str(ROOT), "COLUMNS": "80", name: value}
    env.pop("TTY_INTERACTIVE", None)
    done = subprocess.run(
        [sys.executable, "-m", "attnres_convert", "convert", str(tiny_llama_folder), "-o", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert not SPINNER & set(done.stderr), f"spinner frames in piped output:\n{done.stderr}"
    for redraw in ("\r", "\x1b[2K", "\x1b[1A", "\x1b[?25l"):
        assert redraw not in done.stderr, f"{redraw!r} in piped output:\n{done.stderr!r}"
    lines = done.stderr.splitlines()
    for stage in ("Reading config", "Writing shards", "Verifying against the original"):
        assert sum(stage in line for line in lines) == 1, done.stderr


# ---------------------------------------------------------------- finetune: one throughput, said what it measures


def test_finetune_bar_and_summary_give_the_same_throughput_and_say_what_it_counts(tmp_path):
    """The bar's tok/s is the run's training throughput so far; at the end it is the figure of the summary line,
    which says what is counted (training steps) and what is not (loading, evaluation, checkpoints)."""
    from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe

    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        tiny_recipe(
            tiny_model_folder(tmp_path / "tiny"),
            write_corpus(tmp_path / "corpus"),
            tmp_path / "run",
            train={"steps": 4},
            eval={"every": 2, "max_sequences": 4},
            checkpoint={"every": 2, "keep_last": 1},
        ),
    )
    result = runner.invoke(cli.app, ["finetune", str(recipe)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    bar = re.findall(r"step 4/4 .* ([\d,]+) tok/s", result.output)
    summary = re.search(
        r"training throughput: ([\d,]+) tokens/s \(([\d,]+) tokens in ([\d.,]+) s of training steps; "
        r"loading, evaluation and checkpoints not counted\)",
        " ".join(result.output.split()),
    )
    assert bar and summary, result.output
    assert bar[-1] == summary.group(1), result.output
    tokens, seconds = int(summary.group(2).replace(",", "")), float(summary.group(3).replace(",", ""))
    assert tokens == 4 * 2 * 2 * 32  # steps x micro_batch x grad_accum x seq_len
    speed = int(summary.group(1).replace(",", ""))
    assert tokens / (seconds + 0.05) - 1 <= speed <= tokens / max(seconds - 0.05, 1e-9) + 1  # seconds shown to 0.1 s


def test_recipes_list_says_a_from_scratch_recipe_trains_a_random_model():
    """ab-scratch-cpu and ab-retrofit-cpu build a random 24-layer d=128 model from the embedded SmolLM2's config:
    the list says so (not 'embedded SmolLM2', which is a pretrained model); a pretrained source is named as it is."""
    result = runner.invoke(cli.app, ["recipes", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for name in ("ab-scratch-cpu", "ab-retrofit-cpu"):
        line = next(line for line in lines if line.startswith(f"{name}:"))
        assert line.startswith(
            f"{name}: random 24-layer d=128 model (config: embedded SmolLM2), bytes tokenizer, trains full"
        ), line
    assert any(line.startswith("quickstart-cpu: embedded SmolLM2, trains lora") for line in lines), result.output
    from attnres_convert.finetune.recipe import load_recipe

    assert (
        load_recipe("ab-scratch-cpu")
        .headline()
        .startswith(
            "Fine-tuning random 24-layer d=128 model (config: the embedded SmolLM2-135M-Instruct), bytes tokenizer on shakespeare:*"
        )
    )


# ---------------------------------------------------------------- finetune on the CPU: torch threads


def test_training_threads_are_the_idle_cores_unless_omp_num_threads_says():
    from attnres_convert.io.threads import cpu_threads

    assert cpu_threads(cores=2, busy=0.1, env={})[0] == 2  # idle: every core
    assert cpu_threads(cores=2, busy=1.0, env={})[0] == 1  # one core held by another job
    assert cpu_threads(cores=2, busy=4.7, env={})[0] == 1  # more load than cores: still one
    assert cpu_threads(cores=2, busy=0.4, env={})[0] == 2
    assert cpu_threads(processes=2, cores=4, busy=0.0, env={})[0] == 2  # two processes share the idle cores
    threads, why = cpu_threads(cores=2, busy=1.0, env={})
    assert why.startswith("2 cores, 1.0 of them busy (given): one per idle core; OMP_NUM_THREADS sets it"), why
    assert cpu_threads(cores=2, busy=0.0, env={"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")


def test_finetune_says_its_torch_threads_and_gives_the_process_its_own_back(tmp_path):
    import torch
    from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe

    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        tiny_recipe(
            tiny_model_folder(tmp_path / "tiny"),
            write_corpus(tmp_path / "corpus"),
            tmp_path / "run",
            train={"steps": 2},
        ),
    )
    before = torch.get_num_threads()
    result = runner.invoke(cli.app, ["finetune", str(recipe)], env={"COLUMNS": "200", "OMP_NUM_THREADS": "2"})
    assert result.exit_code == 0, result.output
    assert "Training on cpu in 1 process, no mixed precision, 2 torch threads (OMP_NUM_THREADS)" in result.output, (
        result.output
    )
    assert torch.get_num_threads() == before
    result = runner.invoke(
        cli.app, ["finetune", str(recipe), "output.overwrite=true"], env={"COLUMNS": "200", "OMP_NUM_THREADS": None}
    )
    assert result.exit_code == 0, result.output
    from attnres_convert.io.threads import usable_cores

    assert re.search(
        rf"no mixed precision, \d+ torch threads? \({usable_cores()} cores, [\d.]+ of them busy \(busy over 0.5 s\): "
        r"one per idle core; OMP_NUM_THREADS sets it\)",
        result.output,
    ), result.output
    assert torch.get_num_threads() == before


@pytest.mark.filterwarnings("ignore:.*has no tokenizer")
def test_convert_computes_on_the_idle_cores_and_says_so_when_fewer_than_all(tmp_path, tiny_llama_folder):
    import torch

    from attnres_convert.io.threads import usable_cores

    before = torch.get_num_threads()
    result = runner.invoke(
        cli.app,
        ["convert", str(tiny_llama_folder), "-o", str(tmp_path / "a")],
        env={"COLUMNS": "200", "OMP_NUM_THREADS": "1"},
    )
    assert result.exit_code == 0, result.output
    assert ("1 torch thread (OMP_NUM_THREADS)" in result.output) == (usable_cores() > 1), result.output
    assert torch.get_num_threads() == before
    result = runner.invoke(
        cli.app,
        ["convert", str(tiny_llama_folder), "-o", str(tmp_path / "b"), "--verbose"],
        env={"COLUMNS": "200", "OMP_NUM_THREADS": None},
    )
    assert result.exit_code == 0, result.output
    assert re.search(
        rf"\d+ torch threads? \({usable_cores()} cores, [\d.]+ of them busy \(busy over 0.5 s\)", result.output
    ), result.output
