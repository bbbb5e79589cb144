"""Record and replay expert routes in Hugging Face MoE models."""

from .errors import RouteAlignmentError, RouteValidationError, UnsupportedModelError
from .replay import RouteRecording, RouterCall, RouterReplay
from .routers import ROUTER_FAMILIES, RouterFamily, family_of
from .routes import NO_ROUTE, validate_routes

__all__ = [
    "NO_ROUTE",
    "ROUTER_FAMILIES",
    "RouteAlignmentError",
    "RouteRecording",
    "RouteValidationError",
    "RouterCall",
    "RouterFamily",
    "RouterReplay",
    "UnsupportedModelError",
    "family_of",
    "validate_routes",
]
