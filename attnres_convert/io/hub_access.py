"""Where the HuggingFace hub is and whether it answers: downloading a source and pushing a result both ask."""

from __future__ import annotations

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' and the hub's convention; the hub refuses files over 50GB
# A proxy that cannot reach the hub answers for it: a bad gateway or a gateway timeout is no answer from the hub.
_GATEWAY_FAILURES = (502, 504)


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_reachable(timeout: float = 3.0) -> bool:
    """One HEAD request to the hub endpoint through huggingface_hub's own HTTP session, so it goes where
    downloads go (HF_ENDPOINT, proxies, HF_HUB_OFFLINE, custom client factories), and an offline machine fails
    in seconds, not after minutes of HTTP retries. Any HTTP answer counts: the endpoint is there."""
    from huggingface_hub.utils import get_session

    try:
        response = get_session().head(hub_endpoint(), timeout=timeout, follow_redirects=False)
    except Exception:  # noqa: BLE001 - refused, timed out, no route, offline mode, a bad proxy: not reachable
        return False
    return response.status_code not in _GATEWAY_FAILURES
