"""A time limit for a tool in TRL's tool loop, which has none: a tool that hangs blocks the whole run.

``with_timeout(tool, seconds)`` is the same tool for TRL (name, signature and docstring, hence the same JSON schema;
async stays async) that raises :class:`ToolTimeoutError` when a call takes longer. TRL's tool loop turns any
exception of a tool into the tool result ``{"error": "..."}`` for the model and counts it as a tool failure, so the
rollout goes on. Python cannot stop a thread: a sync tool that never returns keeps running in a daemon thread,
holding what it holds, until the process ends (use a subprocess inside the tool if it must be killed). Environment
methods (``environment_factory``) are not wrapped by this; bound their work inside the method.

    from trl_moe_replay.rollouts.tool_timeout import with_timeout
    trainer = MoEReplayGRPOTrainer(..., tools=[with_timeout(search, 30)])
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import threading
from collections.abc import Callable
from typing import Any

from ..errors import TrlMoeReplayError


class ToolTimeoutError(TrlMoeReplayError, TimeoutError):
    """A tool call did not return within its time limit."""


def with_timeout(tool: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """``tool``, given at most ``seconds`` per call (see the module docstring)."""
    is_number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
    if not is_number or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a tool timeout must be a finite number of seconds > 0, got {seconds!r}")
    name = getattr(tool, "__name__", repr(tool))
    message = f"tool {name} did not return within {seconds:g} s (with_timeout); its result is this error"

    if inspect.iscoroutinefunction(tool):

        @functools.wraps(tool)
        async def bounded_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await asyncio.wait_for(tool(*args, **kwargs), seconds)
            except TimeoutError:
                raise ToolTimeoutError(message) from None

        return bounded_async

    @functools.wraps(tool)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = tool(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                outcome["error"] = exc

        worker = threading.Thread(target=run, name=f"trl-moe-replay-tool-{name}", daemon=True)
        worker.start()
        worker.join(seconds)
        if worker.is_alive():
            raise ToolTimeoutError(message)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    return bounded
