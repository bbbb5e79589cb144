"""Generation backends that keep what R3 needs: the routes the engine used and its sampling log-probs."""

from .transformers import TransformersRolloutRecorder
from .vllm import CompletionRoutesHook, RoutesUnavailableError, VLLMRouteSource, llm_returning_routes, server_command

__all__ = [
    "CompletionRoutesHook",
    "RoutesUnavailableError",
    "TransformersRolloutRecorder",
    "VLLMRouteSource",
    "llm_returning_routes",
    "server_command",
]
