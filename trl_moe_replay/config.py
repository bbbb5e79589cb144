"""``MoEReplayGRPOConfig``: TRL's ``GRPOConfig`` plus the routing-replay options."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

ROUTING_REPLAY_MODES = ("none", "r2", "r3")


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
            and training forwards and in their backward.
        replay_reference_model (`bool`, *optional*, defaults to `True`):
            Whether the reference model's forward (only when `beta != 0`) replays the same routes as the policy.
        extreme_token_threshold (`float`, *optional*, defaults to `2.0`):
            A completion token counts as extreme in `mismatch/extreme_frac` when its sampler/trainer probability
            ratio, either way, exceeds this value.
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

    def __post_init__(self):
        super().__post_init__()
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(
                f"routing_replay must be one of {ROUTING_REPLAY_MODES}, got {self.routing_replay!r}"
            )
        if self.extreme_token_threshold <= 1.0:
            raise ValueError(f"extreme_token_threshold must be > 1, got {self.extreme_token_threshold}")
