"""The trainer side: ``MoEReplayGRPOTrainer`` (a ``trl.GRPOTrainer`` subclass), its config, losses and metrics.

PR2 sits beside it in :mod:`trl_moe_replay.pr2` (mixed in). Depends on :mod:`trl_moe_replay.routing` (replay,
route layout), :mod:`trl_moe_replay.rollouts` (where rollouts and their routes come from) and
:mod:`trl_moe_replay.upstream` (every private upstream name); nothing below depends on it.
"""

from .grpo_config import MoEReplayGRPOConfig
from .grpo_trainer import MoEReplayGRPOTrainer


__all__ = ["MoEReplayGRPOConfig", "MoEReplayGRPOTrainer"]
