"""Where the HuggingFace hub is and whether it answers: downloading a source and pushing a result both ask."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' and the hub's convention; the hub refuses files over 50GB


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP check of the hub endpoint, so an offline machine fails in seconds, not after
    minutes of HTTP retries."""
    url = urlparse(hub_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False
