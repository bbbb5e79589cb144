"""PR2's config fields, declared once: a dataclass mixin ``MoEReplayGRPOConfig`` inherits (as it inherits
``core.routing_options.RoutingOptions``). Their ranges are in ``core.config_checks.OWN_VALUE_RULES`` with every
other field's; a plain TRL config given to the trainer reads these defaults through ``core.routing_options.option``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.routing_options import RouteSource, declare_defaults


@dataclass
class PR2Options:
    """The ``pr2_*`` options of the sync trainer's config (the async trainer runs no PR2)."""

    pr2_lr_multiplier: float = field(
        default=1e3,
        metadata={"help": "PR2 predictor learning rate = learning_rate * this (paper: 50 to 1e4)."},
    )
    pr2_cached_tokens_per_sequence: int = field(
        default=2048,
        metadata={
            "help": "Completion tokens per sequence cached (evenly spaced) in the old-logprob pass to train the PR2 "
            "predictors."
        },
    )
    pr2_rollout_prediction: bool = field(
        default=False,
        metadata={
            "help": "PR2 on transformers generation: route generate itself with the predictors and replay those "
            "routes (the paper's full form)."
        },
    )

    def _check_pr2_mode(self) -> None:
        """Once ``routing_replay`` is parsed: ``pr2_rollout_prediction`` belongs to PR2."""
        config: Any = self  # routing_replay is a field of the config this mixes into
        if self.pr2_rollout_prediction and config.routing_replay.source is not RouteSource.PREDICTED:
            raise ValueError(f"pr2_rollout_prediction needs routing_replay='pr2', got {config.routing_replay!r}")

    def _check_pr2_generation(self) -> None:
        """Once the generation options are resolved: the predictors can steer transformers ``generate`` only."""
        config: Any = self  # use_vllm is TRL's field of the config this mixes into
        if self.pr2_rollout_prediction and config.use_vllm:
            raise ValueError(
                "pr2_rollout_prediction routes transformers `generate` with the predictors; vLLM cannot run them. "
                "Set use_vllm=False, or keep use_vllm and pr2_rollout_prediction=False (predicted routes are then "
                "chosen in the trainer's old-logprob pass)."
            )


declare_defaults(PR2Options)
