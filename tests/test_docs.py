"""The docs describe the product as it is: generated reference pages are current, every recipe field has a
description, every `attnres ...` command line in the docs names real commands, options and arguments, every
Python snippet parses and imports names that exist, and every local link resolves."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import typer
from pydantic import BaseModel

from attnres_convert.cli import app
from attnres_convert.finetune.recipe import Recipe

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# docs/cli.md is Typer's rendering of the CLI, which changes with Typer's release: generated with the lock's.
# performance.md carries tables made from `attnres bench` results (benchmarks/results).
GENERATED = [pytest.param("cli.md", marks=pytest.mark.locked_versions), "recipes.md", "performance.md"]


def test_the_readme_is_a_landing_page():
    """README.md says what attnres is, how to start and where each subject's page is; the detail lives in docs/."""
    size = (ROOT / "README.md").stat().st_size
    assert size <= 25_000, f"README.md is {size / 1000:.1f} KB, over 25 KB: move detail into docs/ and link to it"


@pytest.mark.parametrize("name", GENERATED)
def test_generated_pages_are_current(name):
    pages = {path.name: (path, text) for path, text in _generator().pages().items()}
    assert sorted(pages) == sorted(getattr(page, "values", (page,))[0] for page in GENERATED)
    path, text = pages[name]
    assert path.exists(), f"{path.name} is missing: run python docs/generate.py"
    assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python docs/generate.py"


def _fields(model: type[BaseModel], path: str = ""):
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _fields(annotation, f"{path}{name}.")
        else:
            yield f"{path}{name}", field


def test_every_recipe_field_is_described():
    missing = [name for name, field in _fields(Recipe) if not (field.description or "").strip()]
    assert not missing, f"recipe fields without a description (docs/recipes.md is generated from them): {missing}"


def _command_lines(text: str):
    """`attnres ...` invocations in the pages' bash blocks (backslash continuations joined)."""
    for block in re.findall(r"```(?:bash|console|sh)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("attnres "):
                yield line[len("attnres ") :]
            elif "$(which attnres) " in line:
                yield line.split("$(which attnres) ", 1)[1]


def _options(command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def _positional_words(command, words: list[str]) -> list[str]:
    """WORDS without the options and the values they take (an option takes one value per occurrence)."""
    takes_value = {opt for p in command.params if p.param_type_name == "option" and not p.is_flag for opt in p.opts}
    positional, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = "=" not in word and word in takes_value
        else:
            positional.append(word)
    return positional


def test_command_lines_in_the_docs_use_real_commands_and_options():
    root = typer.main.get_command(app)
    checked = 0
    for page in (p for p in PAGES if p.name != "cli.md"):  # cli.md is generated from the app itself
        for line in _command_lines(page.read_text()):
            words = shlex.split(line, comments=True)
            if not words or words[0].startswith("-"):
                continue
            command, where = root, f"{page.name}: attnres {line}"
            while hasattr(command, "commands") and words and not words[0].startswith("-"):
                name = words.pop(0)
                assert name in command.commands, f"{where}: no command {name!r}"
                command = command.commands[name]
            unknown = [w.split("=")[0] for w in words if w.startswith("-") and w.split("=")[0] not in _options(command)]
            assert not unknown, f"{where}: unknown option(s) {unknown}"
            positional = _positional_words(command, words)
            arguments = [p for p in command.params if p.param_type_name == "argument"]
            if not any(p.nargs == -1 for p in arguments):
                assert len(positional) <= len(arguments), f"{where}: extra argument(s) {positional[len(arguments) :]}"
            checked += 1
    assert checked >= 10  # the pages do show commands; a broken extraction must not pass silently


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_local_links_resolve(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target}: no such file"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page.name}: link to {target}: no such heading"


def test_python_snippets_parse_and_import_real_names():
    checked = 0
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            tree = ast.parse(block)  # a syntax error names the page in the traceback
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnres_convert"):
                    module = importlib.import_module(node.module)
                    missing = [a.name for a in node.names if not hasattr(module, a.name)]
                    assert not missing, f"{page.name}: {node.module} has no {missing}"
                    checked += 1
    assert checked >= 3
