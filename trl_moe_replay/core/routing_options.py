"""The routing options both trainers share: the replay mode as a type, the options declared once, resolved once.

* :class:`ReplayMode` is ``routing_replay``: a ``str`` naming a mode of the registry (``core/replay_modes.py``, where
  each mode is one declaration of what it implies; YAML, the command line and ``"r3"`` in Python all work, and
  ``to_dict()``/JSON write the plain string).
* :class:`RoutingOptions` declares the options both configs have, each with one default and one help text; both
  ``MoEReplayGRPOConfig`` and ``MoEReplayAsyncGRPOConfig`` inherit it.
* :class:`ReplaySettings` is one run's options resolved from a config (ours, or TRL's plain one with our defaults):
  what a trainer reads, instead of restating defaults at each ``getattr``.
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from ..weight_sync.sync_check import SYNC_CHECK_TOLERANCE, SyncCheckUnavailableError
from ..weight_sync.weight_reload import WeightSyncMethod
from .replay_modes import MODE_NAMES, ReplayMode, RouteSource, TrainerKind


SYNC_TRAINER = TrainerKind.SYNC
ASYNC_TRAINER = TrainerKind.ASYNC
MODES = MODE_NAMES  # the registered modes' names (core/replay_modes.py), read live
WEIGHT_SYNC_METHODS = ("auto", "trl", "reload")


@dataclass
class RoutingOptions:
    """The routing options of both configs (a dataclass mixin: one declaration, one default, one help text)."""

    routing_replay: str = field(
        default="r3",
        metadata={
            "help": "Expert routes replayed in training forwards: 'none', 'r2' (old-policy routes), 'r3' (rollout "
            "routes from the inference engine) or 'pr2' (predicted routes, Predictive Routing Replay). The async "
            "trainer takes 'r3' and 'none'.",
            "choices": MODES,
        },
    )
    replay_score_threshold: float = field(
        default=0.0,
        metadata={
            "help": "Threshold replay, in [0, 1], with a mode that replays (r2, r3, pr2): a replayed expert is "
            "kept only where the trainer's router score for it is >= this x the router's weakest top-k score "
            "for that token; a rejected slot takes the router's own best expert not chosen yet. 0: replay as "
            "it is. Logs routing/replace_rate."
        },
    )
    routing_metrics: bool | None = field(
        default=None,
        metadata={
            "help": "Log routing/* agreement between engine and trainer. Unset: on with r2/r3/pr2, off with "
            "'none' (plain TRL, no hooks)."
        },
    )
    extreme_token_threshold: float = field(
        default=2.0,
        metadata={
            "help": "A completion token is 'extreme' (mismatch/extreme_frac) when its sampler/trainer "
            "probability ratio, either way, exceeds this value."
        },
    )
    vllm_weight_sync: str = field(
        default="auto",
        metadata={
            "help": "How weights reach vLLM: 'trl' (TRL's sync), 'reload' (vLLM's reload_weights with checkpoint "
            "names; works on vLLM's CPU build), 'auto' ('reload' when training on a CPU, except the sync trainer "
            "under 'none', which stays plain TRL; else 'trl').",
            "choices": list(WEIGHT_SYNC_METHODS),
        },
    )
    vllm_sync_dir: str | None = field(
        default=None,
        metadata={
            "help": "vllm_weight_sync='reload' with a server: directory the server reads the weights from. "
            "Unset: <output_dir>/_vllm_sync (push_to_hub leaves out names that start with _)."
        },
    )
    vllm_sync_check: bool | None = field(
        default=None,
        metadata={
            "help": "Around each weight sync, score a fixed probe with the engine and the trainer: log "
            "vllm/sync_max_logprob_diff, and stop a run whose sync did not arrive or whose engine changed "
            "between syncs. Unset: on wherever a vLLM engine samples the routes the trainer carries."
        },
    )

    sync_check_tolerance: float = field(
        default=SYNC_CHECK_TOLERANCE,
        metadata={
            "help": "Nats the engine's probe log-probs may move with unchanged weights (batch noise) before the "
            "sync check counts it as a change."
        },
    )

    def to_dict(self) -> dict[str, Any]:
        """TrainingArguments' ``to_dict``, with ``routing_replay`` as the plain string it names (it writes an enum's
        value, and a ``ReplayMode`` is a ``str``, not an enum)."""
        values = super().to_dict()  # type: ignore[misc]  # TrainingArguments', the class this mixes into
        if "routing_replay" in values:
            values["routing_replay"] = str(values["routing_replay"])
        return values


_DEFAULTS = {f.name: f.default for f in fields(RoutingOptions) if f.default is not MISSING}


def declare_defaults(config: type) -> None:
    """Let :func:`option` fall back to the defaults ``config`` declares for fields of its own (neither inherited
    nor overriding a base's): ``MoEReplayGRPOConfig`` adds its sync-only fields (PR2's, RSPO's, MiniRL's), which a
    plain TRL config given to the sync trainer lacks."""
    inherited = {f.name for base in config.__mro__[1:] if is_dataclass(base) for f in fields(base)}
    own = set(inspect.get_annotations(config)) - inherited
    _DEFAULTS.update({f.name: f.default for f in fields(config) if f.name in own and f.default is not MISSING})


def option(args: Any, name: str) -> Any:
    """``args.name``, or the option's declared default for a config that lacks it (TRL's plain configs)."""
    return getattr(args, name, _DEFAULTS[name])


def default_routing_metrics(mode: ReplayMode) -> bool:
    return mode.replays


def resolve_sync_check(args: Any, mode: ReplayMode, routing_metrics: bool, trainer: TrainerKind) -> bool:
    """``vllm_sync_check`` resolved, the same rule for both trainers: an explicit value wins; unset (``None``), the
    engine sync check (``weight_sync/sync_check.py``) is on wherever a vLLM engine samples the routes the trainer carries
    (``routing_replay`` other than ``"none"``, or ``routing_metrics``), and off for plain TRL.

    Where it cannot run: a colocated engine with ``vllm_enable_sleep_mode`` discards its weights and its KV cache
    after every generation, so there is nothing to probe before a sync; the default is off there and an explicit
    ``True`` is refused (``SyncCheckUnavailableError``)."""
    requested = option(args, "vllm_sync_check")
    uses_vllm = trainer == ASYNC_TRAINER or bool(getattr(args, "use_vllm", False))
    sleeping = getattr(args, "vllm_mode", None) == "colocate" and bool(getattr(args, "vllm_enable_sleep_mode", False))
    if requested is None:
        return uses_vllm and (mode.replays or routing_metrics) and not sleeping
    if requested and uses_vllm and sleeping:
        raise SyncCheckUnavailableError(
            "vllm_sync_check=True cannot run with vllm_enable_sleep_mode=True in colocate mode: the sleeping engine "
            "discards its weights and KV cache after every generation, so it cannot score the sync probe. Turn one "
            "of them off."
        )
    return bool(requested) and uses_vllm


def resolve_weight_sync(
    args: Any, mode: ReplayMode, routing_metrics: bool, trainer: TrainerKind
) -> WeightSyncMethod | None:
    """``vllm_weight_sync`` resolved: ``"trl"`` (TRL's own transfer) or ``"reload"`` (``weight_sync/weight_reload.py``);
    ``None`` for the sync trainer without vLLM.

    ``"auto"`` is ``"reload"`` where TRL's own transfer cannot run, which depends on the trainer: the sync trainer's
    (in-process ``load_weights``, NCCL to a server) fails on vLLM's CPU build, the async trainer's (NCCL only) off
    CUDA. The one difference (docs/async.md): the sync trainer without routes (``"none"``, no ``routing_metrics``) is
    TRL's ``GRPOTrainer`` bit for bit, its own sync included, while TRL's async trainer does not run off CUDA at all,
    so there is no TRL behaviour to keep."""
    if trainer == SYNC_TRAINER and not args.use_vllm:
        return None
    method = option(args, "vllm_weight_sync")
    if method != "auto":
        return WeightSyncMethod(method)
    device = args.device.type
    if trainer == ASYNC_TRAINER:
        reload = device != "cuda"
    else:
        reload = device == "cpu" and (mode.replays or routing_metrics)
    return WeightSyncMethod.RELOAD if reload else WeightSyncMethod.TRL


@dataclass(frozen=True)
class ReplaySettings:
    """One run's routing options, resolved once from its config (the same rules for both trainers)."""

    mode: ReplayMode
    routing_metrics: bool
    extreme_token_threshold: float
    vllm_sync_check: bool
    replay_score_threshold: float = 0.0  # threshold replay (routing/replay_rule.py); 0: replay as it is
    trainer: TrainerKind = TrainerKind.SYNC
    # the sync trainer's own (fixed values in the async one, which has neither an old pass nor transformers generate)
    replay_reference_model: bool = True
    rollout_prediction: bool = False  # PR2: generate itself routes by the predicted routes
    transformers_importance_sampling_correction: bool = False
    records_generation: bool = False  # transformers generate runs inside the rollout recorder
    generation_routes: bool = False  # the trainer keeps the engine's routes (recorded, or requested from vLLM)

    @property
    def carries_routes(self) -> bool:
        """Whether the engine's routes are kept at all (to replay them, or for routing/* only)."""
        return self.mode.replays or self.routing_metrics

    @property
    def replays_generation_routes(self) -> bool:
        """The routes replayed are those generation used: R3's engine routes, or PR2's predicted ones when generate
        itself was steered by the predictors."""
        return self.mode.needs_engine_routes or (self.mode.source is RouteSource.PREDICTED and self.rollout_prediction)

    @property
    def records_old_pass(self) -> bool:
        """The old-logprob pass records the natural routes (what R2/PR2 replay; the trainer's side of routing/*)."""
        return self.routing_metrics or self.mode.records_old_pass

    @classmethod
    def from_args(cls, args: Any, trainer: TrainerKind = TrainerKind.SYNC) -> ReplaySettings:
        mode = ReplayMode.parse(option(args, "routing_replay"), trainer)
        metrics = option(args, "routing_metrics")
        metrics = default_routing_metrics(mode) if metrics is None else bool(metrics)
        sync_check = resolve_sync_check(args, mode, metrics, trainer)
        common = dict(
            mode=mode,
            routing_metrics=metrics,
            extreme_token_threshold=option(args, "extreme_token_threshold"),
            vllm_sync_check=sync_check,
            trainer=trainer,
            replay_score_threshold=float(option(args, "replay_score_threshold")) if mode.replays else 0.0,
        )
        if trainer == ASYNC_TRAINER:
            return cls(**common)
        rollout_prediction = bool(option(args, "pr2_rollout_prediction"))
        correction = option(args, "transformers_importance_sampling_correction")
        correction = default_transformers_correction(args, mode) if correction is None else bool(correction)
        engine_routes = mode.needs_engine_routes or rollout_prediction or metrics
        transformers_generate = not args.use_vllm and not args.use_transformers_continuous_batching
        return cls(
            **common,
            replay_reference_model=bool(option(args, "replay_reference_model")),
            rollout_prediction=rollout_prediction,
            transformers_importance_sampling_correction=correction and not args.use_vllm,
            records_generation=transformers_generate and (engine_routes or correction),
            generation_routes=engine_routes and not args.use_transformers_continuous_batching,
        )


def default_transformers_correction(args: Any, mode: ReplayMode) -> bool:
    """``transformers_importance_sampling_correction`` when unset: on with replay or MiniRL on plain ``generate``."""
    wanted = mode.replays or args.loss_type == "minirl"
    return (
        wanted
        and args.vllm_importance_sampling_correction
        and not args.use_vllm
        and not args.use_transformers_continuous_batching
    )
