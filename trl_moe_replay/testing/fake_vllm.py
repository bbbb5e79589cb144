"""Stand-ins for vLLM, built to its routed-experts contract, to test R3 wiring on a CPU without vLLM.

vLLM cannot run here, so these answer TRL exactly the way vLLM 0.33 does, backed by a transformers model:

* :class:`FakeVLLMServer`: a threaded HTTP server on ``127.0.0.1`` with the endpoints TRL's ``VLLMClient`` uses:
  ``GET /health``, ``/v1/models``, ``/server_info``, ``/get_world_size``; ``POST /v1/completions`` (token-id
  prompts, ``n`` per prompt, ``return_token_ids``, ``logprobs``, and per choice ``routed_experts``: base64 ``.npy``
  of ``[p + c - 1, num_layers, top_k]``, uint8/uint16, dense layers all-zero, as ``numpy2base64`` sends it); and
  the weight-transfer control endpoints (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, ``/reset_prefix_cache``).
* :func:`trl_vllm_transport_stub`: what cannot run without vLLM and CUDA is TRL's NCCL weight transport. This
  context manager makes TRL believe vLLM is installed and replaces only the transport: the NCCL rendezvous in
  ``VLLMClient.init_communicator`` (its HTTP calls still go to the server) and the packed NCCL broadcast, whose
  tensors are handed to the in-process server's model instead, so the server samples with the trainer's weights.
* :func:`fake_colocated_vllm`: a ``vllm.LLM`` look-alike for TRL's colocate mode whose ``generate`` returns
  ``RequestOutput``/``CompletionOutput``-shaped objects (``CompletionOutput.routed_experts`` an ``np.ndarray``,
  only when built with ``enable_return_routed_experts=True``, as in vLLM).
* :func:`corrupt_route_payload` and :class:`RouteFuzzer`: payloads no engine may send (bytes, dtypes, shapes, ids),
  each one that the trainer must reject and route natively; ``RouteFuzzer`` is a ``tamper`` hook (for
  ``FakeVLLMServer``, or any function that sees the payloads of a real engine) that records what it corrupted.

Sampling is transformers ``generate``; its routes and processed log-probs are recorded with
``TransformersRolloutRecorder``, so in fp32 they are what the trainer's own forward computes.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import itertools
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import urlparse

import numpy as np
import torch
from torch import nn

from ..rollouts.hf_generate import TransformersRolloutRecorder
from ..routing import RouterReplay, has_route
from ..routing.codec import decode_routed_experts, encode_routed_experts, engine_dtype


__all__ = [
    "CORRUPTIONS",
    "EngineCompletion",
    "FakeVLLMServer",
    "RouteFuzzer",
    "TransformersEngine",
    "corrupt_route_payload",
    "fake_colocated_vllm",
    "trl_vllm_transport_stub",
]


# ----------------------------------------------------------------------------- engine
@dataclass
class EngineCompletion:
    """One sampled completion, as vLLM's ``CompletionOutput`` carries it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # processed log-probs of the sampled tokens (vLLM ``logprobs_mode=processed_logprobs``)
    routed_experts: np.ndarray  # [p + c - 1, num_layers, top_k], engine dtype, dense layers all-zero
    finish_reason: str  # "stop" (EOS) or "length"


class TransformersEngine:
    """Samples with transformers ``generate`` and returns what vLLM would, routed experts included."""

    def __init__(self, model: nn.Module):
        self.model: Any = model.eval()  # a transformers causal LM (generate, generation_config)
        self.router_replay = RouterReplay(model)
        self.dtype = engine_dtype(self.router_replay.num_experts)
        config: Any = model.generation_config  # its GenerationConfig
        eos = config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        self._lock = threading.Lock()  # one generate at a time; weight loads wait for it

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        max_tokens: int = 16,
        top_p: float = 1.0,
        top_k: int = 0,
        **ignored: Any,
    ) -> list[list[EngineCompletion]]:
        """``n`` completions per prompt, prompt-major like vLLM's ``choices``."""
        batch = [list(ids) for ids in prompts for _ in range(n)]
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(ids)) + ids for ids in batch])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
        with self._lock:
            recorder = TransformersRolloutRecorder(self.router_replay, self.model, temperature)
            with recorder:
                generated = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    do_sample=True,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    max_new_tokens=max_tokens,
                    pad_token_id=self.pad_token_id,
                    eos_token_id=sorted(self.eos_token_ids),
                )[:, width:].tolist()
            completions, reasons = [], []
            for ids in generated:  # vLLM stops at (and returns) the first EOS
                stop = next((j for j, token in enumerate(ids) if token in self.eos_token_ids), None)
                completions.append(ids if stop is None else ids[: stop + 1])
                reasons.append("length" if stop is None else "stop")
            recorder.finish_with(completions, pad_token_id=self.pad_token_id)
            prompt_lengths = [len(ids) for ids in batch]
            completion_lengths = [len(ids) for ids in completions]
            rows = recorder.engine_rows(prompt_lengths, completion_lengths)
            logprobs = recorder.sampling_logprobs(completion_lengths)
        dense = [layer for layer in range(self.router_replay.num_layers) if layer not in self.router_replay.moe_layers]
        out = []
        for i, row in enumerate(rows):
            if row is None or not has_route(row[:, self.router_replay.moe_layers]).all():
                raise RuntimeError(f"completion {i}: a forwarded position has no recorded route")
            routes = row.numpy().astype(self.dtype)
            routes[:, dense] = 0  # vLLM's capture buffer is zeros and dense layers never write to it
            out.append(EngineCompletion(batch[i], completions[i], logprobs[i], routes, reasons[i]))
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """The log-prob of each prompt token after the tokens before it (vLLM's ``prompt_logprobs=0``, from the second
        token on): what the engine sync check scores its probe with."""
        with self._lock:
            ids = torch.tensor([prompt])
            logits = self.model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy named tensors into the model, as vLLM's ``model.load_weights`` does; unknown names raise."""
        params = dict(self.model.named_parameters())
        loaded = []
        with self._lock, torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"weight sync sent {name!r}, which the served model does not have")
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
                loaded.append(name)
        return loaded


# ----------------------------------------------------------------------------- server
Tamper = Callable[[int, int, "str | None"], "str | None"]


@dataclass
class ServedBatch:
    """One ``/v1/completions`` call as the server answered it."""

    request: dict
    completions: list[EngineCompletion]  # flat, in choice order
    payloads: list[str | None]  # the routed_experts strings sent, after tampering


@dataclass
class WeightUpdate:
    """One ``/update_weights`` call: what TRL announced and the tensor names the broadcast delivered."""

    update_info: dict
    received: list[str] = field(default_factory=list)


class FakeVLLMServer:
    """vLLM's OpenAI server as TRL's client sees it, on ``127.0.0.1`` and an ephemeral port.

    ``return_routes=False`` is a server started without ``--enable-return-routed-experts`` (``routed_experts`` is
    null); ``routes_field=False`` drops the field altogether, as a vLLM without R3 support answers.
    ``stop_trim(call, choice) -> k`` drops the last ``k`` tokens (all but one at most) with their log-probs and route
    rows, as vLLM does when a stop string ends inside the sampled text (``routed_experts[:-num_dropped]``).
    ``tamper(call, choice, payload) -> payload`` rewrites individual payloads (``call`` counts ``/v1/completions``
    requests from 0). Use as a context manager; ``url`` is the base URL.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        model_name: str = "tiny-moe",
        return_routes: bool = True,
        routes_field: bool = True,
        tamper: Tamper | None = None,
        stop_trim: Callable[[int, int], int] | None = None,
        world_size: int = 1,
    ):
        self.engine = TransformersEngine(model)
        self.model_name = model_name
        self.return_routes = return_routes
        self.routes_field = routes_field
        self.tamper = tamper
        self.stop_trim = stop_trim
        self.world_size = world_size
        self.batches: list[ServedBatch] = []
        self.probes = 0  # prompt_logprobs requests answered (the engine sync check's probe)
        self.weight_updates: list[WeightUpdate] = []
        self.endpoint_calls: list[str] = []
        self.prefix_cache_resets = 0
        self._calls = itertools.count()
        self._broadcast: queue.Queue = queue.Queue()  # the stubbed NCCL broadcast feeds /update_weights
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> FakeVLLMServer:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-vllm", daemon=True)
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
        # an AF_INET server's address: (host text, port); typeshed allows bytes hosts for other families
        host, port = cast(tuple[str, int], self._httpd.server_address[:2])
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ weights (the stubbed NCCL broadcast)
    def broadcast(self, name: str, tensor: torch.Tensor) -> None:
        """The trainer side of the stubbed broadcast: queue one tensor for the pending ``/update_weights``."""
        self._broadcast.put((name, tensor.detach().clone()))

    def _update_weights(self, update_info: dict) -> None:
        """Like vLLM's workers: receive exactly the announced tensors, in order, then load them."""
        update = WeightUpdate(update_info=update_info)
        self.weight_updates.append(update)
        announced = zip(update_info["names"], update_info["dtype_names"], update_info["shapes"], strict=True)
        weights = []
        for name, dtype_name, shape in announced:
            got, tensor = self._broadcast.get(timeout=60)
            if got != name or str(tensor.dtype).removeprefix("torch.") != dtype_name or list(tensor.shape) != shape:
                raise ValueError(
                    f"broadcast sent {got} {tensor.dtype} {list(tensor.shape)} where {name} {dtype_name} {shape} "
                    "was announced"
                )
            weights.append((name, tensor))
        update.received = self.engine.load_weights(iter(weights))

    # ------------------------------------------------------------------ endpoints
    def handle(self, method: str, path: str, body: dict | None) -> tuple[int, Any]:
        self.endpoint_calls.append(f"{method} {path}")
        if method == "GET" and path == "/health":
            return 200, None
        if method == "GET" and path == "/v1/models":
            return 200, {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "owned_by": "vllm",
                        "root": self.model_name,
                        "parent": None,
                    }
                ],
            }
        if method == "GET" and path == "/server_info":
            return 200, {
                "vllm_config": {
                    "model_config": {"model": self.model_name, "logprobs_mode": "processed_logprobs"},
                    "cache_config": {"enable_prefix_caching": True},
                    "weight_transfer_config": {"backend": "nccl"},
                }
            }
        if method == "GET" and path == "/get_world_size":
            return 200, {"world_size": self.world_size}
        if method == "POST" and path == "/v1/completions":
            return self._completions(body or {})
        if method == "POST" and path == "/update_weights":
            self._update_weights((body or {})["update_info"])
            return 200, {}
        if method == "POST" and path in (
            "/init_weight_transfer_engine",
            "/start_weight_update",
            "/finish_weight_update",
        ):
            return 200, {}
        if method == "POST" and path == "/reset_prefix_cache":
            self.prefix_cache_resets += 1
            return 200, {"success": True}
        return 404, {"detail": "Not Found"}

    def _completions(self, request: dict) -> tuple[int, Any]:
        prompts = request.get("prompt")
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) for p in prompts)):
            return 400, {"error": {"message": "this stand-in takes token-id prompts (list[list[int]]), as TRL sends"}}
        if request.get("stream"):
            return 400, {"error": {"message": "routed_experts are returned on non-streaming responses only"}}
        if request.get("prompt_logprobs") is not None:
            return 200, self._prompt_logprobs(prompts, bool(request.get("return_tokens_as_token_ids")))
        n = int(request.get("n", 1))
        start = int(request.get("routed_experts_prompt_start", 0))
        if start < 0:  # vLLM's request validation (ge=0)
            return 400, {"error": {"message": f"routed_experts_prompt_start={start} must be >= 0"}}
        if not all(start < len(p) for p in prompts):  # vLLM CPU 0.28's scheduler asserts it; its engine dies
            return 500, {
                "error": {
                    "message": f"routed_experts_prompt_start={start} not below every prompt's "
                    "length: EngineCore encountered an issue"
                }
            }
        grouped = self.engine.generate(
            prompts,
            n=n,
            temperature=float(request.get("temperature", 1.0)),
            max_tokens=int(request.get("max_tokens", 16)),
            top_p=float(request.get("top_p", 1.0)),
            top_k=int(request.get("top_k", 0) or 0),
        )
        call = next(self._calls)
        want_logprobs = request.get("logprobs") is not None
        as_ids = bool(request.get("return_tokens_as_token_ids"))
        choices, flat, payloads = [], [], []
        for index, completion in enumerate(c for group in grouped for c in group):
            drop = self.stop_trim(call, index) if self.stop_trim is not None else 0
            drop = min(drop, len(completion.token_ids) - 1)  # keep at least one token
            if drop > 0:
                completion = dataclasses.replace(
                    completion,
                    token_ids=completion.token_ids[:-drop],
                    logprobs=completion.logprobs[:-drop],
                    routed_experts=completion.routed_experts[:-drop],
                    finish_reason="stop",
                )
            payload = encode_routed_experts(completion.routed_experts[start:]) if self.return_routes else None
            if self.tamper is not None:
                payload = self.tamper(call, index, payload)
            flat.append(completion)
            payloads.append(payload)
            choice = {
                "index": index,
                "text": "",
                "logprobs": _openai_logprobs(completion, as_ids) if want_logprobs else None,
                "finish_reason": completion.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            if self.routes_field:
                choice["routed_experts"] = payload
            if request.get("return_token_ids"):
                choice["prompt_token_ids"] = completion.prompt_ids
                choice["token_ids"] = completion.token_ids
            choices.append(choice)
        self.batches.append(ServedBatch(request=request, completions=flat, payloads=payloads))
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c.token_ids) for c in flat)
        return 200, {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _prompt_logprobs(self, prompts: list[list[int]], as_ids: bool) -> dict:
        """Each prompt's ``prompt_logprobs`` as vLLM's ``/v1/completions`` returns them (the engine sync check's
        probe); no completion is sampled and nothing is added to ``batches``, which records rollouts."""
        self.probes += 1
        key = (lambda token: f"token_id:{token}") if as_ids else str
        choices = [
            {
                "index": index,
                "text": "",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": _prompt_entries(
                    prompt, self.engine.prompt_logprobs(prompt), lambda token, value: (key(token), {"logprob": value})
                ),
            }
            for index, prompt in enumerate(prompts)
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
        }


def _prompt_entries(prompt: list[int], values: list[float], entry) -> list:
    """vLLM's ``prompt_logprobs``: ``None`` for the first token, then one ``{key: value}`` per token, ``entry(token,
    log-prob) -> (key, value)``."""
    return [None, *(dict([entry(token, value)]) for token, value in zip(prompt[1:], values, strict=True))]


def _openai_logprobs(completion: EngineCompletion, as_ids: bool) -> dict:
    """``/v1/completions`` logprobs for ``logprobs=0``: the sampled token only, as vLLM formats it."""
    tokens = [f"token_id:{t}" if as_ids else str(t) for t in completion.token_ids]
    values = [max(lp, -9999.0) for lp in completion.logprobs]
    return {
        "text_offset": list(range(len(tokens))),
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": [{token: value} for token, value in zip(tokens, values, strict=True)],
    }


def _handler_for(server: FakeVLLMServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
                status, payload = server.handle(method, urlparse(self.path).path, body)
            except Exception as exc:  # surface server-side bugs to the client as vLLM would: a 500 with a message
                status, payload = 500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's naming
            self._answer("GET")

        def do_POST(self):  # noqa: N802
            self._answer("POST")

        def log_message(self, *args):  # keep test output clean
            pass

    return Handler


# ----------------------------------------------------------------------------- TRL transport stub
class _LoopbackGroup:
    """Stands in for the NCCL group TRL's client opens; the "broadcast" lands in the in-process server."""

    def __init__(self, server: FakeVLLMServer | None):
        self.server = server


@contextlib.contextmanager
def trl_vllm_transport_stub(server: FakeVLLMServer | None) -> Iterator[None]:
    """Let TRL's vLLM server mode run without vLLM: stub the NCCL weight transport only.

    Patched for the duration: TRL's ``is_vllm_available`` (client and generation modules), the NCCL part of
    ``VLLMClient.init_communicator`` (the server-info check, ``/get_world_size`` and the
    ``/init_weight_transfer_engine`` POST still run), and the packed NCCL broadcast behind
    ``update_named_params``, which hands the tensors to ``server`` (``None`` on ranks without the server: they
    never broadcast). Everything else, requests and parsing included, is TRL's own code.
    """
    from trl.generation import vllm_client, vllm_generation

    def init_communicator(self, device=0):
        if self.get_server_info()["weight_transfer_config"] is None:
            raise RuntimeError("the server has no weight-transfer engine")
        init_info = {
            "master_address": "127.0.0.1",
            "master_port": self.group_port,
            "rank_offset": 1,
            "world_size": self.get_world_size() + 1,
            "packed": True,
        }
        self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": init_info})
        self.communicator = _LoopbackGroup(server)  # in place of vLLM's NCCL rendezvous (needs CUDA)

    def broadcast(iterator, group, src, post_iter_func):  # in place of packed_nccl_broadcast_producer
        for item in iterator:
            group.server.broadcast(item[0], post_iter_func(item))

    patches = [
        (vllm_client, "is_vllm_available", lambda *args, **kwargs: True),
        (vllm_generation, "is_vllm_available", lambda *args, **kwargs: True),
        (vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE", True),
        (vllm_client, "_HAS_RESET_PREFIX_CACHE_SUCCESS", True),
        (vllm_client, "packed_nccl_broadcast_producer", broadcast),
        (vllm_client.VLLMClient, "init_communicator", init_communicator),
    ]
    with _patched(patches):
        yield


# ----------------------------------------------------------------------------- colocate
@dataclass
class FakeLogprob:
    logprob: float
    rank: int | None = 1
    decoded_token: str | None = None


@dataclass
class FakeCompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: np.ndarray | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[FakeCompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, FakeLogprob] | None] | None = None


class FakeSamplingParams:
    """``vllm.SamplingParams(**kwargs)``: keeps the keyword arguments."""

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs


class FakeLLM:
    """``vllm.LLM`` as TRL's colocate mode uses it, around a transformers model. ``instances`` records every build."""

    instances: list[FakeLLM] = []

    def __init__(self, model_object: nn.Module, *, tamper: Tamper | None = None, **kwargs: Any):
        self.kwargs = kwargs
        self.engine = TransformersEngine(model_object)
        self.return_routes = bool(kwargs.get("enable_return_routed_experts", False))
        self.tamper = tamper
        self.prefix_cache_resets = 0
        self.probes = 0  # prompt_logprobs requests answered (the engine sync check's probe)
        self.outputs: list[list[FakeRequestOutput]] = []
        self.requests: list[dict] = []  # the SamplingParams keyword arguments of every generate
        loader = type("Model", (), {"load_weights": lambda _, weights: self.engine.load_weights(iter(weights))})()
        runner = type("Runner", (), {"model": loader})()
        self.llm_engine = type("Engine", (), {})()
        self.llm_engine.model_executor = type("Executor", (), {})()
        self.llm_engine.model_executor.driver_worker = type("Worker", (), {"model_runner": runner})()
        config: Any = model_object.config  # a transformers PretrainedConfig
        max_model_len = kwargs.get("max_model_len") or config.max_position_embeddings
        self.llm_engine.model_config = type("ModelConfig", (), {"max_model_len": max_model_len})()
        type(self).instances.append(self)

    def generate(self, prompts: list[dict], sampling_params: FakeSamplingParams, use_tqdm: bool = False):
        params = sampling_params.kwargs
        if params.get("prompt_logprobs") is not None:  # the engine sync check's probe: scored, not sampled
            self.probes += 1
            return [
                FakeRequestOutput(
                    uuid.uuid4().hex,
                    None,
                    p["prompt_token_ids"],
                    [],
                    prompt_logprobs=_prompt_entries(
                        p["prompt_token_ids"],
                        self.engine.prompt_logprobs(p["prompt_token_ids"]),
                        lambda token, value: (token, FakeLogprob(value)),
                    ),
                )
                for p in prompts
            ]
        self.requests.append(params)
        grouped = self.engine.generate(
            [p["prompt_token_ids"] for p in prompts],
            n=params.get("n", 1),
            temperature=params.get("temperature", 1.0),
            max_tokens=params.get("max_tokens", 16),
            top_p=params.get("top_p", 1.0),
            top_k=params.get("top_k", 0) or 0,
        )
        want_logprobs = params.get("logprobs") is not None
        start = params.get("routed_experts_prompt_start", 0)
        outputs = []
        for group in grouped:
            completions = [
                FakeCompletionOutput(
                    index=j,
                    text="",
                    token_ids=c.token_ids,
                    cumulative_logprob=float(sum(c.logprobs)),
                    logprobs=[{t: FakeLogprob(lp)} for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
                    if want_logprobs
                    else None,
                    finish_reason=c.finish_reason,
                    routed_experts=c.routed_experts[start:] if self.return_routes else None,
                )
                for j, c in enumerate(group)
            ]
            outputs.append(FakeRequestOutput(uuid.uuid4().hex, None, group[0].prompt_ids, completions))
        if self.tamper is not None:
            choices = [completion for request in outputs for completion in request.outputs]
            for choice, completion in enumerate(choices):
                completion.routed_experts = self._tampered(len(self.outputs), choice, completion.routed_experts)
        self.outputs.append(outputs)
        return outputs

    def _tampered(self, call: int, choice: int, rows: np.ndarray | None) -> Any:
        """``tamper`` works on wire payloads; in process vLLM hands arrays, so a payload that still decodes as a
        ``.npy`` comes back as its array (wrong shape, dtype, ids), anything else as the tampered object itself."""
        tamper = self.tamper
        assert tamper is not None  # generate tampers only when one was given
        tampered = tamper(call, choice, None if rows is None else encode_routed_experts(rows))
        if not isinstance(tampered, str):
            return tampered
        try:
            return np.load(io.BytesIO(base64.b64decode(tampered, validate=True)), allow_pickle=False)
        except Exception:  # noqa: BLE001 - undecodable: hand the broken payload itself
            return tampered

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass


@contextlib.contextmanager
def fake_colocated_vllm(model_object: nn.Module, *, tamper: Tamper | None = None) -> Iterator[type[FakeLLM]]:
    """Make TRL's colocate mode build a :class:`FakeLLM` around ``model_object`` (a separate copy of the policy).

    ``tamper(call, choice, payload)`` rewrites completions' routes as :class:`FakeVLLMServer`'s does (``call`` counts
    ``generate`` calls from 0, ``choice`` the completions of a call).

    Patches ``is_vllm_available``, ``LLM`` and ``SamplingParams`` in ``trl.generation.vllm_generation``; yields the
    class, whose ``instances`` list holds the engine TRL built (and the keyword arguments it was built with).
    """
    from trl.generation import vllm_generation

    class BoundLLM(FakeLLM):
        instances: list[FakeLLM] = []

        def __init__(self, model: str | None = None, **kwargs: Any):
            super().__init__(model_object, model=model, tamper=tamper, **kwargs)

    patches = [
        (vllm_generation, "is_vllm_available", lambda *args, **kwargs: True),
        (vllm_generation, "LLM", BoundLLM),
        (vllm_generation, "SamplingParams", FakeSamplingParams),
    ]
    with _patched(patches):
        yield BoundLLM


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    missing = object()
    saved = [(target, name, getattr(target, name, missing)) for target, name, _ in patches]
    try:
        for target, name, value in patches:
            setattr(target, name, value)
        yield
    finally:
        for target, name, old in reversed(saved):
            if old is missing:
                delattr(target, name)
            else:
                setattr(target, name, old)


# ----------------------------------------------------------------------------- corrupted route payloads
#: Corruption kinds of :func:`corrupt_route_payload`, by what they break. All but :data:`NEVER_WRITTEN` cost the
#: sample its routes; that one costs one position.
CORRUPTIONS = (
    "missing",
    "not-a-string",
    "base64-garbage",
    "base64-truncated",
    "npy-truncated",
    "npy-magic",
    "dtype",
    "rows",
    "layers",
    "top-k",
    "ndim",
    "id-out-of-range",
    "id-negative",
    "id-repeated",
    "route-never-written",
    "dense-layer-routed",
)
#: The corruption that ``routes_from_engine`` falls back from at one position only: one position's route at one MoE
#: layer zeroed, vLLM's "never written" (the sample keeps its other positions' routes).
NEVER_WRITTEN = "route-never-written"


def _npy_base64(array: np.ndarray) -> str:
    """Any array as vLLM's ``numpy2base64`` would encode it (object arrays pickled, as a broken server might)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=array.dtype.kind == "O")
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def corrupt_route_payload(
    payload: str,
    rng: np.random.Generator,
    *,
    num_experts: int,
    moe_layers: Sequence[int] | None = None,
    kind: str | None = None,
) -> tuple[str, Any]:
    """``(kind, corrupted)``: ``payload`` (one completion's base64 ``.npy`` routes, ``[T, L, K]``) broken so that
    ``routes_from_engine`` must reject it (no engine could have sent it for that completion), or, for
    :data:`NEVER_WRITTEN`, fall back at the one position the engine left unwritten.

    ``kind`` is one of :data:`CORRUPTIONS` (random among those that apply when None): the payload missing or not a
    string; invalid or truncated base64; a truncated ``.npy`` or a broken magic; a non-integer dtype (float, bool,
    time, complex, text, object); one row, layer or top-k slot too many or too few, or another number of dimensions;
    one id out of ``[0, num_experts)`` or negative; a route naming an expert twice; a dense layer (not in
    ``moe_layers``) routed; a route never written (all zeros, top-k >= 2, in routes of two rows or more: one row would
    leave nothing to replay).
    """
    rows = decode_routed_experts(payload)
    tokens, layers, top_k = rows.shape
    moe = list(range(layers)) if moe_layers is None else list(moe_layers)
    dense = [layer for layer in range(layers) if layer not in moe]
    applicable = [
        k
        for k in CORRUPTIONS
        if not (
            (k in ("id-repeated", "route-never-written") and top_k < 2)
            or (k == "dense-layer-routed" and not dense)
            or (
                k in ("id-out-of-range", "id-negative", "id-repeated", "route-never-written", "dense-layer-routed")
                and tokens == 0
            )
            or (k == NEVER_WRITTEN and tokens < 2)
        )
    ]
    kind = kind or str(rng.choice(applicable))
    if kind not in applicable:
        raise ValueError(f"corruption {kind!r} does not apply to routes {rows.shape} (applicable: {applicable})")
    rows = np.array(rows)  # writable copy
    t = int(rng.integers(tokens)) if tokens else 0
    if kind == "missing":
        return kind, None
    if kind == "not-a-string":
        return kind, [7, rows.tolist()[:1], {"routed_experts": payload[:8]}][int(rng.integers(3))]
    if kind == "base64-garbage":
        at = int(rng.integers(len(payload) + 1))
        return kind, payload[:at] + str(rng.choice(["!", "@", "é", " ", "-", "*"])) + payload[at:]
    if kind == "base64-truncated":
        return kind, payload[: len(payload) - 4 - int(rng.integers(1, 4))]  # length no longer a multiple of 4
    raw = base64.b64decode(payload)
    if kind == "npy-truncated":
        return kind, base64.b64encode(raw[: int(rng.integers(len(raw) - rows.nbytes // 2 or 1))]).decode()
    if kind == "npy-magic":
        return kind, base64.b64encode(b"\x00NOPE!" + raw[6:]).decode()
    if kind == "dtype":
        dtype = str(
            rng.choice(["float16", "float32", "float64", "bool", "m8[s]", "M8[s]", "complex64", "<U3", "object"])
        )
        return kind, _npy_base64(rows.astype(np.int64).astype(dtype))
    if kind == "rows":
        extra = rows[-1:] if tokens else np.arange(layers * top_k, dtype=rows.dtype).reshape(1, layers, top_k)
        changed = rows[:-1] if tokens and rng.random() < 0.5 else np.concatenate([rows, extra])
        return kind, _npy_base64(changed)
    if kind == "layers":
        changed = rows[:, :-1] if rng.random() < 0.5 else np.concatenate([rows, rows[:, -1:]], axis=1)
        return kind, _npy_base64(changed)
    if kind == "top-k":
        changed = rows[..., :-1] if rng.random() < 0.5 else np.concatenate([rows, rows[..., -1:]], axis=2)
        return kind, _npy_base64(changed)
    if kind == "ndim":
        return kind, _npy_base64(rows.reshape(tokens, layers * top_k) if rng.random() < 0.5 else rows[None])
    layer = int(rng.choice(moe))
    if kind == "id-out-of-range":
        rows = rows.astype(np.uint16) if num_experts > np.iinfo(rows.dtype).max else rows
        high = min(np.iinfo(rows.dtype).max, num_experts + 1000)
        rows[t, layer, int(rng.integers(top_k))] = int(rng.integers(num_experts, high + 1))
    elif kind == "id-negative":
        rows = rows.astype(np.int16)
        rows[t, layer, int(rng.integers(top_k))] = -int(rng.integers(1, 100))
    elif kind == "id-repeated":  # a non-zero id twice: [0, 0] would be a never-written mark, not a repeat
        a = int(rng.choice(np.flatnonzero(rows[t, layer])))
        b = int(rng.choice([slot for slot in range(top_k) if slot != a]))
        rows[t, layer, b] = rows[t, layer, a]
    elif kind == "route-never-written":
        rows[t, layer] = 0
    else:  # dense-layer-routed
        rows[t, int(rng.choice(dense)), int(rng.integers(top_k))] = int(rng.integers(1, num_experts))
    return kind, encode_routed_experts(rows)


class RouteFuzzer:
    """A ``tamper(call, choice, payload)`` hook that corrupts a random share of the route payloads.

    Seeded; ``rate`` is the chance that a payload is corrupted (by :func:`corrupt_route_payload`, a random kind).
    ``keep_first`` keeps the first choice of the first call intact, so the first generation batch has a usable
    payload (a batch without any fails fast by design: the engine would not be set up for routes). ``corrupted``
    maps ``(call, choice)`` to the kind applied.
    """

    def __init__(
        self,
        seed: int,
        *,
        num_experts: int,
        moe_layers: Sequence[int] | None = None,
        rate: float = 0.5,
        keep_first: bool = True,
    ):
        self.rng = np.random.default_rng(seed)
        self.num_experts = num_experts
        self.moe_layers = moe_layers
        self.rate = rate
        self.keep_first = keep_first
        self.corrupted: dict[tuple[int, int], str] = {}

    def whole(self, call: int) -> list[int]:
        """The choices of ``call`` whose corruption costs the whole sample its routes (sorted)."""
        return sorted(choice for (c, choice), kind in self.corrupted.items() if c == call and kind != NEVER_WRITTEN)

    def unwritten(self, call: int) -> list[int]:
        """The choices of ``call`` with one never-written position (:data:`NEVER_WRITTEN`; sorted)."""
        return sorted(choice for (c, choice), kind in self.corrupted.items() if c == call and kind == NEVER_WRITTEN)

    def __call__(self, call: int, choice: int, payload: str | None) -> Any:
        if payload is None or (self.keep_first and call == 0 and choice == 0) or self.rng.random() >= self.rate:
            return payload
        kind, corrupted = corrupt_route_payload(
            payload, self.rng, num_experts=self.num_experts, moe_layers=self.moe_layers
        )
        self.corrupted[call, choice] = kind
        return corrupted
