"""`convert`'s options are declared once (ConvertOptions): the library takes them as keyword arguments or
as one object, and the `attnres convert` command's flags, defaults and help are built from the same fields."""

from __future__ import annotations

import json

import pytest
import typer
from reliability_helpers import leftovers, run_cli, save_tiny

from attnres_convert import ConvertOptions, OptionsError, convert
from attnres_convert.cli import app


def convert_command():
    return typer.main.get_command(app).commands["convert"]


def test_every_cli_option_comes_from_the_declaration():
    params = {p.name: p for p in convert_command().params}
    for name, field in ConvertOptions.model_fields.items():
        if (field.json_schema_extra or {}).get("cli") is False:
            assert name not in params, name
            continue
        param = params[name]
        assert param.help == field.description, name
        flag = "--" + name.replace("_", "-")
        assert flag in param.opts, (name, param.opts)
        assert param.default == field.default, name
        if field.annotation is bool and field.default:
            assert "--no-" + name.replace("_", "-") in param.secondary_opts, name


def test_the_library_docstring_lists_every_option():
    for name, field in ConvertOptions.model_fields.items():
        assert f"{name} (default" in convert.__doc__ and field.description in convert.__doc__


def test_bad_options_fail_before_anything_is_read(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OptionsError, match="blok_size"):
        convert("no/such-model", out, blok_size=3)
    with pytest.raises(OptionsError, match=r"verify_tokens.*got 'many'"):
        convert("no/such-model", out, verify_tokens="many")
    with pytest.raises(OptionsError, match="dtype"):
        convert("no/such-model", out, dtype="float8")
    # on the command line the same field checks it (its usual aliases accepted, bf16 for bfloat16)
    result = run_cli("convert", "no/such-model", "-o", out, "--dtype", "float8")
    assert result.exit_code == 2 and "float8" in result.output and "bfloat16" in result.output
    assert leftovers(out) == []


def test_library_and_cli_build_the_same_conversion(tmp_path):
    source = save_tiny(tmp_path / "tiny")
    # an options object, with a keyword argument overriding one of its fields
    base = ConvertOptions(block_size=2, verify=False)
    convert(str(source), tmp_path / "lib", base, block_size=3)
    result = run_cli("convert", source, "-o", tmp_path / "cli", "--block-size", "3", "--no-verify")
    assert result.exit_code == 0, result.output
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("lib", "cli")]
    assert configs[0]["block_size"] == configs[1]["block_size"] == 3
    assert base.block_size == 2  # the object given is not modified
