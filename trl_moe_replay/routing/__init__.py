"""Record and replay expert routes in Hugging Face MoE models.

Engine routes (vLLM's ``routed_experts``, SGLang's routed experts in the same layout) enter through
``decode_routed_experts`` and ``routes_from_engine``, which place them in TRL's padded token layout.
"""

from .codec import (
    EngineTurn,
    checked_routes_from_engine,
    decode_routed_experts,
    encode_routed_experts,
    engine_dtype,
    routes_from_engine,
)
from .errors import RouteAlignmentError, RouteValidationError, TransformersTooOldError, UnsupportedModelError
from .replay import RouterCall, RouteRecording, RouterReplay
from .router_probs import RouterProbes
from .routers import ROUTER_FAMILIES, RouterFamily, family_of
from .routes import (
    NO_ROUTE,
    NO_ROUTE_UINT8,
    CheckedRoutes,
    RouteLayout,
    check_routes,
    has_route,
    no_route_value,
    route_dtype,
    validate_routes,
)


__all__ = [
    "NO_ROUTE",
    "NO_ROUTE_UINT8",
    "CheckedRoutes",
    "EngineTurn",
    "ROUTER_FAMILIES",
    "RouteAlignmentError",
    "RouteLayout",
    "RouteRecording",
    "RouteValidationError",
    "RouterCall",
    "RouterFamily",
    "RouterProbes",
    "RouterReplay",
    "TransformersTooOldError",
    "UnsupportedModelError",
    "check_routes",
    "checked_routes_from_engine",
    "decode_routed_experts",
    "encode_routed_experts",
    "engine_dtype",
    "family_of",
    "has_route",
    "no_route_value",
    "route_dtype",
    "routes_from_engine",
    "validate_routes",
]
