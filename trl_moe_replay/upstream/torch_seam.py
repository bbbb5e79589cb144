"""The torch part of the seam: torch's private names the package uses, each one entry.

Read from torch 2.13.0 (the version in the development environment); verified there and at the oldest end of the
declared range (CI). :func:`check_torch` reports an entry the installed torch no longer has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import pathlib
import pickle
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .entries import Finding, entry


if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo


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
#    tensor in that slot for one forward (trl_moe_replay/pr2/predictor.py): setattr would refuse a tensor that
#    is not a Parameter, and torch.func.functional_call does not reach a parametrization's stored weight.
# ---------------------------------------------------------------------------------------------------------------
MODULE_PARAMETER_SLOT = entry("module_parameter_slot", "torch", TORCH_READ)


@contextlib.contextmanager
def parameter_replaced(owner: torch.nn.Module, name: str, value: torch.Tensor) -> Iterator[None]:
    """Within the context ``owner.<name>`` reads ``value`` (any tensor) instead of its registered parameter (entry
    ``module_parameter_slot``); the parameter is put back on exit."""
    original = owner._parameters[name]
    owner._parameters[name] = value  # type: ignore[assignment]  # the point: any tensor in the Parameter's slot
    try:
        yield
    finally:
        owner._parameters[name] = original


# ---------------------------------------------------------------------------------------------------------------
# ddp_ignored_parameters: DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names) (a
#    static method, stable since torch 1.8) records names in module._ddp_params_and_buffers_to_ignore, which DDP reads
#    when it wraps the module: those parameters get no gradient bucket. PR2's predictors are averaged by the trainer
#    itself (trl_moe_replay/pr2/state.py).
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
#    (StorageMeta.checkpoint_id). None of them runs anything but building that value. Our reader hands DCP that
#    checked Metadata in place of FileSystemReader.read_metadata, doing what the rest of it does (a StorageMeta where
#    there is none, its load_id the reader's). DCP also pickles the entries that are no tensor (BytesStorageMetadata:
#    the optimizer's param_groups values, floats, tuples, bools, None) into the shard files with torch.save, and
#    DefaultLoadPlanner.load_bytes reads them with torch.load(weights_only=False): our planner reads them with
#    weights_only=True and puts the value where DefaultLoadPlanner does, at its mappings' path in its
#    original_state_dict (the private torch.distributed.checkpoint._traverse.set_element). The probe, with no save
#    and no device: every allowed global resolves to itself, the metadata classes are the ones the metadata module
#    exports, our reader reads a Metadata as FileSystemReader.read_metadata does, and our planner puts a bytes entry
#    where DefaultLoadPlanner.load_bytes does. tests/checkpointing/test_distributed_checkpoint.py reads a real dcp.save's
#    .metadata back through the unpickler.
DCP_METADATA_PICKLE = entry("dcp_metadata_pickle", "torch", TORCH_READ)


@functools.cache
def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object``: every global torch's DCP save writes into a checkpoint's ``.metadata`` (entry
    ``dcp_metadata_pickle``); an unpickler of ``.metadata`` finds these and nothing else."""
    from torch.distributed.checkpoint import filesystem, metadata

    found: dict[tuple[str, str], Any] = {
        (metadata.__name__, cls.__name__): cls
        for cls in (
            metadata.Metadata,
            metadata.TensorStorageMetadata,
            metadata.BytesStorageMetadata,
            metadata.ChunkStorageMetadata,
            metadata.TensorProperties,
            metadata.MetadataIndex,
            metadata.StorageMeta,
            metadata._MEM_FORMAT_ENCODING,
        )
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


def dcp_storage_info_class() -> type[_StorageInfo]:
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
            found = dcp_metadata_globals()[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"global '{module}.{name}' is not one torch's distributed checkpoint writes into its metadata"
            ) from None
        # the two callables whose work grows with their argument, which a pickle can hand them again and again
        # (a memo reference): a shape of many dimensions, a path of many parts, each built once per call
        if found is torch.Size:
            return _bounded_size
        if isinstance(found, type) and issubclass(found, pathlib.PurePath):
            return functools.partial(_bounded_path, found)
        return found


#: The most dimensions a shape in ``.metadata`` may have, and the most characters a path (StorageMeta.checkpoint_id)
MAX_DCP_DIMS, MAX_DCP_PATH_CHARS = 64, 4096


def _bounded_size(values: Any = ()) -> torch.Size:
    if len(values) > MAX_DCP_DIMS:
        raise pickle.UnpicklingError(
            f"a torch.Size of {len(values):,} dimensions, more than the {MAX_DCP_DIMS} a checkpoint's tensors have"
        )
    return torch.Size(values)


def _bounded_path(cls: type, *parts: Any) -> Any:
    if (
        len(parts) > MAX_DCP_PATH_CHARS
        or sum(len(part) if isinstance(part, str) else 1 for part in parts) > MAX_DCP_PATH_CHARS
    ):
        raise pickle.UnpicklingError(f"a {cls.__name__} of more than {MAX_DCP_PATH_CHARS:,} characters")
    return cls(*parts)


def checked_dcp_reader(path: str | pathlib.Path, read_metadata: Callable[[], Any]) -> Any:
    """torch's ``FileSystemReader`` of the shards in ``path`` whose ``read_metadata`` returns ``read_metadata()`` (a
    checked ``Metadata``) where torch's would unpickle the file (entry ``dcp_metadata_pickle``). ``read_metadata``
    raises for a per-rank metadata file, which DCP falls back to and our saves never write."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise ValueError(f"{path}: the per-rank .metadata fallback is not read")
            metadata = read_metadata()
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedReader(path)


def checked_dcp_planner(refuse: Callable[[str], Exception]) -> Any:
    """A ``DefaultLoadPlanner`` that reads the entries that are no tensor with ``torch.load(weights_only=True)``
    (torch's uses ``weights_only=False``: a shard file could run code); a value that is refused raises
    ``refuse(problem)`` (entry ``dcp_metadata_pickle``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class CheckedPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as error:
                paragraphs = [" ".join(part.split()) for part in str(error).split("\n\n") if part.strip()]
                what = paragraphs[1] if len(paragraphs) > 1 else paragraphs[0] if paragraphs else "refused"
                # torch's second paragraph says what was refused ("Trying to load unsupported GLOBAL posix.system")
                raise refuse(
                    f"its shard entry {fqn!r} is a pickle that would run code or build more than plain "
                    f"values ({what[:160]}); nothing in it was run"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return CheckedPlanner()


# ---------------------------------------------------------------------------------------------------------------
# dcp_local_chunks: DTensor.__create_chunk_list__() (torch.distributed.tensor._api; "primarily used for distributed
#    checkpoint purpose") returns the ChunkStorageMetadata (offsets and sizes in the global tensor) of the shard a
#    rank holds, as DCP's planner describes it. The distributed checkpoint's manifest (trl_moe_replay/checkpointing/
#    dcp_manifest.py) sums each tensor's checksum over the ranks' chunks at their global positions. The probe: the
#    method is still there.
DCP_LOCAL_CHUNKS = entry("dcp_local_chunks", "torch", TORCH_READ)


def dcp_local_chunk(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The part of ``tensor`` this rank holds and its offsets in the global tensor (entry ``dcp_local_chunks``): a
    DTensor's local shard or replica, a plain tensor whole at offset 0."""
    create = getattr(tensor, "__create_chunk_list__", None)
    if create is None or not hasattr(tensor, "to_local"):
        return tensor, (0,) * tensor.dim()
    chunks = create()
    if len(chunks) != 1:
        raise ValueError(f"a DTensor whose rank holds {len(chunks)} chunks, where one is expected")
    return tensor.to_local(), tuple(int(n) for n in chunks[0].offsets)


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
        seen: list[bool] = []
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
        import importlib

        from torch.distributed.checkpoint import FileSystemReader, metadata as dcp_metadata_module
        from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

        for (module, name), value in dcp_metadata_globals().items():
            if getattr(importlib.import_module(module), name, None) is not value:
                return f"{module}.{name}, a global DCP writes into .metadata, is gone or another object"
        allowed = {name for module, name in dcp_metadata_globals() if module == dcp_metadata_module.__name__}
        if set(dcp_metadata_module.__all__) != allowed - {"_MEM_FORMAT_ENCODING"}:
            return f"torch.distributed.checkpoint.metadata now exports {sorted(dcp_metadata_module.__all__)}"
        if [f.name for f in dataclasses.fields(dcp_storage_info_class())][:3] != ["relative_path", "offset", "length"]:
            return "_StorageInfo no longer holds relative_path, offset and length"
        written = dcp_metadata_module.Metadata(state_dict_metadata={"a.b": dcp_metadata_module.BytesStorageMetadata()})
        with tempfile.TemporaryDirectory() as folder:
            with open(pathlib.Path(folder) / ".metadata", "wb") as file:
                pickle.dump(written, file)
            theirs = FileSystemReader(folder)
            ours = checked_dcp_reader(folder, lambda: written)
            read = [(reader.read_metadata(), reader.load_id) for reader in (theirs, ours)]
        if any(
            type(m.storage_meta) is not type(read[0][0].storage_meta)
            or m.storage_meta is None
            or m.storage_meta.load_id != load_id
            for m, load_id in read
        ):
            return "FileSystemReader.read_metadata no longer sets a StorageMeta with the reader's load_id"
        state: dict = {"a": {"b": None}}
        planner = checked_dcp_planner(ValueError)
        planner.set_up_planner(state, written, is_coordinator=True)
        index = dcp_metadata_module.MetadataIndex("a.b")
        payload = io.BytesIO()
        torch.save((0.9, 0.999), payload)
        payload.seek(0)
        planner.load_bytes(
            ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0])), payload
        )
        if state != {"a": {"b": (0.9, 0.999)}}:
            return "DefaultLoadPlanner no longer maps a flattened key to its place in the state dict it loads"
        return None

    probe(AUTOGRAD_GRAPH_TASK, graph_task)
    probe(ASSERT_ASYNC, assert_async)
    probe(MODULE_PARAMETER_SLOT, parameter_slot)
    probe(DDP_IGNORED_PARAMETERS, ddp_ignore)
    probe(DCP_METADATA_PICKLE, dcp_metadata)
    probe(
        DCP_LOCAL_CHUNKS,
        lambda: (
            None
            if callable(getattr(_dtensor_class(), "__create_chunk_list__", None))
            else "DTensor no longer has __create_chunk_list__ (its local shard's offsets)"
        ),
    )
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


def _dtensor_class() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor
