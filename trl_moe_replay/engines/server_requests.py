"""Requests to a vLLM server's HTTP endpoints outside TRL's client, with one error for a server that fails them.

The reload weight sync (``engines/weight_reload.py``) and the sync check (``engines/sync_check.py``) of both trainers
talk to the server through :func:`post_to_server` and :func:`served_model_name`: a server that is down, restarting or
refusing a request stops the run with :class:`VLLMServerUnavailableError`, never a hang or a bare ``requests`` error.
"""

from __future__ import annotations

import requests

__all__ = ["VLLMServerUnavailableError", "post_to_server", "served_model_name"]


class VLLMServerUnavailableError(RuntimeError):
    """The vLLM server did not answer a request (down, restarting, or unreachable), or refused it."""


def _server(url: str) -> str:
    return "/".join(url.split("/")[:3])


def post_to_server(url: str, what: str, timeout: float, remedy: str, **kwargs) -> requests.Response:
    """POST ``url``; ``what`` names the request and ``remedy`` says what to do when the server refuses it."""
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
    try:
        response = requests.get(url, timeout=timeout)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        raise VLLMServerUnavailableError(
            f"the vLLM server at {base_url} did not name its model on /v1/models ({type(exc).__name__}: {exc}). Is "
            "it still running? Restart it and resume training from the last checkpoint."
        ) from exc
