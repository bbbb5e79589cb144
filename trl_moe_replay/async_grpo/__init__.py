"""TRL's asynchronous GRPO trainer with R3, laid out like TRL's ``trl/experimental/async_grpo/``: the trainer
(``async_grpo_trainer``), its config (``async_grpo_config``), the packing of routed rows (``packing``) and the rollout
worker that keeps the engine's routes (``async_rollout_worker``). The shared core (the route intake, the route buffer,
replay settings, metrics) lives in ``trl_moe_replay.trainer``.

Names are loaded on first use: the rollout worker's spawned child imports ``async_rollout_worker`` by name, and should
not pay for the trainer.
"""

import importlib


_LAZY = {
    "MoEReplayAsyncGRPOConfig": "async_grpo_config",
    "MoEReplayAsyncGRPOTrainer": "async_grpo_trainer",
    "cpu_tree_attention": "async_grpo_trainer",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
