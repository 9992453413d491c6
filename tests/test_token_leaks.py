"""A hub token never reaches stdout, stderr, logs, metrics, configs, cards or error messages.

End to end: HF_TOKEN is set to a recognisable fake value (not shaped like a real `hf_` token, so pattern
scrubbing cannot hide a leak) in a fresh Python that runs every command writing a folder or talking to
the hub (a fake hub on 127.0.0.1, the same one the hub tests use), with debug logging on. Then the
captured stdout/stderr, every file written (outputs, logs, caches) and every file the hub received are
searched for the token."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fake_hub import FakeHub
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe
from reliability_helpers import ONE_THREAD_ENV

pytestmark = pytest.mark.extended  # end to end, tens of seconds: `make test-extended`

TOKEN = "attnres-SECRET-token-7f3a9c1e5b2d"

# The commands run in one Python, printing to the real stdout/stderr (no capture in between), so that any
# logger writing the token would be seen.
DRIVER = textwrap.dedent(
    """
    import json, sys
    import click
    from attnres_convert import cli

    commands = {c.name or c.callback.__name__ for c in cli.app.registered_commands}
    commands |= {group.name for group in cli.app.registered_groups}
    for args in json.loads(sys.argv[1]):
        if args[0] not in commands:
            print(f"SKIP {args[0]} (not a command yet)", flush=True)
            continue
        try:
            code = cli.app(args, standalone_mode=False) or 0
        except click.exceptions.ClickException as error:
            error.show()
            code = error.exit_code
        except SystemExit as error:
            code = error.code
        sys.stderr.flush()
        print(f"RUN {' '.join(args)} -> {code}", flush=True)
    """
)


def _contains(path: Path, needle: bytes) -> bool:
    try:
        return needle in path.read_bytes()
    except OSError:
        return False


@pytest.mark.slow
def test_token_never_leaks(tmp_path):
    import json

    base = tiny_model_folder(tmp_path / "base")  # with a tokenizer: eval and finetune read text
    corpus = write_corpus(tmp_path / "corpus")
    text = Path(corpus["eval"][0])
    outputs = tmp_path / "outputs"
    converted, pushed = outputs / "converted", outputs / "pushed"
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        tiny_recipe(base, corpus, outputs / "run", train={"steps": 3}, checkpoint={"every": 2, "keep_last": 2}),
    )
    with FakeHub(TOKEN) as hub:
        hub.forbidden_namespaces.add("someone-else")
        commands = [
            ["convert", str(base), "-o", str(converted), "--block-size", "2"],
            ["convert", str(base), "-o", str(pushed), "--push-to-hub", "alice/tiny-attnres"],
            ["push", str(converted), "alice/tiny-attnres-2", "--private"],
            ["push", str(converted), "someone-else/stolen"],  # refused by the hub (403)
            ["push", str(tmp_path / "missing"), "alice/x"],  # bad input
            ["convert", str(tmp_path / "missing"), "-o", str(outputs / "x")],  # bad input
            ["inspect", str(converted), "--plot", str(outputs / "depth.png")],
            ["eval", str(converted), "--data", str(text), "--seq-len", "32"],
            ["finetune", str(recipe), "--push-to-hub", "alice/tiny-finetuned"],
            ["finetune", str(recipe), "--resume"],  # refused: the run is complete
            ["recipes", "validate", str(recipe)],
        ]
        env = {
            **os.environ,
            **ONE_THREAD_ENV,
            "HF_TOKEN": TOKEN,
            "HF_ENDPOINT": hub.endpoint,
            "HF_HUB_DISABLE_XET": "1",
            "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_VERBOSITY": "debug",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "TRANSFORMERS_VERBOSITY": "debug",
            "TOKENIZERS_PARALLELISM": "false",
        }
        result = subprocess.run(
            [sys.executable, "-c", DRIVER, json.dumps(commands)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        published = {name: data for repo in hub.repos for name, data in hub.files(repo).items()}
    captured = result.stdout + result.stderr
    assert result.returncode == 0, captured
    ran = [line for line in result.stdout.splitlines() if line.startswith("RUN ")]
    ok = [line.split(" ", 2)[1] for line in ran if line.endswith("-> 0")]
    assert ok.count("convert") == 2 and ok.count("push") == 1 and "finetune" in ok, ran
    assert sum(line.endswith("-> 2") for line in ran) >= 4, ran  # the failures did happen
    assert published, "nothing reached the fake hub"

    assert TOKEN not in captured, "the token was printed or logged"
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and _contains(p, TOKEN.encode())]
    assert leaked == [], f"the token is written in {leaked}"
    assert [name for name, data in published.items() if TOKEN.encode() in data] == []
