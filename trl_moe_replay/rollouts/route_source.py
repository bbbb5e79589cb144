"""The one interface between the trainers and every source of rollouts and their routes (cf. TRL's
``RolloutWorkerProtocol``).

A route source is what the trainer talks to about routes; it never branches on the backend itself:

* :meth:`RouteSourceProtocol.generate_turn`: one generation turn the trainer's engine runs (TRL's
  ``_generate_single_turn``: the batch's first turn, or a later turn of TRL's tool loop). The source runs TRL's call
  and returns its output with the rows of the turn's completions (:class:`TurnRows`).
* :meth:`RouteSourceProtocol.rollout_turns`: rows that came with finished rollouts (a ``rollout_func``'s output, a
  sample of the async worker), per sample and turn (:class:`~.turns.RolloutTurns`), taken out of the fields TRL hands
  to the reward functions.
* :meth:`RouteSourceProtocol.take_metrics`: the source's own metrics of the batch (``vllm/route_bytes``).
* ``name`` and ``remedy``: what the route intake says when no row of the first batch fits.

Whatever a source returns goes to :class:`~.route_intake.RouteIntake` (per-sample and per-position fallback,
first-batch rule): a source does not check rows. The sources:

=========================================  ==========================================  =================================
source                                      where                                       rows come from
=========================================  ==========================================  =================================
vLLM server, vLLM colocate                  ``vllm_routes.VLLMRouteSource``             ``generate_turn``
transformers ``generate``                   ``hf_generate.TransformersRouteSource``     ``generate_turn``
a ``rollout_func`` (vLLM's layout fields)   ``rollout_func.RolloutFuncFields``                       ``rollout_turns``
an SGLang server (a ``rollout_func``)       ``sglang_routes.SGLangRollout``             ``rollout_turns``
the async trainer's rollout worker          ``async_rollout_worker.WorkerRouteSource``  ``rollout_turns``
=========================================  ==========================================  =================================

:func:`~.route_choice.sync_trainer_route_source` picks the sync trainer's source from its configuration, the one
place that asks which engine generates; the async trainer's source is its rollout worker's
(``async_grpo.async_rollout_worker.WorkerRouteSource``). Adding an engine: docs/maintaining.md, "Add an engine".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .turns import RolloutTurns


__all__ = ["RouteSourceProtocol", "TurnOutput", "TurnRequest", "TurnRows"]

#: What TRL's ``_generate_single_turn`` returns: the completions' token ids and, where the engine gave them, their
#: sampling log-probs.
TurnOutput = tuple[list[list[int]], list[list[float]] | None]


@dataclass(frozen=True)
class TurnRequest:
    """One generation turn the trainer asks its engine for (TRL's ``_generate_single_turn``)."""

    prompt_ids: Sequence[Sequence[int]]  # this rank's prompts of the turn
    later_turn: bool = False  # a later turn of TRL's tool loop, not the batch's first
    # a later turn: the positions every sample of this rank in the turn holds routes for already (``None``: no bound)
    held: int | None = None


@dataclass(frozen=True)
class TurnRows:
    """What a turn's engine returned besides TRL's output."""

    rows: Sequence[Any] | None = None  # one entry per completion (array, base64 payload, None); None: no routes
    prompt_start: int = 0  # the position the rows start at (vLLM's routed_experts_prompt_start)
    sampling_logprobs: list[list[float]] | None = None  # the sampler's log-probs, for the mismatch metrics only


@runtime_checkable
class RouteSourceProtocol(Protocol):
    """What a source of rollouts and their routes offers the trainers.

    Attributes:
        name (`str`): who produced the rows, in the route intake's messages (``"vLLM"``, ``"SGLang"``, ...).
        remedy (`str`): what the user should check when no row of the first batch fits the trained model.
    """

    name: str
    remedy: str

    def generate_turn(self, request: TurnRequest, generate: Callable[[], TurnOutput]) -> tuple[TurnOutput, TurnRows]:
        """Run one generation turn (``generate``: TRL's own call, unchanged) and return its output (which a source may
        complete, e.g. with the sampler's log-probs) and the rows of its completions. A source whose rows come with
        the rollouts returns ``generate()`` and no rows."""
        ...

    def rollout_turns(
        self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], fields: dict[str, Any]
    ) -> RolloutTurns | None:
        """The rows that came with these finished rollouts (one per sample), per sample and turn, taken out of
        ``fields`` (what came with them: a ``rollout_func``'s extra fields); ``None`` when they brought none."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """The source's own metrics since the last call (each summed over the ranks by the trainer), and reset them."""
        ...
