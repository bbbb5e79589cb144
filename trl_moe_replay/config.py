"""``MoEReplayGRPOConfig``: TRL's ``GRPOConfig`` plus the routing-replay options."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

ROUTING_REPLAY_MODES = ("none", "r2", "r3", "pr2")


@dataclass
class MoEReplayGRPOConfig(GRPOConfig):
    r"""
    Configuration for [`MoEReplayGRPOTrainer`]: every [`~trl.GRPOConfig`] field plus the options below.

    Parameters:
        routing_replay (`str`, *optional*, defaults to `"r3"`):
            Which expert routes the trainer's forward passes replay. `"none"`: plain GRPO routing (metrics are still
            logged). `"r2"`: the old policy's routes, recorded in the trainer's old-logprob pass, replayed in the later
            updates of that generation batch. `"r3"`: the routes the inference engine used while sampling (transformers
            `generate` here; vLLM's `routed_experts` in server/colocate mode), replayed in the old-logprob, reference
            and training forwards and in their backward. `"pr2"`: Predictive Routing Replay: R2 with each route
            chosen from the router logits plus a learned per-router linear predictor of their drift (routes
            recorded in the old-logprob pass, or in `generate` with `pr2_rollout_prediction`).
        replay_reference_model (`bool`, *optional*, defaults to `True`):
            Whether the reference model's forward (only when `beta != 0`) replays the same routes as the policy.
        extreme_token_threshold (`float`, *optional*, defaults to `2.0`):
            A completion token counts as extreme in `mismatch/extreme_frac` when its sampler/trainer probability
            ratio, either way, exceeds this value.
        pr2_lr_multiplier (`float`, *optional*, defaults to `1e3`):
            PR2 predictors train with learning rate `learning_rate * pr2_lr_multiplier` (their own optimizer
            group, no weight decay). The paper sweeps 50 to 1e4 (1e3 for Qwen3-30B off-4/off-8 and OLMoE).
        pr2_cached_tokens_per_sequence (`int`, *optional*, defaults to `2048`):
            Completion tokens per sequence whose router inputs and old logits the old-logprob pass caches for the
            predictor loss, evenly spaced along the completion (the paper's T_c for Qwen3-30B). Longer completions
            are subsampled, shorter ones kept whole.
        pr2_rollout_prediction (`bool`, *optional*, defaults to `False`):
            The paper's full form, transformers generation only: `generate` itself routes with the predictors and
            those routes are replayed in the old-logprob and training forwards (otherwise the predicted routes are
            chosen in the old-logprob pass, which works with every generation backend).
    """

    routing_replay: str = field(
        default="r3",
        metadata={
            "help": "Expert routes replayed in training forwards: 'none', 'r2' (old-policy routes) or 'r3' "
            "(rollout routes from the inference engine).",
            "choices": list(ROUTING_REPLAY_MODES),
        },
    )
    replay_reference_model: bool = field(
        default=True,
        metadata={"help": "Whether the reference model's forward (beta != 0) replays the same routes as the policy."},
    )
    extreme_token_threshold: float = field(
        default=2.0,
        metadata={
            "help": "A completion token is 'extreme' (mismatch/extreme_frac) when its sampler/trainer probability "
            "ratio, either way, exceeds this value."
        },
    )

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

    def __post_init__(self):
        super().__post_init__()
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(
                f"routing_replay must be one of {ROUTING_REPLAY_MODES}, got {self.routing_replay!r}"
            )
        if self.extreme_token_threshold <= 1.0:
            raise ValueError(f"extreme_token_threshold must be > 1, got {self.extreme_token_threshold}")
        if self.pr2_lr_multiplier < 0:
            raise ValueError(f"pr2_lr_multiplier must be >= 0, got {self.pr2_lr_multiplier}")
        if self.pr2_cached_tokens_per_sequence < 1:
            raise ValueError(f"pr2_cached_tokens_per_sequence must be >= 1, got {self.pr2_cached_tokens_per_sequence}")
        if self.pr2_rollout_prediction and self.routing_replay != "pr2":
            raise ValueError(f"pr2_rollout_prediction needs routing_replay='pr2', got {self.routing_replay!r}")
        if self.pr2_rollout_prediction and self.use_vllm:
            raise ValueError(
                "pr2_rollout_prediction routes transformers `generate` with the predictors; vLLM cannot run them. "
                "Set use_vllm=False, or keep use_vllm and pr2_rollout_prediction=False (predicted routes are then "
                "chosen in the trainer's old-logprob pass)."
            )
