"""Policy-loss math for MoE RL: RSPO's router-shift weight, GSPO's sequence ratio and the MiniRL objective.

Pure tensor functions, no trainer state; the trainer (``trl_moe_replay.trainer.objectives``) wires them into TRL's
loss.
Shapes: ``B`` completions, ``S = P + C`` input positions (prompt + completion, TRL's padded layout), ``C``
completion tokens, ``L`` decoder layers, ``K`` experts per token. Per-token tensors are ``[B, C]``; advantages are
``[B, 1]`` (or ``[B, C]``).

Position convention: the log-prob of completion token ``t`` comes from the forward at input position ``P + t - 1``
(TRL scores ``input_ids[:, -C:]`` with the logits one position earlier), so the routing that shaped token ``t`` is
the routing at position ``P + t - 1``: :func:`completion_aligned` picks those ``C`` positions out of ``S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..routing.routes import has_route


# ---------------------------------------------------------------------------------------------- RSPO router shift
def router_shift(old_probs: torch.Tensor, current_probs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """RSPO's router shift Δ per position: ``mean_l mean_k |log r_cur(e_lk) - log r_old(e_lk)|``.

    ``expert_ids`` ``[B, S, L, K]`` are the experts the old policy used (``-1``: no route, e.g. a dense layer);
    ``old_probs`` are the old router's probabilities at those experts as stored (half precision) and
    ``current_probs`` the current router's at the same experts. Layers without a route are left out of the mean;
    a position without any route has Δ = 0.

    Both sides are compared at the stored precision (``current_probs`` is rounded to ``old_probs.dtype``), so an
    unchanged router gives exactly Δ = 0, and probabilities are floored at the dtype's smallest normal number
    (below it half precision has no relative accuracy, and ``log 0`` would be infinite). Returns ``[B, S]`` float32.
    """
    if not old_probs.shape == current_probs.shape == expert_ids.shape or old_probs.dim() != 4:
        raise ValueError(
            "router_shift expects old_probs, current_probs and expert_ids of one shape [B, S, L, K]; got "
            f"{tuple(old_probs.shape)}, {tuple(current_probs.shape)}, {tuple(expert_ids.shape)}"
        )
    floor = torch.finfo(old_probs.dtype).smallest_normal
    valid = has_route(expert_ids)[..., None].expand_as(expert_ids)
    old_log = old_probs.float().clamp(min=floor).log()
    current_log = current_probs.detach().to(old_probs.dtype).float().clamp(min=floor).log()
    per_expert = torch.where(valid, (current_log - old_log).abs(), 0.0)
    experts = valid.sum(dim=-1)  # [B, S, L]: K on MoE layers, 0 on dense ones
    per_layer = per_expert.sum(dim=-1) / experts.clamp(min=1)
    routed = experts > 0
    return (per_layer * routed).sum(dim=-1) / routed.sum(dim=-1).clamp(min=1)


def router_shift_gamma(delta: torch.Tensor, gamma_min: float) -> torch.Tensor:
    """RSPO's weight ``γ = sg[max(exp(-Δ), γ_min)]`` in ``[γ_min, 1]``; detached: no gradient reaches the router."""
    return torch.exp(-delta.detach()).clamp(min=gamma_min)


def completion_aligned(per_position: torch.Tensor, completion_length: int) -> torch.Tensor:
    """``[B, S, ...] -> [B, C, ...]``: the value at the position whose forward scored each completion token.

    Completion token ``t`` sits at position ``P + t``; its log-prob comes from position ``P + t - 1``.
    """
    if not 0 < completion_length < per_position.shape[1]:
        raise ValueError(
            f"completion_length must be in [1, S) for S={per_position.shape[1]} positions; got {completion_length}"
        )
    return per_position[:, -completion_length - 1 : -1]


def shift_old_logps(old_per_token_logps: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Old log-probs that make TRL's ratio come out rescaled by ``γ``: ``exp(logp - (old - log γ)) = γ · ratio``.

    TRL forms every importance weight from ``log_ratio = per_token_logps - old_per_token_logps`` (token level:
    ``exp(log_ratio)``; sequence level: ``exp(mean_t log_ratio)``, i.e. GSPO's ``s̃ = exp(mean_t log(γ_t w_t))``),
    so shifting the old log-probs by ``log γ`` applies γ before every loss type's clipping, unchanged. γ = 1 leaves
    them bit for bit.
    """
    return old_per_token_logps - gamma.detach().log().to(old_per_token_logps.dtype)


# ---------------------------------------------------------------------------------------------- GSPO / clipping
def sequence_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio ``(1/|y|) Σ_t log w_t`` over valid tokens, ``[B, 1]``."""
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> torch.Tensor:
    """PPO's per-token loss ``-min(w Â, clip(w, 1-ε_low, 1+ε_high) Â)`` (TRL's grpo/dapo/... branch)."""
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages)


def clip_masks(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens clipped on the low side (``w < 1-ε_low`` with ``Â < 0``) and the high side (``w > 1+ε_high``, ``Â > 0``):
    exactly the tokens whose gradient the clipped surrogate (or MiniRL's mask) removes. TRL's ``clip_ratio/*``."""
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return low, high


# ---------------------------------------------------------------------------------------------- MiniRL
@dataclass
class MiniRLWeights:
    """What :func:`minirl_token_weights` computes, all ``[B, C]``."""

    weight: torch.Tensor
    """``M_t · min(π_θ/μ, cap)``, detached: the per-token loss is ``-weight · Â · log π_θ``."""
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    is_weight: torch.Tensor
    """The truncated rollout importance weight ``min(π_θ/μ, cap)`` (detached)."""
    truncated: torch.Tensor
    """Tokens whose weight hit the cap."""


def minirl_token_weights(
    per_token_logps: torch.Tensor,
    log_ratio: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    is_cap: float,
    gamma: torch.Tensor | None = None,
) -> MiniRLWeights:
    """The token weight of the MiniRL objective (Zheng et al. 2025, "Stabilizing RL with LLMs", Eq. 7).

    ``J = Σ_t M_t · sg[π_θ(y_t)/μ(y_t)] · Â · log π_θ(y_t)``: a REINFORCE term with the token-level importance weight
    with respect to the rollout policy μ (``sampling_per_token_logps``), truncated at ``is_cap`` (TIS) and inside a
    stop-gradient, and the decoupled-PPO mask ``M_t`` on the ratio to the old policy ``r_t = exp(log_ratio)``:
    ``M_t = 0`` where ``Â > 0`` and ``r_t > 1 + ε_high`` or ``Â < 0`` and ``r_t < 1 - ε_low``. Its gradient is
    ``weight · Â · ∇log π_θ`` with ``weight = M_t · min(π_θ/μ, cap)``. With ``gamma`` (RSPO's router-shift weight)
    both ratios are rescaled by γ before the mask and the truncation. A NaN rollout log-prob (vLLM could not score
    the token) gets weight 1, as in TRL.
    """
    current = per_token_logps.detach()
    ratio = torch.exp(log_ratio.detach())
    rollout_log_ratio = torch.nan_to_num(current - sampling_per_token_logps, nan=0.0)
    is_weight = torch.exp(rollout_log_ratio)
    if gamma is not None:
        ratio = ratio * gamma.detach()
        is_weight = is_weight * gamma.detach()
    truncated = is_weight > is_cap
    is_weight = is_weight.clamp(max=is_cap)
    low, high = clip_masks(ratio, advantages, epsilon_low, epsilon_high)
    keep = (~(low | high)).to(is_weight.dtype)
    return MiniRLWeights(
        weight=keep * is_weight, low_clipped=low, high_clipped=high, is_weight=is_weight, truncated=truncated
    )


# ---------------------------------------------------------------------------------------------- metrics
def lower_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q``-quantile (linear interpolation, like ``torch.quantile``) of the non-NaN ``values``; NaN if none.

    Sorts instead of calling ``torch.quantile``, which refuses inputs over 16M elements.
    """
    values = values.flatten()
    values = values[~torch.isnan(values)]
    if values.numel() == 0:
        return torch.tensor(float("nan"), device=values.device)
    ordered = values.float().sort().values
    position = q * (ordered.numel() - 1)
    below = int(position)
    above = min(below + 1, ordered.numel() - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
