"""What the two configs check, for every way they are built (Python, ``TrlParser`` YAML and command line, the recipe).

Two rules, one per owner of a field:

- **Our own fields** (declared by ``MoEReplayGRPOConfig`` / ``MoEReplayAsyncGRPOConfig``, not by TRL's class) are held
  to their annotation: an int field takes integers (not 1.5, not ``"3"``, not ``True``); a float field takes integers
  or finite floats; a bool field takes ``True``/``False`` (not ``"no"``, which would be truthy); ``None`` only where
  the annotation is optional; a field with ``choices`` takes one of them; a path field takes ``os.PathLike`` too.
  Numpy scalars count as the numbers they hold and become Python numbers. ``OWN_VALUE_RULES`` holds the ranges.
- **TRL's and transformers' fields** take whatever plain TRL takes, stored as TRL stores it (a ``Path`` output_dir,
  ``fsdp=True``, an ``AcceleratorConfig``, ``max_steps=0``, an int ``run_name`` from YAML ...).
  ``UPSTREAM_REFUSALS`` is the one list of their values refused early, each because plain TRL would fail on it later
  or would run silently wrong, with the reason. Their annotations are read from TRL's class, never from a user's
  subclass (whose own annotations may name types imported only under ``TYPE_CHECKING``).

``check_config`` runs first in both configs' ``__post_init__``; ``check_config_file`` holds a YAML file's values for
our own fields to the same rule before ``TrlParser`` types their text as it types the command line's.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal, Union

import numpy as np

from ..errors import TrlMoeReplayError
from .replay_modes import MODE_NAMES, ReplayMode


class ConfigTypeError(TrlMoeReplayError, TypeError, ValueError):
    """A config value of the wrong type (a ``ValueError`` too, like the other config refusals)."""


class ConfigValueError(TrlMoeReplayError, ValueError):
    """A config value of the right type outside the range its field can mean (NaN, a negative count, ...)."""


class UpstreamValueError(ConfigValueError):
    """A value of a TRL or transformers field that plain TRL takes but fails on later or runs silently wrong with;
    ``refusal`` is the ``UPSTREAM_REFUSALS`` entry (with its reason) that refused the value of ``field``."""

    def __init__(self, field: str, value, refusal: UpstreamRefusal):
        super().__init__(refusal.message(field, value))
        self.field, self.value, self.refusal = field, value, refusal


# ------------------------------------------------------------------------------------- TRL's and transformers' fields
@dataclass(frozen=True)
class UpstreamRefusal:
    """Values of TRL's or transformers' fields refused early: ``refuses(value)`` for a field that ``covers``, and why.

    ``reason`` says what plain TRL does with the value: "TRL crashes later at ..." or "silently wrong: ...".
    ``given`` is for a value wrong only beside another field's: it reads the whole config (unset: always).
    """

    fields: str  # the field names, or a kind of field ("every float field")
    covers: typing.Callable[[str, Any], bool]  # (name, TRL's annotation) -> whether this entry is about that field
    refuses: typing.Callable[[Any], bool]
    expected: str
    reason: str
    given: typing.Callable[[Any], bool] | None = None  # (the config) -> whether the other fields make it wrong

    def message(self, name: str, value) -> str:
        return f"{name} must be {self.expected}, got {_shown(value)}: {self.reason}"


def _named(*names: str):
    return lambda name, annotation: name in names


def _annotated(kind: type):
    """Fields whose annotation is ``kind`` or ``kind | None`` (TRL's reading of the field matches it there)."""
    return lambda name, annotation: _plain(annotation) is kind


def _is_nan(value) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value) and math.isnan(value)


def _text_not_true(value) -> bool:
    """Text whose truth in Python (non-empty: True) is not what transformers' own reading of it says."""
    if not isinstance(value, str):
        return False
    return value.strip().lower() not in ("yes", "true", "t", "y", "1", "on")  # transformers' string_to_bool


def _not_an_int(value) -> bool:
    return value is not None and not isinstance(value, numbers.Integral)


def _below(low):
    return lambda value: isinstance(value, numbers.Real) and value < low


def _is_inf(value) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value) and value == math.inf


def _is_zero(value) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value) and value == 0


def _cispo(config) -> bool:
    return getattr(config, "loss_type", None) == "cispo"


#: transformers' optimizer names that build torch's AdamW from adam_beta1, adam_beta2, adam_epsilon and weight_decay
#: (``Trainer.get_optimizer_cls_and_kwargs``; the default is one of them). Other optimizers read them otherwise or not.
TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")


def _torch_adamw(config) -> bool:
    optim = getattr(config, "optim", None)
    return str(getattr(optim, "value", optim)) in TORCH_ADAMW


def _by_epochs(config) -> bool:
    """Whether training length comes from ``num_train_epochs``: transformers' Trainer and TRL's async trainer stop by
    ``max_steps`` only when it is > 0."""
    max_steps = getattr(config, "max_steps", -1)
    return isinstance(max_steps, numbers.Real) and max_steps <= 0


# TRL 1.16's own loss types (named in GRPOConfig.loss_type's help; TRL exposes no list of them), and this package's.
TRL_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
MOE_LOSS_TYPES = ("gspo", "rspo", "minirl")

COUNT_FIELDS = (
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "max_completion_length",
)

# The one list of TRL/transformers values this package refuses although plain TRL's config takes them. Everything not
# here is theirs to take or refuse. Each entry: plain TRL would fail on the value later, or run silently wrong with it.
UPSTREAM_REFUSALS: tuple[UpstreamRefusal, ...] = (
    UpstreamRefusal(
        "every float field",
        _annotated(float),
        _is_nan,
        "a number, not NaN",
        "silently wrong: NaN compares false with every bound, so the rate, limit or weight it sets is skipped or "
        "turns the loss into NaN",
    ),
    UpstreamRefusal(
        "every bool field",
        _annotated(bool),
        _text_not_true,
        "True or False",
        "silently wrong: TRL tests the value's truth, and any non-empty text is true, so 'no' or 'false' switches "
        "the option on",
    ),
    UpstreamRefusal(
        ", ".join(COUNT_FIELDS),
        _named(*COUNT_FIELDS),
        _not_an_int,
        "an int",
        "TRL crashes later: transformers and TRL size loops, batches and tensors with it (range(), DataLoader, "
        "repeat_interleave), which take no float or text",
    ),
    UpstreamRefusal(
        "per_device_train_batch_size, gradient_accumulation_steps, num_generations, max_completion_length",
        _named(
            "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "max_completion_length"
        ),
        _below(1),
        "an int >= 1",
        "TRL crashes later: a batch or an accumulation of 0 gives a DataLoader batch of 0, which it refuses; "
        "generate refuses 0 new tokens; 0 generations per prompt divides the group mean by zero",
    ),
    UpstreamRefusal(
        "num_iterations",
        _named("num_iterations"),
        _below(1),
        ">= 1",
        "silently wrong: 0 (or fewer) updates per generation batch trains 0 steps and exits with status 0",
    ),
    UpstreamRefusal(
        "temperature",
        _named("temperature"),
        lambda value: isinstance(value, numbers.Real) and value <= 0,
        "> 0",
        "TRL crashes later: it divides the logits by it (0 fails in its fused log-prob at the first step), and "
        "transformers' and vLLM's samplers raise on a value <= 0",
    ),
    UpstreamRefusal(
        "temperature",
        _named("temperature"),
        _is_inf,
        "finite",
        "silently wrong: it divides the logits by it, so every logit is 0: tokens are sampled uniformly and every "
        "log-prob is -log(vocabulary size), which no weight changes: the policy loss has no gradient (only a router "
        "aux loss, where on, still moves weights)",
    ),
    UpstreamRefusal(
        "num_train_epochs (with max_steps <= 0)",
        _named("num_train_epochs"),
        lambda value: isinstance(value, numbers.Real) and not _is_bool(value) and value <= 0,
        "> 0 while max_steps <= 0 (training by epochs; a max_steps > 0 sets the length instead)",
        "silently wrong: the run trains ceil(num_train_epochs x steps per epoch) = 0 steps and exits with status 0",
        given=_by_epochs,
    ),
    UpstreamRefusal(
        "epsilon, epsilon_high",
        _named("epsilon", "epsilon_high"),
        _below(0),
        ">= 0",
        "silently wrong: the clip range [1 - epsilon, 1 + epsilon_high] then excludes ratio 1 (and torch's clamp "
        "with min > max returns max), so the on-policy tokens of one advantage sign get no gradient (a cispo cap "
        "epsilon_high < 0 reverses it)",
    ),
    UpstreamRefusal(
        "epsilon_high (loss_type cispo)",
        _named("epsilon_high"),
        _is_zero,
        "> 0 under loss_type='cispo'",
        "silently wrong: CISPO weights each token by min(ratio, epsilon_high), so a cap of 0 weights every token 0 "
        "and no weight gets a gradient",
        given=_cispo,
    ),
    UpstreamRefusal(
        "epsilon (loss_type cispo, epsilon_high unset)",
        _named("epsilon"),
        _is_zero,
        "> 0 under loss_type='cispo' without epsilon_high",
        "silently wrong: CISPO caps each token's weight at epsilon_high, which defaults to epsilon, so 0 weights every "
        "token 0 and no weight gets a gradient",
        given=lambda config: _cispo(config) and config.epsilon_high is None,
    ),
    UpstreamRefusal(
        "top_p",
        _named("top_p"),
        _below(0),
        ">= 0",
        "TRL crashes later: transformers' TopPLogitsWarper and vLLM's SamplingParams raise on a negative top_p (above "
        "1 transformers applies no top-p at all, so that is taken)",
    ),
    UpstreamRefusal(
        "learning_rate",
        _named("learning_rate"),
        lambda value: isinstance(value, numbers.Real) and (value < 0 or value == math.inf),
        "a finite number >= 0",
        "TRL crashes later or runs silently wrong: torch's optimizers raise on a negative rate when the trainer "
        "builds them; an infinite one turns every weight to NaN at the first step",
    ),
    UpstreamRefusal(
        "adam_beta1, adam_beta2 (torch's AdamW)",
        _named("adam_beta1", "adam_beta2"),
        lambda value: isinstance(value, numbers.Real) and not 0 <= float(value) < 1,
        "in [0, 1)",
        "TRL crashes later: torch's AdamW raises 'Invalid beta parameter' when the trainer builds it, after the model "
        "has loaded",
        given=_torch_adamw,
    ),
    UpstreamRefusal(
        "adam_epsilon (torch's AdamW)",
        _named("adam_epsilon"),
        lambda value: isinstance(value, numbers.Real) and not 0 < float(value) < math.inf,
        "a finite number > 0",
        "TRL crashes later or runs silently wrong: torch's AdamW raises 'Invalid epsilon value' on a negative one when "
        "the trainer builds it; with 0, every element whose gradient has been 0 so far (an expert no token was routed "
        "to) becomes NaN (0 / 0) at its first step; with inf no weight moves",
        given=_torch_adamw,
    ),
    UpstreamRefusal(
        "weight_decay (torch's AdamW)",
        _named("weight_decay"),
        _below(0),
        ">= 0",
        "TRL crashes later: torch's AdamW raises 'Invalid weight_decay value' when the trainer builds it",
        given=_torch_adamw,
    ),
    UpstreamRefusal(
        "reward_weights",
        _named("reward_weights"),
        lambda value: (
            isinstance(value, (list, tuple))
            and any(isinstance(item, numbers.Real) and not math.isfinite(item) for item in value)
        ),
        "a list of finite numbers",
        "silently wrong: TRL sums the weighted rewards with nansum, so a NaN weight drops that reward function (the "
        "run learns nothing from it) and an infinite one makes the advantages NaN",
    ),
    UpstreamRefusal(
        "loss_type",
        _named("loss_type"),
        lambda value: value not in TRL_LOSS_TYPES + MOE_LOSS_TYPES,
        f"one of TRL's {TRL_LOSS_TYPES} or this package's {MOE_LOSS_TYPES}",
        "TRL crashes later: its loss raises 'Unknown loss type' at the first training step",
    ),
    UpstreamRefusal(
        "weight_sync_steps (async)",
        _named("weight_sync_steps"),
        _below(1),
        ">= 1",
        "TRL crashes later: a sync every 0 steps divides by zero after the first step",
    ),
    UpstreamRefusal(
        "max_staleness (async)",
        _named("max_staleness"),
        _below(0),
        ">= 0",
        "silently wrong: a negative staleness drops every sample, and the run waits for samples that never come",
    ),
)


def upstream_refusal(upstream_class: type, name: str, value, config=None) -> UpstreamRefusal | None:
    """The ``UPSTREAM_REFUSALS`` entry that refuses ``value`` for the field ``name`` of TRL's ``upstream_class`` (in
    ``config``, for an entry that reads other fields; without it such entries are not consulted)."""
    annotation = field_types(upstream_class).get(name)
    for refusal in UPSTREAM_REFUSALS:
        if refusal.covers(name, annotation) and refusal.refuses(value):
            if refusal.given is None or config is not None and refusal.given(config):
                return refusal
    return None


# ------------------------------------------------------------------------------------- our own fields
# Ranges of our own fields, where a value of the right type outside them breaks a run or switches a check off. A
# field missing from a config (the async config has no PR2 fields) is skipped; None (unset) is never checked here.
def _at_least(low):
    return lambda value: value >= low, f">= {low}"


def _above(low):
    return lambda value: value > low, f"> {low}"


OWN_VALUE_RULES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "extreme_token_threshold": _above(1),
    "replay_score_threshold": (lambda value: 0 <= value <= 1, "in [0, 1]"),
    "sync_check_tolerance": _at_least(0),
    "vllm_request_attempts": _at_least(1),
    "max_route_fallback_steps": _at_least(1),
    "pr2_lr_multiplier": _at_least(0),
    "pr2_cached_tokens_per_sequence": _at_least(1),
    "router_shift_gamma_min": (lambda value: 0 < value <= 1, "in (0, 1]"),
}
# Our fields that name a folder or file: ``os.PathLike`` is taken too and kept as the ``str`` it names.
PATH_FIELDS = frozenset({"vllm_sync_dir"})
_UPSTREAM_PACKAGES = ("trl", "transformers")


@functools.cache
def field_types(config_class: type) -> dict[str, Any]:
    """``{field name: resolved annotation}`` of every init field of the dataclass ``config_class``."""
    hints = typing.get_type_hints(config_class)
    return {spec.name: hints[spec.name] for spec in fields(config_class) if spec.init}


def upstream_class(config_class: type) -> type | None:
    """The nearest TRL or transformers dataclass ``config_class`` derives from (itself, if it is one), or None."""
    for klass in config_class.__mro__:
        if is_dataclass(klass) and klass.__module__.split(".")[0] in _UPSTREAM_PACKAGES:
            return klass
    return None


@functools.cache
def own_field_types(config_class: type) -> dict[str, Any]:
    """``{name: annotation}`` of the init fields ``config_class`` declares beyond its TRL/transformers base."""
    upstream = upstream_class(config_class)
    theirs = {spec.name for spec in fields(upstream)} if upstream is not None else set()
    return {name: annotation for name, annotation in field_types(config_class).items() if name not in theirs}


def understood(annotation) -> bool:
    """Whether ``admits`` knows every part of ``annotation`` (the test that no own field goes unchecked asks this)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return all(understood(arg) for arg in args)
    if origin is Literal:
        return True
    if origin in (list, dict):
        return all(understood(arg) for arg in args)
    return annotation in (type(None), bool, int, float, str, list, dict, Any) or isinstance(annotation, type)


def admits(annotation, value) -> bool:
    """Whether ``value`` has a type ``annotation`` admits (ints are no floats' bools, bools no ints)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return any(admits(arg, value) for arg in args)
    if origin is Literal:
        return any(value is arg or type(value) is type(arg) and value == arg for arg in args)
    if annotation is Any:
        return True
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return _is_bool(value)
    if annotation is int:
        return isinstance(value, numbers.Integral) and not _is_bool(value)
    if annotation is float:
        return isinstance(value, numbers.Real) and not _is_bool(value)
    if origin is list or annotation is list:
        return isinstance(value, (list, tuple)) and all(admits(args[0], item) for item in value if args)
    if origin is dict or annotation is dict:
        return isinstance(value, dict) and (
            not args or all(admits(args[0], key) and admits(args[1], item) for key, item in value.items())
        )
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # an annotation ``understood`` does not know: the coverage test fails before a user meets it


def describe(annotation) -> str:
    """'an int', 'a float or None', 'a str or a list of str' ..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        parts = [describe(arg) for arg in args if arg is not type(None)]
        return " or ".join(parts + (["None"] if type(None) in args else []))
    if origin is Literal:
        return " or ".join(repr(arg) for arg in args)
    if origin is list or annotation is list:
        return f"a list of {describe(args[0]).split(' ', 1)[1]}" if args else "a list"
    if origin is dict or annotation is dict:
        return "a dict"
    name = getattr(annotation, "__name__", str(annotation))
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _plain(annotation):
    """``X`` for an annotation ``X`` or ``X | None``; else the annotation itself."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def _shown(value) -> str:
    return f"{type(value).__name__} {value!r}"


def check_value(name: str, annotation, value, where: str = "") -> Any:
    """``value`` as our own field ``name`` keeps it (numpy scalars as Python numbers, a path as its text), or a
    ``ConfigTypeError`` naming the field, what it takes and what came."""
    if name in PATH_FIELDS and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not admits(annotation, value):
        paths = " or an os.PathLike" if name in PATH_FIELDS else ""
        raise ConfigTypeError(f"{name} must be {describe(annotation)}{paths}, got {_shown(value)}{where}")
    if _is_bool(value):
        return bool(value)
    if isinstance(value, numbers.Integral) and type(value) is not int:
        return int(value)
    if isinstance(value, numbers.Real) and type(value) not in (int, float):
        return float(value)
    return value


def check_config(config, own_class: type) -> None:
    """Hold the built dataclass ``config`` (an instance of ``own_class``, or of a user's subclass of it) to this
    module's two rules: ``own_class``'s own fields by their annotation and ``OWN_VALUE_RULES``, TRL's and
    transformers' fields by ``UPSTREAM_REFUSALS`` only. The first mistake raises, in one line naming the field."""
    specs = {spec.name: spec for spec in fields(own_class)}
    for name, annotation in own_field_types(own_class).items():
        given = getattr(config, name)
        value = check_value(name, annotation, given)
        if value is not given:  # a numpy scalar as the Python number it holds, a path as its text
            setattr(config, name, value)
        if value is None or _is_bool(value):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigValueError(f"{name} must be a finite number, got {value} (its default: {specs[name].default})")
        choices = specs[name].metadata.get("choices")
        if choices is not None and isinstance(value, (str, int)) and value not in choices:
            raise ConfigValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        if name in OWN_VALUE_RULES:
            holds, expected = OWN_VALUE_RULES[name]
            if isinstance(value, numbers.Real) and not holds(value):
                raise ConfigValueError(f"{name} must be {expected}, got {value}")
    upstream = upstream_class(own_class)
    if upstream is None:  # our configs derive from TRL's; fields(None) would raise this TypeError less clearly
        raise TypeError(f"check_config: {own_class.__name__} derives from no TRL or transformers config")
    for name in field_types(upstream):
        value = getattr(config, name)
        refusal = upstream_refusal(upstream, name, value, config)
        if refusal is not None:
            raise UpstreamValueError(name, value, refusal)
    threshold, mode = config.replay_score_threshold, ReplayMode(config.routing_replay)  # both configs declare them
    if threshold and not mode.replays:
        raise ConfigValueError(
            f"replay_score_threshold={threshold} filters replayed routes, and routing_replay={mode!r} replays none: "
            f"leave it at 0, or use a mode that replays ({', '.join(m for m in MODE_NAMES if ReplayMode(m).replays)})"
        )
    sync_dir = config.vllm_sync_dir  # both configs declare it (RoutingOptions)
    if sync_dir is not None and os.path.exists(sync_dir) and not os.path.isdir(sync_dir):
        raise ConfigValueError(
            f"vllm_sync_dir must be a folder (created when missing), got {sync_dir!r}, which is a file; name a folder"
        )


def check_config_file(config_classes: typing.Iterable[type], values: dict, path: str) -> None:
    """Hold a config file's values for the classes' own fields (``{key: value}`` as ``yaml.safe_load`` gives them)
    to the standard before ``TrlParser`` turns their text into numbers and bools the way it reads the command
    line's: YAML has numbers and booleans, so ``routing_metrics: "yes"`` is a mistake, as it is from Python. The one
    allowance: a float field takes number text, since YAML 1.1 reads ``1e-5`` (no dot) as text. TRL's and
    transformers' fields are left to ``TrlParser``, as plain TRL leaves them."""
    for config_class in config_classes:
        if not is_dataclass(config_class):
            continue
        annotations = own_field_types(config_class)
        for name, value in values.items():
            if name not in annotations or not isinstance(value, str):
                continue  # values that are no text reach the config's own check as they are
            if admits(annotations[name], 1.5) and _is_number_text(value):
                continue
            if _admits_as_list_item(annotations[name], value):
                continue  # one text for a list field (`reward_funcs: accuracy_reward`), which TRL's parser takes
            check_value(
                name, annotations[name], value, where=f" (in {path}; YAML numbers and booleans are written unquoted)"
            )


def _admits_as_list_item(annotation, value) -> bool:
    """Whether ``annotation`` has a ``list[X]`` part whose item type admits ``value``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return any(_admits_as_list_item(arg, value) for arg in args)
    return origin is list and bool(args) and admits(args[0], value)


def _is_number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
