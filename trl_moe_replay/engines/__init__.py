"""Generation backends that keep what R3 needs: the routes the engine used and its sampling log-probs.

``route_intake`` (the one entry point from engine rows to replayable routes), ``hf_generate`` (transformers ``generate`` with a route recorder), ``vllm_routes`` (TRL's vLLM server and colocate
modes, keeping vLLM's ``routed_experts``), ``weight_reload`` / ``vllm_weights`` (the reload weight sync into vLLM, for
both trainers), ``sync_check`` (the engine sync check, for both trainers), ``server_requests`` (requests to a vLLM
server outside TRL's client) and ``turns`` (routes of multi-turn rollouts). Depends on :mod:`trl_moe_replay.routing` and :mod:`trl_moe_replay.upstream` only.
"""

from .hf_generate import TransformersRolloutRecorder
from .route_intake import RouteIntake, RoutesUnavailableError
from .vllm_routes import (
    CompletionRoutesHook,
    VLLMRouteSource,
    llm_returning_routes,
    server_command,
)


__all__ = [
    "CompletionRoutesHook",
    "RouteIntake",
    "RoutesUnavailableError",
    "TransformersRolloutRecorder",
    "VLLMRouteSource",
    "llm_returning_routes",
    "server_command",
]
