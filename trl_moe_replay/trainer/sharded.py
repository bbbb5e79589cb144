"""Full values of parameters that FSDP2 or DeepSpeed ZeRO-3 keep sharded across ranks.

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns parameters into ``DTensor``s holding one shard per rank;
ZeRO-3 leaves each rank an empty parameter plus its partition (``ds_tensor``). Reading the full value is a
collective in both cases: every rank must call :func:`full_tensors` with the same parameters in the same order.
"""

from __future__ import annotations

import torch
from torch import nn


def is_zero3_partitioned(param: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed ZeRO-3 manages (it carries ``ds_id``)."""
    return hasattr(param, "ds_id")


def is_dtensor(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


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
    return {
        name: (p.full_tensor() if is_dtensor(p) else p).detach().to("cpu", copy=True)
        for name, p in named_params.items()
    }


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank stores for ``param``: its shard (FSDP2), its partition (ZeRO-3), or all of it."""
    if is_zero3_partitioned(param):
        return param.ds_tensor.numel()
    if is_dtensor(param):
        return param.to_local().numel()
    return param.numel()
