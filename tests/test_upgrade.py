"""`attnres upgrade` (conversion/upgrade.py): a converted folder re-saved with this release's two code files, checked
exactly against the folder's own code first. In place and to another path: the same logits, the folder's other files
kept, its old code files (an earlier release's modules, its C++ source) gone. Refused without --trust-remote-code
(the check runs the folder's code), for what is not a converted folder, for an output that exists, and, exit 1 with
the folder left as it is, where the folder's code gives other logits. Exit codes through the CLI."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from reliability_helpers import assert_user_error, run_cli
from tiny_models import randomize_queries, tiny_model, token_ids

from attnres_convert import load_converted, save_converted
from attnres_convert.conversion.surgery import convert_model
from attnres_convert.conversion.upgrade import upgrade_folder
from attnres_convert.errors import SourceError
from attnres_convert.io.paths import OutputError
from attnres_convert.modeling import SHIPPED_CODE, modeling_attnres

# What an earlier release's folder held beside the two files (its code was several modules and the C++ source).
OLD_CODE = {"depth_attention.py": "# an earlier release's module\n", "depth_kernels_cpu.cpp": "// an earlier source\n"}
KEPT = {"README.md": "# the folder's card\n", "attnres_conversion.json": "{}\n"}


@pytest.fixture(scope="module")
def model():
    return randomize_queries(convert_model(tiny_model("llama"), block_size=3).eval(), 0.3, seed=2, key_norms=0.2)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _old_folder(model, path: Path) -> Path:
    """A converted folder with an earlier release's extra code files, and other files of its own."""
    folder = save_converted(copy.deepcopy(model), path)
    for name, text in {**OLD_CODE, **KEPT}.items():
        (folder / name).write_text(text)
    return folder


def _assert_upgraded(folder: Path, model, ids) -> None:
    assert sorted(p.name for p in folder.glob("*.py")) == sorted(SHIPPED_CODE)
    assert (folder / "modeling_attnres.py").read_text() == Path(modeling_attnres.__file__).read_text()
    assert not list(folder.glob("*.cpp")) and not (folder / "depth_attention.py").exists()
    assert all((folder / name).read_text() == text for name, text in KEPT.items())
    assert torch.equal(_logits(load_converted(folder).eval(), ids), _logits(model, ids))


def test_upgrade_to_another_path_and_in_place(model, tmp_path):
    ids = token_ids(2, 7)
    old = _old_folder(model, tmp_path / "old-a")
    result = upgrade_folder(old, tmp_path / "upgraded-a", trust_remote_code=True)
    assert result.folder == (tmp_path / "upgraded-a").absolute() and result.max_difference == 0.0
    assert result.files == tuple(sorted(SHIPPED_CODE))
    _assert_upgraded(result.folder, model, ids)
    assert all((old / name).exists() for name in OLD_CODE)  # the source folder is untouched

    result = upgrade_folder(old, trust_remote_code=True)  # in place
    assert result.folder.resolve() == old.resolve() and result.files == tuple(sorted(SHIPPED_CODE))
    _assert_upgraded(old, model, ids)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_refusals_leave_the_folder_as_it_is(model, tmp_path):
    old = _old_folder(model, tmp_path / "old-b")
    before = sorted(p.name for p in old.iterdir())
    with pytest.raises(SourceError, match="--trust-remote-code"):
        upgrade_folder(old)
    with pytest.raises(SourceError, match="not an AttnRes model folder"):
        upgrade_folder(tmp_path, trust_remote_code=True)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="already exists"):
        upgrade_folder(old, taken, trust_remote_code=True)
    assert (taken / "notes.txt").read_text() == "mine" and sorted(p.name for p in old.iterdir()) == before


def test_the_cli_exit_codes(model, tmp_path):
    old = _old_folder(model, tmp_path / "old-c")
    out = tmp_path / "upgraded-c"
    assert_user_error(run_cli("upgrade", old, "-o", out), "--trust-remote-code", out=out)
    assert_user_error(
        run_cli("upgrade", tmp_path / "no-such-folder", "--trust-remote-code"), "not an AttnRes model folder"
    )

    done = run_cli("upgrade", old, "-o", out, "--trust-remote-code")
    assert done.exit_code == 0, done.output
    assert "Saved" in done.output and "modeling_attnres.py" in done.output
    _assert_upgraded(out, model, token_ids(2, 7))
    assert_user_error(run_cli("upgrade", old, "-o", out, "--trust-remote-code"), "already exists", "--overwrite")
    again = run_cli("upgrade", old, "-o", out, "--trust-remote-code", "--overwrite")
    assert again.exit_code == 0, again.output


def test_a_folder_whose_code_gives_other_logits_is_left_as_it_is(model, tmp_path):
    """The check compares the folder's own code with this release's on the same weights: an earlier code that
    computes other logits is refused (exit 1, a failed check), and nothing is written."""
    old = _old_folder(model, tmp_path / "old-d")
    with (old / "modeling_attnres.py").open("a") as file:  # its code, off by a little
        file.write(
            "\n_forward = AttnResForCausalLM.forward\n\n\n"
            "def _off_forward(self, *args, **kwargs):\n"
            "    output = _forward(self, *args, **kwargs)\n"
            "    output.logits = output.logits + 1e-3\n"
            "    return output\n\n\n"
            "AttnResForCausalLM.forward = _off_forward\n"
        )
    code_before = (old / "modeling_attnres.py").read_text()
    out = tmp_path / "upgraded-d"
    result = run_cli("upgrade", old, "-o", out, "--trust-remote-code")
    assert_user_error(result, "logits", "probe tokens", "left as it is", out=out, code=1)
    assert (old / "modeling_attnres.py").read_text() == code_before and (old / "depth_kernels_cpu.cpp").exists()
