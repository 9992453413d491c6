"""A folder converted by an earlier attnres release keeps working: it loads and generates with the code it ships,
this package fine-tunes it (load_converted), and `attnres upgrade` re-saves it with this release's two code files,
exactly. The earlier release is the one before the shipped code became one generated file, taken from this
repository's own history (a checkout without it skips, saying why)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnres_convert import load_converted
from attnres_convert.modeling import SHIPPED_CODE

REPOSITORY = Path(__file__).resolve().parent.parent
# The last commit whose converted folders ship the package's modeling code as 21 Python files and a C++ source.
EARLIER_RELEASE = "0b65c5b"
pytestmark = [pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def earlier_folder(tmp_path_factory) -> Path:
    """A tiny Llama converted by the earlier release's package (its tree from git, run in a child process)."""
    root = tmp_path_factory.mktemp("earlier")
    archive = subprocess.run(
        ["git", "archive", EARLIER_RELEASE, "attnres_convert"],
        cwd=REPOSITORY,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )
    if archive.returncode != 0:
        pytest.skip(
            f"this checkout has no commit {EARLIER_RELEASE} (a shallow clone?): {archive.stderr.decode()[:200]}"
        )
    (root / "package").mkdir()
    subprocess.run(["tar", "-x", "-C", str(root / "package")], input=archive.stdout, check=True)
    folder = root / "folder"
    code = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(root / "package")!r}, {str(REPOSITORY / "tests")!r}]
        import torch
        import attnres_convert
        assert attnres_convert.__file__.startswith({str(root / "package")!r}), attnres_convert.__file__
        from tiny_models import tiny_model
        from attnres_convert import convert_model, save_converted
        model = convert_model(tiny_model("llama"), block_size=2).eval()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "_res_proj" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
        save_converted(model, {str(folder)!r})
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))


def _own_code_logits(folder: Path) -> torch.Tensor:
    """The folder's logits under its own code, in a child process where this package cannot be imported."""
    from isolated import run_isolated

    torch.save({"ids": _ids()}, folder.parent / f"{folder.name}-ids.pt")
    out = folder.parent / f"{folder.name}-logits.pt"
    result = run_isolated(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        ids = torch.load({str(folder.parent / f"{folder.name}-ids.pt")!r})["ids"]
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            torch.save(model(ids).logits, {str(out)!r})
        print("OWN-OK")
        """
    )
    assert "OWN-OK" in result.stdout, result.stderr[-3000:]
    return torch.load(out)


def test_an_earlier_folder_ships_its_own_code_and_still_runs_it(earlier_folder):
    code = sorted(p.name for p in earlier_folder.iterdir() if p.suffix in (".py", ".cpp"))
    assert len(code) > 2 and "depth_kernels_cpu.cpp" in code  # the earlier layout, not this release's
    assert torch.isfinite(_own_code_logits(earlier_folder)).all()


def test_the_package_runs_an_earlier_folder_with_the_same_logits(earlier_folder):
    """load_converted (what finetune and ab use) runs this release's classes on the earlier folder's weights: the
    same bits as the folder's own code (both run the token-major buffer for these few tokens, not the C++ kernels
    this machine may have built)."""
    from attnres_convert.kernels import code_paths_only

    model = load_converted(earlier_folder).eval()
    with torch.no_grad(), code_paths_only():
        logits = model(_ids()).logits
    assert torch.equal(logits, _own_code_logits(earlier_folder))


def test_upgrade_re_saves_an_earlier_folder_exactly_with_two_code_files(earlier_folder, tmp_path):
    before = _own_code_logits(earlier_folder)
    out = tmp_path / "upgraded"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnres_convert",
            "upgrade",
            str(earlier_folder),
            "-o",
            str(out),
            "--trust-remote-code",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPOSITORY,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "logits equal to the folder's own code" in " ".join(result.stdout.split())
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".py", ".cpp")) == sorted(SHIPPED_CODE)
    for name in SHIPPED_CODE:
        assert (out / name).read_bytes() == (REPOSITORY / "attnres_convert" / "modeling" / name).read_bytes()
    assert json.loads((out / "config.json").read_text())["structure"]  # the plan, recorded
    # Loaded where attnres is not installed, the new folder runs its built-in buffer, which sums the few tokens'
    # sources in another order than the earlier code's token-major one: float32 rounding apart.
    torch.testing.assert_close(_own_code_logits(out), before, rtol=1e-4, atol=1e-4)
    assert sorted(p.name for p in earlier_folder.iterdir() if p.suffix == ".cpp") == [
        "depth_kernels_cpu.cpp"
    ]  # untouched


def test_upgrade_runs_folder_code_only_with_consent_and_names_the_flag(earlier_folder, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "attnres_convert", "upgrade", str(earlier_folder), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPOSITORY,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "pass --trust-remote-code" in " ".join((result.stdout + result.stderr).split())
    assert not (tmp_path / "out").exists()
