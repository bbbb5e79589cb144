"""trl_moe_replay: stable RL for Mixture-of-Experts models with TRL (routing replay R2/R3, PR2, RSPO)."""

__version__ = "0.1.0.dev0"

from .routing import RouterReplay, RouteValidationError, UnsupportedModelError  # noqa: E402

__all__ = ["RouteValidationError", "RouterReplay", "UnsupportedModelError", "__version__"]
