"""Resume integrity: a checkpoint restores every weight of the model, or it is refused in one line.

transformers' Trainer reads a checkpoint's weights with ``load_state_dict(strict=False)``: a weight the file lacks
keeps the value it had, with a logged warning. An empty or partial weights file, or the Hub layout ``save_pretrained``
writes for fused MoE experts (per-expert names the model lacks, transformers#48805), resumed at initial weights;
NaN weights loaded and failed later, inside ``generate``. :func:`restore_checkpoint_weights` is the one load that
every resume and ``load_best_model_at_end`` of our trainers (sync and async) goes through, via
:func:`restore_trainer_weights`.

It checks the whole checkpoint before it changes the model: every weight present, none extra, each of the model's
shape and dtype, and finite (each file is read twice, once to check and once to load, one file in memory at a time). The layouts are what transformers writes: ``model.safetensors``, sharded safetensors with
their index, ``pytorch_model.bin`` (read with ``weights_only=True``) and sharded ``.bin``, each under the model's own
names or under the names ``save_pretrained`` writes (what :func:`~trl_moe_replay.upstream.saved_weight_layout` says,
transformers' reverse conversion); a PEFT model's checkpoint holds only the adapter (``adapter_model.safetensors``,
adapter and ``modules_to_save`` weights, PEFT's own state dict), and the base weights stay as they are. Weights tied to
another (``lm_head`` to the embeddings) are one weight; names the model keeps out of its checkpoints
(``_keys_to_ignore_on_save``: PR2's predictors, restored from their own file) are not expected.

FSDP and DeepSpeed checkpoints are their engines' own formats and are loaded by them (the Trainer's code). A model
sharded at load time by transformers (``distributed_config``, expert parallelism), whose checkpoints transformers
cannot resume, is saved and restored in shards with torch's distributed checkpoint (:mod:`.distributed_checkpoint`),
through the same entry points, under the same promise.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from transformers import PreTrainedModel
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    logging,
)

from ..upstream import saved_weight_layout
from . import distributed_checkpoint

logger = logging.get_logger(__name__)

#: (single file, shard index) of each format, in the order the Trainer prefers them
MODEL_WEIGHT_FILES = ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME))
ADAPTER_WEIGHT_FILES = (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
#: what reading a truncated, damaged or hostile weights file raises (torch.load's unsafe pickles included)
_UNREADABLE = (SafetensorError, pickle.UnpicklingError, EOFError, OSError, RuntimeError, ValueError, KeyError)


class CheckpointWeightsError(ValueError):
    """A checkpoint's model weights cannot restore every weight of the model being resumed."""


class RestoresEveryWeight:
    """Trainer mixin (before the Trainer in the bases): a resume (``_load_from_checkpoint``) and
    ``_load_best_model`` restore every weight through :func:`restore_trainer_weights`, or refuse; transformers'
    own load (``load_state_dict(strict=False)``) leaves what it does not find at its initial value
    (transformers#48805, empty or partial files)."""

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not restore_trainer_weights(self, resume_from_checkpoint, model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        if not restore_trainer_weights(self, self.state.best_model_checkpoint):
            super()._load_best_model()

    # a model sharded at load time (distributed_config): its optimizer in shards, which transformers cannot save
    def _save_optimizer_and_scheduler(self, output_dir):
        if distributed_checkpoint.uses_distributed_checkpoint(self):
            distributed_checkpoint.save_training_state(self, output_dir)
        else:
            super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None and distributed_checkpoint.uses_distributed_checkpoint(self):
            distributed_checkpoint.restore_optimizer_and_scheduler(self, checkpoint)
        else:
            super()._load_optimizer_and_scheduler(checkpoint)


def restore_trainer_weights(trainer, folder: str | os.PathLike, model: torch.nn.Module | None = None) -> bool:
    """A trainer's resume (``_load_from_checkpoint``) and ``_load_best_model``: restore ``model`` (the trainer's
    model by default) from checkpoint ``folder`` through :func:`restore_checkpoint_weights` (a model sharded at load
    time: from its shards, :func:`.distributed_checkpoint.restore_model`). Returns ``False``, and leaves the load to
    the Trainer, for FSDP and DeepSpeed, whose checkpoints their engines read."""
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        return False
    if distributed_checkpoint.uses_distributed_checkpoint(trainer):
        unwrapped = trainer.accelerator.unwrap_model(trainer.model if model is None else model)
        distributed_checkpoint.restore_model(unwrapped, folder)
        return True
    restore_checkpoint_weights(trainer.accelerator.unwrap_model(trainer.model if model is None else model), folder)
    return True


def restore_checkpoint_weights(model: torch.nn.Module, folder: str | os.PathLike) -> None:
    """Load every weight of ``model`` from checkpoint ``folder`` (any layout of the module docstring), or raise
    :class:`CheckpointWeightsError` naming the folder and the first problem, leaving ``model`` unchanged: a weight
    missing, a name that is no weight of the model, a shape or dtype other than the model's, a NaN or inf value, a
    file that cannot be read."""
    folder = Path(folder)
    kind = type(model.get_base_model() if is_peft_model(model) else model).__name__

    def refuse(problem: str) -> CheckpointWeightsError:
        return CheckpointWeightsError(
            f"checkpoint {folder} refused: {' '.join(problem.split())}. Resume from another checkpoint-N of the run, "
            "or with the model that wrote this one; the weights were left as they were"
        )

    files = _weight_files(folder, adapters=is_peft_model(model), refuse=refuse)
    layouts, aliases, buffers = _expected_layouts(model)
    names = {_canonical(name, aliases) for file in files for name in _names_in(file, refuse)}
    layout_name, expected = _closest(layouts, names)
    missing = [name for name in expected if name not in names]
    if missing:
        raise refuse(f"{missing[0]!r} is missing from it ({len(missing)} of the {len(expected)} tensors a checkpoint "
                     f"of {kind} holds are missing)")
    extra = sorted(names - expected.keys())
    if extra:
        raise refuse(f"it holds {extra[0]!r}, which is no weight of {kind} ({len(extra)} such names)")
    for name, tensor in _tensors(files, aliases, refuse):
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape:
            raise refuse(f"{name!r} has shape {list(tensor.shape)} where {kind} has {list(shape)}")
        if tensor.dtype != dtype:
            raise refuse(f"{name!r} is {tensor.dtype} where {kind} holds {dtype}")
        if tensor.is_floating_point() and name not in buffers and not torch.isfinite(tensor).all():
            raise refuse(f"{name!r} holds NaN or infinite values")

    if layout_name == "adapter":
        from peft.utils import set_peft_model_state_dict

        for _, tensors in _files_read(files, aliases, refuse):
            set_peft_model_state_dict(model, tensors, adapter_name=model.active_adapter)
    elif layout_name == "model":
        for _, tensors in _files_read(files, aliases, refuse):
            model.load_state_dict(tensors, strict=False)
    else:
        _load_converted(model, folder, aliases, refuse)


def _load_converted(model: PreTrainedModel, folder: Path, aliases: dict[str, str], refuse) -> None:
    """The names ``save_pretrained`` writes, back to the model's own through transformers' conversion:
    ``from_pretrained`` builds a copy of the model from the checkpoint on the CPU (one more set of weights in CPU
    memory while it lasts), whose weights are copied in, unchanged to the last bit."""
    logger.info(f"{folder}: weights in the layout save_pretrained writes; loading them through from_pretrained")
    try:
        converted, info = type(model).from_pretrained(
            folder, config=copy.deepcopy(model.config), dtype=model.dtype, output_loading_info=True
        )
    except _UNREADABLE as exc:  # checked above: only a file changed meanwhile gets here
        raise refuse(f"transformers could not convert its weights ({type(exc).__name__}: {exc})") from exc
    lacking = sorted([*info.get("missing_keys", ()), *(str(k) for k in info.get("mismatched_keys", ())),
                      *info.get("conversion_errors", {})])
    if lacking:
        raise refuse(f"transformers' conversion left {lacking[0]!r} unloaded")
    state = {_canonical(name, aliases): tensor for name, tensor in converted.state_dict().items()}
    model.load_state_dict(state, strict=False)


# ------------------------------------------------------------------------------------------------- what is expected
def _expected_layouts(model) -> tuple[dict[str, dict], dict[str, str], set[str]]:
    """``({layout: {name: (shape, dtype)}}, aliases, buffer names)``: the layouts a checkpoint of ``model`` may be
    in, ``aliases`` the names of tied weights beyond the first (``lm_head.weight`` -> ``model.embed_tokens.weight``)."""
    if is_peft_model(model):
        from peft.utils import get_peft_model_state_dict

        return {"adapter": _table(get_peft_model_state_dict(model))}, {}, set()
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    own: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in ignored:
            continue
        if id(tensor) in first_name:
            aliases[name] = first_name[id(tensor)]
        else:
            first_name[id(tensor)] = name
            own[name] = tensor.detach()
    layouts = {"model": _table(own)}
    if isinstance(model, PreTrainedModel):
        saved = _table(saved_weight_layout(model, own))
        if saved != layouts["model"]:
            layouts["saved"] = saved
    return layouts, aliases, {name for name, _ in model.named_buffers()}


def _table(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}


def _closest(layouts: dict[str, dict], names: set[str]) -> tuple[str, dict]:
    """The layout ``names`` is in, or the one it is closest to (most names in common), to name its first problem."""
    return max(layouts.items(), key=lambda item: (len(names & item[1].keys()), -len(item[1].keys() ^ names)))


def _canonical(name: str, aliases: dict[str, str]) -> str:
    return aliases.get(name, name)


# ------------------------------------------------------------------------------------------------- reading the files
def _weight_files(folder: Path, adapters: bool, refuse) -> list[Path]:
    """The files holding ``folder``'s model weights (the adapter's for a PEFT model), in the Trainer's preference."""
    if not folder.is_dir():
        raise refuse("no such folder")
    if adapters:
        for name in ADAPTER_WEIGHT_FILES:
            if (folder / name).is_file():
                return [folder / name]
        raise refuse(f"the model is a PEFT model and the folder holds no {' or '.join(ADAPTER_WEIGHT_FILES)}")
    for single, index in MODEL_WEIGHT_FILES:
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise refuse(f"{index} is unreadable ({type(exc).__name__}: {exc})") from exc
            absent = [shard for shard in shards if not (folder / shard).is_file()]
            if absent or not shards:
                raise refuse(f"{index} names shard {absent[0] if absent else '(none)'!r}, which is not in the folder")
            return [folder / shard for shard in shards]
    found = ", ".join(f for pair in MODEL_WEIGHT_FILES for f in pair)
    raise refuse(f"it holds no model weights (one of {found}, or adapter_model.safetensors for a PEFT model)")


def _names_in(file: Path, refuse) -> list[str]:
    try:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt") as weights:
                return list(weights.keys())
        return list(_torch_load(file))
    except _UNREADABLE as exc:
        raise _unreadable(file, exc, refuse) from exc


def _files_read(files: list[Path], aliases: dict[str, str], refuse) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    """Each file's tensors under the model's names (a tied weight once), one file in memory at a time."""
    for file in files:
        try:
            tensors = load_file(file, device="cpu") if file.suffix == ".safetensors" else _torch_load(file)
        except _UNREADABLE as exc:
            raise _unreadable(file, exc, refuse) from exc
        # a tied weight's second name is dropped when its first is there too
        yield file, {_canonical(name, aliases): tensor for name, tensor in tensors.items()
                     if name not in aliases or aliases[name] not in tensors}


def _tensors(files: list[Path], aliases: dict[str, str], refuse) -> Iterator[tuple[str, torch.Tensor]]:
    for _, tensors in _files_read(files, aliases, refuse):
        yield from tensors.items()


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` weights file, safely: tensors only (``weights_only``), never code."""
    # mapped, not read, where torch.save wrote its zip format (the legacy format cannot be mapped)
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"holds a {type(state).__name__}, not a dict of tensors")
    return state


def _unreadable(file: Path, exc: BaseException, refuse) -> CheckpointWeightsError:
    detail = " ".join(str(exc).split())
    detail = detail if len(detail) <= 160 else detail[:157] + "..."
    return refuse(f"{file.name} cannot be read ({type(exc).__name__}: {detail}); the save may have been cut short")
