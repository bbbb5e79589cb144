"""PEFT policies under routing replay: which adapters can be replayed faithfully, refused in one line otherwise.

With vLLM, TRL syncs the *merged* weights ``W + BA`` to the engine (the async trainer too, unless the server runs
with ``--enable-lora``), so the engine routes with the merged router while the trainer replays those routes into
``W`` plus the adapter: the same function, so replay is faithful for LoRA on attention, on the router (PEFT wraps
its weight) and on transformers' fused expert weights (``target_parameters``); tests/cross_cutting/test_vllm_engine.py and
tests/cross_cutting/test_async_engine.py check it token by token on the real CPU engine. What is refused here:

* a prompt-learning adapter (prompt, prefix or p-tuning) under any replay mode: its virtual tokens are positions
  that neither the engine nor the recorded routes have, so no route lines up with the token it belongs to;
* R3 with adapter-only vLLM sync (the async trainer against a server started with ``--enable-lora``) when the
  adapter touches a router or the experts: the engine would then route through vLLM's LoRA kernels, which nothing
  here has checked against the trainer's routes.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import is_peft_model

from ..errors import TrlMoeReplayError
from ..routing.routers import family_of
from .routing_options import ReplayMode


class UnfaithfulPeftReplayError(TrlMoeReplayError, ValueError):
    """A PEFT adapter whose routes the trainer cannot replay as the engine produced them."""


def adapted_routing_modules(model: torch.nn.Module) -> list[str]:
    """Names of the PEFT tuner layers that wrap a router or the experts of ``model`` (a ``PeftModel``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    names = []
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        logical = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if family_of(module.get_base_layer()) is not None or logical.rsplit(".", 1)[-1] == "experts":
            names.append(logical)
    return sorted(set(names))


def check_peft_replay(model: torch.nn.Module, routing_replay: str, *, adapter_only_sync: bool = False) -> None:
    """Refuse, in one line, a PEFT policy whose routes cannot be replayed faithfully (module docstring)."""
    routing_replay = ReplayMode(routing_replay)
    if not routing_replay.replays or not is_peft_model(model):
        return
    config: Any = model.active_peft_config  # a PeftModel's PeftConfig (peft is untyped)
    if config.is_prompt_learning:
        raise UnfaithfulPeftReplayError(
            f"routing_replay={routing_replay!r} with a {config.peft_type.value} adapter: its virtual tokens are "
            "positions the engine and the recorded routes never saw, so no route lines up with its token. Use a LoRA "
            "adapter (peft.LoraConfig), or routing_replay='none'."
        )
    if adapter_only_sync and routing_replay.needs_engine_routes:
        touched = adapted_routing_modules(model)
        if touched:
            raise UnfaithfulPeftReplayError(
                f"routing_replay='r3' with a LoRA on {touched[0]} synced to vLLM as an adapter (the server runs with "
                "--enable-lora): the engine would route through vLLM's LoRA kernels, unchecked against the trainer's "
                "routes. Start the server without --enable-lora (TRL then syncs merged weights, checked on the real "
                "engine), or keep the adapter off the routers and experts."
            )
