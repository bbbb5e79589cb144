r"""Server mode's routes: taking the ``routed_experts`` out of a ``/v1/completions`` response as it arrives, decoded.

:func:`install_routes_hook` puts a :class:`CompletionRoutesHook` on the session of TRL's ``VLLMClient`` (main process
only; the module needs ``requests``, as TRL's client does, so it is imported only in server mode).

vLLM returns a generation batch's routes inside its one JSON response: about 2 GB of base64 for the 30B recipe.
Read whole and parsed (``requests``' ``Response.json()``), the body, the parsed payload strings and the decoded arrays
are alive at once: 6.6x the decoded bytes on the main process (``bench/route_memory.py``). :class:`RoutesSplitter`
reads the body chunk by chunk instead, decodes each payload as soon as its closing quote arrives, and keeps the rest
of the body (the token ids and log-probs TRL parses) with each payload replaced by a placeholder string naming it.
What is alive for the routes is then the decoded arrays, one payload's text and one chunk. TRL reads no key named
``routed_experts``, so its view of the body is unchanged.

Finding a payload is a lexical fact of JSON, not a parse. A ``"`` right after ``{`` or ``,`` (whitespace allowed) is
a string's opening quote (inside a string every ``"`` is escaped, so it follows ``\``), hence
``[{,]\s*"routed_experts"\s*:\s*"`` can only be the key ``routed_experts`` and the opening quote of its string value.
Base64 holds no ``"`` or ``\``, so the value ends at the next unescaped ``"``. Which choice each payload belongs to is
read from the parsed body afterwards (:meth:`RoutesSplitter.rows_by_choice`): the choice whose own ``routed_experts``
holds its placeholder. A payload the scan did not take (a key spelled with escapes, whitespace runs longer than the
scan allows) stays in the body as a string and is still found; one nested in a malformed value (a server sending an
object) leaves that value malformed, so its sample falls back as before.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import numpy as np

from ..routing.codec import decoded_or_as_sent
from ..upstream import client_session


try:
    from requests import Response
except ImportError:  # a plain install (no vllm extra) lacks requests; this module is imported in server mode only
    Response = object  # type: ignore[assignment,misc]


ROUTES_KEY = "routed_experts"
#: A payload's key and the opening quote of its value (group 1: everything before that quote).
_PAYLOAD_START = re.compile(rb'([{,][ \t\r\n]{0,16}"%s"[ \t\r\n]{0,16}:[ \t\r\n]{0,16})"' % ROUTES_KEY.encode())
#: Bytes held back at a chunk's end: any start of a match that did not fit in the chunk (at most 66 bytes long).
_TAIL = 80
_BACKSLASH = ord("\\")


class RoutesSplitter:
    """Feed a response body's chunks in order (:meth:`feed`), then :meth:`finish` for the body without the payloads,
    and :meth:`rows_by_choice` of the parsed body for each choice's rows. One splitter per response.

    A payload becomes its decoded ``[T, L, K]`` array; one that does not decode stays its text (a ``str``), so the
    route intake reports it for its sample exactly as it reports a malformed payload received whole.
    """

    def __init__(self) -> None:
        self._body = bytearray()  # the body so far, without the payloads taken
        self._pending = b""  # unscanned bytes held back (a possible match cut by a chunk's end)
        self._payload: list[bytes] | None = None  # the open payload's text so far, while inside one
        self._escaped = False  # inside a payload: the previous chunk ended in an odd run of backslashes
        self._payloads: list[np.ndarray | str | None] = []
        # What replaces payload k in the body: a string no server can forge (a fresh random part per response), so
        # a placeholder read back from the parsed body is always one this splitter wrote.
        self._marker = f"trl-moe-replay:{secrets.token_hex(16)}:"
        self.payload_chars = 0  # base64 characters received (taken or not): vllm/route_bytes

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk if self._pending else chunk
        self._pending = b""
        pos = 0
        while pos < len(data):
            if self._payload is not None:
                pos = self._read_payload(data, pos)
                continue
            match = _PAYLOAD_START.search(data, pos)
            if match is None:
                keep = max(pos, len(data) - _TAIL)
                self._body += data[pos:keep]
                self._pending = data[keep:]
                return
            self._body += data[pos : match.end(1)]
            self._payload, self._escaped = [], False
            pos = match.end()

    def _read_payload(self, data: bytes, pos: int) -> int:
        """Read the open payload from ``data[pos:]``; the position after it (its closing quote), or ``len(data)``."""
        assert self._payload is not None
        search = pos
        while True:
            quote = data.find(b'"', search)
            if quote < 0:
                self._payload.append(data[pos:])
                self._escaped = _ends_escaping(data, pos, len(data), self._escaped)
                return len(data)
            if not _ends_escaping(data, pos, quote, self._escaped):
                break
            search = quote + 1  # an escaped quote (never in base64): part of the text
        self._payload.append(data[pos:quote])
        text = b"".join(self._payload)
        self._payload = None
        self.payload_chars += len(text)
        self._body += b'"%s%d"' % (self._marker.encode(), len(self._payloads))
        self._payloads.append(_decoded(text))
        return quote + 1

    def finish(self) -> bytes:
        """The body without the payloads taken (each replaced by its placeholder); feed nothing after this.

        A body cut inside a payload stays cut (invalid JSON), so the client's parse fails as it would have."""
        if self._payload is not None:
            self._body += b'"' + b"".join(self._payload)
            self._payload = None
        self._body += self._pending
        self._pending = b""
        body, self._body = bytes(self._body), bytearray()
        return body

    def rows_by_choice(self, parsed: Any) -> list[np.ndarray | str | None]:
        """Each choice's rows, in the order of ``parsed["choices"]`` (the body :meth:`finish` returned, parsed): the
        payload taken where the choice holds its placeholder, else the choice's own value (a payload the scan left
        in the body, ``None``, or something malformed that the intake reports for its sample)."""
        choices = parsed.get("choices") if isinstance(parsed, dict) else None
        rows: list[np.ndarray | str | None] = []
        for choice in choices if isinstance(choices, list) else ():
            value = choice.get(ROUTES_KEY) if isinstance(choice, dict) else None
            if isinstance(value, str) and value.startswith(self._marker):
                ordinal = int(value[len(self._marker) :])
                value, self._payloads[ordinal] = self._payloads[ordinal], None  # held by the rows only
            elif isinstance(value, str):  # left in the body by the scan
                self.payload_chars += len(value)
            rows.append(value)
        self._payloads = []  # any not claimed sat elsewhere than a choice's own field (a malformed value)
        return rows


def _ends_escaping(data: bytes, start: int, end: int, escaped_before: bool) -> bool:
    """Whether ``data[start:end]`` ends in an odd run of backslashes (counting a run carried in from before
    ``start``): then the byte at ``end`` is escaped."""
    run = 0
    while end - run > start and data[end - run - 1] == _BACKSLASH:
        run += 1
    if end - run == start and escaped_before:  # the run continues one carried over from the previous chunk
        run += 1
    return run % 2 == 1


def _decoded(text: bytes) -> np.ndarray | str:
    """A payload's decoded array, or its text where it does not decode (the intake reports it per sample)."""
    if b"\\" in text:  # escapes (a JSON encoder writing "\/", or not base64 at all): the string's actual value
        try:
            value = json.loads(b'"' + text + b'"')
        except ValueError:
            return text.decode("utf-8", "replace")
    else:
        value = text.decode("utf-8", "replace")  # base64 is ASCII; anything else is reported as the server sent it
    return decoded_or_as_sent(value)


class CompletionRoutesHook:
    """A ``requests`` response hook that takes the ``routed_experts`` of every ``/v1/completions`` choice.

    Installed once on the session of TRL's ``VLLMClient`` (main process); it records only between :meth:`start`
    and :meth:`take`, i.e. around one ``VLLMClient.generate``, whose single response lists its choices in TRL's
    completion order (prompt-major, ``n`` per prompt). ``requests`` calls a session's response hooks before it reads
    a non-streamed body, so the hook reads the body itself, chunk by chunk, through a
    :class:`~.route_stream.RoutesSplitter`: each payload is decoded as it arrives, and TRL's ``_post`` gets a response
    whose body holds everything else (seam entry ``vllm_client_session``). Each entry is the choice's decoded
    ``[T, L, K]`` array, the payload's text where it does not decode, or ``None``.
    """

    #: Bytes read from the socket at a time: large enough for few Python-level steps, small next to a batch.
    chunk_size = 1 << 20

    def __init__(self) -> None:
        self._capturing: list[Any] | None = None
        self.payload_chars = 0  # base64 characters received since start (vllm/route_bytes)

    def __call__(self, response, *args, **kwargs):
        if self._capturing is None or not response.ok or response.request.method != "POST":
            return None
        if not response.request.path_url.split("?")[0].endswith("/v1/completions"):
            return None
        splitter = RoutesSplitter()
        for chunk in response.iter_content(self.chunk_size):
            splitter.feed(chunk)
        capturing = self._capturing

        def take_rows(parsed: Any) -> None:
            capturing.extend(splitter.rows_by_choice(parsed))
            self.payload_chars += splitter.payload_chars

        return RoutesTakenResponse(response, splitter.finish(), take_rows)

    def start(self) -> None:
        self._capturing = []
        self.payload_chars = 0

    def take(self) -> list[Any] | None:
        """The rows captured since :meth:`start` (``None`` if not started), and stop capturing."""
        captured, self._capturing = self._capturing, None
        return captured


class RoutesTakenResponse(Response):
    """What the session hands TRL instead of vLLM's response: its status, headers and request, and its body without
    the route payloads. The first :meth:`json` (TRL's ``_post``) also gives the parsed body to ``on_parsed``, which
    matches the payloads taken to their choices."""

    def __init__(self, original: Response, body: bytes, on_parsed) -> None:
        super().__init__()
        for name in (
            "status_code",
            "headers",
            "url",
            "encoding",
            "reason",
            "elapsed",
            "request",
            "history",
            "cookies",
            "raw",
            "connection",
        ):
            if hasattr(original, name):
                setattr(self, name, getattr(original, name))
        self._body = body
        self._on_parsed = on_parsed

    @property
    def content(self) -> bytes:  # type: ignore[override]  # requests declares it a read-only property of Response
        return self._body

    def json(self, **kwargs: Any) -> Any:
        parsed = super().json(**kwargs)
        on_parsed, self._on_parsed = self._on_parsed, None
        if on_parsed is not None:
            on_parsed(parsed)
        return parsed


def install_routes_hook(vllm_client: Any) -> CompletionRoutesHook:
    """Add a :class:`CompletionRoutesHook` to the session of TRL's (already connected) ``VLLMClient``."""
    hook = CompletionRoutesHook()
    client_session(vllm_client).hooks["response"].append(hook)
    return hook
