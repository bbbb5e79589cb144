"""The replay rule: which experts a token uses under replay, and with what combine weights.

:func:`replay_rule` is the one function from (the replayed ids, the trainer router's output) to (the ids the MoE block
runs, their combine weights); ``RouterReplay``'s router hook calls it for every replayed router call, in every forward
of every mode that replays (R3, R2, PR2, a registered mode), and hands its ids and weights to the MoE block.

* **Replay** (``score_threshold=0``, the default): a position with a route uses the replayed ids; a position without
  one (``no route``) keeps the router's own choice.
* **Threshold replay** (``0 < score_threshold <= 1``; prime-rl PR #2703's rule): a replayed expert is kept only if the
  trainer router's score for it is at least ``score_threshold`` x the router's weakest top-k score for that token;
  each rejected slot is refilled from the router's own top-k, best first, skipping experts already chosen (no expert
  twice). At 1 it is the router's own top-k wherever scores are not tied.

The *score* is the router probability: the softmax over all experts of the router's logits in float32 (as
``router_probs.py`` reads it for RSPO), whatever the family; for routers that rank by the logits (every softmax family,
GPT-OSS, Granite) the router's own top-k are the k highest scores. The *combine weights* are the family's own
normalisation of the router's logits at the ids used (``combine``: the family's gate-weight function of
``routers.py`` bound to the router that ran), as the router computes them for its own choice, so the router still
trains and replaying the router's own routes reproduces its outputs bit for bit.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import TrlMoeReplayError
from .routes import has_route


#: ``(logits [N, E], ids [N, K]) -> combine weights [N, K]``: a router family's normalisation of the logits at the
#: given ids (``functools.partial(family.gate_weights, router)``, ``routers.py``)
CombineWeights = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ScoreThresholdError(TrlMoeReplayError, ValueError):
    """A replay score threshold outside [0, 1]."""


def check_score_threshold(value: float, name: str = "replay_score_threshold") -> float:
    """``value`` as a float if it is a usable threshold (a number in [0, 1]), else :class:`ScoreThresholdError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or not 0 <= value <= 1:
        raise ScoreThresholdError(
            f"{name} must be a number in [0, 1] (0: replay the routes as they are; 1: keep a replayed expert only "
            f"where the trainer's router ranks it in its own top-k), got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class ReplayChoice:
    """What :func:`replay_rule` decides for one router call of ``N`` tokens."""

    ids: torch.Tensor
    """``[N, K]``: the experts the block runs (the router's own order where they are its own set, else ascending)."""
    weights: torch.Tensor
    """``[N, K]``: their combine weights, ``combine(logits, ids)`` (in the autograd graph: the router trains)."""
    replaced: torch.Tensor | None
    """``[N, K]`` bool: the replayed slots the threshold rejected (None: no threshold, nothing rejected)."""
    routed: torch.Tensor
    """``[N]`` bool: the tokens that had a route to replay."""


def canonical_ids(rows: torch.Tensor, natural: torch.Tensor, rows_sorted: torch.Tensor | None = None) -> torch.Tensor:
    """The k ids are a set. A row equal (as a set) to the natural choice keeps the router's own order, which makes
    natural replay bit-exact; any other set is put in ascending order so that its order never matters."""
    if rows_sorted is None:
        rows_sorted = rows.sort(dim=-1).values
    same_set = (rows_sorted == natural.sort(dim=-1).values).all(dim=-1, keepdim=True)
    return torch.where(same_set, natural, rows_sorted)


def router_scores(logits: torch.Tensor) -> torch.Tensor:
    """``[N, E]``: the score threshold replay compares (the softmax of the fp32 logits), outside the autograd graph."""
    return torch.softmax(logits.detach().float(), dim=-1)


def replay_rule(
    replayed: torch.Tensor,
    own: torch.Tensor,
    logits: torch.Tensor,
    combine: CombineWeights,
    score_threshold: float = 0.0,
) -> ReplayChoice:
    """The ids and combine weights a router call uses: ``replayed`` ``[N, K]`` (compact or signed, "no route" rows
    allowed) against the router's ``own`` choice ``[N, K]`` (its natural top-k, or a steered choice), its ``logits``
    ``[N, E]`` and its family's normalisation ``combine`` (``(logits, ids) -> weights``).

    Device-side only (no host sync). With ``score_threshold=0`` it is replay as it always was, op for op."""
    ids, replaced, routed = _replay_ids(replayed, own, logits, score_threshold)
    return ReplayChoice(ids, combine(logits, ids), replaced, routed)


def _replay_ids(
    replayed: torch.Tensor, own: torch.Tensor, logits: torch.Tensor, score_threshold: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`replay_rule`'s choice of ids: (ids, replaced slots or None, routed tokens)."""
    routed = has_route(replayed)
    rows = replayed.to(own.dtype)
    if not score_threshold:
        return canonical_ids(torch.where(~routed[:, None], own, rows), own), None, routed
    rows = torch.where(routed[:, None], rows, own)
    scores = router_scores(logits)
    # the router's own top-k, best first (stable: equal scores keep the router's order)
    own_scores = scores.gather(1, own.long())
    order = own_scores.sort(dim=-1, descending=True, stable=True).indices
    ranked = own.gather(1, order)
    weakest = own_scores.min(dim=-1, keepdim=True).values
    keep = scores.gather(1, rows.long()) >= score_threshold * weakest
    keep |= ~routed[:, None]  # no route: the router's own choice, as without a threshold
    # refill: the i-th rejected slot of a token takes the i-th of its ranked experts not kept already (there are
    # enough: K distinct ranked experts, fewer than K - rejected of them among the kept ones)
    taken = ((ranked[:, :, None] == rows[:, None, :]) & keep[:, None, :]).any(dim=-1)
    free_first = taken.to(torch.int8).sort(dim=-1, stable=True).indices
    free = ranked.gather(1, free_first)
    rejected_rank = ((~keep).cumsum(dim=-1) - 1).clamp(min=0)
    ids = torch.where(keep, rows, free.gather(1, rejected_rank))
    return canonical_ids(ids, own), ~keep, routed
