"""Server mode's routes taken out of the response as it arrives (rollouts/route_stream.py), and the scatter of the
decoded rows to the ranks (vllm_routes.scatter_rows)."""

import io
import json
import random
import tracemalloc

import numpy as np
import pytest
import requests
import torch

from trl_moe_replay.rollouts.route_stream import (
    CompletionRoutesHook,
    RoutesSplitter,
    RoutesTakenResponse,
    install_routes_hook,
)
from trl_moe_replay.rollouts.vllm_routes import cpu_group, scatter_rows
from trl_moe_replay.routing.codec import encode_routed_experts
from trl_moe_replay.testing import FakeVLLMServer, tiny_moe_model
from trl_moe_replay.upstream import http_vllm_client


def engine_arrays(*lengths, layers=4, top_k=2, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, (n, layers, top_k), dtype=np.uint8) for n in lengths]


def split(body: bytes, cuts) -> tuple[bytes, RoutesSplitter]:
    splitter = RoutesSplitter()
    pos = 0
    for size in cuts:
        splitter.feed(body[pos : pos + size])
        pos += size
    splitter.feed(body[pos:])
    return splitter.finish(), splitter


def without_routes(parsed):
    return [{k: v for k, v in choice.items() if k != "routed_experts"} for choice in parsed["choices"]]


def test_payloads_are_taken_decoded_and_the_rest_of_the_body_is_untouched_whatever_the_chunks():
    arrays = engine_arrays(5, 17, 300)
    payloads = [encode_routed_experts(a) for a in arrays]
    choices = [  # a text that spells the key inside a string; a null; "/" escaped as JSON allows; not base64
        {
            "index": 0,
            "text": 'x{ "routed_experts": "AAAA" ,"routed_experts":"\\',
            "routed_experts": payloads[0],
            "token_ids": [1, 2],
            "logprobs": {"token_logprobs": [-0.5, -1.25]},
        },
        {"index": 1, "text": "", "routed_experts": None, "token_ids": [3]},
        {"index": 2, "routed_experts": payloads[1], "token_ids": [4]},
        {"index": 3, "routed_experts": "not base64!", "token_ids": [5]},
        {"index": 4, "routed_experts": payloads[2], "token_ids": [6]},
    ]
    body = json.dumps({"id": "cmpl", "choices": choices, "usage": {"total": 9}}).replace("/", "\\/").encode()
    original = json.loads(body)
    assert original["choices"][2]["routed_experts"] == payloads[1] and "\\/" in body.decode()
    rng = random.Random(0)
    for trial in range(200):  # chunk ends anywhere: inside the key, the whitespace, a payload, an escape
        cuts = [rng.randint(1, 9 if trial % 2 else 400) for _ in range(len(body))]
        stripped, splitter = split(body, cuts)
        parsed = json.loads(stripped)
        assert without_routes(parsed) == without_routes(original) and parsed["usage"] == original["usage"]
        rows = splitter.rows_by_choice(parsed)
        assert rows[1] is None and rows[3] == "not base64!"  # the intake reports it for its sample
        for row, array in zip((rows[0], rows[2], rows[4]), arrays, strict=True):
            assert isinstance(row, np.ndarray) and row.dtype == np.uint8 and np.array_equal(row, array)
        assert not any(p[:40].replace("/", "\\/").encode() in stripped for p in payloads)  # they left the body
        assert splitter.payload_chars == sum(len(p.replace("/", "\\/")) for p in payloads) + len("not base64!")  # wire


def test_a_payload_the_scan_does_not_see_stays_in_the_body_and_still_reaches_its_choice():
    payload = encode_routed_experts(engine_arrays(6)[0])
    body = json.dumps({"choices": [{"index": 0, "routed_experts": payload}, {"index": 1, "routed_experts": payload}]})
    body = body.replace(
        '"routed_experts"', '"routed\\u005fexperts"', 1
    ).encode()  # the same key, spelled with an escape
    stripped, splitter = split(body, [len(body)])
    rows = splitter.rows_by_choice(json.loads(stripped))
    assert rows[0] == payload and isinstance(rows[1], np.ndarray)  # a str: the intake decodes it as before
    assert splitter.payload_chars == 2 * len(payload)


def test_a_server_value_is_never_read_as_a_payload_taken_and_a_payload_nested_in_a_malformed_value_stays_malformed():
    payload = encode_routed_experts(engine_arrays(6)[0])
    choices = [
        {"index": 0, "routed_experts": 0},  # an int, where payload 0 sits in the body: still the server's int
        {"index": 1, "routed_experts": {"routed_experts": payload}},  # an object: its sample falls back
        {"index": 2, "routed_experts": payload},
        {"index": 3, "extra": {"routed_experts": payload}},  # not the choice's own field: no routes for it
        {"index": 4, "routed_experts": "trl-moe-replay:00000000000000000000000000000000:2"},  # a forged placeholder
    ]
    body = json.dumps({"choices": choices}).encode()
    stripped, splitter = split(body, [5, 50])
    rows = splitter.rows_by_choice(json.loads(stripped))
    assert rows[0] == 0 and isinstance(rows[1], dict) and rows[3] is None
    assert isinstance(rows[2], np.ndarray) and rows[4] == choices[4]["routed_experts"]
    assert payload[:40].encode() not in stripped  # all three were taken out of the body


def completions_response(body: bytes) -> requests.Response:
    response = requests.Response()
    response.status_code = 200
    response.raw = io.BytesIO(body)
    response.request = requests.Request("POST", "http://127.0.0.1:1/v1/completions").prepare()
    response.headers["Content-Type"] = "application/json"
    return response


def test_the_hook_holds_a_batch_of_routes_about_once_not_as_text_and_parsed_copies():
    """The memory bound, on the bytes Python allocates: a batch of 64 payloads of 96 KiB decoded. Reading the body
    whole costs 4/3 of the decoded bytes before any parse (and the parse as much again)."""
    arrays = engine_arrays(*[1536] * 64, layers=8, top_k=8)
    choices = [
        {"index": i, "token_ids": [7] * 16, "routed_experts": encode_routed_experts(a)} for i, a in enumerate(arrays)
    ]
    body = json.dumps({"choices": choices}).encode()
    del choices
    decoded = sum(a.nbytes for a in arrays)
    hook = CompletionRoutesHook()
    hook.chunk_size = 1 << 16
    hook.start()
    tracemalloc.start()
    try:
        parsed = hook(completions_response(body)).json()  # what TRL's _post does
        rows = hook.take()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(parsed["choices"]) == 64 and all(np.array_equal(r, a) for r, a in zip(rows, arrays, strict=True))
    assert len(body) > 1.3 * decoded  # the text alone
    assert peak < 1.15 * decoded, (peak, decoded)


def test_requests_calls_the_hook_before_reading_the_body_so_the_payloads_are_read_once(monkeypatch):
    """The reliance of seam entry ``vllm_client_session``: a session's response hook sees a body not read yet
    (urllib3's ``tell()`` is 0), and what TRL's ``_post`` parses is the body without the payloads."""
    unread, parsed_bodies = [], []
    parse = RoutesTakenResponse.json

    def recording_json(self, **kwargs):
        parsed_bodies.append(self.content)
        return parse(self, **kwargs)

    monkeypatch.setattr(RoutesTakenResponse, "json", recording_json)
    with FakeVLLMServer(tiny_moe_model("qwen3_moe")) as server:
        client = http_vllm_client(server.url)
        client.session.hooks["response"].insert(0, lambda response, **kw: unread.append(response.raw.tell() == 0))
        hook = install_routes_hook(client)
        hook.start()
        output = client.generate([[5, 6, 7], [8, 9]], n=2, max_tokens=4)
        rows = hook.take()
        served = server.batches[-1].payloads
    assert unread[-1] is True and len(output["completion_ids"]) == 4
    assert len(rows) == 4 and all(isinstance(row, np.ndarray) for row in rows)
    assert len(parsed_bodies) == 1 and b"routed_experts" in parsed_bodies[0]
    assert not any(payload.encode() in parsed_bodies[0] for payload in served)
    assert hook.payload_chars == sum(map(len, served))


@pytest.fixture
def one_process_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_scatter_rows_sends_arrays_of_any_dtype_and_the_other_rows_and_drops_what_it_packed(one_process_group):
    wide = np.arange(3 * 5 * 2, dtype=np.uint16).reshape(3, 5, 2) * 997  # more than 256 experts: uint16
    odd = engine_arrays(7, layers=1, top_k=1)[0]  # 7 bytes: the next array starts aligned anyway
    share = [odd, None, "not base64!", wide, odd[::2]]  # a strided view too
    expected = [a.copy() if isinstance(a, np.ndarray) else a for a in share]
    rows, error = scatter_rows([share], None, is_main=True)
    assert error is None and len(rows) == 5 and rows[1] is None and rows[2] == "not base64!"
    for i in (0, 3, 4):
        assert rows[i].dtype == expected[i].dtype and np.array_equal(rows[i], expected[i])
        assert not rows[i].flags.writeable and rows[i].ctypes.data % 8 == 0
    assert share[0] is None and share[3] is None and share[4] is None  # the main process freed them as it packed
    assert scatter_rows(None, "no routes for this batch", is_main=True) == ([], "no routes for this batch")
    assert scatter_rows([[None, "text"]], None, is_main=True) == ([None, "text"], None)  # no arrays: no scatter


def test_a_share_the_main_process_cannot_pack_reaches_every_rank_as_its_error(one_process_group):
    """Packing happens before the first collective, so a failure there (memory) is sent to every rank instead of
    leaving the others waiting in the scatter."""

    class Unreadable(np.ndarray):
        @property
        def nbytes(self):
            raise MemoryError("no room for the flat buffer")

    share = [np.zeros((2, 1, 1), np.uint8).view(Unreadable)]
    rows, error = scatter_rows([share], None, is_main=True)
    assert rows == [] and "could not pack the routes" in error and "MemoryError" in error


def test_under_another_backend_the_rows_travel_over_a_gloo_group_of_their_own(one_process_group, monkeypatch):
    """Under NCCL the scatter would stage every rank's buffer on the main process's GPU: the routes get a gloo
    group (here the default backend is reported as NCCL; the group really is built and used)."""
    assert cpu_group() is None  # gloo already: the default group
    with monkeypatch.context() as patched:
        patched.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
        group = cpu_group()
    assert group is not None and torch.distributed.get_backend(group) == "gloo"
    array = engine_arrays(3)[0]
    rows, error = scatter_rows([[array]], None, is_main=True, group=group)
    assert error is None and np.array_equal(rows[0], array)
