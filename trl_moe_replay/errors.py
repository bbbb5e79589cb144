"""The one base of every exception the package defines.

``except TrlMoeReplayError`` catches any refusal of the package, whichever part raised it. Each error keeps its
built-in base too (``class RouteValidationError(TrlMoeReplayError, ValueError)``), so ``except ValueError`` and the
like keep working. Every part of the package may import this module; it imports nothing.
"""

__all__ = ["TrlMoeReplayError"]


class TrlMoeReplayError(Exception):
    """The base of every exception ``trl_moe_replay`` defines; subclasses also derive from the built-in error they
    are (``ValueError``, ``RuntimeError``, ``FileNotFoundError``, ...)."""
