"""The one reload weight sync into vLLM, for both trainers: the trainer's weights as a checkpoint, reloaded by vLLM.

TRL 1.16 syncs weights parameter by parameter: ``model.load_weights`` on a colocated engine's model, NCCL to a server
(the synchronous ``GRPOTrainer``), NCCL only (``AsyncGRPOTrainer``). None of it works on vLLM's CPU build: NCCL needs
CUDA, and the CPU backend replaces parameters after loading, so a direct ``load_weights`` fails. A transformers-5
Mixtral's fused names are also rejected by vLLM 0.28-0.31's Mixtral loader on any device. ``vllm_weight_sync="reload"``
sends the weights the way a fresh engine reads a checkpoint instead: under the checkpoint's names and layout
(:func:`~trl_moe_replay.weight_sync.vllm_weights.engine_weights`) through vLLM's ``reload_weights``, which re-runs the
backend's weight processing (on CPU with the plugin's re-pack, ``trl_moe_replay_vllm_plugin``).

:class:`WeightReload` does it, once for both trainers:

* colocated engine (sync trainer): ``llm.collective_rpc("reload_weights", weights_iterator=...)`` in process, nothing
  copied;
* server: the weights are written to ``sync_dir/model.safetensors`` (written aside and renamed into place, in a folder
  that holds nothing else vLLM would load) and the server (dev mode, ``VLLM_SERVER_DEV_MODE=1``, as ``trl vllm-serve``
  starts it) is asked ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": sync_dir}}``;
  it must be able to read that folder (same machine, or a shared filesystem).

Then the engine's prefix cache is reset, as TRL does, so cached prompt routes are recomputed under the new weights.

Each trainer reaches it through a thin adapter with its own constructor: :class:`ReloadWeightSync`
(:func:`sync_trainer_weight_sync`) is driven by the sync trainer through TRL's ``VLLMGeneration`` (server mode with
:func:`client_without_communicator`), :class:`ReloadWeightTransfer` (:func:`async_trainer_weight_transfer`) by the
async trainer as TRL's ``WeightTransferProtocol``.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from typing import Any

import torch
from accelerate.utils import is_peft_model
from safetensors.torch import save_file
from transformers.utils import logging

from ..errors import TrlMoeReplayError
from ..upstream import trl_named_params, wake_colocated_weights
from .server_requests import VLLMServerUnavailableError, http_client, post_to_server
from .vllm_weights import engine_weights


logger = logging.get_logger(__name__)

__all__ = [
    "ReloadWeightSync",
    "ReloadWeightTransfer",
    "VLLMServerUnavailableError",
    "WeightReload",
    "WeightSyncDirError",
    "WeightSyncMethod",
    "async_trainer_weight_transfer",
    "client_without_communicator",
    "sync_dir_of",
    "sync_trainer_weight_sync",
]

WEIGHTS_FILE = "model.safetensors"
WEIGHT_SYNC_TIMEOUT = 1800.0  # seconds per request to the server: TRL's async default for one weight transfer
_PARTIAL_FILE = ".model.safetensors.partial"  # not "*.safetensors": vLLM's loader never picks it up
_RELOAD_REMEDY = (
    "vllm_weight_sync='reload' needs the server's dev-mode endpoints (VLLM_SERVER_DEV_MODE=1, which "
    "`trl vllm-serve` sets) and read access to the sync folder (vllm_sync_dir)."
)


class WeightSyncDirError(TrlMoeReplayError, ValueError):
    """The reload sync's folder holds weight files of its own, which vLLM would load with (or instead of) the sync's."""


#: The reload sync's folder inside output_dir when ``vllm_sync_dir`` is unset. The leading ``_`` keeps it out of Hub
#: pushes: transformers' ``Trainer.push_to_hub`` (and its pushes at each save) upload output_dir with
#: ``ignore_patterns=["_*", "checkpoint-*"]``; a full copy of the weights would otherwise be uploaded with the model.
DEFAULT_SYNC_FOLDER = "_vllm_sync"


def sync_dir_of(args: Any) -> str:
    """The folder the reload sync writes to: ``vllm_sync_dir``, else ``<output_dir>/_vllm_sync``."""
    return os.path.abspath(getattr(args, "vllm_sync_dir", None) or os.path.join(args.output_dir, DEFAULT_SYNC_FOLDER))


def client_without_communicator(client_class: type) -> type:
    """TRL's ``VLLMClient`` without its NCCL weight-transfer communicator (weights go through vLLM's reload)."""

    class ReloadSyncVLLMClient(client_class):
        def init_communicator(self, device=0):
            logger.info("vllm_weight_sync='reload': TRL's NCCL communicator is not opened")

        def close_communicator(self):
            pass

    return ReloadSyncVLLMClient


class WeightReload:
    """Send a model's weights to one vLLM engine as a checkpoint and have it reload them (module docstring).

    Args:
        llm: a colocated ``vllm.LLM``; or, for a server:
        base_url: the server, e.g. ``http://127.0.0.1:8000``, and
        sync_dir: the folder the weights are written to (the server must read it);
        timeout: seconds for each request to the server.
        copy_before_write: copy each tensor to the host before it is written. Needed where the tensors may change
            in place before the file is written: TRL's sync-trainer iterator unmerges a PEFT adapter in place when it
            is exhausted, and on a CPU ``.cpu()`` is the parameter itself (the engine would get ``W``, not ``W + BA``).
    """

    def __init__(
        self,
        *,
        llm: Any = None,
        base_url: str | None = None,
        sync_dir: str | None = None,
        timeout: float = WEIGHT_SYNC_TIMEOUT,
        copy_before_write: bool = False,
    ):
        if (llm is None) == (base_url is None) or (base_url is not None and sync_dir is None):
            raise ValueError("WeightReload reloads a colocated engine (llm=) or a server (base_url= and sync_dir=)")
        self.llm = llm
        self.base_url = base_url.rstrip("/") if base_url is not None else None
        self.sync_dir = os.path.abspath(sync_dir) if sync_dir is not None else None
        self.timeout = timeout
        self.copy_before_write = copy_before_write
        self.reloads = 0  # reloads the engine acknowledged

    def reload(self, model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send ``named_tensors`` (what TRL's sync would send) and have the engine reload them. ``model`` is the
        unwrapped transformers model (or its ``PeftModel``): its weight conversions name the checkpoint."""
        tensors = engine_weights(model, named_tensors)
        if self.llm is not None:
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=tensors, is_checkpoint_format=True))
            self.llm.reset_prefix_cache()
        else:
            self.write(tensors)
            post_to_server(
                f"{self.base_url}/collective_rpc",
                "the weight reload",
                self.timeout,
                _RELOAD_REMEDY,
                json={"method": "reload_weights", "kwargs": {"weights_path": self.sync_dir}},
            )
            post_to_server(
                f"{self.base_url}/reset_prefix_cache", "the prefix-cache reset", self.timeout, _RELOAD_REMEDY
            )
        self.reloads += 1

    def write(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Write ``tensors`` to ``sync_dir/model.safetensors`` whole or not at all; returns the file's path.

        The file is written aside and renamed into place, so a crash mid-write never leaves the server a partial
        file. The folder must hold no other weights: vLLM loads every ``*.safetensors`` file in it, or only those an
        index names, and would mix them with (or prefer them to) the sync's.
        """
        sync_dir = self.sync_dir
        assert sync_dir is not None  # __init__ requires it with base_url, and only a server's reload writes
        os.makedirs(sync_dir, exist_ok=True)
        foreign = sorted(
            name
            for name in os.listdir(sync_dir)
            if name != WEIGHTS_FILE and name.endswith((".safetensors", ".safetensors.index.json"))
        )
        if foreign:
            raise WeightSyncDirError(
                f"the reload sync's folder {sync_dir} must hold no weights but its own {WEIGHTS_FILE}, and it "
                f"holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}: vLLM would load those too. Set "
                "vllm_sync_dir to an empty folder (not a checkpoint's)."
            )
        # gathered one parameter at a time by TRL's iterator, held on the host until written
        copy = self.copy_before_write
        host = {name: tensor.detach().to("cpu", copy=copy).contiguous() for name, tensor in tensors}
        partial, path = os.path.join(sync_dir, _PARTIAL_FILE), os.path.join(sync_dir, WEIGHTS_FILE)
        save_file(host, partial)
        os.replace(partial, path)
        return path


class ReloadWeightSync:
    """The sync trainer's reload: driven through TRL's ``VLLMGeneration`` in its colocate or server mode.

    Reads the weights as TRL's own sync would (``upstream.trl_named_params``: gathered under DeepSpeed/FSDP, PEFT
    merged), wakes a sleeping colocated engine's weights first as TRL does, and hands them to :class:`WeightReload`.
    In server mode only the main process sends; the others read the weights too, to take part in the gathers.
    """

    def __init__(
        self, vllm_generation: Any, model: torch.nn.Module, sync_dir: str, timeout: float = WEIGHT_SYNC_TIMEOUT
    ):
        self.generation = vllm_generation
        self.model = model  # the unwrapped transformers model: its conversions name the checkpoint
        self.sync_dir = os.path.abspath(sync_dir)
        self.reload: WeightReload | None = None  # None: a process that only takes part in the gathers
        if vllm_generation.mode == "colocate":
            self.reload = WeightReload(llm=vllm_generation.llm)
        elif vllm_generation.accelerator.is_main_process:
            # TRL's iterator unmerges a PEFT adapter in place when exhausted, before the file would be written
            self.reload = WeightReload(
                base_url=vllm_generation.vllm_client.base_url,
                sync_dir=sync_dir,
                timeout=timeout,
                copy_before_write=is_peft_model(model),
            )
        self.syncs = 0

    def sync(self) -> None:
        wake_colocated_weights(self.generation)
        named = trl_named_params(self.generation)
        if self.reload is not None:
            self.reload.reload(self.model, named)
        else:
            for _ in named:  # take part in the gathers (DeepSpeed ZeRO-3, FSDP)
                pass
        self.syncs += 1


class ReloadWeightTransfer:
    """The async trainer's reload: TRL's ``WeightTransferProtocol`` for ``AsyncGRPOTrainer(weight_transfer=...)``.

    TRL calls it on the main process: ``init_weight_transfer`` once, then per sync ``pause``, ``send_weights``
    (its ``_streaming_iter``: full tensors, a PEFT adapter merged until ``send_weights`` returns, so nothing needs
    copying) and ``resume``; ``destroy`` at the end. ``send_weights`` is :meth:`WeightReload.reload` into the server.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        sync_dir: where the weights are written; the server must be able to read it (same machine or shared disk).
        model: the unwrapped transformers model; its weight conversions name the checkpoint layout. The async
            trainer sets it once the model is built.
        timeout: seconds for each request.
    """

    def __init__(
        self, base_url: str, sync_dir: str, model: torch.nn.Module | None = None, timeout: float = WEIGHT_SYNC_TIMEOUT
    ):
        self.base_url = base_url.rstrip("/")
        self.sync_dir = os.path.abspath(sync_dir)
        self.model = model
        self.timeout = timeout
        self.reload = WeightReload(base_url=self.base_url, sync_dir=self.sync_dir, timeout=timeout)

    @property
    def delivered(self) -> int:
        """Syncs the server acknowledged."""
        return self.reload.reloads

    def init_weight_transfer(self) -> None:
        requests = http_client()
        try:
            requests.get(f"{self.base_url}/health", timeout=self.timeout).raise_for_status()
        except requests.RequestException as exc:
            raise VLLMServerUnavailableError(f"the vLLM server at {self.base_url} is not healthy: {exc}") from exc

    def pause(self) -> None:
        # "keep": requests in flight are frozen, not aborted, and go on with the new weights after resume()
        post_to_server(f"{self.base_url}/pause", "pause", self.timeout, _RELOAD_REMEDY, params={"mode": "keep"})

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.model is None:
            raise RuntimeError("ReloadWeightTransfer.model is not set: it names the checkpoint layout vLLM loads")
        self.reload.reload(self.model, iterator)

    def resume(self) -> None:
        post_to_server(f"{self.base_url}/resume", "resume", self.timeout, _RELOAD_REMEDY)

    def destroy(self) -> None:
        pass


class WeightSyncMethod(enum.StrEnum):
    """``vllm_weight_sync`` resolved (``core.routing_options.resolve_weight_sync``): how weights reach vLLM."""

    TRL = "trl"  # TRL's own transfer
    RELOAD = "reload"  # vLLM's reload_weights with the checkpoint's names (this module)


def _timeout(args: Any) -> float:
    """Each request may take ``weight_sync_timeout`` seconds (TRL's async field), else :data:`WEIGHT_SYNC_TIMEOUT`."""
    return float(getattr(args, "weight_sync_timeout", None) or WEIGHT_SYNC_TIMEOUT)


def sync_trainer_weight_sync(
    method: WeightSyncMethod | None, args: Any, *, vllm_generation: Any, model: torch.nn.Module
) -> ReloadWeightSync | None:
    """The sync trainer's reload weight sync, or ``None`` where TRL's own sync is used. Built after TRL's
    ``VLLMGeneration`` (``vllm_generation``) exists; ``model`` is the unwrapped transformers model."""
    if method != WeightSyncMethod.RELOAD:
        return None
    return ReloadWeightSync(vllm_generation, model, sync_dir_of(args), timeout=_timeout(args))


def async_trainer_weight_transfer(method: WeightSyncMethod | None, args: Any) -> ReloadWeightTransfer | None:
    """The async trainer's reload transfer for ``args.vllm_server_base_url``, or ``None`` where TRL's own transfer
    is used. Built before TRL's constructor, which takes it; the trainer sets its ``model`` once the model is built."""
    if method != WeightSyncMethod.RELOAD:
        return None
    return ReloadWeightTransfer(args.vllm_server_base_url, sync_dir_of(args), timeout=_timeout(args))
