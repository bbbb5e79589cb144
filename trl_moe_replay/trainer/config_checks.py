"""One type and value standard for every field of a training config, ours and TRL's/transformers' inherited ones.

``check_config`` is what ``MoEReplayGRPOConfig`` and ``MoEReplayAsyncGRPOConfig`` run first in ``__post_init__``, so
every way a config is built reaches it: Python, ``TrlParser`` (YAML and command line) and the recipe. It runs before
TRL's and transformers' own ``__post_init__``, which would otherwise fail later and raw on a wrong type (``max_steps``
2.5 ends in a ``TypeError`` deep inside the training loop).

The standard, from each field's type annotation: an int field takes integers (not 1.5, not ``"3"``, not ``True``); a
float field takes integers or floats, finite unless the field is one where infinity means "no limit"; a bool field
takes ``True``/``False`` (not ``"no"``, which would be truthy); ``None`` only where the annotation is optional; a
field with ``choices`` takes one of them. Numpy scalars count as the numbers they hold and become Python numbers. The
command line's text is typed by ``HfArgumentParser`` before the config is built (strictly: ``int("1.5")`` fails); a
YAML file's values are typed by YAML, and ``check_config_file`` holds them to this standard before the parser turns
their text into numbers (the one allowance: a float written ``1e-5``, which YAML 1.1 reads as text).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Literal, Union

import numpy as np


class ConfigTypeError(TypeError, ValueError):
    """A config value of the wrong type (a ``ValueError`` too, like the other config refusals)."""


class ConfigValueError(ValueError):
    """A config value of the right type outside the range its field can mean (NaN, a negative count, ...)."""


# Float fields where +inf means "no limit" and is kept: a gradient norm logged but not clipped, a timeout that never
# fires, an importance-weight clip or cap that never bites. Every other float must be finite.
INFINITY_MEANS_NO_LIMIT = frozenset({
    "max_grad_norm", "vllm_server_timeout", "heartbeat_stale_after_s", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_cap", "off_policy_mask_threshold", "delta",
})

# Values a field admits beyond its annotation: what TRL and transformers themselves give or document.
ALSO_ADMITTED = {
    "scale_rewards": (bool,),  # True/False, as TRL's GRPOConfig documents
    "debug": (type(None),),  # HfArgumentParser's value when unset; transformers reads it as []
}


def _at_least(low):
    return lambda value: value >= low, f">= {low}"


def _above(low):
    return lambda value: value > low, f"> {low}"


# Ranges, where a value of the right type outside them breaks a run (or silently switches a check off). A field
# missing from a config (the async config has no PR2 fields) is skipped; None (unset) is never checked here.
VALUE_RULES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    # transformers: max_steps <= 0 trains num_train_epochs instead; -1 is its "unset"
    "max_steps": (lambda value: value == -1 or value >= 1, "-1 (unset: num_train_epochs decides) or >= 1"),
    "per_device_train_batch_size": _at_least(1),
    "gradient_accumulation_steps": _at_least(1),
    "max_completion_length": _at_least(1),
    "num_generations": _at_least(1),  # TRL's sync config asks for 2 itself; 0 divides by zero in the group mean
    "vllm_server_timeout": _above(0),
    "request_timeout": _above(0),
    "weight_sync_timeout": _above(0),
    "heartbeat_stale_after_s": _above(0),
    "learning_rate": _at_least(0),
    "temperature": _above(0),  # TRL divides the logits by it
    "top_p": (lambda value: 0 < value <= 1, "in (0, 1]"),
    "beta": _at_least(0),
    "epsilon": _at_least(0),
    "epsilon_high": _at_least(0),
    # async: a sync every 0 steps divides by zero after step 1; a negative staleness drops every sample
    "weight_sync_steps": _at_least(1),
    "max_staleness": _at_least(0),
    "sync_check_tolerance": _at_least(0),
    "vllm_request_attempts": _at_least(1),
    "max_route_fallback_steps": _at_least(1),
    # ours
    "extreme_token_threshold": _above(1),
    "pr2_lr_multiplier": _at_least(0),
    "pr2_cached_tokens_per_sequence": _at_least(1),
    "router_shift_gamma_min": (lambda value: 0 < value <= 1, "in (0, 1]"),
}


@functools.cache
def field_types(config_class: type) -> dict[str, Any]:
    """``{field name: resolved annotation}`` of every init field of the dataclass ``config_class``."""
    hints = typing.get_type_hints(config_class)
    return {spec.name: hints[spec.name] for spec in fields(config_class) if spec.init}


def understood(annotation) -> bool:
    """Whether ``admits`` knows every part of ``annotation`` (the test that no field goes unchecked asks this)."""
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
        return isinstance(value, dict) and (not args or all(
            admits(args[0], key) and admits(args[1], item) for key, item in value.items()))
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


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def _shown(value) -> str:
    return f"{type(value).__name__} {value!r}"


def check_value(name: str, annotation, value, where: str = "") -> Any:
    """``value`` as the field ``name`` keeps it (numpy scalars as Python numbers), or a ``ConfigTypeError`` naming
    the field, what it takes and what came."""
    if not (admits(annotation, value) or isinstance(value, ALSO_ADMITTED.get(name, ()))):
        raise ConfigTypeError(f"{name} must be {describe(annotation)}, got {_shown(value)}{where}")
    if _is_bool(value):
        return bool(value)
    if isinstance(value, numbers.Integral) and type(value) is not int:
        return int(value)
    if isinstance(value, numbers.Real) and type(value) not in (int, float):
        return float(value)
    return value


def check_config(config) -> None:
    """Hold every init field of the dataclass ``config`` to the standard in this module's docstring, then to
    ``VALUE_RULES``; the first mistake raises, in one line naming the field, what it takes and what came."""
    specs = {spec.name: spec for spec in fields(config)}
    for name, annotation in field_types(type(config)).items():
        given = getattr(config, name)
        value = check_value(name, annotation, given)
        if value is not given:  # a numpy scalar, as the Python number it holds
            setattr(config, name, value)
        if value is None or _is_bool(value):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            if not (value == math.inf and name in INFINITY_MEANS_NO_LIMIT):
                default = specs[name].default
                hint = f" (its default: {default})" if default is not MISSING else ""
                raise ConfigValueError(f"{name} must be a finite number, got {value}{hint}")
        choices = specs[name].metadata.get("choices")
        if choices is not None and isinstance(value, (str, int)) and value not in choices:
            raise ConfigValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        if name in VALUE_RULES:
            holds, expected = VALUE_RULES[name]
            if isinstance(value, numbers.Real) and not holds(value):
                raise ConfigValueError(f"{name} must be {expected}, got {value}")
    check_clipping_bounds(config)
    sync_dir = getattr(config, "vllm_sync_dir", None)
    if sync_dir is not None and os.path.exists(sync_dir) and not os.path.isdir(sync_dir):
        raise ConfigValueError(f"vllm_sync_dir must be a folder (created when missing), got {sync_dir!r}, which is a "
                               "file; name a folder")


def check_clipping_bounds(config, note: str = "") -> None:
    """``epsilon_high`` (the upper clipping bound) is not below ``epsilon`` when both are set."""
    low, high = getattr(config, "epsilon", None), getattr(config, "epsilon_high", None)
    if low is not None and high is not None and high < low:
        raise ConfigValueError(f"epsilon_high must be >= epsilon (the clipping range is [1 - epsilon, 1 + "
                               f"epsilon_high]), got epsilon={low}{note}, epsilon_high={high}")


def check_config_file(config_classes, values: dict, path: str) -> None:
    """Hold a config file's values (``{key: value}`` as ``yaml.safe_load`` gives them) to the standard before
    ``TrlParser`` turns their text into numbers and bools the way it reads the command line's: YAML has numbers and
    booleans, so ``max_steps: "3"`` or ``routing_metrics: "yes"`` is a mistake, as it is from Python. The one
    allowance: a float field takes number text, since YAML 1.1 reads ``1e-5`` (no dot) as text."""
    for config_class in config_classes:
        if not is_dataclass(config_class):
            continue
        annotations = field_types(config_class)
        for name, value in values.items():
            if name not in annotations or not isinstance(value, str):
                continue  # values that are no text reach the config's own check as they are
            if admits(annotations[name], 1.5) and _is_number_text(value):
                continue
            if _admits_as_list_item(annotations[name], value):
                continue  # one text for a list field (`lora_target_modules: all-linear`), which TRL's parser takes
            check_value(name, annotations[name], value, where=f" (in {path}; YAML numbers and booleans are written "
                                                              "unquoted)")


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

