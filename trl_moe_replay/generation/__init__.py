"""Generation backends that keep what R3 needs: the routes the engine used and its sampling log-probs."""

from .transformers import TransformersRolloutRecorder
from .vllm import RoutedExpertsVLLMClient, RoutesUnavailableError, VLLMRouteSource, server_command

__all__ = [
    "RoutedExpertsVLLMClient",
    "RoutesUnavailableError",
    "TransformersRolloutRecorder",
    "VLLMRouteSource",
    "server_command",
]
