"""The one entry point from an engine's route rows to routes the trainer replays.

Every source of engine routes -- vLLM (server and colocate), a ``rollout_func``, transformers ``generate`` through our
recorder, and any later one -- hands its rows, per sample and turn (:class:`~trl_moe_replay.routing.EngineTurn`), to
:meth:`RouteIntake.align`. That one call owns the guarantees the rest of the package relies on:

* **Per-position fallback.** A position the engine marks as never written (vLLM's all-zero route at a MoE layer, or
  a route of ``-1`` s) is routed by the trainer's own router, at every layer, while the sample's other positions
  replay their routes; it counts in ``routing/fallback_frac`` and a warning says how many there were.
* **Per-sample fallback.** A sample (or a turn of one) whose rows cannot be placed (missing, wrong length, layer count,
  top-k or dtype, id out of range, repeated ids, undecodable payload, every row never written) is routed by the
  trainer's own router instead of ending the run; its positions count in ``routing/fallback_frac``, the sample in
  ``routing/fallback_samples_frac`` when none of its turns could be placed, and a warning names the first problem.
* **First-batch rule.** When replay needs engine routes (``required``) and no sample of the whole first batch (all
  ranks) fits (a sample fits when at least one of its turns was placed: some never-written positions do not matter), the engine and the trainer disagree about the model or the engine is not set up to return routes:
  :class:`RoutesUnavailableError` is raised instead of silently training without replay. A trainer that aligns
  sample by sample (the async one) says how many samples make its first batch; the rule waits for all of them, so one
  bad sample that happens to arrive first never ends the run.
* **Routes that stop arriving.** When every sample of ``warn_fallback_batches`` batches in a row fell back, a warning
  says so; with ``max_fallback_batches`` set, that many such batches in a row raise :class:`RoutesUnavailableError`.

The routes it returns are :class:`~trl_moe_replay.routing.routes.CheckedRoutes`: checked here, once, and replayed
from there without another pass. A new route source plugs in *before* this call, never beside it
(``tests/rollouts/test_route_intake.py`` checks that nothing else in the package calls ``routes_from_engine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.utils import logging

from ..errors import TrlMoeReplayError
from ..routing.codec import EngineTurn, UnwrittenPositions, checked_routes_from_engine
from ..routing.errors import RouteAlignmentError
from ..routing.routes import CheckedRoutes, RouteLayout


logger = logging.get_logger(__name__)


class RoutesUnavailableError(TrlMoeReplayError, RuntimeError):
    """The inference engine returned no routed experts, so R3 has nothing to replay."""


class RouteIntake:
    """Aligns one generation batch of engine rows into TRL's padded ``[B, S, L, K]`` layout, sample by sample.

    Args:
        accelerator: the trainer's ``Accelerator``; the first-batch rule gathers across its processes. ``None``: one
            process (a tool outside training, e.g. ``trl-moe-replay audit``).
        source: what produced the rows, for messages (``"vLLM"``, ``"rollout_func"``, ...).
        required: whether replay depends on these routes (R3). Routing metrics alone do without them.
        remedy: appended to the first-batch error: what the user should check for this source.
        needed_by: what needs the routes, at the start of the first-batch error (default ``"routing_replay='r3'"``).
        batch_samples: samples of this rank that make one batch (one optimizer step). ``None``: each ``align`` call is
            one batch (the sync trainer aligns a whole generation batch at once).
        max_fallback_batches: raise when every sample of this many batches in a row fell back. ``None``: never.
            Judged per process, without a gather: only for a trainer that aligns on one process (the async one).
        warn_fallback_batches: warn (once per such run of batches) when every sample of this many batches in a row
            fell back.
    """

    def __init__(
        self,
        accelerator: Any,
        *,
        source: str,
        required: bool,
        remedy: str = "",
        needed_by: str = "routing_replay='r3'",
        batch_samples: int | None = None,
        max_fallback_batches: int | None = None,
        warn_fallback_batches: int = 3,
    ):
        self.accelerator = accelerator
        self.source = source
        self.required = required
        self.remedy = remedy
        self.needed_by = needed_by
        self.batch_samples = batch_samples
        self.max_fallback_batches = max_fallback_batches
        self.warn_fallback_batches = warn_fallback_batches
        self.fallback_samples = 0  # samples routed natively for want of usable engine rows, since start
        self.unwritten_positions = 0  # positions routed natively because the engine never wrote them, since start
        self.aligned_samples = 0  # samples aligned, since start
        self._taken = (0, 0)  # (fallback_samples, aligned_samples) at the last take_sample_sums()
        self._first_batch: dict[str, Any] = {"pending": required, "seen": 0, "usable": 0, "problem": None}
        self._fallback_streak = 0  # samples in a row, up to now, that all fell back
        self._warned_streak = False

    def align(
        self,
        samples: Sequence[Sequence[EngineTurn]],
        layout: RouteLayout,
        *,
        prompt_lengths: Sequence[int],
        completion_lengths: Sequence[int],
        prompt_width: int,
        completion_width: int,
    ) -> CheckedRoutes:
        """This rank's samples (each a list of :class:`EngineTurn`, one per generation turn) in TRL's padded
        ``[B, prompt_width + completion_width]`` layout, checked for the model's ``layout``
        (``routes_from_engine``). A sample or turn with missing or malformed rows falls back to the router's own
        choice, with a warning; a position the engine never wrote falls back alone."""
        failures: list[RouteAlignmentError] = []
        unwritten: list[UnwrittenPositions] = []
        routes = checked_routes_from_engine(
            samples,
            layout,
            prompt_lengths=prompt_lengths,
            completion_lengths=completion_lengths,
            prompt_width=prompt_width,
            completion_width=completion_width,
            on_error=failures.append,
            on_unwritten=unwritten.append,
        )
        failed_turns = [0] * len(samples)  # a multi-turn sample may fail in several turns
        for error in failures:
            assert error.sample is not None  # the codec names the sample of every failure it reports
            failed_turns[error.sample] += 1
        given = [sum(turn.rows is not None for turn in turns) for turns in samples]
        missing = sum(count == 0 for count in given)
        malformed = sum(0 < count <= failed for count, failed in zip(given, failed_turns, strict=True))
        partial = sum(0 < failed < count for count, failed in zip(given, failed_turns, strict=True))
        usable = len(samples) - missing - malformed  # at least one turn placed
        self._first_batch_rule(usable, len(samples), failures, layout)
        self._fallback_streak_rule(usable, len(samples), failures)
        self.fallback_samples += missing + malformed
        self.aligned_samples += len(samples)
        if missing or malformed or partial:
            detail = f"; first problem: {failures[0]}" if failures else ""
            turns = f"; {partial} more lost the routes of some of their turns" if partial else ""
            logger.warning(
                f"routing replay: {missing + malformed} of {len(samples)} samples on this rank have no usable "
                f"{self.source} routes ({missing} missing, {malformed} malformed) and use the trainer's own "
                f"routing instead{turns} (counted in routing/fallback_frac){detail}"
            )
        if unwritten:
            positions = sum(report.count for report in unwritten)
            self.unwritten_positions += positions
            first = unwritten[0]
            logger.warning(
                f"routing replay: {positions} positions in {len(unwritten)} of {len(samples)} samples on this rank "
                f"were never written by {self.source} (all-zero or -1 routes) and use the trainer's own routing "
                f"there, the rest of those samples replaying their routes (counted in routing/fallback_frac); first: "
                f"sample {first.sample}, position {first.first}"
            )
        return routes

    def take_sample_sums(self) -> dict[str, torch.Tensor]:
        """The samples aligned since the last call, and those of them that fell back whole (no turn placed), as the
        ``samples`` / ``fallback_samples`` sums of ``routing/fallback_samples_frac`` (``core.metrics``)."""
        now = (self.fallback_samples, self.aligned_samples)  # totals only grow: a concurrent align is never lost
        fallback, samples = (total - taken for total, taken in zip(now, self._taken, strict=True))
        self._taken = now
        return {"fallback_samples": torch.tensor(float(fallback)), "samples": torch.tensor(float(samples))}

    def _first_batch_rule(
        self, usable: int, count: int, failures: list[RouteAlignmentError], layout: RouteLayout
    ) -> None:
        """Raise when no sample of the whole first batch (``batch_samples`` of them, all ranks) fits."""
        first = self._first_batch
        if not first["pending"]:
            return
        first["seen"] += count
        first["usable"] += usable
        if first["problem"] is None and failures:
            first["problem"] = failures[0]
        if self.batch_samples is not None and first["seen"] < self.batch_samples:
            return  # the first batch is not complete yet: a sample that falls back now is not the verdict
        first["pending"] = False
        usable = first["usable"]
        if self.accelerator is not None:  # every rank takes the branch below together
            usable = int(self.accelerator.gather(torch.tensor([usable], device=self.accelerator.device)).sum())
        if usable == 0:
            problem = first["problem"]
            reason = f"first problem here: {problem}" if problem else "no sample here came with routes"
            raise RoutesUnavailableError(
                f"{self.needed_by}: no route {self.source} returned for the first batch fits the trained model "
                f"({layout.num_layers} decoder layers, top-{layout.top_k}; {first['seen']} samples here); "
                f"{reason}. {self.remedy}"
            )

    def _fallback_streak_rule(self, usable: int, count: int, failures: list[RouteAlignmentError]) -> None:
        """Warn, or raise when configured, once every sample of several batches in a row fell back."""
        if usable > 0 or count == 0:
            self._fallback_streak, self._warned_streak = 0, False
            return
        self._fallback_streak += count
        batches = self._fallback_streak // (self.batch_samples or count)
        detail = f" (last problem: {failures[-1]})" if failures else ""
        if self.max_fallback_batches is not None and batches >= self.max_fallback_batches:
            raise RoutesUnavailableError(
                f"{self.source} routes stopped arriving: every sample of the last {batches} batches "
                f"({self._fallback_streak} samples) fell back to the trainer's own routing{detail}, and "
                f"max_route_fallback_steps is {self.max_fallback_batches}. {self.remedy} Raise the limit, or leave it "
                "unset to only warn."
            )
        if batches >= self.warn_fallback_batches and not self._warned_streak:
            self._warned_streak = True
            logger.warning(
                f"routing replay: every sample of the last {batches} batches fell back to the trainer's own routing "
                f"(routing/fallback_frac 1.0): {self.source} routes stopped arriving{detail}. {self.remedy}"
            )
