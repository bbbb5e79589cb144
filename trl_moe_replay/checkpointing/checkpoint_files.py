"""The resume pre-flight: every file of a checkpoint that a resume reads is checked before the model changes.

transformers' Trainer reads a checkpoint in steps: the weights first (``_load_from_checkpoint``), then
``trainer_state.json``, the optimizer and scheduler states and the RNG states, each when training needs it. A damaged
file in a later step failed after the weights had changed, as a traceback: a truncated ``optimizer.pt`` in torch's zip
reader, a hostile pickle as ``UnpicklingError`` (refused by ``weights_only``, never run), garbage in
``trainer_state.json`` as a ``TypeError``. :func:`check_checkpoint_files` reads each of them as the Trainer will,
before anything is loaded, and refuses the checkpoint in one line (:class:`CheckpointError`) naming the file and the
problem. Every resume reaches it: both trainers' ``train(resume_from_checkpoint=...)`` (the ``RestoresEveryWeight``
mixin, checkpointing/checkpoint_weights.py) and the recipe's :func:`~.checkpoints.resolve_resume`, before the model is
built. The weights are checked by :func:`~.checkpoint_weights.restore_checkpoint_weights` (every weight present, of the
model's shapes, finite), which also checks before it changes anything.

What is checked:

- each file a resume reads is a regular file inside the checkpoint folder (:func:`checkpoint_file`): not a link out
  of the folder (but for the Hub cache's links from a snapshot to its repository's blobs), a FIFO (whose read would
  wait forever), a device or a folder;
- ``trainer_state.json``: read with a bound (:mod:`trl_moe_replay.bounded_json`), a JSON object of ``TrainerState``'s
  fields, those the Trainer computes with of the types it computes with (:data:`STATE_FIELD_TYPES`);
- ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``: ``torch.load(weights_only=True)`` as the
  Trainer loads them (memory-mapped where torch's zip format allows, so the optimizer state is not read into memory
  an extra time), each the object the Trainer hands on: a dict; the optimizer's with ``state`` and ``param_groups``,
  the RNG's with ``python``, ``numpy`` and ``cpu``;
- ``distributed/`` (the shards of a model sharded at load time, torch's distributed checkpoint): its ``.metadata``, a
  pickle that torch's reader loads with plain ``pickle.load`` on every rank, read first with an unpickler that finds
  only the globals DCP's save writes there (seam entry ``dcp_metadata_pickle``: a pickle that would call anything
  else is refused, never run), within a bound (:data:`MAX_DCP_METADATA_BYTES`), the ``Metadata`` torch reads, each
  entry of the types DCP's load plans with (the model's and the optimizer state's a tensor); each shard file it
  names, a relative path inside ``distributed/`` (no ``..``), a regular file inside the checkpoint folder that holds
  every byte the metadata places in it (:func:`read_distributed_metadata`, :class:`DistributedCheckpointError`);
- full model weights and a PEFT adapter side by side: refused. The Trainer writes one or the other, never both, so
  such a folder holds two runs' files (a LoRA run and a full run into one ``output_dir``), and only one of them wrote
  its ``optimizer.pt`` and ``trainer_state.json``.

FSDP and DeepSpeed keep their model and optimizer states in their engines' own files, which their engines read; the
files above are checked where they are present.
"""

from __future__ import annotations

import io
import os
import re
import stat
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import TrainerState
from transformers.trainer_pt_utils import safe_globals
from transformers.utils import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from ..bounded_json import JSONFileError, read_json_file
from ..errors import TrlMoeReplayError
from ..upstream import DCPMetadataUnpickler, dcp_storage_info_class


MODEL_WEIGHT_NAMES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
ADAPTER_NAMES = (ADAPTER_CONFIG_NAME, ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
_NUMBER = (int, float)
#: The fields of trainer_state.json the Trainer computes with when it resumes, and the types it computes with
#: (transformers 5.24, Trainer._init_training_state and the training loop): the step arithmetic (global_step // and %
#: the steps per epoch, logging/eval/save steps as divisors), the best checkpoint (os.path.isdir), the callbacks'
#: states (looked up by name). Other TrainerState fields are taken as they are; names it lacks fail TrainerState(**).
STATE_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "global_step": (int,), "epoch": _NUMBER, "max_steps": (int,), "num_train_epochs": _NUMBER,
    "logging_steps": _NUMBER, "eval_steps": _NUMBER, "save_steps": _NUMBER, "train_batch_size": (int, type(None)),
    "num_input_tokens_seen": (int,), "total_flos": _NUMBER, "log_history": (list,),
    "best_metric": (*_NUMBER, type(None)), "best_global_step": (int, type(None)),
    "best_model_checkpoint": (str, type(None)), "stateful_callbacks": (dict, type(None)),
}
#: The checkpoint's torch files -> the keys the Trainer reads from the dict each holds
_TORCH_FILES = {OPTIMIZER_NAME: ("state", "param_groups"), SCHEDULER_NAME: (), SCALER_NAME: ()}
_RNG_FILE = re.compile(r"^rng_state(_\d+)?\.pth$")  # rng_state.pth, or rng_state_<rank>.pth with several processes
_RNG_KEYS = ("python", "numpy", "cpu")
DISTRIBUTED_FOLDER = "distributed"  # checkpoint-N/distributed/: the shards (torch.distributed.checkpoint's format)
DCP_METADATA_NAME = ".metadata"  # torch.distributed.checkpoint.filesystem's name for it, written last by a save
#: Largest ``distributed/.metadata`` read (bytes). Written by torch 2.13's dcp.save, it takes about 190 bytes per entry
#: of the state dict and 150 more per further shard of a tensor: Qwen3-30B-A3B's model and AdamW state (about 2,800
#: entries, fused experts) over 64 ranks is a few MiB. Unpickling builds objects several times the file's size.
MAX_DCP_METADATA_BYTES = 256 * 2**20
#: The entries of our saves that are tensors (the model's weights, the optimizer's state: AdamW's exp_avg, exp_avg_sq
#: and step), which the restore reads as tensors; the optimizer's param_groups values may be either.
TENSOR_ENTRIES = ("model.", "optimizer.state.")


class CheckpointError(TrlMoeReplayError, ValueError):
    """A checkpoint a resume cannot restore exactly: refused, in one line, before the model changes."""


class DistributedCheckpointError(CheckpointError):
    """A checkpoint's torch distributed checkpoint (``distributed/``: a model sharded at load time) cannot be read
    safely, or cannot restore every weight (or the optimizer) being resumed."""


def refusal(folder: str | os.PathLike, problem: str, remedy: str,
            error: type[CheckpointError] = CheckpointError) -> CheckpointError:
    """The one-line refusal of ``folder``: ``checkpoint FOLDER refused: PROBLEM. REMEDY``."""
    return error(f"checkpoint {folder} refused: {' '.join(problem.split())}. {remedy}")


def check_checkpoint_files(folder: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` if a file of checkpoint ``folder`` that a resume reads cannot be read as the
    Trainer reads it (see the module docstring); return if every one can, having changed nothing."""
    folder = Path(folder)

    def refuse(problem: str) -> CheckpointError:
        return refusal(folder, problem, "Resume from another checkpoint-N of the run; nothing was loaded")

    if not folder.is_dir():
        raise refuse("no such folder")
    _check_one_kind_of_weights(folder, refuse)
    state = checkpoint_file(folder, TRAINER_STATE_NAME, refuse)
    if state is not None:
        _check_trainer_state(state, refuse)
    if os.path.lexists(folder / DISTRIBUTED_FOLDER / DCP_METADATA_NAME):  # (without it: refused at the load, if read)
        read_distributed_metadata(folder, lambda problem: refusal(
            folder, problem, "Resume from another checkpoint-N of the run; nothing was loaded",
            DistributedCheckpointError))
    for name in sorted(entry.name for entry in folder.iterdir()):
        if _RNG_FILE.match(name) or name in _TORCH_FILES:
            path = checkpoint_file(folder, name, refuse)
            assert path is not None  # iterdir just listed it
            if _RNG_FILE.match(name):
                with safe_globals():  # the numpy types of the RNG state, which the Trainer allows the same way
                    _check_torch_file(path, _RNG_KEYS, refuse)
            else:
                _check_torch_file(path, _TORCH_FILES[name], refuse)


def checkpoint_file(folder: Path, name: str, refuse) -> Path | None:
    """``folder / name`` if it is there (``None`` if not), refused (``refuse(problem)``) unless it is a regular file
    inside ``folder``: a resume reads the checkpoint's own files, not what a link points to elsewhere."""
    path = folder / name
    if not os.path.lexists(path):
        return None
    target = path.resolve()
    if not _inside(target, folder.resolve()):
        raise refuse(f"{name} is a link to {target}, outside the checkpoint folder: copy the file into the folder if "
                     "it belongs to this checkpoint")
    try:
        mode = target.stat().st_mode
    except OSError as exc:
        raise refuse(f"{name} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise refuse(f"{name} is {kind}, not a file the Trainer writes")
    return path


def read_distributed_metadata(folder: str | os.PathLike, refuse) -> Any:
    """The ``Metadata`` of checkpoint ``folder``'s ``distributed/`` shards, read without running anything it holds,
    its shard files checked (see the module docstring); ``refuse(problem)`` (which returns the exception to raise) for
    the first problem. The one reader of ``.metadata``: the pre-flight, and every DCP load of
    :mod:`.distributed_checkpoint` (which hands torch's reader this object instead of letting it unpickle the file)."""
    from torch.distributed.checkpoint.metadata import Metadata

    folder = Path(folder)
    name = f"{DISTRIBUTED_FOLDER}/{DCP_METADATA_NAME}"
    path = checkpoint_file(folder, name, refuse)
    if path is None:
        raise refuse(f"it holds no {name}")
    size = path.stat().st_size
    if size > MAX_DCP_METADATA_BYTES:
        raise refuse(f"{name} holds {size:,} bytes, more than the {MAX_DCP_METADATA_BYTES:,} read")
    with open(path, "rb") as file:
        data = file.read(MAX_DCP_METADATA_BYTES + 1)
    if len(data) > MAX_DCP_METADATA_BYTES:  # grew since stat
        raise refuse(f"{name} holds more than the {MAX_DCP_METADATA_BYTES:,} bytes read")
    try:
        metadata = DCPMetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 -- a damaged or hostile pickle raises whatever unpickling meets
        raise refuse(f"{name} cannot be read ({type(exc).__name__}: {short_message(exc)}); nothing in it was run. "
                     "The save may have been cut short, or the file is not one torch's distributed checkpoint "
                     "wrote") from None
    if not isinstance(metadata, Metadata):
        raise refuse(f"{name} holds a {type(metadata).__name__}, where torch's distributed checkpoint reads its "
                     "Metadata")
    try:
        problem = _metadata_problem(metadata)
    except AttributeError as exc:  # an object built without the fields its class declares
        problem = f"holds an object without its fields ({short_message(exc)})"
    if problem:
        raise refuse(f"{name} {problem}, not what torch's distributed checkpoint writes")
    _check_shards(folder, metadata.storage_data, refuse)
    return metadata


def _metadata_problem(metadata) -> str | None:
    """What in ``metadata`` is not of the types DCP's load reads (and our restore reads: ``size``, ``dtype``)."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta | None):
        return f"holds storage_meta {type(metadata.storage_meta).__name__}, where a StorageMeta or None is read"
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return (f"holds state_dict_metadata {type(entries).__name__} and storage_data {type(storage).__name__}, "
                "where dicts are read")
    for key, entry in entries.items():
        if isinstance(key, str) and isinstance(entry, BytesStorageMetadata):
            if key.startswith(TENSOR_ENTRIES):
                return f"describes {shown(key)} by a BytesStorageMetadata, where the restore reads a tensor"
            continue
        if not (isinstance(key, str) and isinstance(entry, TensorStorageMetadata)
                and isinstance(entry.properties, TensorProperties) and isinstance(entry.properties.dtype, torch.dtype)
                and isinstance(entry.size, torch.Size) and isinstance(entry.chunks, list)
                and all(isinstance(chunk, ChunkStorageMetadata) and isinstance(chunk.offsets, torch.Size)
                        and isinstance(chunk.sizes, torch.Size) for chunk in entry.chunks)):
            return f"describes {shown(key)} by a {type(entry).__name__} of other fields or types"
    info = dcp_storage_info_class()
    for index, where in storage.items():
        if not (isinstance(index, MetadataIndex) and isinstance(where, info) and isinstance(where.relative_path, str)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                        for n in (where.offset, where.length))):
            return f"places {shown(getattr(index, 'fqn', index))} by a {type(where).__name__} of other fields or types"
    return None


def _check_shards(folder: Path, storage: dict, refuse) -> None:
    """Every shard file ``storage`` (``Metadata.storage_data``) names is a regular file inside ``folder``'s
    ``distributed/``, long enough for every byte range read from it."""
    ends: dict[str, int] = {}
    for where in storage.values():
        ends[where.relative_path] = max(ends.get(where.relative_path, 0), where.offset + where.length)
    for relative, end in sorted(ends.items()):
        if not relative or PurePosixPath(relative).is_absolute() or ".." in PurePosixPath(relative).parts:
            raise refuse(f"{DISTRIBUTED_FOLDER}/{DCP_METADATA_NAME} names the shard file {relative!r}, a path out of "
                         f"{DISTRIBUTED_FOLDER}/ (torch's save writes file names inside it)")
        name = f"{DISTRIBUTED_FOLDER}/{relative}"
        path = checkpoint_file(folder, name, refuse)
        if path is None:
            raise refuse(f"{name}, a shard file its {DCP_METADATA_NAME} names, is missing (a save cut short, or "
                         "a copy without it)")
        size = path.stat().st_size
        if size < end:
            raise refuse(f"{name} holds {size:,} bytes, where its {DCP_METADATA_NAME} reads up to byte {end:,} (cut "
                         "short)")


def _inside(target: Path, folder: Path) -> bool:
    """Whether ``target`` is the checkpoint's own: inside ``folder``, or, where ``folder`` is (inside) a snapshot of
    the Hugging Face cache (``snapshot_download``), one of that repository's ``blobs/``, which its files link to."""
    if target.is_relative_to(folder):
        return True
    snapshots = next((parent for parent in folder.parents if parent.name == "snapshots"), None)
    return snapshots is not None and target.parent == snapshots.parent / "blobs"


def _check_one_kind_of_weights(folder: Path, refuse) -> None:
    full = [name for name in MODEL_WEIGHT_NAMES if os.path.lexists(folder / name)]
    adapter = [name for name in ADAPTER_NAMES if os.path.lexists(folder / name)]
    if full and adapter:
        raise refuse(
            f"it holds full model weights ({', '.join(full)}) and a PEFT adapter ({', '.join(adapter)}): the Trainer "
            "writes one or the other, so two runs (one with LoRA, one without) saved into this folder, and its "
            f"{OPTIMIZER_NAME} and {TRAINER_STATE_NAME} are only one run's. Delete the other run's files ("
            f"{', '.join(adapter)} to resume the full run, {', '.join(full)} to resume the LoRA run) and resume again"
        )


def _check_trainer_state(path: Path, refuse) -> None:
    try:
        state = read_json_file(path)
    except (OSError, JSONFileError) as exc:
        raise refuse(f"{TRAINER_STATE_NAME}: {exc}") from None
    if not isinstance(state, dict):
        raise refuse(f"{TRAINER_STATE_NAME} holds a JSON {type(state).__name__}, not the object the Trainer writes")
    known = set(TrainerState.__dataclass_fields__)
    unknown = sorted(str(key) for key in state if key not in known)
    if unknown:
        raise refuse(f"{TRAINER_STATE_NAME} holds {unknown[0]!r}, which is no field of transformers' TrainerState "
                     "(the file is not what the Trainer writes)")
    for name, types in STATE_FIELD_TYPES.items():
        value = state.get(name)
        if name in state and (isinstance(value, bool) or not isinstance(value, types)):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise refuse(f"{TRAINER_STATE_NAME}: {name} is {shown(value)}, where the Trainer reads {wanted}")
    if isinstance(state.get("global_step"), int) and state["global_step"] < 0:
        raise refuse(f"{TRAINER_STATE_NAME}: global_step is {state['global_step']}, a negative step")


def _check_torch_file(path: Path, keys: tuple[str, ...], refuse) -> None:
    try:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # noqa: BLE001 -- a damaged or hostile file raises whatever its reader meets
        raise refuse(f"{path.name} cannot be read ({type(exc).__name__}: {short_message(exc)}); the save may have "
                     "been cut short, or the file is not one the Trainer wrote") from None
    if not isinstance(content, dict):
        raise refuse(f"{path.name} holds a {type(content).__name__}, where the Trainer reads a dict")
    missing = [key for key in keys if key not in content]
    if missing:
        raise refuse(f"{path.name} holds no {missing[0]!r}, which the Trainer reads from it")


def shown(value: Any) -> str:
    """``value`` for a one-line message: a short repr of a scalar, the type name of anything else."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def short_message(exc: BaseException, limit: int = 160) -> str:
    """An exception's message on one line, cut to ``limit`` characters (torch's run over several paragraphs)."""
    detail = " ".join(str(exc).split())
    return detail if len(detail) <= limit else detail[: limit - 3] + "..."
