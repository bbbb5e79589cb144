"""The torch part of the seam: torch's private names the package uses, each one entry.

Read from torch 2.13.0 (the version in the development environment); verified there and at the oldest end of the
declared range (CI). :func:`check_torch` reports an entry the installed torch no longer has.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pathlib
import pickle
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .entries import Finding, entry

TORCH_READ = "2.13.0"


# ---------------------------------------------------------------------------------------------------------------
# autograd_graph_task: torch._C._current_graph_task_id() is -1 outside a backward pass and the running graph task's id
#    inside one. RouterReplay uses it to tell an activation-checkpoint recompute (which runs the forward again
#    inside the backward) from a fresh forward (trl_moe_replay/routing/replay.py).
# ---------------------------------------------------------------------------------------------------------------
AUTOGRAD_GRAPH_TASK = entry("autograd_graph_task", "torch", TORCH_READ)


def in_backward() -> bool:
    """True while autograd runs a backward pass, i.e. during an activation-checkpoint recompute (entry
    ``autograd_graph_task``). False while torch.compile traces: the traced forward is never a recompute."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------------------------------------------------
# assert_async: torch._assert_async(condition, message) checks a boolean tensor without a host sync: it raises at
#    once on CPU, at the next synchronisation on CUDA. RouterReplay checks a steer() function's ids with it at every
#    decode step (trl_moe_replay/routing/replay.py).
# ---------------------------------------------------------------------------------------------------------------
ASSERT_ASYNC = entry("assert_async", "torch", TORCH_READ)


def assert_without_sync(condition: torch.Tensor, message: str) -> None:
    """Fail with ``message`` where ``condition`` (a one-element bool tensor) is False, without a host sync (entry
    ``assert_async``)."""
    torch._assert_async(condition, message)


# ---------------------------------------------------------------------------------------------------------------
# module_parameter_slot: nn.Module keeps its registered parameters in the dict Module._parameters, which
#    Module.__getattr__ reads on every access. PR2 evaluates a router with a shifted weight by putting a (non-leaf)
#    tensor in that slot for one forward (trl_moe_replay/routing/predictor.py): setattr would refuse a tensor that
#    is not a Parameter, and torch.func.functional_call does not reach a parametrization's stored weight.
# ---------------------------------------------------------------------------------------------------------------
MODULE_PARAMETER_SLOT = entry("module_parameter_slot", "torch", TORCH_READ)


@contextlib.contextmanager
def parameter_replaced(owner: torch.nn.Module, name: str, value: torch.Tensor) -> Iterator[None]:
    """Within the context ``owner.<name>`` reads ``value`` (any tensor) instead of its registered parameter (entry
    ``module_parameter_slot``); the parameter is put back on exit."""
    original = owner._parameters[name]
    owner._parameters[name] = value
    try:
        yield
    finally:
        owner._parameters[name] = original


# ---------------------------------------------------------------------------------------------------------------
# ddp_ignored_parameters: DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names) (a
#    static method, stable since torch 1.8) records names in module._ddp_params_and_buffers_to_ignore, which DDP reads
#    when it wraps the module: those parameters get no gradient bucket. PR2's predictors are averaged by the trainer
#    itself (trl_moe_replay/trainer/pr2.py).
# ---------------------------------------------------------------------------------------------------------------
DDP_IGNORED_PARAMETERS = entry("ddp_ignored_parameters", "torch", TORCH_READ)


def ignore_in_ddp(model: torch.nn.Module, names: list[str]) -> None:
    """Add ``names`` (parameter names of ``model``) to what DistributedDataParallel leaves alone when it wraps
    ``model`` (entry ``ddp_ignored_parameters``)."""
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, sorted(ignored | set(names))
    )


# ---------------------------------------------------------------------------------------------------------------
# dcp_metadata_pickle: torch.distributed.checkpoint's FileSystemWriter pickles the checkpoint's Metadata into
#    ``.metadata`` (pickle.dump), and FileSystemReader.read_metadata reads it back with plain pickle.load, on every
#    rank. The resume pre-flight (trl_moe_replay/checkpointing/checkpoint_files.py) and our own DCP reads unpickle it
#    with an unpickler that finds only the globals DCP's save writes there, listed by unpickling what torch 2.13's
#    dcp.save wrote for a model's and an optimizer's state (fp32, bf16 and int8 tensors, a channels-last one, Python
#    values): the metadata dataclasses and the private enum _MEM_FORMAT_ENCODING (torch.distributed.checkpoint.
#    metadata), the private _StorageInfo (one shard's file, offset and length; torch.distributed.checkpoint.filesystem),
#    torch.Size, the dtypes, torch.serialization._get_layout (a layout from its name), pathlib's paths
#    (StorageMeta.checkpoint_id). None of them runs anything but building that value. The probe saves a small
#    checkpoint with dcp.save and reads its .metadata back through the unpickler.
# ---------------------------------------------------------------------------------------------------------------
DCP_METADATA_PICKLE = entry("dcp_metadata_pickle", "torch", TORCH_READ)


@functools.cache
def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object``: every global torch's DCP save writes into a checkpoint's ``.metadata`` (entry
    ``dcp_metadata_pickle``); an unpickler of ``.metadata`` finds these and nothing else."""
    from torch.distributed.checkpoint import filesystem, metadata

    found: dict[tuple[str, str], Any] = {
        (metadata.__name__, cls.__name__): cls
        for cls in (metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
                    metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex,
                    metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING)
    }
    found[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    found[("torch", "Size")] = torch.Size
    found[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        found[("pathlib", cls.__name__)] = cls
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            found[("torch", name)] = value
    return found


def dcp_storage_info_class() -> type:
    """The class of the values of a DCP ``Metadata.storage_data``: one shard's ``relative_path``, ``offset`` and
    ``length`` (entry ``dcp_metadata_pickle``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


class DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``, finding only :func:`dcp_metadata_globals` (entry ``dcp_metadata_pickle``): any
    other global (``os.system``, ``builtins.eval``) raises ``pickle.UnpicklingError`` before it is looked up, so
    nothing is called; ``persistent_load`` is pickle's own, which refuses every persistent id."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return dcp_metadata_globals()[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not one torch's distributed checkpoint "
                                         "writes into its metadata") from None


def check_torch() -> tuple[Finding, ...]:
    """Every entry above against the installed torch, by behaviour (each call on a tiny input)."""
    findings: list[Finding] = []

    def probe(declared, run) -> None:
        try:
            problem = run()
        except Exception as error:  # the private name is gone or takes other arguments
            problem = f"{type(error).__name__}: {error}"
        if problem:
            findings.append(Finding(declared, problem))

    def graph_task():
        seen = []
        x = torch.ones(1, requires_grad=True)
        y = _RecordInBackward.apply(x, seen)
        y.sum().backward()
        if in_backward() or seen != [True]:
            return "torch._C._current_graph_task_id() no longer tells a backward pass from a forward"
        return None

    def assert_async():
        assert_without_sync(torch.tensor(True), "not raised")
        try:
            assert_without_sync(torch.tensor(False), "raised")
        except RuntimeError:
            return None
        return "torch._assert_async(False) no longer raises on CPU"

    def parameter_slot():
        module = torch.nn.Linear(1, 1, bias=False)
        with parameter_replaced(module, "weight", torch.full((1, 1), 3.0)):
            out = module(torch.ones(1, 1))
        if out.item() != 3.0 or not isinstance(module.weight, torch.nn.Parameter):
            return "Module._parameters no longer holds what the module's forward reads"
        return None

    def ddp_ignore():
        module = torch.nn.Linear(1, 1)
        ignore_in_ddp(module, ["weight"])
        ignore_in_ddp(module, ["bias"])
        if set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) != {"weight", "bias"}:
            return "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model no longer records the names"
        return None

    def dcp_metadata():
        import torch.distributed.checkpoint as dcp

        state = {"weight": torch.zeros(2, 3), "half": torch.zeros(2, dtype=torch.bfloat16),
                 "wide": torch.zeros(1, 2, 2, 2).to(memory_format=torch.channels_last), "step": 3, "name": "x"}
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "running in a single process"
            dcp.save(state, checkpoint_id=folder, no_dist=True)  # this rank alone, under torchrun too
            with open(pathlib.Path(folder) / ".metadata", "rb") as file:
                data = file.read()
        try:
            metadata = DCPMetadataUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as error:
            return f"dcp.save wrote a .metadata the unpickler refuses ({error})"
        infos = list(getattr(metadata, "storage_data", {}).values())
        if set(getattr(metadata, "state_dict_metadata", {})) != set(state) or not infos or not all(
                isinstance(info, dcp_storage_info_class()) for info in infos):
            return "dcp.save's .metadata no longer holds Metadata with state_dict_metadata and _StorageInfo shards"
        return None

    probe(AUTOGRAD_GRAPH_TASK, graph_task)
    probe(ASSERT_ASYNC, assert_async)
    probe(MODULE_PARAMETER_SLOT, parameter_slot)
    probe(DDP_IGNORED_PARAMETERS, ddp_ignore)
    probe(DCP_METADATA_PICKLE, dcp_metadata)
    return tuple(findings)


class _RecordInBackward(torch.autograd.Function):
    """Records :func:`in_backward` during its own backward (the probe of entry ``autograd_graph_task``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seen: list) -> torch.Tensor:
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.seen.append(in_backward())
        return grad, None
