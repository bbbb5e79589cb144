"""Which source the sync trainer's routes come from: the one place that asks which engine generates.

The trainer asks it twice: before TRL builds its engine (:func:`sync_trainer_engine_classes`: the classes that
capture routes) and after (:func:`sync_trainer_route_source`: the source it talks to from then on).
"""

from __future__ import annotations

from typing import Any

from .rollout_func import RolloutFuncFields, RolloutFuncRoutes
from .route_source import RouteSourceProtocol
from .vllm_routes import VLLMRouteSource, llm_returning_routes


def sync_trainer_route_source(
    args: Any,
    *,
    keep_routes: bool,
    required: bool,
    vllm_generation: Any = None,
    accelerator: Any = None,
    generate_source: RouteSourceProtocol | None = None,
    rollout_func: Any = None,
) -> RouteSourceProtocol | None:
    """The sync trainer's route source, from its configuration: vLLM's (server or colocate) when TRL generates with
    vLLM and the trainer keeps engine routes (``keep_routes``), else ``generate_source`` (transformers ``generate``'s
    recorder, ``None`` when it records nothing); with a ``rollout_func``, that function's routes (its own where it is a
    route source) over it. ``None``: nothing to ask any engine for (every generation call hands straight to TRL)."""
    turns = generate_source
    if args.use_vllm:
        turns = VLLMRouteSource(vllm_generation, accelerator, required=required) if keep_routes else None
    if rollout_func is None:
        return turns
    rollouts = rollout_func if isinstance(rollout_func, RouteSourceProtocol) else RolloutFuncFields()
    return RolloutFuncRoutes(rollouts, turns, keep=keep_routes, required=required)


def sync_trainer_engine_classes(args: Any, *, keep_routes: bool) -> dict[str, Any]:
    """The engine classes TRL builds that must capture routes (seam entry ``vllm_generation_classes``): vLLM colocate's
    ``LLM`` built to return them, when the trainer keeps engine routes. Server mode captures them on the client side
    (``route_stream.py``), transformers ``generate`` by hooks: nothing to choose before TRL builds them."""
    if args.use_vllm and args.vllm_mode == "colocate" and keep_routes:
        return {"LLM": llm_returning_routes}
    return {}
