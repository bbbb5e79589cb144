"""Resume integrity: a checkpoint restores every weight of the model, or it is refused in one line.

transformers' Trainer reads a checkpoint's weights with ``load_state_dict(strict=False)``: a weight the file lacks
keeps the value it had, with a logged warning. An empty or partial weights file, or the Hub layout ``save_pretrained``
writes for fused MoE experts (per-expert names the model lacks, transformers#48805), resumed at initial weights;
NaN weights loaded and failed later, inside ``generate``. :func:`restore_checkpoint_weights` is the one load that
every resume and ``load_best_model_at_end`` of our trainers (sync and async) goes through, via
:func:`restore_trainer_weights`.

It checks the whole checkpoint before it changes the model: every weight present, none extra, each of the model's shape
and dtype, and finite (each file is read twice, once to check and once to load, one file in memory at a time). The
layouts are what transformers writes: ``model.safetensors``, sharded safetensors with their index,
``pytorch_model.bin`` (read with ``weights_only=True``) and sharded ``.bin``, each under the model's own names or under
the names ``save_pretrained`` writes (seam entry ``saved_weight_layout``: transformers' reverse conversion); a PEFT
model's checkpoint holds only the adapter (``adapter_model.safetensors``, adapter and ``modules_to_save`` weights,
PEFT's own state dict), and the base weights stay as they are. Weights tied to another (``lm_head`` to the embeddings)
are one weight; names the model keeps out of its checkpoints (seam entry ``keys_ignored_on_save``: PR2's predictors,
restored from their own file) are not expected.

Every file read is a regular file inside the checkpoint folder (a link out of it is refused), an index names its
shards by file name, of its own format; ``.bin`` files hold dense tensors under text names. A tied pair whose two
names the checkpoint holds with different values (an untied model's checkpoint resumed into a tied one) is refused:
loading one would drop the other. The names ``save_pretrained`` writes are converted by ``from_pretrained`` on a
folder of links to the checked weight files alone, so nothing else in the checkpoint (a PEFT adapter another run left
there, whose ``adapter_config.json`` ``from_pretrained`` would attach) takes part, and the converted weights must
cover every weight of the model before any is copied in. Files beside the weights (optimizer, scheduler, RNG, trainer
state) are checked before this by the resume pre-flight (checkpointing/checkpoint_files.py), which the trainers' ``train``
runs.

FSDP and DeepSpeed checkpoints are their engines' own formats and are loaded by them (the Trainer's code). A model
sharded at load time by transformers (``distributed_config``, expert parallelism), whose checkpoints transformers
cannot resume, is saved and restored in shards with torch's distributed checkpoint (:mod:`.distributed_checkpoint`),
through the same entry points, under the same promise.
"""

from __future__ import annotations

import copy
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from accelerate.utils import is_peft_model
from safetensors import safe_open
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

from ..bounded_json import JSONFileError, read_json_file
from ..upstream.transformers_seam import keys_ignored_on_save, saved_weight_layout
from . import distributed_checkpoint
from .checkpoint_files import (
    CheckpointError,
    check_checkpoint_files,
    checkpoint_file,
    refusal,
    short_message,
    shown,
)
from .checkpoints import resolve_resume


logger = logging.get_logger(__name__)

#: (single file, shard index) of each format, in the order the Trainer prefers them
MODEL_WEIGHT_FILES = ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME))
ADAPTER_WEIGHT_FILES = (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)


class CheckpointWeightsError(CheckpointError):
    """A checkpoint's model weights cannot restore every weight of the model being resumed."""


def resume_argument(trainer, resume_from_checkpoint):
    """``train(resume_from_checkpoint=...)``'s argument as the Trainer should get it: ``True`` becomes the newest
    *complete* checkpoint, as the recipe resumes (:func:`~.checkpoints.resolve_resume`: one with its
    ``trainer_state.json``, which the Trainer writes last), where transformers takes the newest folder, a save cut short
    included; a named checkpoint has its files checked (:func:`~.checkpoint_files.check_checkpoint_files`) before the
    Trainer reads any. The base of both trainers (``MoEReplayTrainerMixin.train``) calls it."""
    if resume_from_checkpoint is True:  # the newest complete checkpoint-N, its files checked
        assert trainer.args.output_dir is not None  # TrainingArguments defaults it ("trainer_output")
        return resolve_resume(True, trainer.args.output_dir)
    if resume_from_checkpoint:
        check_checkpoint_files(resume_from_checkpoint)
    return resume_from_checkpoint


def stop_if_resumed_complete(trainer) -> bool:
    """For ``get_batch_samples``: ``True`` (and the Trainer told to stop) for a run resumed at or past its last step
    (seam entry ``resume_at_max_steps``): the Trainer judges ``max_steps`` only after a step, so it would train a step
    ``max_steps + 1``; a run resumed at its last step trains nothing."""
    state = trainer.state
    if not 0 < state.max_steps <= state.global_step:
        return False
    if not trainer.control.should_training_stop and trainer.accelerator.is_main_process:
        logger.warning(
            f"resumed at step {state.global_step} of {state.max_steps}: the run is complete, no "
            "step is trained (raise max_steps to train on)"
        )
    trainer.control.should_training_stop = True
    return True


def save_training_state(trainer, output_dir: str, save: Callable[[str], None]) -> None:
    """``_save_optimizer_and_scheduler``: a model sharded at load time (``distributed_config``) keeps its optimizer in
    shards, which transformers cannot save; any other goes to the Trainer's ``save``."""
    if distributed_checkpoint.uses_distributed_checkpoint(trainer):
        distributed_checkpoint.save_training_state(trainer, output_dir)
    else:
        save(output_dir)


def restore_training_state(trainer, checkpoint: str | None, load: Callable[[str | None], None]) -> None:
    """``_load_optimizer_and_scheduler``: the optimizer and scheduler from the shards of a checkpoint written sharded
    at load time, or refused where the engine cannot read them; any other checkpoint goes to the Trainer's ``load``."""
    if checkpoint is not None and distributed_checkpoint.uses_distributed_checkpoint(trainer):
        distributed_checkpoint.restore_optimizer_and_scheduler(trainer, checkpoint)
    elif checkpoint is not None and distributed_checkpoint.holds_training_state_in_shards(checkpoint):
        # written sharded at load time (expert parallelism), resumed without: the Trainer would find no
        # optimizer.pt and start the optimizer and scheduler afresh
        if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
            raise distributed_checkpoint.DistributedCheckpointError(
                f"checkpoint {checkpoint} refused: its optimizer and scheduler are in torch distributed checkpoint "
                f"shards ({distributed_checkpoint.FOLDER}/, written by a run sharded at load time: expert "
                f"parallelism), which {'FSDP' if trainer.is_fsdp_enabled else 'DeepSpeed'} does not read. Resume "
                "with the distributed_config (ep_size) that wrote it, or without FSDP and DeepSpeed"
            )
        distributed_checkpoint.restore_optimizer_and_scheduler(trainer, checkpoint)
    else:
        load(checkpoint)


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
    missing, a name that is no weight of the model, a shape or dtype other than the model's, a NaN or inf value,
    two different values for one tied weight, a file that cannot be read or is not the checkpoint's own (a link out of
    its folder)."""
    folder = Path(folder)
    base = model.get_base_model() if is_peft_model(model) else model  # type: ignore[operator]  # a PeftModel's method
    kind = type(base).__name__

    def refuse(problem: str) -> CheckpointWeightsError:
        error = refusal(
            folder,
            problem,
            "Resume from another checkpoint-N of the run, or with the model that wrote "
            "this one; the weights were left as they were",
            error=CheckpointWeightsError,
        )
        return cast(CheckpointWeightsError, error)  # refusal builds an instance of the `error` class it is given

    files, index = _weight_files(folder, adapters=is_peft_model(model), refuse=refuse)
    layouts, aliases, buffers = _expected_layouts(model)
    names = {_canonical(name, aliases) for file in files for name in _names_in(file, refuse)}
    layout_name, expected = _closest(layouts, names)
    missing = [name for name in expected if name not in names]
    if missing:
        raise refuse(
            f"{missing[0]!r} is missing from it ({len(missing)} of the {len(expected)} tensors a checkpoint "
            f"of {kind} holds are missing){_untied_hint(model, missing)}"
        )
    extra = sorted(names - expected.keys())
    if extra:
        raise refuse(f"it holds {extra[0]!r}, which is no weight of {kind} ({len(extra)} such names)")
    tied_seen: dict[str, tuple[str, torch.Tensor]] = {}  # a tied weight's first name in the files -> its tensor
    for saved_name, tensor in _tensors(files, refuse):
        name = _canonical(saved_name, aliases)
        if name in tied_seen:  # the second name of a tied pair: one weight, so the same values or refused
            first_name, first = tied_seen[name]
            if tensor.shape != first.shape or not torch.equal(tensor, first):
                raise refuse(
                    f"it holds {first_name!r} and {saved_name!r} with different values, where {kind} ties them into "
                    "one weight (tie_word_embeddings=True): it was written by a model with untied embeddings, and "
                    "loading one would drop the other. Resume with tie_word_embeddings=False, as the run that wrote it"
                )
            continue
        if name in aliases.values():
            tied_seen[name] = (saved_name, tensor)
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape:
            raise refuse(f"{name!r} has shape {list(tensor.shape)} where {kind} has {list(shape)}")
        if tensor.dtype != dtype:
            raise refuse(f"{name!r} is {tensor.dtype} where {kind} holds {dtype}")
        if tensor.is_floating_point() and name not in buffers and not torch.isfinite(tensor).all():
            raise refuse(f"{name!r} holds NaN or infinite values")
    del tied_seen

    if layout_name == "adapter":
        from peft.utils import set_peft_model_state_dict

        for tensors in _files_read(files, aliases, refuse):
            set_peft_model_state_dict(model, tensors, adapter_name=model.active_adapter)
    elif layout_name == "model":
        for tensors in _files_read(files, aliases, refuse):
            model.load_state_dict(tensors, strict=False)
    else:
        # a transformers model: the other layouts are its save_pretrained conversions (_expected_layouts)
        _load_converted(cast(PreTrainedModel, model), files, index, layouts["model"], aliases, refuse)


def _load_converted(
    model: PreTrainedModel,
    files: list[Path],
    index: Path | None,
    own: dict[str, tuple],
    aliases: dict[str, str],
    refuse,
) -> None:
    """The names ``save_pretrained`` writes, back to the model's own through transformers' conversion:
    ``from_pretrained`` builds a copy of the model on the CPU (one more set of weights in CPU memory while it lasts)
    from a folder of links to the checked weight files alone (and their index), so no other file of the checkpoint
    takes part (a stray PEFT adapter would be attached, and its ``base_model_name_or_path`` followed). Its weights
    must be every weight of the model (``own``), which are then copied in, unchanged to the last bit."""
    logger.info(
        f"{files[0].parent}: weights in the layout save_pretrained writes; loading them through from_pretrained"
    )
    with tempfile.TemporaryDirectory(prefix="trl_moe_replay_resume_") as view:
        for file in [*files, *([index] if index else [])]:
            os.symlink(file.resolve(), os.path.join(view, file.name))
        config = copy.deepcopy(model.config)
        # the model's own config, there to be found: from_pretrained looks for a generation config in the folder and
        # falls back to config.json (transformers 5.24 fails with a TypeError where neither is present)
        config.to_json_file(os.path.join(view, "config.json"))
        try:
            # output_loading_info=True: (model, info), which transformers' annotation does not say
            loaded: Any = type(model).from_pretrained(view, config=config, dtype=model.dtype, output_loading_info=True)
            converted, info = loaded
        except Exception as exc:  # noqa: BLE001 -- checked above: only a file changed meanwhile gets here
            raise refuse(
                f"transformers could not convert its weights ({type(exc).__name__}: {short_message(exc)})"
            ) from exc
    lacking = sorted(
        [
            *info.get("missing_keys", ()),
            *(str(k) for k in info.get("mismatched_keys", ())),
            *info.get("conversion_errors", {}),
        ]
    )
    if lacking:
        raise refuse(f"transformers' conversion left {lacking[0]!r} unloaded")
    state = {_canonical(name, aliases): tensor for name, tensor in converted.state_dict().items()}
    absent = sorted(own.keys() - state.keys())
    if absent:
        raise refuse(f"transformers' conversion gave no {absent[0]!r} ({len(absent)} weights of the model)")
    model.load_state_dict({name: state[name] for name in own}, strict=False)


def _untied_hint(model: torch.nn.Module, missing: list[str]) -> str:
    """Why a checkpoint lacks exactly the output embeddings of an untied model: a tied model wrote it."""
    output = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    weight = getattr(output, "weight", None)
    if weight is None or len(missing) != 1 or dict(model.named_parameters()).get(missing[0]) is not weight:
        return ""
    return (
        "; it was written by a model with tied embeddings (tie_word_embeddings=True), which saves the output "
        "embeddings once, under the input embeddings' name: resume with tie_word_embeddings=True, as that run"
    )


# ------------------------------------------------------------------------------------------------- what is expected
def _expected_layouts(model) -> tuple[dict[str, dict], dict[str, str], set[str]]:
    """``({layout: {name: (shape, dtype)}}, aliases, buffer names)``: the layouts a checkpoint of ``model`` may be
    in, ``aliases`` the names of tied weights beyond the first (``lm_head.weight`` -> ``model.embed_tokens.weight``)."""
    if is_peft_model(model):
        from peft.utils import get_peft_model_state_dict

        return {"adapter": _table(get_peft_model_state_dict(model))}, {}, set()
    ignored = keys_ignored_on_save(model)
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
def _weight_files(folder: Path, adapters: bool, refuse) -> tuple[list[Path], Path | None]:
    """The files holding ``folder``'s model weights (the adapter's for a PEFT model), in the Trainer's preference,
    and the shard index they come from (``None`` for one file)."""
    if not folder.is_dir():
        raise refuse("no such folder")
    if adapters:
        for name in ADAPTER_WEIGHT_FILES:
            if (found := checkpoint_file(folder, name, refuse)) is not None:
                return [found], None
        raise refuse(f"the model is a PEFT model and the folder holds no {' or '.join(ADAPTER_WEIGHT_FILES)}")
    for single, index_name in MODEL_WEIGHT_FILES:
        if (found := checkpoint_file(folder, single, refuse)) is not None:
            return [found], None
        if (index := checkpoint_file(folder, index_name, refuse)) is not None:
            shards = _shards(index, single.rsplit(".", 1)[-1], refuse)
            absent = [shard for shard in shards if checkpoint_file(folder, shard, refuse) is None]
            if absent:
                raise refuse(f"{index_name} names shard {absent[0]!r}, which is not in the folder")
            return [folder / shard for shard in shards], index
    expected = ", ".join(f for pair in MODEL_WEIGHT_FILES for f in pair)
    raise refuse(f"it holds no model weights (one of {expected}, or adapter_model.safetensors for a PEFT model)")


def _shards(index: Path, suffix: str, refuse) -> list[str]:
    """The shard file names ``index`` maps weights to: plain file names of its own format (``.safetensors`` or
    ``.bin``), each read with a bound."""
    try:
        content = read_json_file(index)
    except (OSError, JSONFileError) as exc:
        raise refuse(f"{index.name} is unreadable ({exc})") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise refuse(f"{index.name} holds no weight_map (a JSON object from weight names to shard files)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard or not shard.endswith(f".{suffix}"):
            raise refuse(
                f"{index.name} maps {name!r} to {shown(shard)}, which is not the name of a .{suffix} file "
                "in the folder"
            )
    return sorted(set(weight_map.values()))


def _names_in(file: Path, refuse) -> list[str]:
    try:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt") as weights:
                return list(weights.keys())
        return list(_torch_load(file))
    except Exception as exc:  # noqa: BLE001 -- a damaged or hostile file raises whatever its reader meets
        raise _unreadable(file, exc, refuse) from None


def _files_read(files: list[Path], aliases: dict[str, str], refuse) -> Iterator[dict[str, torch.Tensor]]:
    """Each file's tensors under the model's names (a tied weight once: its two names were checked to hold the
    same values), one file in memory at a time."""
    for file in files:
        tensors = _read(file, refuse)
        yield {
            _canonical(name, aliases): tensor
            for name, tensor in tensors.items()
            if name not in aliases or aliases[name] not in tensors
        }


def _tensors(files: list[Path], refuse) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files under its name in the file, one file in memory at a time."""
    for file in files:
        yield from _read(file, refuse).items()


def _read(file: Path, refuse) -> dict[str, torch.Tensor]:
    try:
        return load_file(file, device="cpu") if file.suffix == ".safetensors" else _torch_load(file)
    except Exception as exc:  # noqa: BLE001 -- a damaged or hostile file raises whatever its reader meets
        raise _unreadable(file, exc, refuse) from None


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` weights file, safely: tensors only (``weights_only``), never code; dense tensors under text
    names, as ``torch.save(model.state_dict())`` writes them."""
    # mapped, not read, where torch.save wrote its zip format (the legacy format cannot be mapped)
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a dict of tensors")
    for name, value in state.items():
        if not isinstance(name, str):
            raise ValueError(f"holds the key {name!r} ({type(name).__name__}), where weight names are text")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name!r} is a {type(value).__name__}, not a tensor")
        if value.layout != torch.strided or value.is_quantized:
            raise ValueError(f"{name!r} is a {value.layout} tensor, where model weights are dense (torch.strided)")
    return state


def _unreadable(file: Path, exc: BaseException, refuse) -> CheckpointWeightsError:
    return refuse(
        f"{file.name} cannot be read ({type(exc).__name__}: {short_message(exc)}); the save may have been cut short"
    )
