"""The content check of a distributed checkpoint: each tensor's checksum, written beside the shards when our trainers
save them, compared with what a resume loaded before the first step.

The resume pre-flight checks a DCP checkpoint's structure before anything is loaded
(:func:`~.checkpoint_files.read_distributed_metadata`): every tensor covered once, in bytes of its own. What structure
cannot show is bytes that fit but belong elsewhere: two layers' storage swapped in the ``.metadata``, a shard
rewritten. Each save of :mod:`.distributed_checkpoint` writes ``distributed/manifest.json``: for every tensor of the
saved state (model weights, optimizer states), its shape, dtype and a checksum that does not depend on how the tensor
is sharded, so a resume under another layout (EP 2 x FSDP 2 to FSDP 2, or without expert parallelism) computes the same
from the tensors it loaded. The checksum is two sums over the tensor's elements of (the element's bits + 1) times a
weight of its position in the whole tensor, modulo 2^31 - 1 (62 bits in all): each rank sums over the chunk it holds,
the chunks are gathered with torch's ``all_gather_object`` (a replica counted once) and added. A value moved, changed
or left at its initial value changes it.

A checkpoint without a manifest (written by another tool, or before this file existed) is still checked by
structure, and the run says so in one line.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from ..bounded_json import JSONFileError, read_json_file
from ..upstream import dcp_local_chunk


logger = logging.get_logger(__name__)

MANIFEST_NAME = "manifest.json"  # in checkpoint-N/distributed/, beside torch's .metadata
FORMAT = 1
_PRIME = 2**31 - 1
#: (a, b, c) of each weighting w(i) = a*i^2 + b*i + c (mod _PRIME), i an element's flat index in the whole tensor
_WEIGHTS = ((48271, 69621, 1), (16807, 39373, 7))
_BLOCK = 2**22  # elements summed at once (a few int64 temporaries of this size)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_warned: set[str] = set()


def flat_tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict under DCP's flattened keys (``model.<name>``, ``optimizer.state.<...>``)."""
    found: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found.update(flat_tensors(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            found[name] = value
    return found


def checksums(state: dict) -> dict[str, dict[str, Any]]:
    """``{key: {"shape", "dtype", "checksum"}}`` of every tensor of ``state`` (a nested state dict, DTensors or plain
    tensors), the same on every rank and under any sharding (collective where torch.distributed is initialised)."""
    tensors = flat_tensors(state)
    partial: list[tuple[str, tuple[int, ...], tuple[int, int] | None]] = []
    for key, tensor in tensors.items():
        local, offsets = dcp_local_chunk(tensor)
        partial.append((key, offsets, _chunk_sums(local.detach(), offsets, tuple(tensor.shape))))
    gathered = [partial]
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        gathered = [[] for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(gathered, partial)
    sums: dict[str, list[int] | None] = {}
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for key, offsets, value in (item for rank in gathered for item in rank):
        if (key, offsets) in seen:  # a replica of a chunk another rank holds
            continue
        seen.add((key, offsets))
        total = sums.setdefault(key, [0, 0])
        if value is None or total is None:
            sums[key] = None
        else:
            sums[key] = [(total[0] + value[0]) % _PRIME, (total[1] + value[1]) % _PRIME]
    return {
        key: {"shape": list(tensor.shape), "dtype": str(tensor.dtype), "checksum": sums[key]}
        for key, tensor in tensors.items()
    }


def _chunk_sums(local: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """This rank's part of the checksum: the sums over ``local`` (the chunk at ``offsets`` of a tensor of ``shape``);
    ``None`` for a dtype of no integer width (complex), whose checksum is not kept."""
    bits_dtype = _BITS.get(local.element_size())
    if bits_dtype is None:
        return None
    if local.numel() == 0:
        return 0, 0
    device = local.device
    values = local.contiguous().view(bits_dtype).reshape(local.shape[0] if local.dim() else 1, -1)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    inner = torch.zeros(1, dtype=torch.int64, device=device)  # the flat index of each element of a row, in the whole
    for d in range(1, local.dim()):
        positions = (offsets[d] + torch.arange(local.shape[d], device=device)) * strides[d]
        inner = (inner[:, None] + positions[None, :]).reshape(-1)
    rows = max(1, _BLOCK // max(1, inner.numel()))
    sums = torch.zeros(len(_WEIGHTS), dtype=torch.int64, device=device)  # on the device: one sync per chunk
    for start in range(0, values.shape[0], rows):
        block = values[start : start + rows].to(torch.int64).remainder(_PRIME) + 1
        first = (
            (offsets[0] + torch.arange(start, start + block.shape[0], device=device)) * strides[0]
            if local.dim()
            else torch.zeros(1, dtype=torch.int64, device=device)
        )
        index = (first[:, None] + inner[None, :]).remainder(_PRIME)
        square = (index * index).remainder(_PRIME)
        for n, (a, b, c) in enumerate(_WEIGHTS):
            weight = (square * a + index * b + c).remainder(_PRIME)
            sums[n] = (sums[n] + (weight * block).remainder(_PRIME).sum()).remainder(_PRIME)
    first_sum, second_sum = (int(value) for value in sums.tolist())
    return first_sum, second_sum


def write_manifest(shards: str | os.PathLike, state: dict, should_write: bool) -> None:
    """The checksums of ``state`` (as saved into the ``shards`` folder) into ``shards/manifest.json``, written by the
    process that ``should_write`` (collective: every rank computes its part)."""
    tensors = checksums(state)
    if not should_write:
        return
    path = Path(shards) / MANIFEST_NAME
    partial = path.with_name(f".{MANIFEST_NAME}.partial")
    partial.write_text(json.dumps({"format": FORMAT, "tensors": tensors}))
    os.replace(partial, path)


def verify_loaded(checkpoint: str | os.PathLike, shards: str | os.PathLike, state: dict, refuse) -> None:
    """Raise ``refuse(problem)`` unless every tensor of ``state`` (just loaded from ``shards``) has the shape, dtype
    and checksum ``shards/manifest.json`` gives it; without a manifest, say once that the checkpoint was checked by
    structure only (collective: every rank computes its part)."""
    path = Path(shards) / MANIFEST_NAME
    if not os.path.lexists(path):
        if str(checkpoint) not in _warned:
            _warned.add(str(checkpoint))
            logger.warning(
                f"checkpoint {checkpoint}: {Path(shards).name}/ holds no {MANIFEST_NAME} (not written by "
                "trl_moe_replay's trainers): its structure was checked, its values cannot be; resuming"
            )
        return
    loaded = checksums(state)
    saved = _read_manifest(path, refuse)
    where = f"{Path(shards).name}/{MANIFEST_NAME}"
    differ = [key for key in loaded if saved.get(key) != loaded[key]]
    if not differ:
        return
    key = differ[0]
    if key not in saved:
        raise refuse(
            f"its shards hold {key!r}, which its {where} (written by the save) does not list: the metadata "
            "was changed after the save"
        )
    what = next(field for field in ("shape", "dtype", "checksum") if saved[key].get(field) != loaded[key][field])
    raise refuse(
        f"{key!r} as loaded from its shards has another {what} than the save wrote in {where} "
        f"({len(differ)} of the {len(loaded)} tensors loaded differ): its shards or their .metadata were "
        "changed after the save (another tensor's bytes, or a value not loaded)"
    )


def _read_manifest(path: Path, refuse) -> dict[str, dict]:
    try:
        content = read_json_file(path)
    except (OSError, JSONFileError) as exc:
        raise refuse(f"its {path.parent.name}/{MANIFEST_NAME} cannot be read ({exc})") from None
    tensors = content.get("tensors") if isinstance(content, dict) and content.get("format") == FORMAT else None
    if not isinstance(tensors, dict) or not all(isinstance(v, dict) for v in tensors.values()):
        raise refuse(
            f"its {path.parent.name}/{MANIFEST_NAME} is not the manifest our save writes (format {FORMAT}: "
            "a tensors object)"
        )
    return tensors


__all__ = ["MANIFEST_NAME", "checksums", "flat_tensors", "verify_loaded", "write_manifest"]
