"""A stand-in for SGLang's server, built to its routed-experts contract (read from sglang 0.5.23; docs/sglang.md).

:class:`FakeSGLangServer` is a threaded HTTP server on ``127.0.0.1`` answering SGLang's native ``POST /generate`` for
token-id prompts (``input_ids``: one list, or a list of them), ``sampling_params`` (``max_new_tokens``,
``temperature``), ``return_logprob`` (``meta_info["output_token_logprobs"]``: ``[logprob, token_id, None]`` per output
token) and ``return_routed_experts`` with ``routed_experts_start_len = s``: ``meta_info["routed_experts"]``, base64 of
the raw ``int32`` bytes of ``[p + c - 1 - s, num_layers, top_k]`` (positions ``[s, p + c - 1)`` of prompt + output,
dense layers zero). A start below 0 or past the prompt aborts that request (``finish_reason`` of type ``"abort"``,
no routes), as SGLang's scheduler does. Sampling is transformers ``generate`` (``TransformersEngine``).

``return_routes=False`` is a server started without ``--enable-return-routed-experts`` (no ``routed_experts`` key);
``tamper(call, index, payload) -> payload`` rewrites individual payloads (``call`` counts ``/generate`` requests
from 0). Use as a context manager; ``url`` is the base URL. Every request body is kept in ``requests``, what each
result carried in ``routes`` and ``outputs``.
"""

from __future__ import annotations

import base64
import itertools
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import numpy as np
from torch import nn

from .fake_vllm import TransformersEngine


__all__ = ["FakeSGLangServer", "sglang_payload"]

Tamper = Callable[[int, int, str | None], Any]


def sglang_payload(routes: np.ndarray) -> str:
    """``routes`` as SGLang sends them: base64 of the raw bytes of an ``int32`` tensor (no shape, no header)."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype="<i4").tobytes()).decode("ascii")


class FakeSGLangServer:
    """SGLang's ``/generate`` as a client sees it, on ``127.0.0.1`` and an ephemeral port (see the module docstring)."""

    def __init__(self, model: nn.Module, *, return_routes: bool = True, tamper: Tamper | None = None):
        self.engine = TransformersEngine(model)
        self.return_routes = return_routes
        self.tamper = tamper
        self.requests: list[dict] = []
        self.routes: list[list[np.ndarray | None]] = []  # per request, the routes each result carried (decoded)
        self.outputs: list[list[list[int]]] = []  # per request, each result's output_ids
        self._calls = itertools.count()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FakeSGLangServer:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-sglang", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._httpd is not None and self._thread is not None  # __enter__ started them
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    @property
    def url(self) -> str:
        assert self._httpd is not None, "the server runs inside its `with` block"
        host, port = cast(tuple[str, int], self._httpd.server_address[:2])
        return f"http://{host}:{port}"

    def generate(self, body: dict) -> list[dict] | dict:
        """One ``/generate`` request: a result per prompt (a single prompt: one result, not a list)."""
        self.requests.append(body)
        call = next(self._calls)
        single = bool(body["input_ids"]) and isinstance(body["input_ids"][0], int)
        prompts = [body["input_ids"]] if single else body["input_ids"]
        params = body.get("sampling_params") or {}
        start = body.get("routed_experts_start_len", 0)
        wants_routes = bool(body.get("return_routed_experts")) and self.return_routes
        valid = [not wants_routes or 0 <= start <= len(prompt) for prompt in prompts]
        sampled = iter(
            self.engine.generate(
                [p for p, ok in zip(prompts, valid, strict=True) if ok],
                n=1,
                temperature=params.get("temperature", 1.0),
                max_tokens=params.get("max_new_tokens", 16),
            )
            if any(valid)
            else []
        )
        results: list[dict[str, Any]] = []
        served: list[np.ndarray | None] = []
        outputs: list[list[int]] = []
        for index, (prompt, ok) in enumerate(zip(prompts, valid, strict=True)):
            meta: dict[str, Any] = {"id": f"{call}-{index}", "prompt_tokens": len(prompt)}
            if not ok:  # SGLang's scheduler aborts the request
                meta.update(
                    completion_tokens=0,
                    finish_reason={
                        "type": "abort",
                        "message": f"routed_experts_start_len={start} is outside [0, {len(prompt)}]",
                    },
                )
                results.append({"text": "", "output_ids": [], "meta_info": meta})
                served.append(None)
                outputs.append([])
                continue
            (completion,) = next(sampled)
            meta.update(completion_tokens=len(completion.token_ids), finish_reason={"type": completion.finish_reason})
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [
                    [value, token, None]
                    for value, token in zip(completion.logprobs, completion.token_ids, strict=True)
                ]
            routes = completion.routed_experts[min(start, len(completion.routed_experts)) :].astype(np.int32)
            served.append(routes if wants_routes else None)
            outputs.append(completion.token_ids)
            payload = sglang_payload(routes) if wants_routes else None
            if self.tamper is not None:
                payload = self.tamper(call, index, payload)
            if payload is not None:
                meta["routed_experts"] = payload
            results.append({"text": "", "output_ids": completion.token_ids, "meta_info": meta})
        self.routes.append(served)
        self.outputs.append(outputs)
        return results[0] if single else results


def _handler_for(server: FakeSGLangServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 - http.server's naming
            length = int(self.headers.get("Content-Length") or 0)
            answer: list[dict] | dict
            try:
                body = json.loads(self.rfile.read(length))
                if self.path != "/generate":
                    status, answer = 404, {"error": {"message": f"no route {self.path}"}}
                else:
                    status, answer = 200, server.generate(body)
            except Exception as exc:  # a server-side bug reaches the client as a 500 with a message
                status, answer = 500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # keep test output clean
            pass

    return Handler
