"""``MoEReplayAsyncGRPOConfig``: TRL's ``AsyncGRPOConfig`` plus the routing-replay options of the async trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from .config_checks import check_config

ASYNC_ROUTING_REPLAY_MODES = ("r3", "none")
ASYNC_WEIGHT_SYNC_METHODS = ("auto", "trl", "reload")


@dataclass
class MoEReplayAsyncGRPOConfig(AsyncGRPOConfig):
    """``AsyncGRPOConfig`` with routing replay for Mixture-of-Experts models.

    Parameters:
        routing_replay (`str`, *optional*, defaults to `"r3"`):
            `"r3"`: every training forward (and its backward recompute) routes each token by the experts the vLLM
            engine used when it sampled that token. `"none"`: TRL's `AsyncGRPOTrainer`, unchanged. R2 and PR2 replay
            the routes of an old-policy forward; TRL's async trainer has none (the sampler's log-probs are the old
            ones), so they are refused.
        routing_metrics (`bool`, *optional*):
            Carry the engine's routes and log `routing/*` (natural top-k of the trained weights vs the engine's
            routes) without replaying them. Defaults to on under R3, off under `"none"`.
        extreme_token_threshold (`float`, *optional*, defaults to `2.0`):
            A token counts in `mismatch/extreme_frac` when the trainer/sampler probability ratio exceeds this either
            way.
        vllm_weight_sync (`str`, *optional*, defaults to `"auto"`):
            `"reload"`: write the weights as a checkpoint and have the server reload them
            (`trl_moe_replay.engines.async_weights.ReloadWeightTransfer`; works on vLLM's CPU build). `"trl"`: TRL's
            NCCL transfer (GPU). `"auto"`: reload when the trainer is not on CUDA (no CUDA, or `use_cpu`). A
            `weight_transfer=` passed to the trainer wins.
        vllm_sync_dir (`str`, *optional*):
            Directory for the reload sync (default `output_dir/vllm_sync`); the server must be able to read it.
        vllm_sync_check (`bool`, *optional*):
            Score a fixed probe with the engine around every sync (`SyncGuard`): a sync that did not reach the engine,
            or engine weights that changed between syncs (a restarted server), end the run with a clear error; logs
            `vllm/sync_max_logprob_diff`. Defaults to on whenever routes are carried.
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

    routing_replay: str = field(default="r3", metadata={"help": "'r3' or 'none'."})
    routing_metrics: bool | None = field(default=None, metadata={"help": "Carry routes and log routing/* metrics."})
    extreme_token_threshold: float = field(default=2.0, metadata={"help": "Ratio threshold of mismatch/extreme_frac."})
    vllm_weight_sync: str = field(default="auto", metadata={"help": "'auto', 'trl' (NCCL) or 'reload'."})
    vllm_sync_dir: str | None = field(default=None, metadata={"help": "Directory of the reload sync."})
    vllm_sync_check: bool | None = field(default=None, metadata={"help": "Check every sync reached the engine."})
    sync_check_tolerance: float = field(default=0.05, metadata={"help": "Engine probe noise tolerance, in nats."})
    vllm_request_attempts: int | None = field(default=None, metadata={"help": "Cap on attempts per request."})
    max_route_fallback_steps: int | None = field(
        default=None, metadata={"help": "Stop after this many steps in a row without a usable engine route."})

    def __post_init__(self):
        check_config(self, MoEReplayAsyncGRPOConfig)  # our fields strictly, TRL's as TRL takes them (config_checks)
        if self.routing_replay in ("r2", "pr2"):
            raise ValueError(
                f"routing_replay={self.routing_replay!r} replays the routes of an old-policy forward, and TRL's "
                "AsyncGRPOTrainer runs none (the sampler's log-probs are the old ones; the only forward is the "
                "training one, which R2 would replay onto itself). Use 'r3' (the engine's routes) or 'none'."
            )
        if self.routing_replay not in ASYNC_ROUTING_REPLAY_MODES:
            raise ValueError(f"routing_replay must be one of {ASYNC_ROUTING_REPLAY_MODES}, got {self.routing_replay!r}")
        if self.vllm_weight_sync not in ASYNC_WEIGHT_SYNC_METHODS:
            raise ValueError(
                f"vllm_weight_sync must be one of {ASYNC_WEIGHT_SYNC_METHODS}, got {self.vllm_weight_sync!r}"
            )
        super().__post_init__()
        if self.routing_metrics is None:
            self.routing_metrics = self.routing_replay != "none"
        if self.vllm_sync_check is None:
            self.vllm_sync_check = self.carries_routes

    @property
    def carries_routes(self) -> bool:
        """Whether samples carry the engine's routes (R3, or routing metrics)."""
        return self.routing_replay != "none" or bool(self.routing_metrics)
