"""The modeling file a converted folder ships is generated from modeling/sources/ (modeling/generate.py): it must be
what its sources generate, and stay small enough to read before passing trust_remote_code."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from attnres_convert.modeling import SHIPPED_CODE, generate

# The two code files of a converted folder, together (configuration_attnres.py and modeling_attnres.py).
MAX_SHIPPED_LINES = 1500
MAX_COLUMNS = 120


def test_the_modeling_file_is_what_its_sources_generate():
    assert generate.TARGET.read_text() == generate.generate(), f"stale: run `{generate.COMMAND}`"
    check = subprocess.run(
        [sys.executable, "-m", "attnres_convert.modeling.generate", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=generate.HERE.parent.parent,
        stdin=subprocess.DEVNULL,
    )
    assert check.returncode == 0, check.stderr


def test_the_generated_file_says_it_is_generated_and_how_to_regenerate_it():
    header = ast.get_docstring(ast.parse(generate.TARGET.read_text()))
    assert "GENERATED" in header and generate.COMMAND in header and "Do not edit" in header


def test_the_shipped_code_is_two_files_within_the_line_and_column_limits():
    assert SHIPPED_CODE == ("configuration_attnres.py", "modeling_attnres.py")
    texts = {name: (generate.HERE / name).read_text() for name in SHIPPED_CODE}
    lines = sum(len(text.splitlines()) for text in texts.values())
    assert lines <= MAX_SHIPPED_LINES, f"{lines} lines shipped: move out what running the model does not need"
    wide = [
        f"{name}:{number}"
        for name, text in texts.items()
        for number, line in enumerate(text.splitlines(), 1)
        if len(line) > MAX_COLUMNS
    ]
    assert wide == [], f"lines over {MAX_COLUMNS} columns: {wide}"


def test_a_source_that_defines_a_name_twice_or_imports_the_package_is_refused(tmp_path, monkeypatch):
    (tmp_path / "one.py").write_text('"""One."""\n\nX = 1\n')
    (tmp_path / "two.py").write_text('"""Two."""\n\nX = 2\n')
    monkeypatch.setattr(generate, "SOURCES", tmp_path)
    monkeypatch.setattr(generate, "ORDER", ("one", "two"))
    with pytest.raises(generate.GenerationError, match="X is defined in both"):
        generate.generate()
    (tmp_path / "two.py").write_text('"""Two."""\n\nfrom attnres_convert.io import saving\n')
    with pytest.raises(generate.GenerationError, match="imports attnres_convert.io"):
        generate.generate()
