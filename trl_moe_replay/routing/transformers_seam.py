"""The transformers half of the versioned seam (the TRL half is ``trl_moe_replay/upstream.py``).

RouterReplay relies on two transformers internals that changed between releases inside the declared range; each is
one entry below, read and rebuilt only through these functions, which fail with :class:`TransformersChangedError`
naming the entry.
"""

from __future__ import annotations

import inspect
from typing import Any

from packaging.version import Version

from .errors import TransformersChangedError

TRANSFORMERS_VERIFIED = ("5.16.1", "5.24.0")
"""transformers versions every entry was verified on (the whole family and replay suites ran there)."""


# ---------------------------------------------------------------------------------------------------------------
# T1. The KV cache keyword of the decoder stack (RouterReplay's stack pre-hook, trl_moe_replay/routing/replay.py).
#    Before transformers 5.24 `generate` hands the stack (e.g. Qwen3MoeModel.forward) its cache as
#    `past_key_values=`; from 5.24 as `cache=` (`past_key_values` stays a deprecated alias, renamed inside
#    forward, so a pre-hook can see either). A pre-hook that misses the cache takes every decode step for a fresh
#    forward. Verified on transformers 5.16.1 and 5.24.0 (TRANSFORMERS_VERIFIED; CI runs both ends).
# ---------------------------------------------------------------------------------------------------------------
STACK_CACHE_KEYWORDS = ("cache", "past_key_values")


def check_stack_cache_keyword(stack: Any) -> None:
    """Raise :class:`TransformersChangedError` (entry T1) unless ``stack.forward`` takes one of
    :data:`STACK_CACHE_KEYWORDS`. Called when RouterReplay attaches to a model."""
    params = inspect.signature(stack.forward).parameters
    if not any(keyword in params for keyword in STACK_CACHE_KEYWORDS):
        raise TransformersChangedError(
            f"[T1] {type(stack).__name__}.forward takes neither of {STACK_CACHE_KEYWORDS} (it takes "
            f"{tuple(params)}): transformers {transformers_version()} renamed the decoder stack's KV cache "
            "argument, and RouterReplay could not tell generate's decode steps from fresh forwards. Install a "
            "transformers inside this package's declared range (README, Tested versions)."
        )


def stack_cache(kwargs: dict) -> Any:
    """The KV cache a decoder-stack forward was called with (entry T1), or ``None``."""
    for keyword in STACK_CACHE_KEYWORDS:
        if kwargs.get(keyword) is not None:
            return kwargs[keyword]
    return None


# ---------------------------------------------------------------------------------------------------------------
# T2. The order of a router's outputs (RouterReplay's router hook).
#    Every router in the family table returns (router_logits [N, E], gate_weights [N, K], expert_ids [N, K]), except,
#    before transformers 5.21, the GraniteMoe(-Shared, -Hybrid) and Aria routers, which return
#    (expert_ids, gate_weights, router_logits). Read from transformers 5.16.1 through 5.24.0 (every minor release);
#    verified by tests/test_families.py at 5.16.1 and 5.24.0. RouterReplay reads and rebuilds a router's output only
#    through these two functions, which check the dtypes (integer ids, floating logits) so that a router whose
#    order changed again fails loudly with this entry's name instead of replaying logits as ids.
# ---------------------------------------------------------------------------------------------------------------
IDS_FIRST_BEFORE = "5.21.0"
IDS_FIRST_ROUTERS = frozenset(
    {"GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter", "GraniteMoeHybridTopKRouter", "AriaTextTopKRouter"}
)


def transformers_version() -> str:
    """The installed transformers' version (one function, so tests can pretend another)."""
    import transformers

    return transformers.__version__


def router_ids_first(router: Any) -> bool:
    """Whether ``router`` returns ``(ids, weights, logits)`` in the installed transformers (entry T2)."""
    if Version(transformers_version()) >= Version(IDS_FIRST_BEFORE):
        return False
    return any(cls.__name__ in IDS_FIRST_ROUTERS for cls in type(router).__mro__)


def split_router_output(output: tuple, ids_first: bool, router_name: str) -> tuple[Any, Any, Any]:
    """``(logits, weights, ids)`` of a router's output, whatever its order (entry T2)."""
    logits, weights, ids = (output[2], output[1], output[0]) if ids_first else (output[0], output[1], output[2])
    if ids.dtype.is_floating_point or not logits.dtype.is_floating_point:
        raise TransformersChangedError(
            f"[T2] router {router_name} ({transformers_version()}) returned {tuple(o.dtype for o in output[:3])}; "
            f"expected {'(ids, weights, logits)' if ids_first else '(logits, weights, ids)'} as "
            "trl_moe_replay/routing/transformers_seam.py entry T2 records for this transformers. Its output order changed: install "
            "a transformers inside this package's declared range, or update entry T2."
        )
    return logits, weights, ids


def join_router_output(output: tuple, ids_first: bool, logits: Any, weights: Any, ids: Any) -> tuple:
    """A router output in the router's own order with new ``weights`` and ``ids`` (entry T2)."""
    head = (ids, weights, logits) if ids_first else (logits, weights, ids)
    return (*head, *output[3:])
