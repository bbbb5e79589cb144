"""Training-inference mismatch and routing-agreement metrics: one implementation for both trainers.

Each ``*_sums`` function returns *sums and counts* (0-dim tensors) rather than means, so that they are added up
across ranks before dividing (a mean of per-rank means would weight ranks with few tokens too much);
:func:`log_ratio_metrics` does that and appends the ``mismatch/*`` and ``routing/*`` values to TRL's metric lists.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..routing.routes import has_route


def check_extreme_threshold(threshold: float, name: str = "extreme_token_threshold") -> float:
    """``threshold`` if it is a usable extreme-token ratio threshold (a finite number > 1), else ``ValueError``.

    A token is extreme when its probability ratio exceeds the threshold either way, so a threshold <= 1 makes every
    token extreme, and NaN none (every comparison with NaN is false).
    """
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not math.isfinite(threshold)
        or threshold <= 1
    ):
        raise ValueError(
            f"{name} must be a finite probability ratio > 1 (2: a token is extreme when the trainer's and the "
            f"sampler's probabilities differ more than 2x), got {threshold!r}"
        )
    return threshold


def logprob_mismatch_sums(
    sampling_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor, extreme_threshold: float
) -> dict[str, torch.Tensor]:
    """Sums over valid completion tokens of the sampler-vs-trainer divergences.

    With ``log_ratio = trainer - sampling`` (tokens were drawn from the sampler):
    ``kl_k1 = -log_ratio`` (unbiased estimator of KL(sampler || trainer)), ``kl_k3 = exp(log_ratio) - 1 - log_ratio``
    (its low-variance, non-negative estimator), and a token is *extreme* when the probability ratio exceeds the
    threshold either way: ``|log_ratio| > log(threshold)``. NaN sampling log-probs (vLLM sends None for some) are
    excluded.
    """
    valid = mask.bool() & ~torch.isnan(sampling_logps)
    log_ratio = torch.where(valid, trainer_logps.float() - sampling_logps.float(), 0.0)
    return {
        "kl_k1": (-log_ratio).sum(),
        "kl_k3": (torch.expm1(log_ratio) - log_ratio).sum(),
        "extreme": (log_ratio.abs() > math.log(extreme_threshold)).logical_and(valid).sum().float(),
        "tokens": valid.sum().float(),
    }


def routing_agreement_sums(
    natural: torch.Tensor, replayed: torch.Tensor, positions: torch.Tensor, moe_layers: list[int]
) -> dict[str, torch.Tensor]:
    """Sums comparing the trainer's natural top-k with the replayed (or reference) routes.

    ``natural`` and ``replayed`` are ``[B, S, L, K]``; ``positions`` is a ``[B, S]`` bool mask of the positions
    to judge. Pairs are (position, MoE layer). A position without a replayed route (``-1``) counts as a fallback
    and is left out of the agreement sums.
    """
    routed = has_route(replayed[:, :, moe_layers]).to(natural.device)  # [B, S, L]
    natural = natural[:, :, moe_layers].long()
    replayed = replayed[:, :, moe_layers].to(natural.device).long()
    positions = positions.to(natural.device).bool()
    judged = routed & positions[..., None]
    # |natural ∩ replayed| per pair: ids within a row are distinct, so count equal pairs across the k x k grid
    overlap = (natural[..., :, None] == replayed[..., None, :]).sum(dim=(-1, -2))
    k = natural.shape[-1]
    differs = (overlap < k) & judged
    return {
        "pairs": judged.sum().float(),
        "mismatch_pairs": differs.sum().float(),
        "overlap": torch.where(judged, overlap, 0).sum().float() / k,
        "tokens": judged.any(dim=-1).sum().float(),
        "tokens_any_mismatch": differs.any(dim=-1).sum().float(),
        "positions": positions.sum().float(),
        "fallback_positions": (positions & ~routed.all(dim=-1)).sum().float(),
    }


def fallback_sums(replayed: torch.Tensor, positions: torch.Tensor, moe_layers: list[int]) -> dict[str, torch.Tensor]:
    """The two fallback sums of ``routing_agreement_sums``, for when there is no natural routing to compare."""
    routed = has_route(replayed[:, :, moe_layers]).all(dim=-1)  # [B, S]
    positions = positions.to(routed.device).bool()
    return {"positions": positions.sum().float(), "fallback_positions": (positions & ~routed).sum().float()}


def routable_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions an engine can have routed: real tokens except each sequence's final one (never fed forward)."""
    mask = attention_mask.bool()
    last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(dim=-1)  # index of each row's last real token
    is_last = torch.zeros_like(mask)
    is_last[torch.arange(mask.shape[0]), last] = True
    return mask & ~is_last


# metric name -> (numerator, denominator) among the sums above
MISMATCH_RATIOS = {
    "mismatch/kl_k1": ("kl_k1", "tokens"),
    "mismatch/kl_k3": ("kl_k3", "tokens"),
    "mismatch/extreme_frac": ("extreme", "tokens"),
}
AGREEMENT_RATIOS = {
    "routing/mismatch_frac": ("mismatch_pairs", "pairs"),
    "routing/token_any_mismatch": ("tokens_any_mismatch", "tokens"),
    "routing/topk_agreement": ("overlap", "pairs"),
}
# threshold replay (routing/replay_rule.py): replaced / routed (position, MoE layer, slot) choices, and per layer
REPLACE_RATE = "routing/replace_rate"
# fallback_samples / samples: RouteIntake.take_sample_sums() (samples none of whose turns could be placed), which
# both trainers add to the sums they log these with
FALLBACK_RATIOS = {
    "routing/fallback_frac": ("fallback_positions", "positions"),
    "routing/fallback_samples_frac": ("fallback_samples", "samples"),
}


def global_sums(accelerator: Any, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sums`` added up over every process (one gather of them all)."""
    names = list(sums)
    stacked = torch.stack([sums[name].float().to(accelerator.device) for name in names])
    gathered = accelerator.gather(stacked[None]).sum(dim=0)
    return dict(zip(names, gathered, strict=True))


def log_ratio_metrics(
    metrics: dict[str, list],
    accelerator: Any,
    sums: dict[str, torch.Tensor],
    ratios: dict[str, tuple[str, str]],
    *,
    as_rate: bool = False,
) -> None:
    """Append each of ``ratios`` (name -> numerator, denominator among ``sums``), summed over processes, to TRL's
    metric lists: the value, or with ``as_rate`` the (numerator, denominator) pair that the async trainer's ``log``
    reduces as a rate over the logging window. Nothing counted (denominator 0) is NaN, never 0.0 (which reads as a
    perfect score): TRL's ``log`` leaves NaN out of a window's average, and a window of no data logs ``None``."""
    total = global_sums(accelerator, sums)
    for name, (numerator, denominator) in ratios.items():
        count = total[denominator].item()
        if count <= 0:
            metrics[name].append(math.nan)
        elif as_rate:
            metrics[name].append((total[numerator].item(), count))
        else:
            metrics[name].append((total[numerator] / total[denominator]).item())
