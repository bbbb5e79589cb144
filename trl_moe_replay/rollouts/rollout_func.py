"""The routes of a ``rollout_func`` (TRL's custom rollouts): taken out of its output, or from the function itself where it
is a route source (:class:`~.sglang_routes.SGLangRollout`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .route_intake import RoutesUnavailableError
from .route_source import RouteSourceProtocol, TurnOutput, TurnRequest, TurnRows
from .turns import RolloutTurns


class RolloutFuncRoutes:
    """The routes of a ``rollout_func``: the rollout part (:class:`RolloutFuncFields`, or the ``rollout_func`` itself
    where it is a route source, as :class:`~.sglang_routes.SGLangRollout` is), and for the later turns of TRL's tool
    loop, which TRL generates itself, the trainer's turn engine (``turns``; ``None``: they carry no routes)."""

    def __init__(
        self, rollouts: RouteSourceProtocol, turns: RouteSourceProtocol | None, *, keep: bool, required: bool
    ):
        self.rollouts = rollouts
        self.turns = turns
        self.keep = keep  # the trainer keeps engine routes (R3, routing metrics); else they are only taken out
        self.required = required  # R3: a batch without routes ends the run
        self.name, self.remedy = rollouts.name, rollouts.remedy

    def generate_turn(self, request: TurnRequest, generate: Callable[[], TurnOutput]) -> tuple[TurnOutput, TurnRows]:
        if self.turns is None:
            return generate(), TurnRows()
        return self.turns.generate_turn(request, generate)

    def rollout_turns(
        self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], fields: dict[str, Any]
    ) -> RolloutTurns | None:
        turns = self.rollouts.rollout_turns(prompt_ids, completion_ids, fields)  # taken out of fields in any case
        if not self.keep:
            return None
        if turns is None and self.required:
            raise RoutesUnavailableError(
                f"routing_replay='r3' with a rollout_func needs the experts the engine routed each token to, and "
                f"{self.name} returned none. {self.remedy} Or train with routing_replay='r2'."
            )
        return turns

    def take_metrics(self) -> dict[str, float]:
        return {**self.rollouts.take_metrics(), **(self.turns.take_metrics() if self.turns is not None else {})}


class RolloutFuncFields:
    """The rollout part of a plain ``rollout_func``: per-sample ``routed_experts`` in its output (vLLM's layout:
    ``[p + c - 1 - s, L, K]`` arrays or base64 ``.npy`` strings, ``None`` for none) and ``routed_experts_prompt_start``
    (an int or one per sample)."""

    name = "rollout_func"
    remedy = (
        "Does the rollout_func's engine serve the same checkpoint as the trainer, and return them as "
        "output['routed_experts'] (one [p + c - 1, num_layers, top_k] array or vLLM base64 payload per "
        "sample, vLLM's layout)?"
    )

    def generate_turn(self, request: TurnRequest, generate: Callable[[], TurnOutput]) -> tuple[TurnOutput, TurnRows]:
        return generate(), TurnRows()

    def rollout_turns(
        self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], fields: dict[str, Any]
    ) -> RolloutTurns | None:
        rows = fields.pop("routed_experts", None)
        starts = fields.pop("routed_experts_prompt_start", 0)
        if rows is None:
            return None
        if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__len__") or len(rows) != len(prompt_ids):
            count = f"{len(rows)} entries" if hasattr(rows, "__len__") else "no list"
            raise RoutesUnavailableError(
                f"rollout_func returned routed_experts as a {type(rows).__name__} ({count}) for {len(prompt_ids)} "
                "completions: return a list with one entry per completion (an array, a base64 payload or None)"
            )
        try:  # a bad value for one sample only loses that sample's routes (RouteIntake); a wrong count is a bug
            return RolloutTurns(prompt_ids, completion_ids, rows, starts)
        except ValueError as exc:
            raise RoutesUnavailableError(f"rollout_func returned {exc}") from None

    def take_metrics(self) -> dict[str, float]:
        return {}
