"""vLLM generation that keeps the routes (R3): TRL's server mode and colocate mode.

vLLM returns, per completion, the experts it routed every forwarded token to (``enable_return_routed_experts``;
layout in ``trl_moe_replay.routing.codec``). TRL 1.16 drops them on both paths; this module keeps them with the
least reach into TRL:

* **Server mode** (``trl vllm-serve --model M --enable-return-routed-experts``). Only the main process talks to
  the server. A ``requests`` response hook on the session of TRL's ``VLLMClient``
  (:class:`~.route_stream.CompletionRoutesHook`) takes each ``/v1/completions`` choice's ``routed_experts`` out of the
  body as it arrives, decoded, while TRL's own ``generate`` parses the rest unchanged. TRL then broadcasts its token
  ids and log-probs to every rank as usual; the routes do not ride along. :meth:`VLLMRouteSource.local_rows`
  scatters them instead (:func:`scatter_rows`): rank r receives only the arrays of its own samples (TRL's
  ``process_slice``), over a CPU (gloo) process group. Bytes moved per generation batch: about the decoded bytes of
  the global batch once (each rank its own share, padded to the largest), instead of world size times that for a
  broadcast.
* **Colocate mode** (``vllm.LLM`` inside each training process). TRL builds its ``LLM`` from a subclass chosen at
  construction (:func:`llm_returning_routes`, installed through ``trl_moe_replay.upstream``) that adds
  ``enable_return_routed_experts=True`` and keeps the ``RequestOutput``s of its last ``generate``; their
  ``CompletionOutput.routed_experts`` arrays are this rank's rows (sliced like TRL's tensor-parallel slice when
  ``vllm_tensor_parallel_size > 1``). Nothing moves between processes.

A later tool turn asks the engine only for the positions its samples do not hold yet (vLLM's
``routed_experts_prompt_start``, one value per request): :meth:`VLLMRouteSource.request_prompt_start` takes the
minimum over every rank whose samples share the request (all ranks in server mode, the tensor-parallel group in
colocate mode). ``vllm/route_bytes`` logs the route bytes received from the engine per generation batch (server
mode: the base64 characters of the main process's responses; colocate mode: route array bytes, summed over ranks).

Missing routes are handled in two ways. If the very first generation batch carries no route at all, the engine is
not set up for R3 (flag off, prefix caching off, a model vLLM does not capture): :class:`RoutesUnavailableError`
is raised on every rank with the exact command to run; likewise if none of its routes fits the trained model
(another checkpoint). Later, a sample whose payload is missing or malformed (aborted request, wrong length,
undecodable) is routed by the trainer's own router instead, with a warning; its positions count in
``routing/fallback_frac``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.utils import gather_object
from transformers.utils import logging

from ..upstream import vllm_request_fields
from .route_intake import RoutesUnavailableError
from .route_source import TurnOutput, TurnRequest, TurnRows


if TYPE_CHECKING:
    from .route_stream import CompletionRoutesHook


logger = logging.get_logger(__name__)

SERVER_FLAG = "--enable-return-routed-experts"


# What a vLLM needs to return routes, by version (docs/vllm.md, "vLLM versions").
CAPTURE_CONDITIONS = (
    "vLLM captures routes only with prefix caching on (the default: do not pass --no-enable-prefix-caching) and "
    "Model Runner V2 (the default: do not set VLLM_USE_V2_MODEL_RUNNER=0), for a Mixture-of-Experts model, without "
    "pipeline or context parallelism. vLLM >= 0.31 refuses to start when one of these is missing, so a server that "
    "started and still returns no routes is older than 0.31 or was started without "
    f'{SERVER_FLAG} (or --aux-output-config \'{{"enable_return_routed_experts": true, "max_bytes": N}}\', which '
    "also caps the memory kept for routes). On vLLM 0.31 and 0.32 an evicted prefix-cache block ends the engine "
    "with BlockObjectStoreError: upgrade to 0.33."
)


def server_command(model: str) -> str:
    """The command that starts a vLLM server returning routes for ``model`` (TRL forwards the flag to vLLM)."""
    return f"trl vllm-serve --model {model} {SERVER_FLAG}"


# ----------------------------------------------------------------------------- server mode
# ----------------------------------------------------------------------------- colocate mode
def llm_returning_routes(llm_class: type) -> type:
    """A subclass of ``llm_class`` (vLLM's ``LLM``) built with ``enable_return_routed_experts=True`` that keeps the
    ``RequestOutput``s of its last ``generate`` in :attr:`last_outputs` (TRL's ``VLLMGeneration`` keeps only token
    ids and log-probs)."""

    class RoutedExpertsLLM(llm_class):
        last_outputs = None

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("enable_return_routed_experts", True)
            super().__init__(*args, **kwargs)

        def generate(self, *args, **kwargs):
            outputs = super().generate(*args, **kwargs)
            self.last_outputs = outputs
            return outputs

    RoutedExpertsLLM.__qualname__ = RoutedExpertsLLM.__name__ = f"RoutedExperts{llm_class.__name__}"
    return RoutedExpertsLLM


# ----------------------------------------------------------------------------- per-rank rows
@dataclass
class RouteTransfer:
    """What this rank received for its last generation batch (its share of the rows)."""

    samples: int = 0
    payloads: int = 0  # samples that came with a payload
    payload_bytes: int = 0


class VLLMRouteSource:
    """Engine route rows of this rank's samples, one generation batch at a time: the route source
    (:class:`~.route_source.RouteSourceProtocol`) of TRL's vLLM server and colocate modes.

    Built after TRL's ``VLLMGeneration`` exists (``trainer.vllm_generation``); installs the capture for its mode.
    Every rank runs :meth:`generate_turn` around ``VLLMGeneration.generate``, which calls :meth:`local_rows` right
    after it (in server mode a collective, like TRL's broadcast before it); the rows then go to the trainer's
    :class:`~.route_intake.RouteIntake`.
    """

    name = "vLLM"
    remedy = "Does the server serve the same checkpoint as the trainer?"

    def __init__(self, vllm_generation: Any, accelerator: Any, *, required: bool = True):
        self.mode = vllm_generation.mode
        self.accelerator = accelerator
        self.required = required  # R3 stops when the engine returns no routes; metrics alone do without them
        self._generation = vllm_generation
        self.prompt_start = _prompt_start(vllm_generation.generation_kwargs)
        self.received_routes = False  # has any batch carried a route yet (fail fast only before that)
        self._warned_no_routes = False
        self.last_transfer = RouteTransfer()
        self.received_bytes = 0  # this rank's route bytes since take_received_bytes: vllm/route_bytes
        self._hook: CompletionRoutesHook | None = None
        self._cpu_group: tuple[Any] | None = None  # (group,) once built: server mode's scatter (cpu_group)
        if self.mode == "server":
            self.client = vllm_generation.vllm_client if accelerator.is_main_process else None
            if self.client is not None:
                from .route_stream import install_routes_hook  # server mode only: needs requests, as TRL's client does

                self._hook = install_routes_hook(self.client)
        elif self.mode != "colocate":
            raise ValueError(f"vllm_mode must be 'server' or 'colocate', got {self.mode!r}")

    def request_prompt_start(self, local_held: int | None, prompt_lengths: Sequence[int]) -> int:
        """vLLM's ``routed_experts_prompt_start`` for a request: the positions that every sample in the request
        already holds routes for, so the engine returns only the rest.

        ``local_held`` is this rank's :meth:`~.turns.RolloutTurns.held_positions` on a later tool turn, or the
        user's ``generation_kwargs`` start on a first turn (``None``: no sample of this rank continues into the
        request, so it sets no bound). ``prompt_lengths`` are this rank's prompts in the request: the start stays
        below the shortest, as vLLM's engine dies on a start at or past a prompt's length (0.28's scheduler asserts
        it). One request serves the samples of several ranks in server mode (TRL's main process sends every rank's
        prompts) and of a tensor-parallel group in colocate mode, and it carries one value: the minimum over those
        ranks, gathered where TRL gathers the prompts (a collective exactly where TRL's own ``generate`` is one).
        Every rank returns the same value, the one sent."""
        if prompt_lengths:
            below_every_prompt = max(min(prompt_lengths) - 1, 0)
            local_held = below_every_prompt if local_held is None else min(local_held, below_every_prompt)
        if self.mode == "server" and self.accelerator.num_processes > 1:
            held = gather_object([local_held])
        elif self.mode == "colocate" and self._generation.tensor_parallel_size > 1:
            held = [None] * self._generation.tensor_parallel_size
            torch.distributed.all_gather_object(held, local_held, group=self._generation.tp_group)
        else:
            held = [local_held]
        return min((value for value in held if value is not None), default=0)

    def generate_turn(self, request: TurnRequest, generate: Callable[[], TurnOutput]) -> tuple[TurnOutput, TurnRows]:
        """One turn of TRL's vLLM generation (``generate``), asking vLLM for the routes of the positions the turn's
        samples do not hold yet; every rank calls it (server mode: collectives where TRL's ``generate`` has them)."""
        start, sent = self.prompt_start, request.later_turn or self.prompt_start > 0
        if request.later_turn:  # ask only for the positions every sample of the request does not hold yet
            start = request.held  # type: ignore[assignment]  # None: no sample of this rank bounds it
        if sent:  # one value for the request, below every prompt's length (vLLM's engine dies on more)
            start = self.request_prompt_start(start, [len(ids) for ids in request.prompt_ids])
            if not request.later_turn and start < self.prompt_start:
                logger.warning_once(  # one message per run: the start sent varies with the prompts
                    f"generation_kwargs['routed_experts_prompt_start']={self.prompt_start} is at or past the "
                    "length of some prompts: requests with such a prompt ask from one position before the end of "
                    "their shortest prompt instead (vLLM's engine stops on a start at or past a prompt's length)"
                )
        self.begin_batch()
        with (
            vllm_request_fields(self._generation, routed_experts_prompt_start=start)
            if sent
            else contextlib.nullcontext()
        ):
            output = generate()
        rows: list[Any] | None = self.local_rows(len(request.prompt_ids))
        if not self.required and not any(row is not None for row in rows or []):
            rows = None  # metrics alone: an engine without routes leaves nothing to compare
        return output, TurnRows(rows, start)

    def rollout_turns(self, prompt_ids, completion_ids, fields) -> None:
        return None  # its rows come turn by turn

    def take_metrics(self) -> dict[str, float]:
        """``vllm/route_bytes``: this rank's route bytes received from the engine since the last call."""
        return {"vllm/route_bytes": float(self.take_received_bytes())}

    def begin_batch(self) -> None:
        """Call right before TRL's ``VLLMGeneration.generate``: capture this batch's server response."""
        if self._hook is not None:
            self._hook.start()

    # ------------------------------------------------------------------ rows
    def local_rows(self, num_local: int) -> list[Any]:
        """This rank's ``num_local`` engine rows (base64 str, array or ``None``), in TRL's completion order."""
        rows = self._server_rows(num_local) if self.mode == "server" else self._colocate_rows(num_local)
        payloads = [row for row in rows if row is not None]
        if not self.required and not payloads and not self._warned_no_routes:  # routing metrics only
            self._warned_no_routes = True
            logger.warning(
                "routing_metrics: vLLM returned no routed experts, so routing/* against the engine cannot be logged. "
                f"Start the server with {SERVER_FLAG} (colocate: a vLLM that returns routes) to get them."
            )
        self.last_transfer = RouteTransfer(
            samples=len(rows),
            payloads=len(payloads),
            payload_bytes=sum(len(row) if isinstance(row, str) else getattr(row, "nbytes", 0) for row in payloads),
        )
        if self.mode == "colocate":  # server mode counts the base64 the main process received (_server_rows)
            self.received_bytes += self.last_transfer.payload_bytes
        return rows

    def take_received_bytes(self) -> int:
        """This rank's route bytes received from the engine since the last call (server mode: the base64 characters
        of the main process's responses, 0 on the other ranks; colocate: bytes of its route arrays), and reset the
        count."""
        received, self.received_bytes = self.received_bytes, 0
        return received

    def _server_rows(self, num_local: int) -> list[Any]:
        accelerator = self.accelerator
        world = accelerator.num_processes
        shares: list[list[Any]] | None = None
        error: str | None = None
        if accelerator.is_main_process:
            assert self._hook is not None  # server mode: installed on the main process
            payloads = self._hook.take()
            self.received_bytes += self._hook.payload_chars  # what came from the engine, counted once (main)
            error = self._batch_error(payloads, num_local * world)
            if error is None:
                assert payloads is not None
                shares = [payloads[rank * num_local : (rank + 1) * num_local] for rank in range(world)]
            del payloads  # the shares alone hold the rows: scatter_rows frees each as it packs it
        if world > 1:
            # Each rank gets its own share only: TRL's broadcast sends everything everywhere, routes are too big.
            if self._cpu_group is None:  # built at the first batch: the first collective every rank reaches here
                self._cpu_group = (cpu_group(),)
            rows, error = scatter_rows(shares, error, is_main=accelerator.is_main_process, group=self._cpu_group[0])
        else:
            rows = shares[0] if shares is not None else []
        if error:
            raise RoutesUnavailableError(error)
        if any(row is not None for row in rows):
            self.received_routes = True
        return rows

    def _batch_error(self, payloads: list | None, expected: int) -> str | None:
        """On the main process: why this batch's routes cannot be used at all, or None."""
        if payloads is None:
            return "the vLLM client returned no routed_experts list: was generation done by another client?"
        if len(payloads) != expected:
            return (
                f"the vLLM server returned routed_experts for {len(payloads)} completions, expected {expected} "
                "(one per completion)"
            )
        if self.required and not self.received_routes and all(payload is None for payload in payloads):
            assert self.client is not None  # asked on the main process, which holds the client
            model = self.client.model
            return (
                f"routing_replay='r3' needs the experts vLLM routed each token to, but the server at "
                f"{self.client.base_url} returned none for the first batch ({expected} completions). Start it "
                f"with:\n\n    {server_command(model)}\n\n{CAPTURE_CONDITIONS} Or train with routing_replay='r2' (no engine routes "
                "needed)."
            )
        return None

    def _colocate_rows(self, num_local: int) -> list[Any]:
        llm = self._generation.llm
        outputs, llm.last_outputs = getattr(llm, "last_outputs", None), None
        if outputs is None:
            raise RoutesUnavailableError("the colocated vLLM engine's outputs were not captured for this batch")
        rows = [getattr(completion, "routed_experts", None) for request in outputs for completion in request.outputs]
        tp_size = self._generation.tensor_parallel_size
        if tp_size > 1:  # every rank of a TP group generated the group's prompts: keep this rank's (as TRL does)
            rank_in_group = torch.distributed.get_rank(group=self._generation.tp_group)
            rows = rows[rank_in_group * num_local : (rank_in_group + 1) * num_local]
        if len(rows) != num_local:
            raise RoutesUnavailableError(f"vLLM returned {len(rows)} completions on this rank, expected {num_local}")
        if self.required and not self.received_routes and all(row is None for row in rows):
            raise RoutesUnavailableError(
                "routing_replay='r3' needs the experts vLLM routed each token to, but the colocated engine "
                f"returned no routed_experts for the first batch ({num_local} completions on this rank), although "
                f"it was built with LLM(..., enable_return_routed_experts=True). {CAPTURE_CONDITIONS} Or train with "
                "routing_replay='r2' (no engine routes needed)."
            )
        if any(row is not None for row in rows):
            self.received_routes = True
        return rows


def _prompt_start(generation_kwargs: dict | None) -> int:
    """vLLM's ``routed_experts_prompt_start`` as the user set it through ``generation_kwargs`` (default 0)."""
    start = (generation_kwargs or {}).get("routed_experts_prompt_start", 0)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"generation_kwargs['routed_experts_prompt_start'] must be an int >= 0, got {start!r}")
    return start


# ----------------------------------------------------------------------------- server mode: the scatter
#: Each array's offset in a rank's flat buffer is a multiple of this, so every view of it is aligned.
_ALIGN = 8


def scatter_rows(
    shares: list[list[Any]] | None, error: str | None, *, is_main: bool, group: Any = None
) -> tuple[list[Any], str | None]:
    """Every rank's share of the main process's rows -> this rank's ``(rows, error)``; every rank of ``group`` (a
    CPU process group: :func:`cpu_group`) calls it, and the main process is its rank 0.

    ``shares`` (main process only) holds rank r's rows at ``shares[r]``: decoded arrays, payload texts that did not
    decode, ``None``. The arrays travel as one flat ``uint8`` CPU tensor per rank (``torch.distributed.scatter``,
    each padded to the largest share), packed share by share while the arrays are dropped from ``shares``, so the
    main process holds the batch about once (plus one share) instead of twice as pickling it would; their dtypes,
    shapes and offsets, the other rows and ``error`` travel by ``scatter_object_list``. Everything the main process
    can fail at (packing: memory) happens before the first collective, and its error reaches every rank through it,
    so no rank is left waiting. A rank's rows are read-only views of its received buffer."""
    world = torch.distributed.get_world_size(group)
    layouts: list[Any] | None = None
    flats: list[torch.Tensor] | None = None
    if is_main:
        if error is None and shares is not None:
            try:
                cut = [_layout(share) for share in shares]
                size = max((end for _, end in cut), default=0)
                flats = [_packed(share, entries, size) for share, (entries, _) in zip(shares, cut, strict=True)]
                layouts = [(None, size, entries) for entries, _ in cut]
            except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised there as one error
                flats = None
                error = f"the main process could not pack the routes for the other ranks ({type(exc).__name__}: {exc})"
        if error is not None or shares is None:
            layouts = [(error or "no routes", 0, [])] * world
    received: list[Any] = [None]
    torch.distributed.scatter_object_list(received, layouts, src=0, group=group)
    error, size, entries = received[0]
    if error is not None:
        return [], error
    out = torch.empty(size, dtype=torch.uint8)
    if size:  # the same size on every rank: all scatter, or none does
        torch.distributed.scatter(out, flats, src=0, group=group)
    del flats
    buffer = out.numpy()
    rows = [
        np.ndarray(entry[1], np.dtype(entry[0]), buffer, entry[2]) if isinstance(entry, tuple) else entry
        for entry in entries
    ]
    for row in rows:
        if isinstance(row, np.ndarray):
            row.flags.writeable = False  # as decode_routed_experts returns them: the intake copies what it keeps
    return rows, None


def cpu_group() -> Any:
    """A process group over every rank whose collectives run on the CPU: the default one under gloo, else a gloo
    group beside it (built once, by every rank). The routes are used on the CPU: under NCCL they would be staged on
    the main process's GPU, world size x the largest share, while it trains."""
    if torch.distributed.get_backend() == "gloo":
        return None
    return torch.distributed.new_group(backend="gloo")


def _layout(share: list[Any]) -> tuple[list[Any], int]:
    """A share's entries for the receiver (``(dtype, shape, offset)`` per array, the row itself otherwise) and the
    bytes its arrays take in the flat buffer."""
    entries: list[Any] = []
    offset = 0
    for row in share:
        if isinstance(row, np.ndarray):
            entries.append((row.dtype.str, row.shape, offset))
            offset = -(-(offset + row.nbytes) // _ALIGN) * _ALIGN
        else:
            entries.append(row)
    return entries, offset


def _packed(share: list[Any], entries: list[Any], size: int) -> torch.Tensor:
    """The share's arrays copied into one flat buffer of ``size`` bytes, each array dropped from ``share`` once
    copied (the rows' only other holder is the caller's list, already gone)."""
    flat = np.zeros(size, np.uint8)
    for i, entry in enumerate(entries):
        if isinstance(entry, tuple):
            row = np.ascontiguousarray(share[i])
            flat[entry[2] : entry[2] + row.nbytes] = row.reshape(-1).view(np.uint8)
            share[i] = None
            del row
    return torch.from_numpy(flat)
