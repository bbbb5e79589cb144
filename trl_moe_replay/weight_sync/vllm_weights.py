"""The trainer's weights as a vLLM engine loads them: the checkpoint's names and layout on disk.

transformers 5 loads many MoE checkpoints through weight conversions (e.g. Qwen3-MoE's per-expert
``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj`` become fused ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` and ``mlp.experts.down_proj``), and ``save_pretrained`` reverts them when it writes the checkpoint.
vLLM's model loaders are written for the checkpoint on disk. :func:`checkpoint_named_tensors` applies the same
reversion as ``save_pretrained`` (seam entry ``saved_weight_layout``: transformers' ``revert_weight_conversion``),
one decoder layer at a time, so a weight sync sends exactly what a fresh engine would read from a saved checkpoint.

:func:`engine_weights` is the one place where both trainers' weight syncs collect what they send.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from accelerate.utils import is_peft_model

from ..upstream.transformers_seam import save_pretrained_weights


__all__ = ["checkpoint_named_tensors", "engine_weights"]

_LAYER_PREFIX = re.compile(r"^(.*?(?:^|\.)layers\.\d+\.)")


def engine_weights(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights a vLLM engine is sent at a weight sync: ``named_tensors`` under the checkpoint's names and layout.

    The one place where the weights are collected for the engine: the reload sync of both trainers
    (``weight_sync/weight_reload.py``) streams or writes exactly what this yields. ``named_tensors`` is what TRL's own
    sync would send, one parameter at a time (``VLLMGeneration._iter_named_params``, or the async trainer's
    ``_streaming_iter``: gathered under DeepSpeed ZeRO-3 and FSDP, a PEFT adapter merged, vLLM's names). A model sharded
    at load time (expert parallelism) has that iterator wrapped once, at the trainer's construction, to gather its
    DTensor shards (``parallel/expert_parallel.py``, ``parallel.sharded.full_tensor``), so TRL's own sync and this one
    read the same full tensors and no path sends a shard.
    """
    return checkpoint_named_tensors(model, named_tensors)


def checkpoint_named_tensors(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` in the naming and layout ``model.save_pretrained`` would write.

    ``named_tensors`` defaults to ``model.named_parameters()`` (detached); pass TRL's own iterator (names already
    stripped of wrapper prefixes) to convert what it would send. Tensors are grouped by decoder layer before the
    reversion (a conversion never spans layers), so at most one layer's tensors are held at a time; reverted tensors
    are views of the given ones where the reversion is a split.

    A PEFT model's conversions are its base model's: TRL's iterator sends the merged weights under the base model's
    names, and the ``PeftModel`` wrapper itself declares no conversion, so reverting with it would send fused expert
    names that vLLM's loaders do not read (the engine would keep its old experts).
    """
    if is_peft_model(model):
        model = model.get_base_model()  # type: ignore[operator]  # a PeftModel's method (peft is untyped)
    if named_tensors is None:
        named_tensors = ((name, param.detach()) for name, param in model.named_parameters())
    group: dict[str, torch.Tensor] = {}
    group_layer: str | None = None
    for name, tensor in named_tensors:
        match = _LAYER_PREFIX.match(name)
        layer = match.group(1) if match else None
        if group and layer != group_layer:
            yield from save_pretrained_weights(model, group).items()
            group = {}
        group_layer = layer
        group[name] = tensor
    if group:
        yield from save_pretrained_weights(model, group).items()
