"""The resume pre-flight: every file of a checkpoint that a resume reads is checked before the model changes.

transformers' Trainer reads a checkpoint in steps: the weights first (``_load_from_checkpoint``), then
``trainer_state.json``, the optimizer and scheduler states and the RNG states, each when training needs it. A damaged
file in a later step failed after the weights had changed, as a traceback: a truncated ``optimizer.pt`` in torch's zip
reader, a hostile pickle as ``UnpicklingError`` (refused by ``weights_only``, never run), garbage in
``trainer_state.json`` as a ``TypeError``. :func:`check_checkpoint_files` reads each of them as the Trainer will,
before anything is loaded, and refuses the checkpoint in one line (:class:`CheckpointError`) naming the file and the
problem. Every resume reaches it: both trainers' ``train(resume_from_checkpoint=...)`` (through
``checkpoint_weights.resume_argument``) and the recipe's :func:`~.checkpoints.resolve_resume`, before the model is
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
  every byte the metadata places in it, no byte placed twice; and what it says: each tensor's chunks cover its shape
  exactly once (no gap, no overlap, no negative offset or size), each stored in at least the bytes its elements take,
  so no element count exceeds what the shard files hold; the file itself no larger than the shards it describes,
  checked before it is unpickled (:func:`read_distributed_metadata`, :class:`DistributedCheckpointError`). A
  checkpoint our trainers saved also holds a manifest of its tensors' checksums, checked after the load
  (:mod:`.dcp_manifest`);
- full model weights and a PEFT adapter side by side: refused. The Trainer writes one or the other, never both, so
  such a folder holds two runs' files (a LoRA run and a full run into one ``output_dir``), and only one of them wrote
  its ``optimizer.pt`` and ``trainer_state.json``.

FSDP and DeepSpeed keep their model and optimizer states in their engines' own files, which their engines read; the
files above are checked where they are present.
"""

from __future__ import annotations

import functools
import io
import math
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
    "global_step": (int,),
    "epoch": _NUMBER,
    "max_steps": (int,),
    "num_train_epochs": _NUMBER,
    "logging_steps": _NUMBER,
    "eval_steps": _NUMBER,
    "save_steps": _NUMBER,
    "train_batch_size": (int, type(None)),
    "num_input_tokens_seen": (int,),
    "total_flos": _NUMBER,
    "log_history": (list,),
    "best_metric": (*_NUMBER, type(None)),
    "best_global_step": (int, type(None)),
    "best_model_checkpoint": (str, type(None)),
    "stateful_callbacks": (dict, type(None)),
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
#: ``distributed/.metadata`` is read only if it is at most the size of the shard files beside it plus this. torch
#: 2.13's save stores each entry in at least 1,261 bytes of shard (``torch.save`` format; a tiny MoE's model and AdamW
#: state: 90,363 bytes of metadata for 2,192,539 of shards), so a larger file describes entries with no bytes: a
#: 25 MB metadata beside a small model's shards was unpickled into a MemoryError after minutes.
DCP_METADATA_SLACK_BYTES = 2**20
#: The entries of our saves that are tensors (the model's weights, the optimizer's state: AdamW's exp_avg, exp_avg_sq
#: and step), which the restore reads as tensors; the optimizer's param_groups values may be either.
TENSOR_ENTRIES = ("model.", "optimizer.state.")


class CheckpointError(TrlMoeReplayError, ValueError):
    """A checkpoint a resume cannot restore exactly: refused, in one line, before the model changes."""


class DistributedCheckpointError(CheckpointError):
    """A checkpoint's torch distributed checkpoint (``distributed/``: a model sharded at load time) cannot be read
    safely, or cannot restore every weight (or the optimizer) being resumed."""


def refusal(
    folder: str | os.PathLike, problem: str, remedy: str, error: type[CheckpointError] = CheckpointError
) -> CheckpointError:
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
        read_distributed_metadata(
            folder,
            lambda problem: refusal(
                folder,
                problem,
                "Resume from another checkpoint-N of the run; nothing was loaded",
                DistributedCheckpointError,
            ),
        )
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
        raise refuse(
            f"{name} is a link to {target}, outside the checkpoint folder: copy the file into the folder if "
            "it belongs to this checkpoint"
        )
    try:
        mode = target.stat().st_mode
    except OSError as exc:
        raise refuse(f"{name} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise refuse(f"{name} is {kind}, not a file the Trainer writes")
    return path


def read_distributed_metadata(
    folder: str | os.PathLike, refuse, parameters: dict[str, tuple[int, ...]] | None = None
) -> Any:
    """The ``Metadata`` of checkpoint ``folder``'s ``distributed/`` shards, read without running anything it holds,
    its shard files checked (see the module docstring); ``refuse(problem)`` (which returns the exception to raise) for
    the first problem. The one reader of ``.metadata``: the pre-flight, and every DCP load of
    :mod:`.distributed_checkpoint` (which hands torch's reader this object instead of letting it unpickle the file).

    Checked before anything is loaded: its size (at most :data:`MAX_DCP_METADATA_BYTES`, and the shard files' size
    plus :data:`DCP_METADATA_SLACK_BYTES`) before it is unpickled; its types; every shard byte range inside an
    existing shard file and no two sharing a byte; every tensor's chunks covering it exactly once, each in at least
    the bytes its elements take (:func:`_layout_problem`). With ``parameters`` (the model's parameter names and
    shapes, from the restores), every optimizer state at most as large as its parameter."""
    from torch.distributed.checkpoint.metadata import Metadata

    folder = Path(folder)
    name = f"{DISTRIBUTED_FOLDER}/{DCP_METADATA_NAME}"
    path = checkpoint_file(folder, name, refuse)
    if path is None:
        raise refuse(f"it holds no {name}")
    size = path.stat().st_size
    if size > MAX_DCP_METADATA_BYTES:
        raise refuse(f"{name} holds {size:,} bytes, more than the {MAX_DCP_METADATA_BYTES:,} read")
    described = _shard_bytes(folder / DISTRIBUTED_FOLDER)
    if size > described + DCP_METADATA_SLACK_BYTES:
        raise refuse(
            f"{name} holds {size:,} bytes, more than the {described:,} bytes of shard files it describes "
            f"(+{DCP_METADATA_SLACK_BYTES:,}): torch's save writes a few hundred bytes of metadata per entry, "
            "each entry stored in over a thousand bytes of shard; it was not read"
        )
    with open(path, "rb") as file:
        data = file.read(MAX_DCP_METADATA_BYTES + 1)
    if len(data) > min(MAX_DCP_METADATA_BYTES, described + DCP_METADATA_SLACK_BYTES):  # grew since stat
        raise refuse(f"{name} grew while it was read")
    try:
        metadata = DCPMetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 -- a damaged or hostile pickle raises whatever unpickling meets
        raise refuse(
            f"{name} cannot be read ({type(exc).__name__}: {short_message(exc)}); nothing in it was run. "
            "The save may have been cut short, or the file is not one torch's distributed checkpoint "
            "wrote"
        ) from None
    if not isinstance(metadata, Metadata):
        raise refuse(
            f"{name} holds a {type(metadata).__name__}, where torch's distributed checkpoint reads its Metadata"
        )
    try:
        problem = _metadata_problem(metadata)
    except AttributeError as exc:  # an object built without the fields its class declares
        problem = f"holds an object without its fields ({short_message(exc)})"
    if problem:
        raise refuse(f"{name} {problem}, not what torch's distributed checkpoint writes")
    _check_shards(folder, metadata.storage_data, refuse)
    problem = _layout_problem(metadata)
    if problem is None and parameters is not None:
        problem = _size_problem(metadata.state_dict_metadata, parameters)
    if problem:
        raise refuse(f"{name} {problem}")
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
        return (
            f"holds state_dict_metadata {type(entries).__name__} and storage_data {type(storage).__name__}, "
            "where dicts are read"
        )
    for key, entry in entries.items():
        if isinstance(key, str) and isinstance(entry, BytesStorageMetadata):
            if key.startswith(TENSOR_ENTRIES):
                return f"describes {shown(key)} by a BytesStorageMetadata, where the restore reads a tensor"
            continue
        if not (
            isinstance(key, str)
            and isinstance(entry, TensorStorageMetadata)
            and isinstance(entry.properties, TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype)
            and isinstance(entry.size, torch.Size)
            and isinstance(entry.chunks, list)
            and all(
                isinstance(chunk, ChunkStorageMetadata)
                and isinstance(chunk.offsets, torch.Size)
                and isinstance(chunk.sizes, torch.Size)
                for chunk in entry.chunks
            )
        ):
            return f"describes {shown(key)} by a {type(entry).__name__} of other fields or types"
    info = dcp_storage_info_class()
    for index, where in storage.items():
        if not (
            isinstance(index, MetadataIndex)
            and isinstance(where, info)
            and isinstance(where.relative_path, str)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (where.offset, where.length))
        ):
            return f"places {shown(getattr(index, 'fqn', index))} by a {type(where).__name__} of other fields or types"
    return None


def _check_shards(folder: Path, storage: dict, refuse) -> None:
    """Every shard file ``storage`` (``Metadata.storage_data``) names is a regular file inside ``folder``'s
    ``distributed/``, long enough for every byte range read from it, and no two entries share a byte."""
    ends: dict[str, int] = {}
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for index, where in storage.items():
        ends[where.relative_path] = max(ends.get(where.relative_path, 0), where.offset + where.length)
        if where.length:
            ranges.setdefault(where.relative_path, []).append((where.offset, where.offset + where.length, index.fqn))
    for relative, end in sorted(ends.items()):
        if not relative or PurePosixPath(relative).is_absolute() or ".." in PurePosixPath(relative).parts:
            raise refuse(
                f"{DISTRIBUTED_FOLDER}/{DCP_METADATA_NAME} names the shard file {relative!r}, a path out of "
                f"{DISTRIBUTED_FOLDER}/ (torch's save writes file names inside it)"
            )
        name = f"{DISTRIBUTED_FOLDER}/{relative}"
        path = checkpoint_file(folder, name, refuse)
        if path is None:
            raise refuse(
                f"{name}, a shard file its {DCP_METADATA_NAME} names, is missing (a save cut short, or "
                "a copy without it)"
            )
        size = path.stat().st_size
        if size < end:
            raise refuse(
                f"{name} holds {size:,} bytes, where its {DCP_METADATA_NAME} reads up to byte {end:,} (cut short)"
            )
    for relative, spans in sorted(ranges.items()):
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise refuse(
                    f"{DISTRIBUTED_FOLDER}/{DCP_METADATA_NAME} places {shown(first, 200)} and "
                    f"{shown(second, 200)} in shared bytes of {relative!r} (byte {start:,}): torch's save "
                    "stores each entry in bytes of its own, so the metadata was changed after the save"
                )


def _shard_bytes(shards: Path) -> int:
    """The bytes of the regular files in ``shards`` (a ``distributed/`` folder) beside its ``.metadata``."""
    total = 0
    with os.scandir(shards) as entries:
        for entry in entries:
            if entry.name != DCP_METADATA_NAME and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def _layout_problem(metadata) -> str | None:
    """Where ``metadata`` does not describe every tensor exactly once: each entry placed in the shards, each
    tensor's chunks inside its shape (no negative offset or size), at offsets of their own, covering every element
    once (no gap: DCP leaves a gap at the value the model had; no overlap), each in at least the bytes its elements
    take (torch's save stores a chunk's every element, in ``torch.save`` format or raw, unless a storage transform
    compressed it), which bounds every element count by the shard files' size."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    storage = metadata.storage_data
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            if MetadataIndex(key) not in storage:
                return f"places {shown(key, 200)} in no shard (it holds no storage entry for it)"
            continue
        shape = tuple(entry.size)
        if any(n < 0 for n in shape):
            return f"gives {shown(key, 200)} the shape {list(shape)}"
        numel, itemsize, covered, seen = math.prod(shape), _itemsize(entry.properties.dtype), 0, set()
        for chunk in entry.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if (
                len(offsets) != len(shape)
                or len(sizes) != len(shape)
                or min((*offsets, *sizes), default=0) < 0
                or any(o + n > dim for o, n, dim in zip(offsets, sizes, shape, strict=True))
            ):
                return (
                    f"gives {shown(key, 200)} (shape {list(shape)}) a chunk at offsets {list(offsets)} of sizes "
                    f"{list(sizes)}, outside the tensor"
                )
            if offsets in seen:
                return f"gives {shown(key, 200)} two chunks at offsets {list(offsets)}"
            seen.add(offsets)
            where = storage.get(MetadataIndex(key, chunk.offsets))
            if where is None:
                return f"places the chunk of {shown(key, 200)} at offsets {list(offsets)} in no shard"
            volume = math.prod(sizes)
            if not getattr(where, "transform_descriptors", None) and where.length < volume * itemsize:
                return (
                    f"stores the chunk of {shown(key, 200)} at offsets {list(offsets)} ({volume:,} elements of "
                    f"{entry.properties.dtype}) in {where.length:,} bytes, fewer than its elements take"
                )
            covered += volume
        if covered != numel:
            why = "a gap, which would keep the values the model had there" if covered < numel else "chunks overlap"
            return (
                f"covers {covered:,} of the {numel:,} elements of {shown(key, 200)} with its {len(entry.chunks)} "
                f"chunks ({why})"
            )
        overlap = _overlap(entry.chunks)
        if overlap:
            return (
                f"gives {shown(key, 200)} chunks that overlap (at offsets {list(overlap[0])} and {list(overlap[1])})"
            )
    return None


def _overlap(chunks) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The offsets of two of ``chunks`` (inside their tensor, at offsets of their own) that share an element."""
    boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks if math.prod(c.sizes) > 0 and len(c.sizes))
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in boxes:  # a sweep along dim 0: only chunks whose rows reach this one's can share an element
        active = [(o, s) for o, s in active if o[0] + s[0] > offsets[0]]
        for o, s in active:
            if all(o[d] < offsets[d] + sizes[d] and offsets[d] < o[d] + s[d] for d in range(len(offsets))):
                return o, offsets
        active.append((offsets, sizes))
    return None


def _size_problem(entries: dict, parameters: dict[str, tuple[int, ...]]) -> str | None:
    """An optimizer state (``optimizer.state.<parameter>.<name>``, the flattened keys our saves write) with more
    elements than the parameter it belongs to (a moment: as many; Adam's step: one)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "optimizer.state."
    for key, entry in entries.items():
        if not (key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)):
            continue
        fqn = key[len(prefix) :].rpartition(".")[0]
        if fqn in parameters:
            numel, most = math.prod(entry.size), max(1, math.prod(parameters[fqn]))
            if numel > most:
                return (
                    f"gives the optimizer state {shown(key[len(prefix) :], 200)} {numel:,} elements (shape "
                    f"{list(entry.size)}), more than the {most:,} of the model's parameter {shown(fqn, 200)}"
                )
    return None


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
        raise refuse(
            f"{TRAINER_STATE_NAME} holds {unknown[0]!r}, which is no field of transformers' TrainerState "
            "(the file is not what the Trainer writes)"
        )
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
        raise refuse(
            f"{path.name} cannot be read ({type(exc).__name__}: {short_message(exc)}); the save may have "
            "been cut short, or the file is not one the Trainer wrote"
        ) from None
    if not isinstance(content, dict):
        raise refuse(f"{path.name} holds a {type(content).__name__}, where the Trainer reads a dict")
    missing = [key for key in keys if key not in content]
    if missing:
        raise refuse(f"{path.name} holds no {missing[0]!r}, which the Trainer reads from it")


def shown(value: Any, limit: int = 60) -> str:
    """``value`` for a one-line message: a repr of a scalar (cut to ``limit`` characters), the type name of anything
    else."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_message(exc: BaseException, limit: int = 160) -> str:
    """An exception's message on one line, cut to ``limit`` characters (torch's run over several paragraphs)."""
    detail = " ".join(str(exc).split())
    return detail if len(detail) <= limit else detail[: limit - 3] + "..."
