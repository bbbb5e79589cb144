"""Generation backends that keep what R3 needs: the routes the engine used and its sampling log-probs."""

from .transformers import TransformersRolloutRecorder

__all__ = ["TransformersRolloutRecorder"]
