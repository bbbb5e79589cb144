"""What the launch asked for against what the trainer got: precision and distributed engine; and a model name that
names no loadable checkpoint (:func:`check_model_path`: a local path without one, a Hub id that cannot be fetched),
refused in one line before any work (``~`` in a local path expanded, as a shell would).

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

from ..errors import TrlMoeReplayError


logger = logging.get_logger(__name__)


class LaunchMismatchError(TrlMoeReplayError, RuntimeError):
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
    if requested is None:
        return
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


class ModelPathError(TrlMoeReplayError, FileNotFoundError):
    """A model named by a local path that does not hold a transformers checkpoint."""


class HubModelError(ModelPathError):
    """A model named by a Hub id that cannot be fetched: no network (or offline mode without a cached copy), no such
    repository, revision or ``config.json``."""


def checked_model_name(model, args):
    """A trainer's ``model`` argument, checked by :func:`check_model_path` when it is a name (with the revision and
    token of ``args.model_init_kwargs``) and returned as the name to load (``~`` expanded); a model object as it is.
    The one call both trainers make first in ``__init__``."""
    if not isinstance(model, str):
        return model
    loading = getattr(args, "model_init_kwargs", None)
    loading = loading if isinstance(loading, dict) else {}
    return check_model_path(model, loading.get("revision"), loading.get("token"))


def check_model_path(model: str, revision: str | None = None, token: str | bool | None = None) -> str:
    """Raise :class:`ModelPathError` if ``model`` names no checkpoint that can be loaded; one line, before any work.
    Returns the name to load: a local path with ``~`` expanded (transformers does not expand it, and takes
    ``~/models/x`` for a malformed Hub id), a Hub id as it is.

    A name is a local path if it exists, is absolute, starts with ``.`` or ``~``, or has more than one ``/``:
    such a path must be a folder with ``config.json`` (transformers would otherwise take a mistyped path for a Hub
    id, and a folder without ``config.json`` fails later in the tokenizer). Anything else (``org/name``, even with a
    folder ``./org/`` here) is a Hub id, checked by :func:`check_hub_model`.
    """
    path = Path(model).expanduser()
    local = path.exists() or path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1
    if not local:
        check_hub_model(model, revision, token)
        return model
    if not path.exists():
        near = _nearest_sibling(path)
        raise ModelPathError(
            f"no model folder at {model}: it reads as a local path (a Hub id looks like 'org/name'); pass the folder "
            "that holds config.json and the weights" + (f" (did you mean {near}?)" if near else "")
        )
    if not path.is_dir():
        raise ModelPathError(f"{model} is a file; pass the folder that holds config.json and the weights")
    if not (path / "config.json").is_file():
        inside = sorted(
            (p for p in path.glob("checkpoint-*") if (p / "config.json").is_file()),
            key=lambda p: int(p.name.rsplit("-", 1)[-1]) if p.name.rsplit("-", 1)[-1].isdigit() else -1,
        )
        hint = f"; its newest checkpoint is {inside[-1]}" if inside else ""
        raise ModelPathError(
            f"{model} holds no config.json, so it is not a transformers checkpoint{hint}: pass the folder that holds "
            "config.json and the weights (what save_pretrained writes)"
        )
    return os.path.expanduser(model)


def check_hub_model(model: str, revision: str | None = None, token: str | bool | None = None) -> None:
    """Raise :class:`HubModelError` if the Hub id ``model`` cannot be fetched; return at once if it is cached.

    One metadata request for its ``config.json`` without retries, instead of transformers' retries and traceback:
    where the network is absent the connection fails within seconds (``HF_HUB_ETAG_TIMEOUT`` at most). Errors of
    the Hub itself (5xx) are left to transformers. ``token``: as for ``from_pretrained`` (default: the login's).
    """
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    local_hint = _local_hint(model)
    try:
        cached = isinstance(try_to_load_from_cache(model, "config.json", revision=revision), str)
    except HFValidationError as exc:
        raise HubModelError(f"{model} is neither a local folder nor a Hub id ({exc}){local_hint}") from exc
    if cached:
        return
    if constants.is_offline_mode():
        raise HubModelError(
            f"{model} is not a local folder, and offline mode (HF_HUB_OFFLINE=1) reads only the Hub cache, which holds "
            f"no copy of it{local_hint}: pass the local folder that holds config.json and the weights, or unset "
            "HF_HUB_OFFLINE on a machine that reaches the Hub to download it"
        )
    unreachable: tuple[type[Exception], ...] = (*_network_errors(), OfflineModeIsEnabled)
    try:
        get_hf_file_metadata(hf_hub_url(model, "config.json", revision=revision), token=token, retry_on_errors=False)
    except unreachable as exc:
        raise HubModelError(
            f"{model} is not a local folder and the Hub ({constants.ENDPOINT}) cannot be reached "
            f"({type(exc).__name__}: {' '.join(str(exc).split()) or 'no answer'}){local_hint}: pass the local folder "
            "that holds config.json and the weights, or, if the model was downloaded before, set HF_HUB_OFFLINE=1 "
            "(offline mode) to load it from the Hub cache"
        ) from exc
    except GatedRepoError as exc:
        raise HubModelError(
            f"{model} is a gated Hub repository: accept its terms on the Hub and log in "
            "(hf auth login), or pass a local folder"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise HubModelError(
            f"no model {model} on the Hub (or it is private: log in with hf auth login){local_hint}: "
            "pass a Hub id 'org/name' or a local folder that holds config.json"
        ) from exc
    except RevisionNotFoundError as exc:
        raise HubModelError(f"the Hub repository {model} has no revision {revision!r}") from exc
    except RemoteEntryNotFoundError as exc:
        raise HubModelError(
            f"the Hub repository {model} holds no config.json, so it is not a transformers checkpoint"
        ) from exc


def _network_errors() -> tuple[type[Exception], ...]:
    """The "could not connect / no answer" errors of the HTTP library huggingface_hub uses (httpx2 from
    huggingface_hub 2, httpx before), and the standard library's."""
    import importlib

    errors: list[type[Exception]] = [ConnectionError, TimeoutError]
    for library in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(library).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _local_hint(model: str) -> str:
    """' (no folder runs/typo here either; did you mean runs/type?)' when the id's first part is a folder here."""
    first = model.split("/", 1)[0]
    if "/" not in model or not Path(first).is_dir():
        return ""
    near = _nearest_sibling(Path(model))
    return f" (no folder {model} here either" + (f"; did you mean {near}?)" if near else ")")


def _nearest_sibling(path: Path) -> str | None:
    """The existing entry of ``path``'s parent folder whose name is closest to ``path``'s, if any is close."""
    import difflib

    parent = path.parent
    if not parent.is_dir():
        return None
    names = [p.name for p in parent.iterdir()]
    match = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return str(parent / match[0]) if match else None
