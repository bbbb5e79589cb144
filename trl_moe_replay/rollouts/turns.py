"""Engine routes across the turns of a multi-turn rollout (TRL's ``tools`` / ``environment_factories`` loop).

TRL generates a tool-calling completion turn by turn: the first turn from the prompt, each later turn from the
sample's whole sequence so far (prompt + completion + tool result, as token ids) for the samples whose last turn
called a tool. Each turn's engine returns routes for the positions it forwarded: ``[p_t + c_t - 1 - s_t, L, K]``
rows for its own prompt of ``p_t`` tokens (from ``routed_experts_prompt_start = s_t``) and its ``c_t`` new tokens.

:class:`RolloutTurns` keeps, per sample, every turn's rows with the token counts they cover
(:class:`~trl_moe_replay.routing.codec.EngineTurn`), so that in the final multi-segment sequence every position
replays the route of the *first* turn that forwarded it: a generated token's route from the turn that sampled it,
a tool-result token's (and a turn's last generated token's) from the prefill of the turn that read it. A later turn
never overwrites an earlier one's routes (the failure mode of engines that keep only the last turn's array).

Which sample a later turn continues comes from TRL's tool loop (``owners``: the trainer reads the loop's list of
tool-calling samples through the seam, entry ``tool_loop_samples``). Only where that is not known (a loop of the
user's own) do the tokens decide, and then only when they can: a turn goes to the one sample whose sequence so far is
a prefix of its prompt in every order-keeping assignment (TRL generates the tool-calling samples in batch order). Two
samples of a group that wrote the same tool call have the same sequence; when only one of them goes on, its turn
fits both, and is given to neither: those positions use the trainer's own routing (counted in
``routing/fallback_frac``), never another sample's routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers.utils import logging

from ..routing.codec import EngineTurn


logger = logging.get_logger(__name__)


class RolloutTurns:
    """Per-sample engine turns of one generation batch (this rank's samples, in TRL's completion order)."""

    def __init__(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        rows: Sequence[Any] | None,
        prompt_start: Any = 0,
    ):
        """The batch's first turn (``prompt_start``: one value for the request, or a list, tuple or 1-D array with
        one per sample). The values are kept as given: alignment checks each sample's (a bad one loses that
        sample's rows, not the batch)."""
        self.turns: list[list[EngineTurn]] = []
        self._sequences: list[list[int]] = []
        self.unmatched = 0  # later-turn prompts that matched no sample (their routes are dropped)
        self.ambiguous = 0  # later-turn prompts that fit several samples, with no owner known (routes dropped)
        rows = rows if rows is not None else [None] * len(prompt_ids)
        starts = per_sample(prompt_start, len(prompt_ids), "routed_experts_prompt_start")
        for prompt, completion, sample_rows, start in zip(prompt_ids, completion_ids, rows, starts, strict=True):
            self.turns.append([EngineTurn(sample_rows, len(prompt), len(completion), start)])
            self._sequences.append([*prompt, *completion])

    @classmethod
    def from_engine_turns(
        cls, samples: Sequence[Sequence[EngineTurn]], sequences: Sequence[Sequence[int]]
    ) -> RolloutTurns:
        """Turns already kept per sample (each ``EngineTurn`` with the token counts it covers), with each sample's
        whole sequence: what a rollout worker that ran the conversations itself hands over."""
        rollout = cls([], [], None)
        rollout.turns = [list(turns) for turns in samples]
        rollout._sequences = [list(sequence) for sequence in sequences]
        return rollout

    def match(self, prompt_ids: Sequence[Sequence[int]], owners: Sequence[int] | None = None) -> list[int | None]:
        """The sample each later-turn prompt continues (``None``: none, or no telling which).

        ``owners``: the samples TRL's tool loop generated the prompts for (increasing), taken when each owner's
        sequence so far is a prefix of its prompt. Otherwise the tokens decide: a prompt goes to a sample when every
        order-keeping assignment of the prompts to samples whose sequence is a prefix of them gives it that sample; a
        prompt that fits several samples (two samples with the same tool call, one of which stopped) goes to none."""
        prompts = [list(prompt) for prompt in prompt_ids]
        if owners is not None and self._owned(prompts, owners):
            return list(owners)
        fits = [
            [sample for sample, sequence in enumerate(self._sequences) if _is_prefix(sequence, prompt)]
            for prompt in prompts
        ]
        earliest: list[int | None] = []
        last = -1
        for candidates in fits:  # the smallest sample each prompt can have, in order
            pick = next((sample for sample in candidates if sample > last), None)
            earliest.append(pick)
            last = pick if pick is not None else last
        latest: list[int | None] = [None] * len(prompts)
        bound = len(self._sequences)
        for index in reversed(range(len(prompts))):  # the largest, in order (prompts that fit none left out)
            if earliest[index] is None:
                continue
            pick = next((sample for sample in reversed(fits[index]) if sample < bound), None)
            latest[index] = pick
            bound = pick if pick is not None else bound
        matched = [first if first == last_pick else None for first, last_pick in zip(earliest, latest, strict=True)]
        unmatched = sum(first is None for first in earliest)
        ambiguous = sum(
            first is not None and first != last_pick for first, last_pick in zip(earliest, latest, strict=True)
        )
        self.unmatched += unmatched
        self.ambiguous += ambiguous
        if unmatched or ambiguous:
            logger.warning(
                f"routing replay: of {len(prompts)} prompts of a tool turn, {unmatched} continue no sample of this "
                f"batch and {ambiguous} more than one (samples with the same sequence so far, and which one goes on is "
                "not known); their routes are dropped (those positions use the trainer's own routing, counted in "
                "routing/fallback_frac)"
            )
        return matched

    def _owned(self, prompts: list[list[int]], owners: Sequence[int]) -> bool:
        """Whether ``owners`` (one sample per prompt, increasing) can be the samples the prompts continue."""
        return (
            len(owners) == len(prompts)
            and all(
                0 <= sample < len(self._sequences) and _is_prefix(self._sequences[sample], prompt)
                for sample, prompt in zip(owners, prompts, strict=True)
            )
            and all(earlier < later for earlier, later in zip(owners, owners[1:], strict=False))
        )

    def held_positions(self, samples: Sequence[int | None]) -> int | None:
        """Positions every given sample already holds routes for from its earlier turns (the common prefix a later
        turn need not send again: vLLM's ``routed_experts_prompt_start`` for that turn's request). ``None`` when no
        given sample is one of this batch's (no bound: the request's other samples decide)."""
        held = [self._held(sample) for sample in samples if sample is not None]
        return min(held, default=None)

    def _held(self, sample: int) -> int:
        covered = 0
        for index, turn in enumerate(self.turns[sample]):
            # a turn without rows, or one starting past what is held, leaves a gap: positions from there on are not
            # held (the first turn's skipped prefix is skipped on purpose: the caller asked for no routes there)
            if turn.rows is None or (index > 0 and turn.prompt_start > covered):
                break
            covered = max(covered, turn.prompt_length + turn.completion_length - 1)
        return covered

    def add_turn(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        rows: Sequence[Any] | None,
        prompt_start: int = 0,
        samples: Sequence[int | None] | None = None,
    ) -> None:
        """Record one later turn (``samples`` from :meth:`match`, matched by tokens here if not given)."""
        samples = self.match(prompt_ids) if samples is None else samples
        rows = rows if rows is not None else [None] * len(prompt_ids)
        for prompt, completion, sample_rows, sample in zip(prompt_ids, completion_ids, rows, samples, strict=True):
            if sample is None:  # no sample, or no telling which: counted and said by match()
                continue
            self.turns[sample].append(EngineTurn(sample_rows, len(prompt), len(completion), prompt_start))
            self._sequences[sample] = [*prompt, *completion]


def per_sample(value: Any, count: int, name: str) -> list[Any]:
    """``value`` for each of ``count`` samples: a list, tuple or array of ``count`` entries as it is, anything else
    (an int, a numpy integer, a bad scalar) repeated. A sequence of another length raises ``ValueError``."""
    if isinstance(value, (list, tuple)) or (hasattr(value, "ndim") and getattr(value, "ndim", 0) > 0):
        values = value.tolist() if hasattr(value, "tolist") else list(value)
        if len(values) != count:
            raise ValueError(
                f"{name} has {len(values)} entries for {count} samples: pass one value, or one per sample"
            )
        return values
    return [value] * count


def _is_prefix(prefix: list[int], sequence: list[int]) -> bool:
    return len(prefix) <= len(sequence) and sequence[: len(prefix)] == prefix
