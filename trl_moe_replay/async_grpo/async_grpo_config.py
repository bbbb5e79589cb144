"""``MoEReplayAsyncGRPOConfig``: TRL's ``AsyncGRPOConfig`` plus the routing-replay options of the async trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.config_checks import check_config
from ..core.routing_options import (
    ASYNC_TRAINER,
    ReplayMode,
    RoutingOptions,
    declare_defaults,
    default_routing_metrics,
    resolve_sync_check,
)
from ..upstream import AsyncGRPOConfig


@dataclass
class MoEReplayAsyncGRPOConfig(RoutingOptions, AsyncGRPOConfig):
    """``AsyncGRPOConfig`` with routing replay for Mixture-of-Experts models.

    The routing options both trainers have (``routing_replay``, ``routing_metrics``, ``extreme_token_threshold``,
    ``vllm_weight_sync``, ``vllm_sync_dir``, ``vllm_sync_check``) are declared once
    (``trl_moe_replay.core.routing_options.RoutingOptions``) and resolve alike; docs/async.md has the table of
    where this trainer differs, and why. Here:

    Parameters:
        routing_replay (`str`, *optional*, defaults to `"r3"`):
            `"r3"`: every training forward (and its backward recompute) routes each token by the experts the vLLM
            engine used when it sampled that token. `"none"`: TRL's `AsyncGRPOTrainer`, unchanged. R2 and PR2 replay
            the routes of an old-policy forward; TRL's async trainer has none (the sampler's log-probs are the old
            ones), so they are refused.
        routing_metrics (`bool`, *optional*):
            Carry the engine's routes and log `routing/*` (natural top-k of the trained weights vs the engine's
            routes) without replaying them. Defaults to on under R3, off under `"none"`.
        vllm_weight_sync (`str`, *optional*, defaults to `"auto"`):
            `"reload"`: write the weights as a checkpoint and have the server reload them
            (`trl_moe_replay.weight_sync.weight_reload.ReloadWeightTransfer`; works on vLLM's CPU build). `"trl"`: TRL's
            NCCL transfer (GPU). `"auto"`: reload when the trainer is not on CUDA (no CUDA, or `use_cpu`). A
            `weight_transfer=` passed to the trainer wins.
        vllm_sync_check (`bool`, *optional*):
            Score a fixed probe with the engine around every sync (`weight_sync/sync_check.py`, the same check as the
            sync trainer's): a sync that did not reach the engine, or engine weights that changed between syncs (a
            restarted server), end the run with a clear error; logs `vllm/sync_max_logprob_diff`. Defaults to on
            whenever routes are carried.
        sync_check_tolerance (`float`, *optional*, defaults to `0.05`):
            Nats the engine's probe log-probs may move between syncs (batch noise) before it counts as changed.
        vllm_request_attempts (`int`, *optional*):
            Caps the attempts of each generation request to the server (TRL retries a completion up to 30 x 3 times
            with back-off, ~20 minutes against a dead server). Only with routes carried (our rollout loop).
        max_route_fallback_steps (`int`, *optional*):
            Stop the run (`RoutesUnavailableError`) when every sample of this many steps in a row fell back to the
            trainer's own routing (`routing/fallback_frac` 1.0: the engine's routes stopped arriving). Unset: only a
            warning, after 3 such steps.
    """

    vllm_request_attempts: int | None = field(default=None, metadata={"help": "Cap on attempts per request."})
    max_route_fallback_steps: int | None = field(
        default=None, metadata={"help": "Stop after this many steps in a row without a usable engine route."}
    )

    def __post_init__(self):
        check_config(self, MoEReplayAsyncGRPOConfig)  # our fields strictly, TRL's as TRL takes them (config_checks)
        self.routing_replay = ReplayMode.parse(self.routing_replay, ASYNC_TRAINER)
        super().__post_init__()
        if self.routing_metrics is None:
            self.routing_metrics = default_routing_metrics(self.routing_replay)
        sync_check = resolve_sync_check(self, self.routing_replay, self.routing_metrics, ASYNC_TRAINER)
        if self.vllm_sync_check is None:
            self.vllm_sync_check = sync_check

    @property
    def carries_routes(self) -> bool:
        """Whether samples carry the engine's routes (R3, or routing metrics)."""
        return ReplayMode(self.routing_replay).replays or bool(self.routing_metrics)  # a ReplayMode after init


declare_defaults(MoEReplayAsyncGRPOConfig)
