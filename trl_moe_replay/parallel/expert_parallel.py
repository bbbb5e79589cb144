"""Expert parallelism, and the other sizes transformers shards a model by at load time (``DistributedConfig``).

transformers 5.x shards a model itself when it is loaded with ``from_pretrained(path,
distributed_config=DistributedConfig(ep_size=..., fsdp_size=..., tp_size=..., ep_implementation=...))``: each rank
holds a share of the experts (DTensors) and tokens travel to them (``all_to_all``), FSDP2 shards the rest, and its
Trainer takes the model as it is ("sharded at load time": no DDP or FSDP wrapping by accelerate). Routing replay
needs nothing more: the routers run on every rank before the dispatch, so the replay hooks choose the experts the
dispatch sends each token to (tested against DDP in tests/parallel/test_expert_parallel.py).

This module is the launch side:

* :func:`distributed_config_from_args`: the parallel sizes a config asks for, as YAML and the command line can say
  them: ``model_init_kwargs: {distributed_config: {ep_size: 8, fsdp_size: 8, ep_implementation: all_to_all}}``
  (a mapping of ``DistributedConfig``'s fields; a ``DistributedConfig`` object is accepted too). A bad combination is
  refused in one line (:class:`ParallelSizesError`) before any work: sizes that do not multiply to the number of
  processes, sizes that are no ints, ``pp_size > 1``, plan entries transformers cannot apply, an ``ep_implementation``
  it has none for or that the layout cannot run, tensor parallelism on CPU processes (accelerate refuses it there), a
  transformers without EP.
* :func:`sharded_at_load_construction`: around the trainer's ``super().__init__``: hands TRL the
  ``DistributedConfig`` built from that mapping, and lets transformers' Trainer accept checkpointing for a model
  sharded at load time (it refuses it, since it cannot resume one; :mod:`.distributed_checkpoint` does).
* :func:`check_sharded_at_load`: after it: what is not supported on such a model is refused in one line (PEFT
  adapters), and TRL's vLLM weight sync is given full tensors.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import numbers
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import TrlMoeReplayError
from ..upstream import (
    distributed_config_class,
    ep_implementations,
    lift_sharded_resume_refusal,
    map_weight_sync_tensors,
    parallel_plan_styles,
)
from .sharded import full_tensor, is_sharded_at_load


DISTRIBUTED_CONFIG = "distributed_config"  # the model_init_kwargs key (from_pretrained's argument)


class ParallelSizesError(TrlMoeReplayError, ValueError):
    """The parallel sizes asked for cannot run: wrong product, a combination this machine or package refuses."""


class ShardedAtLoadUnsupportedError(TrlMoeReplayError, ValueError):
    """A feature that does not support a model sharded at load time (``DistributedConfig``) was asked for with one."""


# ------------------------------------------------------------------------------------------------- sizes and checks
def _distributed_config_class() -> type:
    """transformers' ``DistributedConfig``, or a one-line refusal where it lacks the expert parallelism this package
    drives (``upstream.distributed_config_class``: transformers 5.23 on)."""
    import transformers

    config_class = distributed_config_class()
    if config_class is None:
        raise ParallelSizesError(
            "model_init_kwargs.distributed_config asks transformers to shard the model at load time, but "
            f"transformers {transformers.__version__} has no expert parallelism this package can drive (its "
            "DistributedConfig lacks ep_size or ep_implementation, new in 5.23): install transformers 5.23 or newer "
            "(tested with 5.24 and 5.25), or drop distributed_config and use DDP, FSDP2 or DeepSpeed"
        )
    return config_class


def requested_distributed_config(args: Any) -> Any:
    """The ``distributed_config`` entry of ``args.model_init_kwargs`` (mapping or ``DistributedConfig``), or None."""
    kwargs = getattr(args, "model_init_kwargs", None)
    return kwargs.get(DISTRIBUTED_CONFIG) if isinstance(kwargs, Mapping) else None


def distributed_config_from_args(args: Any, world_size: int | None = None, *, gpus: bool | None = None) -> Any:
    """The ``DistributedConfig`` that ``args.model_init_kwargs["distributed_config"]`` asks for (None if none), checked
    against ``world_size`` processes (default: ``WORLD_SIZE``) and this machine (``gpus=True``: GPU processes, as
    ``trl-moe-replay plan`` checks a layout for); else :class:`ParallelSizesError`."""
    value = requested_distributed_config(args)
    if value is None:
        return None
    config_class = _distributed_config_class()
    if isinstance(value, Mapping):
        names = [f.name for f in dataclasses.fields(config_class)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ParallelSizesError(
                f"model_init_kwargs.distributed_config has {unknown[0]!r}, which is no field of transformers' "
                f"DistributedConfig: use {', '.join(n for n in names if not n.startswith('enable_'))}"
            )
        try:
            config = config_class(**value)
        except (ValueError, TypeError, OSError) as exc:
            raise ParallelSizesError(
                f"model_init_kwargs.distributed_config={dict(value)} refused by transformers: "
                f"{' '.join(str(exc).split())}"
            ) from None
    elif isinstance(value, config_class):
        config = value
    else:
        raise ParallelSizesError(
            f"model_init_kwargs.distributed_config is a {type(value).__name__}: pass a mapping of DistributedConfig's "
            "fields (YAML: distributed_config: {ep_size: 8, fsdp_size: 8}) or a transformers DistributedConfig"
        )
    check_parallel_sizes(config, world_size, use_cpu=bool(getattr(args, "use_cpu", False)), gpus=gpus)
    return config


SIZE_FIELDS = ("pp_size", "dp_replicate_size", "fsdp_size", "tp_size", "ep_size")
PLAN_FIELDS = ("tp_plan", "ep_plan", "fsdp_plan")


def check_layout_values(config: Any) -> None:
    """Refuse, in one line, values of a ``DistributedConfig`` that transformers takes but cannot run: a size that is no
    int (``2.0`` fails deep in FSDP2's ``__init__``, ``True`` counts as 1), ``pp_size > 1`` (no pipeline schedule in
    the Trainer: a rank aborts), a plan that is no mapping of module names to styles transformers applies (checked
    by transformers only inside ``from_pretrained``, on every rank)."""
    for name in SIZE_FIELDS:
        size = getattr(config, name)
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise ParallelSizesError(
                f"distributed_config {name} must be an int (a number of processes), got {type(size).__name__} "
                f"{size!r}: write it without a decimal point or quotes ({name}: 2)"
            )
    check_ep_implementation(config)
    if config.pp_size > 1:
        raise ParallelSizesError(
            f"distributed_config has pp_size {config.pp_size}, and pipeline parallelism does not train here: "
            "transformers' Trainer runs no pipeline schedule (one rank aborts), and transformers refuses it with FSDP "
            "and with expert token dispatch. Use pp_size 1, and ep_size with fsdp_size (or tp_size on GPUs)"
        )
    styles = parallel_plan_styles()
    for name in PLAN_FIELDS:
        plan = getattr(config, name)
        if plan is None or name == "tp_plan" and plan == "auto":
            continue
        if not isinstance(plan, Mapping):
            raise ParallelSizesError(
                f"distributed_config {name} must be a mapping of module names to styles{' or auto' * (name == 'tp_plan')}"
                f", got {type(plan).__name__} {plan!r}"
            )
        for key, style in plan.items():
            if not isinstance(key, str) or not key:
                raise ParallelSizesError(
                    f"distributed_config {name} has the key {key!r}: its keys are module names (layers.*.mlp.experts)"
                )
            if not isinstance(style, str) or style not in styles[name]:
                raise ParallelSizesError(
                    f"distributed_config {name}[{key!r}] is {style!r}, which is no {name} style transformers applies: "
                    f"use one of {', '.join(sorted(styles[name]))} (or leave {name} out: the model's own plan)"
                )


def check_ep_implementation(config: Any) -> None:
    """Refuse, in one line, an ``ep_implementation`` that transformers would refuse only inside ``from_pretrained``,
    on every rank, once the model is built (seam entry ``ep_implementations``): a name it has no implementation for,
    one that needs every rank of the expert group to hold the same batch (``all_reduce``) where the layout gives them
    different ones (``ep_size != tp_size``, e.g. ep 2 x fsdp 2), one that cannot train. Only with ``ep_size > 1``:
    without expert parallelism transformers reads no ``ep_implementation``."""
    name = config.ep_implementation
    ep_size, tp_size = config.ep_size, config.tp_size
    if not isinstance(ep_size, numbers.Integral) or ep_size <= 1:
        return
    known = ep_implementations()
    if not isinstance(name, str) or name not in known:
        raise ParallelSizesError(
            f"distributed_config ep_implementation is {name!r}, which transformers has no implementation for: use one "
            f"of {', '.join(known)} (auto: transformers' choice)"
        )
    shared_batch, trains = known[name]
    if shared_batch and ep_size != tp_size:
        raise ParallelSizesError(
            f"distributed_config ep_implementation {name!r} needs every rank of an expert group to hold the same batch "
            f"(ep_size == tp_size), but the layout has ep_size {ep_size} and tp_size {tp_size}, so the ranks of an "
            "expert group hold different batches: use ep_implementation all_to_all (or auto), or ep_size == tp_size"
        )
    if not trains:
        raise ParallelSizesError(
            f"distributed_config ep_implementation {name!r} runs at inference only (its kernel has no backward), and "
            "a trainer trains through it: use all_to_all (or auto)"
        )


def check_parallel_sizes(
    config: Any, world_size: int | None = None, *, use_cpu: bool = False, gpus: bool | None = None
) -> None:
    """Refuse sizes that cannot run with ``world_size`` processes here (``gpus``: on GPU processes, default: whether
    this machine has one), in one line (:class:`ParallelSizesError`)."""
    check_layout_values(config)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    sizes = {name: getattr(config, name) for name in ("pp_size", "dp_replicate_size", "fsdp_size", "tp_size")}
    product = 1
    for size in sizes.values():
        product *= size
    if product != world_size:
        said = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1) or "all sizes 1"
        raise ParallelSizesError(
            f"distributed_config lays the model out over {product} processes ({said}; ep_size {config.ep_size} "
            f"splits the experts within them), but the launch started {world_size}: make pp_size x "
            "dp_replicate_size x fsdp_size x tp_size equal the number of processes (--nproc_per_node x nodes)"
        )
    gpus = torch.cuda.is_available() if gpus is None else gpus
    if config.tp_size > 1 and (use_cpu or not gpus):
        raise ParallelSizesError(
            f"distributed_config has tp_size {config.tp_size}, and tensor parallelism trains only on GPUs: accelerate "
            "refuses its ParallelismConfig for CPU processes (MULTI_CPU). On CPUs use ep_size with fsdp_size "
            "(ep_implementation all_to_all) and tp_size 1"
        )


# ------------------------------------------------------------------------------------------------- trainer wiring
@contextlib.contextmanager
def sharded_at_load_construction(args: Any, model: Any) -> Iterator[None]:
    """Around ``Trainer.__init__`` for a model sharded at load time, or one ``model_init_kwargs`` asks to shard:

    * TRL loads the model with the ``DistributedConfig`` the mapping in ``model_init_kwargs`` describes (the user's
      mapping is put back afterwards, so the config still serialises);
    * transformers' refusal of checkpoints with optimizer state for such a model is lifted, because
      :mod:`.distributed_checkpoint` saves and restores them (seam entry ``sharded_at_load_resume``).
    """
    config = distributed_config_from_args(args) if isinstance(model, str) else None
    if not isinstance(model, str) and is_sharded_at_load(model):
        check_parallel_sizes(model.config.distributed_config, use_cpu=bool(getattr(args, "use_cpu", False)))
    sharded = config is not None or is_sharded_at_load(model)
    if not sharded:
        yield
        return
    saved_kwargs = args.model_init_kwargs
    if config is not None:
        args.model_init_kwargs = {**saved_kwargs, DISTRIBUTED_CONFIG: copy.copy(config)}
    try:
        with lift_sharded_resume_refusal(args):
            yield
    finally:
        args.model_init_kwargs = saved_kwargs


def check_sharded_at_load(trainer: Any) -> None:
    """After ``Trainer.__init__``: refuse what a model sharded at load time does not support, in one line, and make
    TRL's vLLM weight sync send full tensors (every sync path reads the parameters through it)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    from accelerate.utils import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    if not is_sharded_at_load(base):
        return
    if is_peft_model(model):
        raise ShardedAtLoadUnsupportedError(
            "a PEFT adapter on a model sharded at load time (distributed_config) is not supported here: its merge "
            "for the vLLM weight sync would run on sharded expert weights. Train the full model with "
            "distributed_config, or train the adapter under DDP, FSDP2 or DeepSpeed"
        )
    if getattr(trainer, "vllm_generation", None) is not None:
        map_weight_sync_tensors(trainer.vllm_generation, full_tensor)
