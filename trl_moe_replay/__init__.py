"""trl_moe_replay: stable RL for Mixture-of-Experts models with TRL (routing replay R2/R3, mismatch metrics)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING


__version__ = "0.1.0.dev0"

# The public names load on first use (PEP 562), so that `trl-moe-replay --help`, `trl-moe-replay plot` and
# `import trl_moe_replay.routing` do not pay for importing TRL (~15 s of CPU on a small machine).
# `from trl_moe_replay import MoEReplayGRPOTrainer` works exactly as with eager imports.
_PUBLIC = {
    "CheckpointError": "trl_moe_replay.checkpointing.checkpoint_files",
    "CheckpointWeightsError": "trl_moe_replay.checkpointing.checkpoint_weights",
    "DistributedCheckpointError": "trl_moe_replay.checkpointing.checkpoint_files",
    "LaunchMismatchError": "trl_moe_replay.core.launch",
    "MoEReplayAsyncGRPOConfig": "trl_moe_replay.async_grpo",
    "MoEReplayAsyncGRPOTrainer": "trl_moe_replay.async_grpo",
    "MoEReplayGRPOConfig": "trl_moe_replay.trainer",
    "MoEReplayGRPOTrainer": "trl_moe_replay.trainer",
    "OutputDirInUseError": "trl_moe_replay.core.output_lock",
    "RouteAlignmentError": "trl_moe_replay.routing",
    "RouteValidationError": "trl_moe_replay.routing",
    "RouterReplay": "trl_moe_replay.routing",
    "RoutesUnavailableError": "trl_moe_replay.rollouts",
    "TrlMoeReplayError": "trl_moe_replay.errors",
    "UnsupportedModelError": "trl_moe_replay.routing",
    "decode_routed_experts": "trl_moe_replay.routing",
    "encode_routed_experts": "trl_moe_replay.routing",
    "routes_from_engine": "trl_moe_replay.routing",
}

if TYPE_CHECKING:
    from .async_grpo import MoEReplayAsyncGRPOConfig, MoEReplayAsyncGRPOTrainer
    from .checkpointing.checkpoint_files import CheckpointError, DistributedCheckpointError
    from .checkpointing.checkpoint_weights import CheckpointWeightsError
    from .core.launch import LaunchMismatchError
    from .core.output_lock import OutputDirInUseError
    from .errors import TrlMoeReplayError
    from .rollouts import RoutesUnavailableError
    from .routing import (
        RouteAlignmentError,
        RouterReplay,
        RouteValidationError,
        UnsupportedModelError,
        decode_routed_experts,
        encode_routed_experts,
        routes_from_engine,
    )
    from .trainer import MoEReplayGRPOConfig, MoEReplayGRPOTrainer

__all__ = [
    "CheckpointError",
    "CheckpointWeightsError",
    "DistributedCheckpointError",
    "LaunchMismatchError",
    "MoEReplayAsyncGRPOConfig",
    "MoEReplayAsyncGRPOTrainer",
    "MoEReplayGRPOConfig",
    "MoEReplayGRPOTrainer",
    "OutputDirInUseError",
    "RouteAlignmentError",
    "RouteValidationError",
    "RouterReplay",
    "RoutesUnavailableError",
    "TrlMoeReplayError",
    "UnsupportedModelError",
    "__version__",
    "decode_routed_experts",
    "encode_routed_experts",
    "routes_from_engine",
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'trl_moe_replay' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
