"""Where rollouts and their routes come from: the engines that generate, and the one intake of their route rows.

``route_intake`` (the one entry point from engine rows to replayable routes), ``hf_generate`` (transformers
``generate`` with a route recorder), ``vllm_routes`` (TRL's vLLM server and colocate modes, keeping vLLM's
``routed_experts``), ``route_stream`` (server mode: the payloads taken out of the response as it arrives),
``turns`` (routes of multi-turn rollouts) and ``tool_timeout`` (a time limit for a tool in TRL's tool loop). How the trainer's weights reach the engine is :mod:`trl_moe_replay.weight_sync`. Depends on
:mod:`trl_moe_replay.routing` and :mod:`trl_moe_replay.upstream` only.
"""

from .hf_generate import TransformersRolloutRecorder
from .route_intake import RouteIntake, RoutesUnavailableError
from .vllm_routes import (
    VLLMRouteSource,
    llm_returning_routes,
    server_command,
)


__all__ = [
    "RouteIntake",
    "RoutesUnavailableError",
    "TransformersRolloutRecorder",
    "VLLMRouteSource",
    "llm_returning_routes",
    "server_command",
]
