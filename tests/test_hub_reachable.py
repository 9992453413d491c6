"""Whether the hub answers is asked through huggingface_hub's own HTTP session, so the check goes where
downloads go: HF_ENDPOINT, a proxy from the environment, offline mode. Each case runs in a fresh Python, where
huggingface_hub reads its environment on import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fake_hub import FakeHub

ROOT = Path(__file__).resolve().parent.parent
CHECK = "from attnres_convert.io.hub_access import hub_reachable; print('REACHABLE', hub_reachable())"
PROXY_VARIABLES = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
)


def reachable(env: dict) -> tuple[bool, float]:
    """hub_reachable() in a fresh Python with ENV (and no proxy but the one ENV names); the answer and its seconds."""
    full = {key: value for key, value in os.environ.items() if key not in PROXY_VARIABLES}
    full.update({"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "0", **env})
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, env=full, timeout=120, stdin=subprocess.DEVNULL
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.split("REACHABLE ")[-1].strip().lower()), time.monotonic() - start


def test_hf_endpoint_is_asked_over_http():
    """A fake hub named by HF_ENDPOINT answers an HTTP request (a bare TCP connect would send none)."""
    with FakeHub("token") as hub:
        answer, _ = reachable({"HF_ENDPOINT": hub.endpoint})
        assert answer is True
        assert [(r.method, r.path) for r in hub.requests] == [("HEAD", "/")]


def test_a_proxy_from_the_environment_is_used():
    """An endpoint this machine cannot resolve is reachable through the proxy the environment names, as
    huggingface_hub's downloads would reach it: the proxy receives the request for the endpoint."""
    with FakeHub("token") as proxy:
        answer, _ = reachable({"HF_ENDPOINT": "http://hub.invalid", "HTTP_PROXY": proxy.endpoint})
        assert answer is True
        assert [(r.method, r.path) for r in proxy.requests] == [("HEAD", "http://hub.invalid/")]


def test_unreachable_and_offline_answer_fast():
    with FakeHub("token") as hub:
        endpoint = hub.endpoint
    answer, seconds = reachable({"HF_ENDPOINT": endpoint})  # the server is gone: the port refuses
    assert answer is False and seconds < 30
    with FakeHub("token") as hub:  # HF_HUB_OFFLINE: huggingface_hub sends nothing, the hub counts as unreachable
        answer, seconds = reachable({"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "1"})
        assert answer is False and seconds < 30 and hub.requests == []
