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

A later turn's prompts are matched to samples by their tokens: the samples whose sequence so far is a prefix of the
turn's prompt, in sample order (TRL generates the tool-calling samples in that order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers.utils import logging

from ..routing.codec import EngineTurn


logger = logging.get_logger(__name__)


class RolloutTurns:
    """Per-sample engine turns of one generation batch (this rank's samples, in TRL's completion order)."""

    def __init__(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                 rows: Sequence[Any] | None, prompt_start: Any = 0):
        """The batch's first turn (``prompt_start``: one value for the request, or a list, tuple or 1-D array with
        one per sample). The values are kept as given: alignment checks each sample's (a bad one loses that
        sample's rows, not the batch)."""
        self.turns: list[list[EngineTurn]] = []
        self._sequences: list[list[int]] = []
        self.unmatched = 0  # later-turn prompts that matched no sample (their routes are dropped)
        rows = rows if rows is not None else [None] * len(prompt_ids)
        starts = per_sample(prompt_start, len(prompt_ids), "routed_experts_prompt_start")
        for prompt, completion, sample_rows, start in zip(prompt_ids, completion_ids, rows, starts, strict=True):
            self.turns.append([EngineTurn(sample_rows, len(prompt), len(completion), start)])
            self._sequences.append([*prompt, *completion])

    def match(self, prompt_ids: Sequence[Sequence[int]]) -> list[int | None]:
        """The sample each later-turn prompt continues (``None``: no sample's sequence is a prefix of it)."""
        matched: list[int | None] = []
        sample = 0
        for prompt in prompt_ids:
            prompt = list(prompt)
            start = sample
            while sample < len(self._sequences) and not _is_prefix(self._sequences[sample], prompt):
                sample += 1
            if sample == len(self._sequences):
                matched.append(None)
                sample = start  # keep the order for the prompts after it
                continue
            matched.append(sample)
            sample += 1
        return matched

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

    def add_turn(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                 rows: Sequence[Any] | None, prompt_start: int = 0,
                 samples: Sequence[int | None] | None = None) -> None:
        """Record one later turn (``samples`` from :meth:`match`, computed here if not given)."""
        samples = self.match(prompt_ids) if samples is None else samples
        rows = rows if rows is not None else [None] * len(prompt_ids)
        for prompt, completion, sample_rows, sample in zip(prompt_ids, completion_ids, rows, samples, strict=True):
            if sample is None:
                self.unmatched += 1
                logger.warning(
                    "routing replay: a tool turn's prompt continues no sample of this batch; its routes are dropped "
                    "(those positions use the trainer's own routing, counted in routing/fallback_frac)"
                )
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
