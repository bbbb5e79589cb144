"""trl_moe_replay: stable RL for Mixture-of-Experts models with TRL (routing replay R2/R3, mismatch metrics)."""

__version__ = "0.1.0.dev0"

from .config import MoEReplayGRPOConfig  # noqa: E402
from .generation.vllm import RoutesUnavailableError  # noqa: E402
from .launch import LaunchMismatchError  # noqa: E402
from .output_lock import OutputDirInUseError  # noqa: E402
from .routing import (  # noqa: E402
    RouteAlignmentError,
    RouterReplay,
    RouteValidationError,
    UnsupportedModelError,
    decode_routed_experts,
    encode_routed_experts,
    routes_from_engine,
)
from .trainer import MoEReplayGRPOTrainer  # noqa: E402

__all__ = [
    "LaunchMismatchError",
    "MoEReplayGRPOConfig",
    "MoEReplayGRPOTrainer",
    "OutputDirInUseError",
    "RouteAlignmentError",
    "RouteValidationError",
    "RouterReplay",
    "RoutesUnavailableError",
    "UnsupportedModelError",
    "__version__",
    "decode_routed_experts",
    "encode_routed_experts",
    "routes_from_engine",
]
