"""A converted folder outlives the transformers release it was written with: a folder converted here loads with
`trust_remote_code=True` in the environments of the other ends of pyproject.toml's range (`.venv-lowest` made by
`make test-lowest`, `.venv-latest` by `make test-latest`), without attnres importable there, and gives the same
logits and the same cached greedy generation. Within one environment, `make test-lowest` and `make test-latest`
run the whole suite (conversion, saving and loading) on that end."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from attnres_convert import save_converted
from attnres_convert.conversion.surgery import convert_model
from test_save_load import BLOCK_IMPORT
from tiny_models import randomize_queries, tiny_model, token_ids

ROOT = Path(__file__).resolve().parents[1]
ENDS = {"lowest": ROOT / ".venv-lowest", "latest": ROOT / ".venv-latest"}
NEW_TOKENS = 8

LOAD = textwrap.dedent(
    """
    import json, sys
    import torch, transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(int(sys.argv[3]))
    folder, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, max_new_tokens=%d, do_sample=False, use_cache=True)
    print("RESULT " + json.dumps({"transformers": transformers.__version__, "logits": logits.tolist(),
                                  "generated": generated.tolist()}))
    """ % NEW_TOKENS
)


def _other_end(name: str) -> Path:
    python = ENDS[name] / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"{ENDS[name].name} does not exist: `make test-{name}` creates it")
    if ENDS[name].resolve() == Path(sys.prefix).resolve():
        pytest.skip(f"this is {ENDS[name].name} itself")
    return python


@pytest.mark.slow  # a model load in another Python
@pytest.mark.parametrize("end", sorted(ENDS))
def test_a_converted_folder_loads_at_the_other_end_of_the_range(end, tmp_path):
    python = _other_end(end)
    model = randomize_queries(convert_model(tiny_model("llama"), block_size=3).eval(), 0.1, key_norms=0.1, add=True)
    folder = save_converted(model, tmp_path / "converted")
    ids = token_ids()
    with torch.no_grad():
        expected_logits = model(ids).logits
        expected_tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
    run = subprocess.run(
        [str(python), "-c", BLOCK_IMPORT + LOAD, str(folder), json.dumps(ids.tolist()), str(torch.get_num_threads())],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(f"converted with transformers {transformers.__version__}, loaded with {result['transformers']}")
    # The same torch at both ends: the base layers differ only by what transformers changed between releases.
    assert (torch.tensor(result["logits"]) - expected_logits).abs().max().item() <= 1e-5
    assert result["generated"] == expected_tokens.tolist()
