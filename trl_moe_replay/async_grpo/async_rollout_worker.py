"""The rollout side of async R3: TRL's rollout worker, keeping the routes vLLM returns with every sample.

TRL's ``AsyncRolloutWorker`` runs an ``_AsyncRolloutLoop`` in a spawned child process that calls a plain ``vllm serve``
at ``/v1/completions`` and pushes scored ``RolloutSample`` s into an ``mp.Queue``. :class:`RoutedRolloutLoop` (chosen
through the worker's ``_loop_cls``) changes three things, all inside that child:

* every ``/v1/completions`` request of a later turn asks only for the positions the conversation does not hold yet
  (``routed_experts_prompt_start``, :func:`held_positions`), so a conversation of T turns moves about one route row
  per position instead of the whole prefix again at every turn;
* every ``/v1/completions`` response is seen in ``_post``: the choice's ``routed_experts`` (vLLM's base64 ``.npy``,
  ``[prompt + completion - 1, L, K]``, returned when the server runs with ``--enable-return-routed-experts``) is
  decoded there, once, to its compact numpy dtype (uint8 up to 256 experts), together with the policy version read
  before and after the request;
* after a conversation is chained into training rows, each row gets the turns whose prompt and output are a prefix of
  it, as :class:`~trl_moe_replay.routing.EngineTurn` s in generation order, so that alignment later gives every
  position the route of the *first* turn that forwarded it (as in the synchronous trainer);
* ``_score_group`` emits :class:`RoutedRolloutSample` s: TRL's sample plus those turns.

The worker is the async trainer's route source (:class:`SampleRoutes`, ``rollouts/route_source.py``): the trainer
takes each sample's turns through it.

Nothing is validated here: rows that are missing, undecodable or of the wrong shape reach the trainer as they are and
fall back there, per sample, in the one entry point (:class:`~trl_moe_replay.rollouts.route_intake.RouteIntake`).

This module must stay importable by name: the spawned child unpickles the loop class and the samples by reference.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np
from transformers.utils import logging

from ..errors import TrlMoeReplayError
from ..rollouts.route_source import TurnOutput, TurnRequest, TurnRows
from ..rollouts.turns import RolloutTurns
from ..routing.codec import EngineTurn, decoded_or_as_sent
from ..upstream import async_worker_classes


if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess


# Any: TRL's classes, looked up at run time (see the seam)
_AsyncRolloutLoop: Any
AsyncRolloutWorker: Any
RolloutSample: Any
_AsyncRolloutLoop, AsyncRolloutWorker, RolloutSample = async_worker_classes()
logger = logging.get_logger(__name__)

__all__ = [
    "RolloutWorkerDiedError",
    "RoutedAsyncRolloutWorker",
    "RoutedRolloutLoop",
    "RoutedRolloutSample",
    "SampleRoutes",
]


class RolloutWorkerDiedError(TrlMoeReplayError, RuntimeError):
    """The rollout worker's child process is gone (killed, or crashed without reporting an exception)."""


@dataclass(slots=True)
class RoutedRolloutSample(RolloutSample):
    """TRL's ``RolloutSample`` plus the engine routes of the turns that produced its tokens.

    ``route_turns`` are in generation order; the first one's ``prompt_length`` is ``route_prompt_length`` (the row's
    prompt as far as routes are concerned). ``sampled_versions`` is the lowest and highest policy version read while
    those turns ran: a request that spans a weight sync has routes of the old weights before it and the new after it.
    """

    route_turns: list[EngineTurn] = field(default_factory=list)
    route_prompt_length: int = 0
    sampled_versions: tuple[int, int] | None = None


@dataclass(frozen=True)
class _TurnRoutes:
    prompt_ids: list[int]
    output_ids: list[int]
    rows: Any  # compact numpy array, or what the engine sent when it could not be decoded (the trainer reports it)
    versions: tuple[int, int]
    prompt_start: int = 0  # the routed_experts_prompt_start this turn's request asked for


def held_positions(prompt_ids: list[int], turns: list[_TurnRoutes]) -> int:
    """How many leading positions of ``prompt_ids`` the conversation's earlier turns hold routes for.

    A turn counts when its prompt and output are a prefix of ``prompt_ids`` (TRL realigned or forked nothing away),
    its rows decoded to exactly the positions it asked for, and they start where the positions held before it end
    (or earlier): then positions ``[0, prompt + output - 1)`` are held. The last token of a turn was never forwarded,
    so its route comes from the next turn's prefill. A turn whose rows are missing or malformed holds nothing, and
    the next request asks for its positions again."""
    held = 0
    for turn in turns:
        covered = len(turn.prompt_ids) + len(turn.output_ids)
        rows = turn.rows
        if (
            covered - 1 <= held
            or turn.prompt_start > held
            or covered > len(prompt_ids)
            or not isinstance(rows, np.ndarray)
            or rows.ndim != 3
            or rows.shape[0] != covered - 1 - turn.prompt_start
            or prompt_ids[:covered] != turn.prompt_ids + turn.output_ids
        ):
            continue
        held = covered - 1
    return held


def _decoded(payload: Any) -> Any:
    rows = decoded_or_as_sent(payload) if isinstance(payload, str) else payload
    return np.ascontiguousarray(rows) if isinstance(rows, np.ndarray) else rows  # own copy: pickled to the parent


def turns_for_row(input_ids: list[int], turns: list[_TurnRoutes]) -> tuple[list[EngineTurn], int]:
    """The turns whose prompt and output are a prefix of ``input_ids`` (one training row), as ``EngineTurn`` s.

    A turn TRL realigned or forked away from this row is left out: its tokens are not the row's. Returns the turns and
    the row's prompt length (the first kept turn's prompt; 0 when none is kept)."""
    kept: list[EngineTurn] = []
    for turn in turns:
        covered = len(turn.prompt_ids) + len(turn.output_ids)
        if covered > len(input_ids) or input_ids[:covered] != turn.prompt_ids + turn.output_ids:
            continue
        if kept and len(turn.prompt_ids) < kept[0].prompt_length:
            continue  # the first kept turn's prompt is the row's prompt
        kept.append(EngineTurn(turn.rows, len(turn.prompt_ids), len(turn.output_ids), turn.prompt_start))
    return kept, (kept[0].prompt_length if kept else 0)


class RoutedRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop, keeping each turn's routed experts (see the module docstring). Runs in the child."""

    def __init__(self, *, max_request_attempts: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.max_request_attempts = max_request_attempts
        self._task_turns: dict[int, list[_TurnRoutes]] = {}

    async def _retry(self, coro_factory, *, label: str, max_attempts: int = 1):
        # TRL retries a completion request up to 30 x 3 times with back-off (~20 min against a dead server); a
        # bounded count turns a dead server into the worker's error, which the trainer raises, within seconds.
        if self.max_request_attempts is not None:
            max_attempts = min(max_attempts, self.max_request_attempts)
        return await super()._retry(coro_factory, label=label, max_attempts=max_attempts)

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        before = self.model_version
        turns = self._task_turns.get(id(asyncio.current_task()))
        start = 0
        if path == "/v1/completions" and turns:
            start = held_positions(list(payload["prompt"]), turns)
            if start:  # a later turn: only the positions this conversation does not hold yet
                payload = {**payload, "routed_experts_prompt_start": start}
        content = await super()._post(path, payload, timeout, max_retries)
        if path == "/v1/completions" and turns is not None:
            choice = content["choices"][0]
            routes = choice.get("routed_experts")
            if isinstance(routes, str):
                self._counters["vllm/route_bytes"] += len(routes)
            turns.append(
                _TurnRoutes(
                    list(payload["prompt"]),
                    list(choice["token_ids"]),
                    _decoded(routes),
                    (before, self.model_version),
                    start,
                )
            )
            if before != self.model_version:
                self._counters["routes/turns_spanning_sync_total"] += 1
        return content

    async def _generate_one(self, prompt, tool_dict, tools, group_id=0):
        key = id(asyncio.current_task())
        self._task_turns[key] = []
        try:
            result = await super()._generate_one(prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)
        finally:
            turns = self._task_turns.pop(key)
        for sequence in result[2]:  # TRL's TrainingSequence rows of this conversation: the routes ride along
            kept, prompt_length = turns_for_row(list(sequence.input_ids), turns)
            sequence.route_turns, sequence.route_prompt_length = kept, prompt_length
            spans = [turn.versions for turn in turns]
            sequence.sampled_versions = (min(v for v, _ in spans), max(v for _, v in spans)) if spans else None
        return result

    async def _score_group(self, group):
        samples = await super()._score_group(group)
        sequences = [sequence for rows in group.completions_sequences for sequence in rows]  # TRL's sample order
        names = [f.name for f in fields(RolloutSample)]
        routed = []
        for sample, sequence in zip(samples, sequences, strict=True):
            turns = getattr(sequence, "route_turns", [])
            nbytes = sum(turn.rows.nbytes for turn in turns if isinstance(turn.rows, np.ndarray))
            self._rates["routes/bytes_per_sample"][0] += nbytes
            self._rates["routes/bytes_per_sample"][1] += 1
            routed.append(
                RoutedRolloutSample(
                    **{name: getattr(sample, name) for name in names},
                    route_turns=turns,
                    route_prompt_length=getattr(sequence, "route_prompt_length", 0),
                    sampled_versions=getattr(sequence, "sampled_versions", None),
                )
            )
        return routed


class SampleRoutes:
    """The async trainer's route source (:class:`~trl_moe_replay.rollouts.route_source.RouteSourceProtocol`): the
    turns a sample carries (``route_turns``, as :class:`RoutedRolloutLoop` keeps them). Generation runs in the worker's
    child, so no turn is generated through it."""

    name = "vLLM"
    remedy = "Is the server started with --enable-return-routed-experts and serving the trainer's checkpoint?"

    def generate_turn(self, request: TurnRequest, generate: Callable[[], TurnOutput]) -> tuple[TurnOutput, TurnRows]:
        return generate(), TurnRows()  # the child generates: its rows come with the samples

    def rollout_turns(
        self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], fields: dict[str, Any]
    ) -> RolloutTurns | None:
        """One sample's turns (``fields["route_turns"]``), or ``None`` when it carries none."""
        turns = fields.pop("route_turns", None)
        if not turns:
            return None
        sequences = [[*prompt, *completion] for prompt, completion in zip(prompt_ids, completion_ids, strict=True)]
        return RolloutTurns.from_engine_turns([turns], sequences)

    def take_metrics(self) -> dict[str, float]:
        return {}  # the worker's metrics travel through TRL's metrics queue


class RoutedAsyncRolloutWorker(SampleRoutes, AsyncRolloutWorker):
    """TRL's ``AsyncRolloutWorker`` running :class:`RoutedRolloutLoop`, with a liveness check that notices a dead child
    at once (TRL's notices only a reported exception, or a heartbeat older than ``heartbeat_stale_after_s``). It is
    the trainer's route source (:class:`SampleRoutes`)."""

    _loop_cls = RoutedRolloutLoop
    _process: BaseProcess | None  # TRL's child process, set by its start() (the base class is found at import time)

    def _raise_if_dead(self) -> None:
        process = self._process
        if process is not None and not process.is_alive() and not self._failed_event.is_set():
            raise RolloutWorkerDiedError(
                f"the rollout worker process (pid {process.pid}) exited with code {process.exitcode} without "
                "reporting an error (killed, or out of memory?). No further samples can come; restart the run "
                "(resume from the last checkpoint)."
            )

    def _locked(self, value):
        """Acquire a shared ``mp.Value``'s lock without blocking forever: a child SIGKILLed while holding it (it reads
        the version on every request and writes its heartbeat in a loop) would leave TRL's blocking accesses hung
        (seen here: the version update after a sync never returned)."""
        lock = value.get_lock()
        while not lock.acquire(timeout=1.0):
            self._raise_if_dead()
        return lock

    def check_health(self, stale_after_s: float) -> None:
        self._raise_if_dead()
        lock = self._locked(self._heartbeat_value)
        lock.release()
        super().check_health(stale_after_s)

    #: Seconds a live child gets to leave its loops after the stop request, before SIGTERM, then as long before SIGKILL.
    stop_grace_s: float = 15.0

    def stop(self) -> None:
        """Stop the child within a bounded time (at most about ``3 * stop_grace_s``), whatever state it is in.

        TRL's ``stop()`` sets the shared stop event in the calling thread. ``multiprocessing.Event.set`` waits, with no
        timeout, until every thread sleeping on the event (the child's stop watcher) has woken; a child that exits or
        dies in between (a failed rollout loop exits at once) never wakes, and ``set`` waits forever (seen: 8 of 8
        failing runs under CPU load). Here the event is set from a daemon thread nobody waits for, and the child is
        joined with timeouts, then terminated, then killed."""
        process = self._process
        self._process = None
        if process is None or process.pid is None:  # never started (start() failed before the spawn)
            return
        if process.is_alive():
            threading.Thread(target=self._stop_event_mp.set, name="grpo-rollout-stop-request", daemon=True).start()
            process.join(timeout=self.stop_grace_s)
        for end in (process.terminate, process.kill):
            if not process.is_alive():
                break
            logger.warning(
                f"rollout worker child (pid {process.pid}) still running after the stop request: {end.__name__}"
            )
            end()
            process.join(timeout=self.stop_grace_s)

    def update_model_version(self, model_version: int) -> None:
        self._raise_if_dead()
        lock = self._locked(self._model_version_value)
        try:  # the lock is re-entrant: TRL's setter takes it again
            super().update_model_version(model_version)
        finally:
            lock.release()
