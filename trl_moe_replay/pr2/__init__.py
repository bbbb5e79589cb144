"""PR2 (Predictive Routing Replay, ``routing_replay="pr2"``) beside the sync trainer, PEFT-style.

* ``options``: its config fields (``PR2Options``, a dataclass mixin of ``MoEReplayGRPOConfig``);
* ``predictor``: the route predictors and their loss;
* ``state``: one run's PR2 state (``PredictiveRoutingReplay``: predicted routes, cache, loss, checkpoint file);
* ``trainer_mixin``: ``PR2TrainerMixin``, which ``MoEReplayGRPOTrainer`` mixes in and calls at a few named points.

Depends on :mod:`trl_moe_replay.core`, :mod:`~trl_moe_replay.routing`, :mod:`~trl_moe_replay.parallel` and
:mod:`~trl_moe_replay.upstream`; only the trainer (and the package's entry points) import it.
"""

from .state import PREDICTORS_FILE, PR2CheckpointError, PR2StateError, PredictiveRoutingReplay


__all__ = ["PREDICTORS_FILE", "PR2CheckpointError", "PR2StateError", "PredictiveRoutingReplay"]
