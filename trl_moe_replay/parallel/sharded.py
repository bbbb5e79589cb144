"""Full values of parameters that FSDP2, DeepSpeed ZeRO-3 or transformers' loading-time sharding keep across ranks.

FSDP2 (``torch.distributed.fsdp.fully_shard``, also what ``from_pretrained(distributed_config=...)`` applies, with
expert parallelism's DTensor experts) turns parameters into ``DTensor``s holding one shard per rank;
ZeRO-3 leaves each rank an empty parameter plus its partition (``ds_tensor``). Reading the full value is a
collective in both cases: every rank must call :func:`full_tensors` with the same parameters in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
from torch import nn


if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_zero3_partitioned(param: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed ZeRO-3 manages (it carries ``ds_id``)."""
    return hasattr(param, "ds_id")


def is_dtensor(param: torch.Tensor) -> TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def is_sharded_at_load(model) -> bool:
    """Whether ``model`` was sharded by transformers at load time (``from_pretrained(distributed_config=...)``: expert,
    tensor or FSDP2 parallelism applied by transformers, which its Trainer leaves unwrapped)."""
    return bool(getattr(model, "is_distributed_loading_by_transformers", False))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of ``tensor``: a DTensor's shards gathered (a collective over its mesh: FSDP2, or a model
    sharded at load time by transformers, expert parallelism included), any other tensor as it is. The one gather
    every weight sync from a DTensor model goes through (parallel/expert_parallel.py)."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def full_tensors(named_params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the full values of ``named_params`` (collective under FSDP2 and ZeRO-3)."""
    params = list(named_params.values())
    zero3 = [p for p in params if is_zero3_partitioned(p)]
    if zero3 and len(zero3) != len(params):
        raise ValueError("full_tensors: mix of ZeRO-3 partitioned and plain parameters")
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(zero3, modifier_rank=None):
            return {name: p.detach().to("cpu", copy=True) for name, p in named_params.items()}
    return {name: full_tensor(p).detach().to("cpu", copy=True) for name, p in named_params.items()}


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank stores for ``param``: its shard (FSDP2), its partition (ZeRO-3), or all of it."""
    if is_zero3_partitioned(param):
        return cast(Any, param).ds_tensor.numel()  # DeepSpeed's attribute, unknown to torch's stubs
    if is_dtensor(param):
        return param.to_local().numel()
    return param.numel()
