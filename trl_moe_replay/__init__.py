"""trl_moe_replay: stable RL for Mixture-of-Experts models with TRL (routing replay R2/R3, mismatch metrics)."""

__version__ = "0.1.0.dev0"

from .routing import RouterReplay, RouteValidationError, UnsupportedModelError  # noqa: E402
from .trainer import MoEReplayGRPOConfig, MoEReplayGRPOTrainer  # noqa: E402

__all__ = [
    "MoEReplayGRPOConfig",
    "MoEReplayGRPOTrainer",
    "RouteValidationError",
    "RouterReplay",
    "UnsupportedModelError",
    "__version__",
]
