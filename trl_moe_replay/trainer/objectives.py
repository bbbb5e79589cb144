"""The trainer side of the MoE loss options: RSPO's router-shift weight with any loss, ``gspo``/``rspo`` on TRL's
loss, and ``minirl`` on TRL's loss code. The math lives in ``trl_moe_replay.trainer.losses``;
``MoEReplayGRPOTrainer`` holds them as a component (:class:`MoEObjectives`, ``_objectives``) and calls it from its
own overrides (``_get_per_token_logps_and_entropies``, ``get_gamma_weights``, ``log``). Every reliance on how TRL's
``_compute_loss`` is written is an entry of ``trl_moe_replay.upstream``.

* γ (seam entry ``old_logps_after_forward``): TRL builds every importance weight from
  ``per_token_logps - old_per_token_logps``, read right after the training forward. The trainer's ``_compute_loss``
  hands TRL a shallow copy of the micro-batch (``MicroBatch.inputs``, ``core/route_flow.py``), the training forward
  measures the current router at the old experts (``MoEObjectives.measuring_router_shift``), and before TRL reads it
  the copy's ``old_per_token_logps`` becomes ``old - log γ`` (``losses.shift_old_logps``): every TRL loss type then
  clips ``γ · ratio`` with its own code, and γ = 1 leaves TRL's computation bit for bit unchanged. The buffered batch itself is never modified.
* MiniRL (seam entry ``minirl_on_vespo``): its per-token loss ``-sg[M_t · min(π_θ/μ, C)] · Â · log π_θ`` is the
  form of TRL's ``vespo`` branch, whose weight TRL asks ``get_gamma_weights`` for. The trainer answers with MiniRL's
  weight, and TRL's code does the rest (forward, masks, KL term, aggregation, aux loss, entropy bonus, metrics).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core.metrics import global_sums
from ..core.route_flow import MicroBatch
from ..core.routing_options import option
from ..routing.router_probs import RouterProbes
from ..upstream import MINIRL_TRL_BRANCH, nanmax, nanmin, run_loss_on_trl_branch, set_old_logps_for_loss
from .grpo_config import MOE_LOSS_TYPES
from .losses import (
    completion_aligned,
    lower_quantile,
    minirl_token_weights,
    router_shift,
    router_shift_gamma,
    shift_old_logps,
)


# The TRL loss branch each of our names runs on: GSPO is TRL's "grpo" loss (mean over sequences of the per-sequence
# mean) with importance_sampling_level="sequence" (TRL's docs reproduce the GSPO paper this way); MiniRL is TRL's
# vespo branch with MiniRL's token weight.
_TRL_LOSS_FOR = {"gspo": "grpo", "rspo": "grpo", "minirl": MINIRL_TRL_BRANCH}
# TRL logs the vespo weight's mean under this name; under minirl it is MiniRL's weight, logged under ours.
_VESPO_WEIGHT_METRIC = "vespo/phi_seq_mean"


if TYPE_CHECKING:
    from trl import GRPOTrainer

    from ..routing import RouterReplay


@dataclass(frozen=True)
class MoEObjectives:
    """The loss options of one run, resolved once (:meth:`resolve`), and what the trainer asks of them: the old
    router's capture in the old-logprob pass, γ measured around the training forward, MiniRL's weight, its metric name.
    A component of ``MoEReplayGRPOTrainer`` (``_objectives``): its methods take the trainer, whose current
    :class:`~trl_moe_replay.core.route_flow.MicroBatch` (``_micro_batch``, set by its ``_compute_loss`` only while it
    runs) holds the loss inputs, the unshifted old log-probs and γ."""

    loss_type: str  # ours (gspo, rspo, minirl) or TRL's
    router_shift_weighting: bool = False
    router_shift_gamma_min: float = 0.0
    minirl_is_cap: float | None = None
    router_probes: RouterProbes | None = None  # the router's probabilities at the old experts (router-shift weighting)

    @classmethod
    def resolve(cls, trainer: GRPOTrainer, args: Any, route_replay: RouterReplay | None) -> MoEObjectives:
        """Call after ``GRPOTrainer.__init__``, with the trainer's ``RouterReplay`` (if any): TRL's loss branch set for
        ``args.loss_type`` (seam entry), the options read."""
        name = args.loss_type
        if name in MOE_LOSS_TYPES and not hasattr(args, "minirl_is_cap"):
            raise ValueError(f"loss_type={name!r} needs a MoEReplayGRPOConfig (it resolves that loss's defaults)")
        run_loss_on_trl_branch(trainer, _TRL_LOSS_FOR.get(name, name))
        weighting = bool(option(args, "router_shift_weighting"))
        # the weighting reads the router at the old experts: the trainer puts its hooks on for it (hooks_needed)
        assert route_replay is not None or not weighting
        return cls(
            loss_type=name,
            router_shift_weighting=weighting,
            router_shift_gamma_min=option(args, "router_shift_gamma_min"),
            minirl_is_cap=option(args, "minirl_is_cap"),
            router_probes=RouterProbes(route_replay) if route_replay is not None and weighting else None,
        )

    # ------------------------------------------------------------------ old-logprob pass
    def old_router_capture(self, batch: int, seq: int, is_old_pass: bool):
        """Context around one chunk's forward: in the old-logprob pass (with router-shift weighting), the old
        router's probabilities at the experts used; yields None otherwise."""
        probes = self.router_probes
        if probes is None or not is_old_pass:
            return contextlib.nullcontext()
        return probes.capture(batch, seq)

    # ------------------------------------------------------------------ training forward
    def with_router_shift(self, trainer: GRPOTrainer, micro: MicroBatch, forward: Callable) -> Callable:
        """TRL's ``forward`` (``_get_per_token_logps_and_entropies``) for the training forward of ``micro``: it also
        measures the router shift (:meth:`measuring_router_shift`)."""

        def measured(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            with self.measuring_router_shift(trainer, micro, input_ids, logits_to_keep):
                return forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

        return measured

    @contextlib.contextmanager
    def measuring_router_shift(
        self, trainer: GRPOTrainer, micro: MicroBatch, input_ids: torch.Tensor, logits_to_keep: int
    ) -> Iterator[None]:
        """Around the training forward of ``_compute_loss``: measure γ and hand it to the loss (in the micro-batch)."""
        if not self.router_shift_weighting:
            yield
            return
        inputs = micro.inputs
        old_ids = micro.held.per_sample.get("old_router_ids")  # held with the routes (route_flow step 4)
        if old_ids is None:
            # No old-logprob pass: TRL treats the batch as on-policy (old = current, detached), so the router has
            # not moved either: Δ = 0, γ = 1.
            yield
            delta = torch.zeros(input_ids.shape[0], logits_to_keep, device=input_ids.device)
        else:
            if old_ids.shape[:2] != input_ids.shape:
                raise ValueError(
                    f"old_router_ids {tuple(old_ids.shape)} do not match the forward's input_ids "
                    f"{tuple(input_ids.shape)}: they must be gathered by the micro-batch's route_rows"
                )
            probes = self.router_probes
            assert probes is not None  # built with router_shift_weighting
            with probes.at(old_ids) as reading:
                yield
            probs = reading.probs
            assert probs is not None  # set when at() exits
            old_probs = micro.held.per_sample["old_router_probs"].to(probs.device)
            per_position = router_shift(old_probs, probs, old_ids.to(probs.device))
            delta = completion_aligned(per_position, logits_to_keep)
        gamma = micro.gamma = router_shift_gamma(delta, self.router_shift_gamma_min)
        # MiniRL applies γ inside its own weight (get_gamma_weights): its ratio is not TRL's clipped one
        if self.loss_type != "minirl" and micro.old_logps is not None:
            set_old_logps_for_loss(inputs, shift_old_logps(micro.old_logps, gamma))
            if trainer.off_policy_mask_threshold is not None and "sampling_per_token_logps" not in inputs:
                # TRL's off-policy mask falls back to the old log-probs: keep it on the unshifted ones
                inputs["sampling_per_token_logps"] = micro.old_logps
        _log_router_shift(trainer, delta, gamma, _loss_mask(inputs), self.router_shift_gamma_min)

    # ------------------------------------------------------------------ minirl
    def minirl_weight(
        self, trainer: GRPOTrainer, micro: MicroBatch | None, advantages, log_ratio_per_token
    ) -> torch.Tensor:
        """MiniRL's detached token weight ``M_t · min(π_θ/μ, C)`` for the trainer's ``get_gamma_weights`` (TRL's vespo
        branch then forms ``-weight · Â · log π_θ``; seam entry ``minirl_on_vespo``)."""
        # _compute_loss holds the micro-batch while TRL's loss calls this; minirl's objectives carry its cap
        assert micro is not None and self.minirl_is_cap is not None
        inputs = micro.inputs
        sampling_logps = inputs.get("sampling_per_token_logps")
        if sampling_logps is None:
            raise RuntimeError(
                "loss_type='minirl' needs the rollout log-probs (sampling_per_token_logps) in the batch, and this "
                "batch has none: the generation path did not return them (a custom rollout_func without logprobs?)"
            )
        old_logps = inputs.get("old_per_token_logps")
        if old_logps is None:  # the config guarantees an old-logprob pass (importance-sampling correction on)
            raise RuntimeError(
                "loss_type='minirl' needs old_per_token_logps in the batch: TRL ran no old-logprob pass"
            )
        current = log_ratio_per_token.detach() + old_logps  # TRL: log_ratio = per_token_logps - old (unshifted here)
        weights = minirl_token_weights(
            current,
            log_ratio_per_token,
            sampling_logps,
            advantages,
            trainer.epsilon_low,
            trainer.epsilon_high,
            self.minirl_is_cap,
            gamma=micro.gamma,
        )
        _log_minirl(trainer, weights, _loss_mask(inputs))
        return weights.weight

    def rename_metrics(self, metrics: dict[str, defaultdict[str, list[float]]]) -> None:
        """Before the trainer logs: under ``minirl``, TRL's vespo metric is MiniRL's mean token weight."""
        if self.loss_type != "minirl":
            return
        for mode_metrics in metrics.values():
            if _VESPO_WEIGHT_METRIC in mode_metrics:
                mode_metrics["minirl/token_weight_mean"] = mode_metrics.pop(_VESPO_WEIGHT_METRIC)


def _log_router_shift(
    trainer: GRPOTrainer, delta: torch.Tensor, gamma: torch.Tensor, mask: torch.Tensor, gamma_min: float
) -> None:
    assert trainer.model is not None  # TRL's trainers always hold one (the Trainer's is Optional)
    mode = "train" if trainer.model.training else "eval"
    metrics = trainer._metrics[mode]
    valid = mask.bool()
    floored = torch.exp(-delta) < gamma_min
    sums = global_sums(
        trainer.accelerator,
        {
            "tokens": valid.sum(),
            "gamma": torch.where(valid, gamma, 0.0).sum(),
            "shift": torch.where(valid, delta, 0.0).sum(),
            "floored": (floored & valid).sum(),
        },
    )
    tokens = sums["tokens"].clamp(min=1.0)
    metrics["rspo/gamma_mean"].append((sums["gamma"] / tokens).item())
    metrics["rspo/shift_mean"].append((sums["shift"] / tokens).item())
    metrics["rspo/floor_frac"].append((sums["floored"] / tokens).item())
    # min and 10th percentile need the values themselves: gather them, padded to a common length with NaN
    values = torch.where(valid, gamma, torch.nan).flatten().float()
    values = trainer.accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
    values = trainer.accelerator.gather(values)
    metrics["rspo/gamma_min"].append(nanmin(values).item() if (~values.isnan()).any() else float("nan"))
    metrics["rspo/gamma_p10"].append(lower_quantile(values, 0.1).item())


def _log_minirl(trainer: GRPOTrainer, weights, mask: torch.Tensor) -> None:
    assert trainer.model is not None  # TRL's trainers always hold one (the Trainer's is Optional)
    mode = "train" if trainer.model.training else "eval"
    metrics = trainer._metrics[mode]
    valid = mask.bool()
    low, high = weights.low_clipped, weights.high_clipped
    sums = global_sums(
        trainer.accelerator,
        {
            "tokens": valid.sum(),
            "low": (low & valid).sum(),
            "high": (high & valid).sum(),
            "is_weight": torch.where(valid, weights.is_weight, 0.0).sum(),
            "truncated": (weights.truncated & valid).sum(),
        },
    )
    tokens = sums["tokens"].clamp(min=1.0)
    metrics["clip_ratio/low_mean"].append((sums["low"] / tokens).item())
    metrics["clip_ratio/high_mean"].append((sums["high"] / tokens).item())
    metrics["clip_ratio/region_mean"].append(((sums["low"] + sums["high"]) / tokens).item())
    per_seq = mask.sum(-1)  # like TRL: a sequence without valid tokens gives NaN, which nanmin/nanmax skip
    gather = trainer.accelerator.gather
    metrics["clip_ratio/low_min"].append(nanmin(gather((low * mask).sum(-1) / per_seq)).item())
    metrics["clip_ratio/high_max"].append(nanmax(gather((high * mask).sum(-1) / per_seq)).item())
    metrics["minirl/is_weight_mean"].append((sums["is_weight"] / tokens).item())
    metrics["minirl/is_truncated_frac"].append((sums["truncated"] / tokens).item())


def _loss_mask(inputs: dict) -> torch.Tensor:
    """TRL's loss mask: completion tokens, minus tool-output tokens."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]
