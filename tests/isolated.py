"""Running code in a fresh Python that cannot import attnres_convert: what a user without the package runs
(trust_remote_code alone), for the tests that load converted folders that way."""

import subprocess
import sys
import textwrap

import torch

# A Python without this package. Nor fla-core (installed for tests/test_fla.py): transformers binds a hybrid family's
# linear attention to fla's GPU-only Triton kernels whenever it imports (as conftest.py keeps from happening here).
BLOCK_IMPORT = textwrap.dedent(
    """
    import importlib.abc, sys
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("attnres_convert", "cli"):
                raise ImportError("attnres_convert is not installed here")
            if name.split(".")[0] == "fla":
                raise ImportError("fla-core's kernels need a GPU")
    sys.meta_path.insert(0, _Block())
    try:
        import attnres_convert
        raise SystemExit("attnres_convert should not be importable")
    except ImportError:
        pass
    """
)


def run_isolated(code: str) -> subprocess.CompletedProcess:
    """Run code in a Python that cannot import this package. The child uses this process's torch thread
    count, so a comparison with logits computed here sums in the same order (like for like)."""
    threads = f"import torch\ntorch.set_num_threads({torch.get_num_threads()})\n"
    return subprocess.run(
        [sys.executable, "-c", BLOCK_IMPORT + threads + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def assert_same_logits_without_the_package(folder, ids: torch.Tensor, expected: torch.Tensor, scratch) -> None:
    """FOLDER, loaded with trust_remote_code in a Python that cannot import this package, gives EXPECTED logits for
    IDS bit for bit (SCRATCH: a folder for the tensors handed over)."""
    from pathlib import Path

    handed = Path(scratch) / "expected.pt"
    torch.save({"ids": ids, "logits": expected}, handed)
    result = run_isolated(f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        data = torch.load({str(handed)!r})
        with torch.no_grad():
            assert torch.equal(model(data["ids"]).logits, data["logits"])
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
