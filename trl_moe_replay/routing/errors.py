"""Exceptions raised by the routing package.

Every error says what was expected, what came, and what to do; all route problems are
``ValueError`` subclasses so callers can catch bad input uniformly. ``TransformersChangedError`` (the installed
transformers no longer matches an entry of the seam) is the seam's, re-exported here with the others RouterReplay
raises.
"""

from ..errors import TrlMoeReplayError
from ..upstream.entries import TransformersChangedError


__all__ = [
    "RouteAlignmentError",
    "RouteValidationError",
    "TransformersChangedError",
    "TransformersTooOldError",
    "UnsupportedModelError",
]


class UnsupportedModelError(TrlMoeReplayError, ValueError):
    """The model has no MoE router of a supported family, or its routers cannot be replayed."""


class TransformersTooOldError(UnsupportedModelError):
    """The model's router family needs a newer transformers than the one installed (the message names it)."""


class RouteValidationError(TrlMoeReplayError, ValueError):
    """A routes tensor does not fit the model or the forward pass it is meant for."""


class RouteAlignmentError(RouteValidationError):
    """Engine route rows do not line up with the tokens of the sample they belong to.

    ``sample`` is the batch index of the offending sample when the problem is in one sample's rows (its
    message then starts with ``sample <i>:``), ``None`` when it concerns the whole call.
    """

    def __init__(self, message: str, sample: int | None = None):
        super().__init__(message)
        self.sample = sample
