"""The route's path through the trainer, from where a generation batch's routes enter to every forward that uses them.

Read top to bottom, this module is that path (the trainers' overrides call it; none keeps routes of its own):

1. **Generation** (:class:`GenerationBatch`): the engine's rows, per sample and turn, as generation returns them
   (vLLM, transformers ``generate`` through the recorder, a ``rollout_func``).
2. **Intake** (:meth:`GenerationBatch.align`), once per generation batch, right after generation, at the widths TRL
   pads the batch to: ``RouteIntake.align`` checks every row -> :class:`~trl_moe_replay.routing.routes.CheckedRoutes`.
3. **Scoring forwards** (:meth:`RouteFlow.plan`): the old-logprob pass replays the rollout's routes (R3) and/or records
   the natural ones (R2/PR2's routes, the trainer's side of ``routing/*``; checked by construction); the reference
   pass replays the policy's.
4. **Buffer** (:class:`RouteBuffer`): the routes to replay, and the other per-sample values of ours (RSPO's old router
   ids and probabilities, PR2's predictor cache: :class:`HeldRows`), stay with the trainer; the batch dict carries only ``route_rows`` (batch
   serial, row) through TRL's buffer, shuffle and split, so no routes tensor is handed to code that could write into
   it, and TRL's batch holds only TRL's keys and ``route_rows``.
5. **Training forward** (:class:`MicroBatch`, :meth:`RouteFlow.micro_routes` -> :meth:`RouteFlow.plan`): each
   micro-batch gathers its own rows (a stale index is refused) and replays them until its backward has returned
   (:class:`MicroBatchReplay`; ``core/trainer_base.py`` ends it).

The async trainer enters at 2 (one sample at a time) and 4 (packed rows; ``trl_moe_replay.async_grpo``).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..rollouts.route_intake import RouteIntake
from ..rollouts.turns import RolloutTurns
from ..routing import RouterReplay
from ..routing.errors import RouteAlignmentError, RouteValidationError
from ..routing.routes import CheckedRoutes
from ..upstream import trl_padded_width
from .routing_options import ReplaySettings


ROUTE_ROWS = "route_rows"
"""The batch-dict key of a (micro-)batch's rows in the trainer's route buffer: ``[B, 2]`` (batch serial, row)."""


class StaleRouteRowsError(RouteValidationError):
    """A batch's ``route_rows`` name routes the trainer no longer holds (a batch kept past its generation batch)."""


# ---------------------------------------------------------------------------------------------- 1-2. generation, intake
@dataclass
class GenerationBatch:
    """What one ``_generate_and_score_completions`` call learns about routes; lives exactly as long as that call.

    Filled through its methods, each for one step of generation and scoring (the trainer writes no field)."""

    turns: RolloutTurns | None = None  # the engine's rows per sample and turn (None: no engine routes)
    generated_turns: int = 0  # _generate_single_turn calls so far (TRL's tool loop calls it again per turn)
    sampling_logprobs: list[list[float]] | None = None  # recorded for the metrics only (not handed to TRL)
    generation: CheckedRoutes | None = None  # the engine's routes in TRL's padded layout (step 2)
    natural: CheckedRoutes | None = None  # the trainer's natural routes of its old-logprob (or metrics) pass
    old_router: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # RSPO: ids, probs per chunk
    # other per-sample tensors ([B, ...], the batch's row order) held with the routes in the buffer (step 4): PR2's cache
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)

    def begin_turn(self) -> bool:
        """One more ``_generate_single_turn`` call (TRL's tool loop calls it again per turn): whether it is a later
        turn of the batch."""
        self.generated_turns += 1
        return self.generated_turns > 1

    def take_turns(self, turns: RolloutTurns) -> None:
        """The batch's rows, whole (a ``rollout_func``'s ``routed_experts``)."""
        self.turns = turns

    def record_sampling_logprobs(self, logprobs: list[list[float]] | None) -> None:
        """The sampler's log-probs, for the metrics only (``None``: nothing to compare with)."""
        self.sampling_logprobs = logprobs

    def add_old_router(self, ids: torch.Tensor, probs: torch.Tensor) -> None:
        """RSPO: one old-pass chunk's router ids and probabilities at the experts used."""
        self.old_router.append((ids, probs))

    def old_router_inputs(self) -> dict[str, torch.Tensor]:
        """RSPO's per-sample inputs of the loss (held with the batch's routes), or none."""
        if not self.old_router:
            return {}
        return {
            "old_router_ids": torch.cat([ids for ids, _ in self.old_router], dim=0),
            "old_router_probs": torch.cat([probs for _, probs in self.old_router], dim=0),
        }

    def record_natural(self, chunks: list[CheckedRoutes]) -> None:
        """The trainer's natural routes of its old-logprob (or metrics) pass, chunk by chunk."""
        self.natural = CheckedRoutes.cat(chunks)

    def add_turn(self, prompt_ids, completion_ids, rows, prompt_start: Any, samples) -> None:
        """One generation turn's rows (the batch's first turn, or a later one of TRL's tool loop)."""
        if self.turns is None:  # the batch's first turn (later ones add to it), unless it brought no routes
            if self.generated_turns == 1 and rows is not None:
                self.turns = RolloutTurns(prompt_ids, completion_ids, rows, prompt_start)
            return
        self.turns.add_turn(prompt_ids, completion_ids, rows, prompt_start, samples)

    def align(
        self,
        intake: RouteIntake,
        rr: RouterReplay,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        pad_to_multiple_of: int | None,
    ) -> None:
        """Step 2: the engine's rows -> checked routes, at the widths TRL will pad the batch to."""
        if self.turns is None:
            return
        prompt_lengths, completion_lengths = [len(ids) for ids in prompt_ids], [len(ids) for ids in completion_ids]
        self.generation = intake.align(
            self.turns.turns,
            rr.layout,
            prompt_lengths=prompt_lengths,
            completion_lengths=completion_lengths,
            prompt_width=trl_padded_width(prompt_lengths, pad_to_multiple_of),
            completion_width=trl_padded_width(completion_lengths, pad_to_multiple_of),
        )

    def to_replay(self, settings: ReplaySettings) -> CheckedRoutes | None:
        """The routes the policy's forwards replay: generation's (R3, PR2 predicted in generate), or the old pass's
        recorded ones (R2, PR2), or None."""
        if settings.replays_generation_routes:
            return self.generation
        return self.natural if settings.mode.records_old_pass else None


# ---------------------------------------------------------------------------------------------- 5. one micro-batch
@dataclass
class MicroBatch:
    """One micro-batch's training forward as a value (the sync trainer's ``_compute_loss`` builds it, and holds it only
    while it runs): what the forward replays and what the loss reads, instead of per-batch attributes of the trainer."""

    inputs: dict  # TRL's loss inputs: a shallow copy of the micro-batch (RSPO shifts its old log-probs by γ)
    held: HeldRows = field(default_factory=lambda: HeldRows())  # its rows of the buffer: routes, RSPO's old router
    old_logps: torch.Tensor | None = None  # the unshifted old log-probs
    gamma: torch.Tensor | None = None  # RSPO's router-shift weight, once the training forward has measured it

    @classmethod
    def of(cls, inputs: dict, held: HeldRows | None = None) -> MicroBatch:
        inputs = dict(inputs)
        return cls(inputs, held if held is not None else HeldRows(), inputs.get("old_per_token_logps"))

    @property
    def routes(self) -> CheckedRoutes | None:
        return self.held.routes


# ---------------------------------------------------------------------------------------------- 3, 5. forward plans
class Forward(enum.Enum):
    OLD = "the old-logprob pass"
    REFERENCE = "the reference pass"
    METRICS = "the routing-metrics pass"
    TRAINING = "a training forward"


@dataclass(frozen=True)
class ForwardPlan:
    """What one forward does with routes: the one decision ``_get_per_token_logps_and_entropies`` acts on."""

    forward: Forward
    route_replay: RouterReplay | None  # whose hooks (a separate reference model has its own; None: it replays nothing)
    replay: CheckedRoutes | None = None  # replayed, sliced by rows exactly as input_ids
    record: bool = False  # record the natural routes into the generation batch
    pr2: bool = False  # PR2's old pass: steer to the predicted routes (unless replayed) and cache predictor inputs
    old_router: bool = False  # RSPO: capture the old router's probabilities at the experts used

    @property
    def is_plain(self) -> bool:
        return self.replay is None and not (self.record or self.pr2 or self.old_router)

    def check_width(self, width: int) -> None:
        """O(1): the routes were aligned to the width TRL's padding rule gives (``upstream.trl_padded_width``)."""
        if self.replay is not None and self.replay.shape[1] != width:
            raise RouteAlignmentError(
                f"routes aligned to {self.replay.shape[1]} positions by TRL's padding rule, but {self.forward.value} "
                f"feeds {width}: TRL pads differently than upstream.trl_padded_width reads it (a TRL upgrade?)"
            )


# ---------------------------------------------------------------------------------------------- 4. the buffer
@dataclass(frozen=True)
class HeldRows:
    """A batch's per-sample values the trainer holds for it, row for row: the routes its forwards replay, and other
    per-sample inputs of ours by name (RSPO's ``old_router_ids``/``old_router_probs``), each ``[B, ...]``."""

    routes: CheckedRoutes | None = None
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        if self.routes is not None:
            return len(self.routes)
        return next(iter(self.per_sample.values())).shape[0]

    def rows(self, index: torch.Tensor) -> HeldRows:
        return HeldRows(
            None if self.routes is None else self.routes.rows(index),
            {name: value[index.to(value.device)] for name, value in self.per_sample.items()},
        )


class RouteBuffer:
    """Routes the trainer holds for batches in flight, by batch serial; a batch dict carries only their ``route_rows``.

    ``store`` keeps a batch's routes and returns its ``route_rows``: under a ``slot``, until the next batch of that slot
    (the sync trainer's current training and evaluation batches, reused over ``num_iterations``), or without one until
    taken (the async trainer's packed rows, each trained once). ``gather`` gives a micro-batch's own rows (a gather of
    the held routes: owned, checked by construction); a serial no longer held is refused in one line."""

    MAX_UNSLOTTED = 8  # rows stored ahead of their forward (the dataloader prefetches); older ones are dropped

    def __init__(self):
        self._held: dict[Any, tuple[int, HeldRows]] = {}
        self._serial = 0

    def store(self, routes: CheckedRoutes | HeldRows, slot: str | None = None) -> torch.Tensor:
        held = routes if isinstance(routes, HeldRows) else HeldRows(routes)
        self._serial += 1
        self._held[slot if slot is not None else self._serial] = (self._serial, held)
        unslotted = [key for key in self._held if not isinstance(key, str)]
        for key in unslotted[: max(0, len(unslotted) - self.MAX_UNSLOTTED)]:
            del self._held[key]
        rows = torch.arange(len(held))
        return torch.stack([torch.full_like(rows, self._serial), rows], dim=1)

    def gather(self, route_rows: torch.Tensor, take: bool = False) -> CheckedRoutes | None:
        """The routes of the rows ``route_rows`` name; ``take``: the batch is not needed again, and is let go."""
        return self.gather_held(route_rows, take).routes

    def gather_held(self, route_rows: torch.Tensor, take: bool = False) -> HeldRows:
        """Everything held for the rows ``route_rows`` name (routes and per-sample inputs)."""
        if not isinstance(route_rows, torch.Tensor) or route_rows.dim() != 2 or route_rows.shape[1] != 2:
            raise StaleRouteRowsError(
                f"{ROUTE_ROWS} must be a [batch, 2] tensor (serial, row), got "
                f"{getattr(route_rows, 'shape', type(route_rows).__name__)}"
            )
        serials = set(route_rows[:, 0].tolist())
        by_serial = {serial: key for key, (serial, _) in self._held.items()}
        if len(serials) != 1 or not serials <= by_serial.keys():
            raise StaleRouteRowsError(
                f"{ROUTE_ROWS} name generation batch(es) {sorted(serials)}, but the trainer holds the routes of "
                f"{sorted(by_serial)} only: a (micro-)batch must be trained while its generation batch is the current one"
            )
        key = by_serial[serials.pop()]
        held = self._held.pop(key)[1] if take else self._held[key][1]
        rows = route_rows[:, 1]
        if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < len(held):
            raise StaleRouteRowsError(f"{ROUTE_ROWS} name rows {rows.tolist()} of a batch of {len(held)} samples")
        return held.rows(rows)


# ---------------------------------------------------------------------------------------------- 5. replay through backward
class MicroBatchReplay:
    """A micro-batch's routes, replayed from its training forward until its backward has returned (gradient
    checkpointing runs the routers again in backward): the one implementation both trainers use."""

    def __init__(self):
        self._held = contextlib.ExitStack()

    def replay(self, route_replay: RouterReplay, routes: CheckedRoutes) -> contextlib.AbstractContextManager:
        """Around the training forward: with gradients, the replay is held until :meth:`end` (the returned context
        does nothing); without (evaluation), it lasts as long as the returned context."""
        replay = route_replay.replay(routes)
        if not torch.is_grad_enabled():
            return replay
        self._held.enter_context(replay)
        return contextlib.nullcontext()

    def end(self) -> None:
        """Only once the micro-batch's backward (and any recompute in it) has returned."""
        self._held.close()


# ---------------------------------------------------------------------------------------------- the trainer's one object
class RouteFlow:
    """The routes' state in one sync trainer: the generation batch being scored and the buffer. The batch is opened
    and closed in one place: :meth:`generation_batch` (a context around TRL's ``_generate_and_score_completions``); a
    micro-batch's routes are a value (:class:`MicroBatch`), replayed through its backward (:class:`MicroBatchReplay`,
    ended by ``core/trainer_base.py``)."""

    def __init__(
        self,
        settings: ReplaySettings,
        route_replay: RouterReplay | None,
        reference_replay: RouterReplay | None,
        *,
        pr2: bool,
        router_shift: bool,
    ):
        self.settings = settings
        self.route_replay = route_replay
        self.reference_replay = reference_replay
        self.pr2 = pr2
        self.router_shift = router_shift
        self.buffer = RouteBuffer()
        self.batch: GenerationBatch | None = None

    @contextlib.contextmanager
    def generation_batch(self) -> Iterator[GenerationBatch]:
        self.batch = GenerationBatch()
        try:
            yield self.batch
        finally:
            self.batch = None

    def store(self, batch: GenerationBatch, mode: str) -> torch.Tensor | None:
        """Step 4: keep the routes the policy's forwards replay and RSPO's old router; the batch's ``route_rows``
        (None: nothing to hold)."""
        held = HeldRows(batch.to_replay(self.settings), {**batch.old_router_inputs(), **batch.per_sample})
        if held.routes is None and not held.per_sample:
            return None
        return self.buffer.store(held, slot=mode)

    def micro_rows(self, inputs: dict) -> HeldRows | None:
        """Step 5: a micro-batch's own rows of the buffer (None: it carries none)."""
        route_rows = inputs.get(ROUTE_ROWS)
        return None if route_rows is None else self.buffer.gather_held(route_rows)

    def plan(self, is_reference: bool, is_ref_model: bool, micro: MicroBatch | None = None) -> ForwardPlan | None:
        """Which forward this is, and what it does with routes (None: no routes at all, TRL's forward); ``micro``:
        the micro-batch whose training forward runs, if any."""
        settings, rr, batch = self.settings, self.route_replay, self.batch
        if rr is None:
            return None
        if batch is None:  # outside scoring: the training (or evaluation) forward of a micro-batch
            if micro is None or micro.routes is None:
                return None
            return ForwardPlan(Forward.TRAINING, rr, replay=micro.routes)
        if is_reference:  # replays the policy's routes, unless told not to
            replay = batch.to_replay(settings) if settings.mode.replays and settings.replay_reference_model else None
            return ForwardPlan(Forward.REFERENCE, self.reference_replay if is_ref_model else rr, replay=replay)
        return ForwardPlan(
            Forward.OLD,
            rr,
            replay=batch.generation if settings.replays_generation_routes else None,
            record=settings.records_old_pass,
            pr2=self.pr2,
            old_router=self.router_shift,
        )

    def metrics_plan(self) -> ForwardPlan:
        """The trainer's own no-grad pass for ``routing/*`` when TRL ran no old-logprob pass: routed like the old pass
        would be, recording the natural routes."""
        batch = self.batch
        assert batch is not None  # asked while scoring, inside generation_batch()
        replay = batch.generation if self.settings.replays_generation_routes else None
        return ForwardPlan(Forward.METRICS, self.route_replay, replay=replay, record=True)
