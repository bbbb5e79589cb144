"""Requests to a vLLM server's HTTP endpoints outside TRL's client, with one error for a server that fails them.

The reload weight sync (``weight_sync/weight_reload.py``) and the sync check (``weight_sync/sync_check.py``) of both trainers
talk to the server through :func:`post_to_server` and :func:`served_model_name`: a server that is down, restarting or
refusing a request stops the run with :class:`VLLMServerUnavailableError`, never a hang or a bare ``requests`` error.

``requests`` is imported here, when server mode talks to the server, never at import: a plain install (no extras)
does not bring it (huggingface_hub 2 no longer does), and the ``vllm`` extras declare it. Without it server mode stops
with :class:`ServerModeDependencyError`, one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import TrlMoeReplayError


if TYPE_CHECKING:
    import requests

__all__ = [
    "ServerModeDependencyError",
    "VLLMServerUnavailableError",
    "http_client",
    "post_to_server",
    "served_model_name",
    "server_gone_errors",
]


class VLLMServerUnavailableError(TrlMoeReplayError, RuntimeError):
    """The vLLM server did not answer a request (down, restarting, or unreachable), or refused it."""


class ServerModeDependencyError(TrlMoeReplayError, ImportError):
    """vLLM server mode needs ``requests``, which a plain install (no extras) does not bring."""


def http_client():
    """The ``requests`` module, for a request to the vLLM server; :class:`ServerModeDependencyError` without it."""
    try:
        import requests
    except ImportError as exc:
        raise ServerModeDependencyError(
            "vLLM server mode needs the requests package, which is not installed (a plain install does not bring "
            'it): pip install "trl-moe-replay[vllm]" (or pip install requests)'
        ) from exc
    return requests


def server_gone_errors() -> tuple[type[BaseException], ...]:
    """What a request to a vLLM server that went away raises: ours (:class:`VLLMServerUnavailableError`) and TRL's
    client's (a ``requests`` error once its retries are spent, or a bare ``ConnectionError``)."""
    try:
        import requests
    except ImportError:
        return VLLMServerUnavailableError, ConnectionError
    return VLLMServerUnavailableError, ConnectionError, requests.RequestException


def _server(url: str) -> str:
    return "/".join(url.split("/")[:3])


def post_to_server(url: str, what: str, timeout: float, remedy: str, **kwargs) -> requests.Response:
    """POST ``url``; ``what`` names the request and ``remedy`` says what to do when the server refuses it."""
    requests = http_client()
    try:
        response = requests.post(url, timeout=timeout, **kwargs)
    except requests.RequestException as exc:
        raise VLLMServerUnavailableError(
            f"the vLLM server at {_server(url)} did not answer {what} ({type(exc).__name__}: {exc}). Is it still "
            "running? Restart it and resume training from the last checkpoint."
        ) from exc
    if response.status_code != 200:
        raise VLLMServerUnavailableError(
            f"the vLLM server at {_server(url)} refused {what} ({response.status_code}: {response.text[:300]}). "
            f"{remedy}"
        )
    return response


def served_model_name(base_url: str, timeout: float) -> str:
    """The name the server serves its model under (the first of ``/v1/models``, as TRL's ``VLLMClient`` reads it)."""
    url = f"{base_url}/v1/models"
    requests = http_client()
    try:
        response = requests.get(url, timeout=timeout)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        raise VLLMServerUnavailableError(
            f"the vLLM server at {base_url} did not name its model on /v1/models ({type(exc).__name__}: {exc}). Is "
            "it still running? Restart it and resume training from the last checkpoint."
        ) from exc
