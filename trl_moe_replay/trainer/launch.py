"""What the launch asked for against what the trainer got: precision and distributed engine; and a model path that
is not a checkpoint (:func:`check_model_path`), refused before transformers mistakes it for a Hub id.

Two silent mismatches of accelerate are turned into errors that say what to change:

* Precision. ``accelerate launch`` exports the config's ``mixed_precision`` (``ACCELERATE_MIXED_PRECISION``), and
  ``TrainingArguments`` keeps it unless ``bf16``/``fp16`` is set, so a config saying ``bf16`` turns on bf16
  autocast for a run whose arguments say ``bf16=False`` (and under DeepSpeed fails with a config mismatch).
  Precision follows the training arguments here: the shipped ``recipes/accelerate/*.yaml`` set ``no``.
* Engine. accelerate switches to FSDP only for GPU-type devices: on a CPU an FSDP config quietly becomes plain
  data parallelism (``MULTI_CPU``), every process holding the whole model. A run that asked for FSDP or DeepSpeed
  (accelerate config, or the ``fsdp``/``deepspeed`` training arguments) and got something else stops.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from accelerate.utils import DistributedType
from transformers.utils import logging

logger = logging.get_logger(__name__)


class LaunchMismatchError(RuntimeError):
    """The launch configuration asked for something the training run does not do."""


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "false").lower() in ("1", "true", "yes")


def _report(message: str, strict: bool) -> None:
    if strict:
        raise LaunchMismatchError(message)
    logger.warning(f"LAUNCH MISMATCH (not stopping: plain GRPOTrainer runs as TRL would): {message}")


def check_launched_precision(args, environ: Mapping[str, str] | None = None, *, strict: bool = True) -> None:
    """Raise (``strict``) or warn if accelerate was launched with mixed precision the arguments do not ask for."""
    environ = os.environ if environ is None else environ
    launched = environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launched in ("bf16", "fp16") and not (args.bf16 or args.fp16):
        _report(
            f"accelerate was launched with mixed_precision={launched!r} (ACCELERATE_MIXED_PRECISION, from the "
            "accelerate config or --mixed_precision), but the training arguments say bf16=False and fp16=False. "
            f"Precision follows the training arguments: pass --{launched} true to train in {launched}, or launch "
            "with --mixed_precision no (the shipped recipes/accelerate/*.yaml do).",
            strict,
        )


def requested_engine(args, environ: Mapping[str, str] | None = None) -> str | None:
    """``"DeepSpeed"``, ``"FSDP"`` or ``None``: the sharded engine the launch config or the arguments ask for."""
    environ = os.environ if environ is None else environ
    if getattr(args, "deepspeed", None) or _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed"
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_plugin_args", None) or _flag(environ, "ACCELERATE_USE_FSDP"):
        return "FSDP"
    return None


def check_launched_engine(
    args, distributed_type: DistributedType, environ: Mapping[str, str] | None = None, *, strict: bool = True
) -> None:
    """Raise (``strict``) or warn if the launch asked for FSDP or DeepSpeed and accelerate set up another engine."""
    requested = requested_engine(args, environ)
    expected = {"DeepSpeed": DistributedType.DEEPSPEED, "FSDP": DistributedType.FSDP}.get(requested)
    if expected is None or distributed_type == expected:
        return
    why = ""
    if requested == "FSDP" and distributed_type in (DistributedType.MULTI_CPU, DistributedType.NO):
        why = (
            " accelerate switches to FSDP only on GPU-type devices (CUDA, XPU, NPU, ...) with several processes; "
            "on a CPU it runs plain data parallelism, every process holding the whole model."
        )
    _report(
        f"the launch asked for {requested} (accelerate config with distributed_type {requested.upper()}, or the "
        f"{requested.lower()} training argument), but accelerate set up {distributed_type.value}.{why} Launch with "
        "a config that matches the machine: recipes/accelerate/ddp.yaml (or torchrun) for data parallelism on "
        f"CPUs, {requested} configs on GPUs.",
        strict,
    )


class ModelPathError(FileNotFoundError):
    """A model named by a local path that does not hold a transformers checkpoint."""


def check_model_path(model: str) -> None:
    """Raise :class:`ModelPathError` if ``model`` reads as a local path and is not a checkpoint folder.

    transformers treats any name that is not an existing folder as a Hub id: a mistyped path then fails with the
    Hub's "Repo id must be in the form ..." (or, offline, after a minute of retries), and a folder without
    ``config.json`` fails later in the tokenizer. A name is a local path if it exists, is absolute, starts with
    ``.`` or ``~``, has more than one ``/``, or its first part is a folder here (``runs/typo`` with ``runs/``
    present); ``org/name`` otherwise stays a Hub id.
    """
    path = Path(model).expanduser()
    first = model.split("/", 1)[0]
    local = (path.exists() or path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1
             or ("/" in model and Path(first).is_dir()))
    if not local:
        return
    if not path.exists():
        near = _nearest_sibling(path)
        raise ModelPathError(
            f"no model folder at {model}: it reads as a local path (a Hub id looks like 'org/name'); pass the folder "
            "that holds config.json and the weights" + (f" (did you mean {near}?)" if near else "")
        )
    if not path.is_dir():
        raise ModelPathError(f"{model} is a file; pass the folder that holds config.json and the weights")
    if not (path / "config.json").is_file():
        inside = sorted((p for p in path.glob("checkpoint-*") if (p / "config.json").is_file()),
                        key=lambda p: int(p.name.rsplit("-", 1)[-1]) if p.name.rsplit("-", 1)[-1].isdigit() else -1)
        hint = f"; its newest checkpoint is {inside[-1]}" if inside else ""
        raise ModelPathError(
            f"{model} holds no config.json, so it is not a transformers checkpoint{hint}: pass the folder that holds "
            "config.json and the weights (what save_pretrained writes)"
        )


def _nearest_sibling(path: Path) -> str | None:
    """The existing entry of ``path``'s parent folder whose name is closest to ``path``'s, if any is close."""
    import difflib

    parent = path.parent
    if not parent.is_dir():
        return None
    names = [p.name for p in parent.iterdir()]
    match = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return str(parent / match[0]) if match else None
