"""Around a training run: the ``trl-moe-replay`` command (``commands``), the pre-training ``audit``, metric
``plotting``, and a compact ``progress`` bar for the recipes.

``main`` is the console script's entry point (``trl_moe_replay.cli:main``; ``python -m trl_moe_replay.cli`` runs it
too). ``commands`` imports ``audit`` and ``plotting`` only inside their sub-command.
"""

from .commands import main


__all__ = ["main"]
