r"""Checkpoints that resume a model sharded at load time (expert parallelism), with torch's distributed checkpoint.

transformers' Trainer cannot resume a model that ``from_pretrained(distributed_config=...)`` sharded: it refuses any
checkpoint with optimizer state for one. The Trainer's own save and resume entry points stay the ones that run
(``save_steps``, the recipe's Ctrl-C, ``resume_from_checkpoint``); for such a model they reach this module
(through the functions of :mod:`.checkpoint_weights` that the base of both trainers calls):

* save (``_save_optimizer_and_scheduler``): the model's and the optimizer's shards, each rank its own, with
  ``torch.distributed.checkpoint`` (``get_state_dict``, optimizer state keyed by parameter name) into
  ``checkpoint-N/distributed/`` (DCP's own format; its ``.metadata`` is written last); the scheduler as the Trainer
  writes it (``scheduler.pt``). The Trainer still writes ``model.safetensors`` (full weights, gathered by
  ``save_pretrained``) for ``from_pretrained`` and vLLM, and the RNG states and ``trainer_state.json`` (last).
  PR2's predictors are parameters of the model, so they are in the shards too (and in their own file, as always).
* resume (``_load_from_checkpoint``, then ``_load_optimizer_and_scheduler``): every weight of the model from the
  shards (``set_model_state_dict``), then the optimizer and scheduler. The model is restored whole or not at all: the
  checkpoint's metadata must hold every tensor of the model at its shape, the values are read into copies and checked
  finite before the model is changed; otherwise :class:`DistributedCheckpointError`, one line.
* content: the save writes a manifest of every tensor's checksum beside the shards (:mod:`.dcp_manifest`); each load
  compares what it loaded with it before anything is handed on (the model's copies before they are copied in, the
  optimizer state before it is set), so storage swapped between two layers in ``.metadata`` is refused in one line.
  The metadata's structure (chunks covering every tensor once, in bytes of their own, optimizer states no larger than
  their parameters) is checked before any rank loads, by the one reader of ``.metadata``.
* resumed without expert parallelism (the model not sharded at load time, not FSDP or DeepSpeed): the weights come
  from ``model.safetensors`` as for any checkpoint, and the optimizer and scheduler from the shards, here
  (:func:`holds_training_state_in_shards`): the Trainer, finding no ``optimizer.pt``, would start them afresh (the
  learning rate at step 3 was 0 instead of 2e-4). FSDP and DeepSpeed, whose engines read their own files, refuse it.

torch's reader unpickles ``.metadata`` with plain ``pickle.load`` on every rank. Every load here hands it the
metadata read by :func:`~.checkpoint_files.read_distributed_metadata` instead (the resume pre-flight's reader: only
DCP's own classes, the shard files checked), so nothing in the file runs, whichever path reaches the load
(``_load_best_model`` has no pre-flight). Its planner reads the entries that are no tensor (the optimizer's
param_groups values, which DCP ``torch.save``\ s into the shards) with ``torch.load(weights_only=True)``, where torch's
uses ``weights_only=False`` (seam entry ``dcp_metadata_pickle``: :func:`~..upstream.torch_seam.checked_dcp_planner`).

DCP describes each DTensor shard as one rectangle, which the strided shards of experts sharded over both the
expert-FSDP and the EP dimension are not; they are redistributed to plain shards for the save and the load and back
(seam entry ``sharded_at_load_resume``: ``dcp_placements``, transformers' own workaround for its DCP saves), as transformers does.
"""

from __future__ import annotations

import os

import torch
from transformers.trainer import OPTIMIZER_NAME

from ..parallel.sharded import is_sharded_at_load
from ..upstream import checked_dcp_planner, checked_dcp_reader, dcp_placements
from .checkpoint_files import (
    DCP_METADATA_NAME,
    DISTRIBUTED_FOLDER,
    DistributedCheckpointError,
    read_distributed_metadata,
)
from .dcp_manifest import verify_loaded, write_manifest


FOLDER = DISTRIBUTED_FOLDER
SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer's name for it


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # optimizer state keyed by parameter name, not by position in the param groups (PR2 adds a group of its own)
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _model(trainer) -> torch.nn.Module:
    return trainer.accelerator.unwrap_model(trainer.model)


def uses_distributed_checkpoint(trainer) -> bool:
    """Whether ``trainer``'s checkpoints go through this module (its model was sharded at load time)."""
    return is_sharded_at_load(_model(trainer))


def save_training_state(trainer, output_dir: str) -> None:
    """The model's and optimizer's shards into ``output_dir/distributed`` (every rank), the scheduler beside them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(_model(trainer), trainer.optimizer, options=_options())
    state = dcp_placements({"model": model_state, "optimizer": optimizer_state})
    dcp.save(state, checkpoint_id=os.path.join(output_dir, FOLDER))
    write_manifest(os.path.join(output_dir, FOLDER), state, should_write=trainer.args.should_save)
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def restore_model(model: torch.nn.Module, checkpoint: str | os.PathLike) -> None:
    """Every weight of ``model`` from ``checkpoint/distributed``, or :class:`DistributedCheckpointError` naming the
    first problem with the model left as it was (collective: every rank calls it)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    def refuse(problem: str) -> DistributedCheckpointError:
        return DistributedCheckpointError(
            f"checkpoint {checkpoint} refused: {problem}. Resume from another checkpoint-N of the run, or with the "
            "distributed_config and model that wrote this one; the weights were left as they were"
        )

    metadata = _metadata(checkpoint, refuse, model)
    current = get_model_state_dict(model, options=_options())
    for name, tensor in current.items():
        entry = metadata.get(f"model.{name}")
        if entry is None:
            missing = [n for n in current if f"model.{n}" not in metadata]
            raise refuse(
                f"{name!r} is missing from its shards ({len(missing)} of the model's {len(current)} tensors are)"
            )
        if isinstance(tensor, torch.Tensor) and not isinstance(entry, TensorStorageMetadata):
            raise refuse(f"{name!r} is a {type(entry).__name__} in its shards, where the model holds a tensor")
        if isinstance(tensor, torch.Tensor) and tuple(entry.size) != tuple(tensor.shape):
            raise refuse(f"{name!r} has shape {list(entry.size)} where the model has {list(tensor.shape)}")
    copies = dcp_placements(
        {
            name: tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor
            for name, tensor in current.items()
        }
    )
    _load({"model": copies}, checkpoint, refuse, "shards")
    verify_loaded(checkpoint, os.path.join(checkpoint, FOLDER), {"model": copies}, refuse)
    copies = dcp_placements(copies, reference=current)
    bad = [
        name
        for name, tensor in copies.items()
        if isinstance(tensor, torch.Tensor)
        and tensor.is_floating_point()
        and not bool(torch.isfinite(_local(tensor)).all())
    ]
    if _any_rank(bool(bad)):
        raise refuse(f"{bad[0] if bad else 'a tensor (on another rank)'!r} holds NaN or infinite values")
    set_model_state_dict(model, copies, options=_options())


def restore_optimizer_and_scheduler(trainer, checkpoint: str | os.PathLike) -> None:
    """The optimizer's shards and the scheduler from ``checkpoint`` (collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)

    def refuse(problem: str) -> DistributedCheckpointError:
        return DistributedCheckpointError(
            f"checkpoint {checkpoint} refused: {problem}. Resume from another checkpoint-N of the run"
        )

    model = _model(trainer)
    metadata = _metadata(checkpoint, refuse, model)
    if not os.path.isfile(scheduler_file):
        raise refuse(f"it has no {SCHEDULER_NAME}")
    current = get_optimizer_state_dict(model, trainer.optimizer, options=_options())
    _add_missing_state(trainer.optimizer, current, metadata, dict(model.named_parameters()), refuse)
    state = dcp_placements(current)
    _load({"optimizer": state}, checkpoint, refuse, "optimizer shards")
    verify_loaded(checkpoint, os.path.join(checkpoint, FOLDER), {"optimizer": state}, refuse)
    set_optimizer_state_dict(model, trainer.optimizer, dcp_placements(state, reference=current), options=_options())
    trainer.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def _add_missing_state(optimizer, state: dict, metadata: dict, params: dict, refuse) -> None:
    """Room in ``state`` (a flattened optimizer state dict) and in ``optimizer.state`` for every parameter state the
    checkpoint holds.

    DCP loads only the keys the state dict has, and ``set_optimizer_state_dict`` sets only the state names a
    parameter already has. An optimizer that has not stepped yet has state only where torch's initialising step gave
    a parameter a gradient: PR2's predictor group skips steps in which the predictors did not train, so their Adam
    moments would silently stay unrestored. Each missing entry is allocated as the parameter (sharded alike) or, for a
    scalar such as Adam's ``step``, at the checkpoint's size; the load then overwrites it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "optimizer.state."
    for key, entry in metadata.items():
        if not key.startswith(prefix) or key[len("optimizer.") :] in state:
            continue
        fqn, _, field = key[len(prefix) :].rpartition(".")
        param = params.get(fqn)
        if param is None:
            raise refuse(f"its optimizer holds state for {fqn!r}, which is no parameter of the model")
        if not isinstance(entry, TensorStorageMetadata):
            raise refuse(
                f"its optimizer state {key[len(prefix) :]!r} is a {type(entry).__name__}, where a tensor is read"
            )
        dtype = entry.properties.dtype
        size = tuple(entry.size)
        room = (
            torch.zeros_like(param.detach(), dtype=dtype)
            if size == tuple(param.shape)
            else torch.zeros(size, dtype=dtype)
        )
        state[key[len("optimizer.") :]] = room
        optimizer.state[param][field] = room


def _metadata(checkpoint: str | os.PathLike, refuse, model: torch.nn.Module) -> dict:
    """The global tensor metadata of ``checkpoint``'s shards (DCP writes ``.metadata`` last: present = complete),
    checked against ``model``'s parameters before anything is loaded."""
    if not os.path.lexists(os.path.join(checkpoint, FOLDER, DCP_METADATA_NAME)):
        raise refuse(
            f"it holds no complete {FOLDER}/ shards (the model was sharded at load time, whose checkpoints "
            "are torch distributed checkpoints; this one was written without them, or cut short)"
        )
    parameters = {name: tuple(param.shape) for name, param in model.named_parameters()}
    return read_distributed_metadata(checkpoint, refuse, parameters).state_dict_metadata


def holds_training_state_in_shards(checkpoint: str | os.PathLike) -> bool:
    """Whether ``checkpoint`` keeps its optimizer in ``distributed/`` shards (a run sharded at load time wrote it) and
    not in the Trainer's ``optimizer.pt``."""
    return os.path.lexists(os.path.join(checkpoint, FOLDER, DCP_METADATA_NAME)) and not os.path.lexists(
        os.path.join(checkpoint, OPTIMIZER_NAME)
    )


def checked_reader(checkpoint: str | os.PathLike, refuse):
    """torch's reader of ``checkpoint``'s shards, handed the metadata :func:`read_distributed_metadata` reads (torch's
    own ``read_metadata`` unpickles the file with plain ``pickle.load``)."""
    return checked_dcp_reader(os.path.join(checkpoint, FOLDER), lambda: read_distributed_metadata(checkpoint, refuse))


def _load(state: dict, checkpoint: str | os.PathLike, refuse, what: str) -> None:
    """``dcp.load`` of ``state`` from ``checkpoint``'s shards: the checked metadata, and the entries that are no tensor
    read with ``weights_only=True`` (torch's planner runs whatever a shard pickles); one line for any failure."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=checked_reader(checkpoint, refuse), planner=checked_dcp_planner(refuse))
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001
        first = _first_failure(exc)
        if isinstance(first, DistributedCheckpointError):  # already one line naming the checkpoint
            raise first from None
        raise refuse(f"its {what} cannot be read ({type(first).__name__}: {_short(first)})") from exc


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _any_rank(flag: bool) -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    on_gpu = "nccl" in str(torch.distributed.get_backend()) and torch.cuda.is_available()
    value = torch.tensor([int(flag)], device=f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu")
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def _first_failure(exc: BaseException) -> BaseException:
    """The exception of a failed DCP load. DCP wraps every rank's failure, traceback included, in one
    ``CheckpointException`` (a ``BaseException``, which ``except Exception`` let through as a traceback): the first
    rank's own exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


__all__ = [
    "DistributedCheckpointError",
    "holds_training_state_in_shards",
    "restore_model",
    "restore_optimizer_and_scheduler",
    "save_training_state",
    "uses_distributed_checkpoint",
]
