"""The one entry point from an engine's route rows to routes the trainer replays.

Every source of engine routes -- vLLM (server and colocate), a ``rollout_func``, transformers ``generate`` through our
recorder, and any later one -- hands its rows, per sample and turn (:class:`~trl_moe_replay.routing.EngineTurn`), to
:meth:`RouteIntake.align`. That one call owns the guarantees the rest of the package relies on:

* **Per-sample fallback.** A sample whose rows are missing or malformed (wrong length, id out of range, repeated ids,
  undecodable payload) is routed by the trainer's own router instead of ending the run; its positions count in
  ``routing/fallback_frac`` and a warning names the first problem.
* **First-batch rule.** When replay needs engine routes (``required``) and no sample of the whole first batch (all
  ranks) fits, the engine and the trainer disagree about the model or the engine is not set up to return routes:
  :class:`RoutesUnavailableError` is raised instead of silently training without replay.

A new route source plugs in *before* this call, never beside it (``tests/test_route_intake.py`` checks that nothing
else in the package calls ``routes_from_engine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.utils import logging

from ..routing.engine import EngineTurn, routes_from_engine
from ..routing.errors import RouteAlignmentError

logger = logging.get_logger(__name__)


class RoutesUnavailableError(RuntimeError):
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
    """

    def __init__(self, accelerator: Any, *, source: str, required: bool, remedy: str = "",
                 needed_by: str = "routing_replay='r3'"):
        self.accelerator = accelerator
        self.source = source
        self.required = required
        self.remedy = remedy
        self.needed_by = needed_by
        self.fallback_samples = 0  # samples routed natively for want of usable engine rows, since start
        self._aligned_first_batch = False

    def align(self, samples: Sequence[Sequence[EngineTurn]], **layout: Any) -> torch.Tensor:
        """``routes_from_engine`` over this rank's samples (each a list of :class:`EngineTurn`, one per generation
        turn); ``layout`` is ``routes_from_engine``'s keyword arguments. A sample or turn with missing or malformed
        rows falls back to the router's own choice, with a warning."""
        failures: list[RouteAlignmentError] = []
        routes = routes_from_engine(samples, on_error=failures.append, **layout)
        missing = sum(all(turn.rows is None for turn in turns) for turns in samples)
        malformed = len({error.sample for error in failures})  # a multi-turn sample may fail in several turns
        if self.required and not self._aligned_first_batch:
            self._aligned_first_batch = True
            usable = len(samples) - missing - malformed
            if self.accelerator is not None:  # every rank takes the branch below together
                usable = int(self.accelerator.gather(torch.tensor([usable], device=self.accelerator.device)).sum())
            if usable == 0:
                reason = f"first problem here: {failures[0]}" if failures else "no sample here came with routes"
                raise RoutesUnavailableError(
                    f"{self.needed_by}: no route {self.source} returned for the first batch fits the trained "
                    f"model ({layout['num_layers']} decoder layers, top-{layout['top_k']}); {reason}. {self.remedy}"
                )
        if missing or malformed:
            self.fallback_samples += missing + malformed
            detail = f"; first problem: {failures[0]}" if failures else ""
            logger.warning(
                f"routing replay: {missing + malformed} of {len(samples)} samples on this rank have no usable "
                f"{self.source} routes ({missing} missing, {malformed} malformed) and use the trainer's own "
                f"routing instead (counted in routing/fallback_frac){detail}"
            )
        return routes
