"""Sharded checkpoints are pre-flighted like every other file (issue 42, item 4). torch's reader unpickles a
checkpoint's ``distributed/.metadata`` with plain ``pickle.load`` on every rank; the resume pre-flight reads it first
with an unpickler that finds only DCP's metadata classes and checks the shard files it names. A hostile file is never
run, a damaged one is one line naming the file (``DistributedCheckpointError``), through the trainer's resume and the
recipe; a real DCP checkpoint is still accepted. The recipe under torchrun (2 ranks, EP) is in tests/parallel/test_expert_parallel.py.

The checkpoint is the resume pre-flight's real one (tests/checkpointing/test_checkpoint_files.py) with ``distributed/`` written beside it
by ``dcp.save`` in this process (one shard file), as an EP run writes it (one shard file per rank).
"""

import dataclasses
import io
import os
import pickle
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from trl_moe_replay import DistributedCheckpointError
from trl_moe_replay.checkpointing import checkpoint_files, distributed_checkpoint
from trl_moe_replay.checkpointing.checkpoint_files import check_checkpoint_files, read_distributed_metadata
from trl_moe_replay.testing import tiny_moe_model
from trl_moe_replay.upstream import DCPMetadataUnpickler

from tests.checkpointing.test_checkpoint_files import (  # noqa: F401 - fixtures
    checkpoint,
    recipe,
    recipe_refusal,
    refused_by_train,
    resumer,
    resumes_exactly,
)
from tests.parallel.test_expert_parallel import has_expert_parallelism


#: the package's own DCP save and restore (transformers.distributed.checkpoint) exist with expert parallelism only,
#: which the oldest end of the ranges (transformers 5.16.1) lacks and refuses at launch in one line
needs_expert_parallelism = pytest.mark.skipif(
    not has_expert_parallelism(), reason="transformers 5.16 has no expert parallelism (refused at launch)"
)

SHARD = "__0_0.distcp"


@pytest.fixture(scope="module")
def sharded(checkpoint, tmp_path_factory) -> Path:  # noqa: F811
    """The real checkpoint-1 with the shards of a model's and an optimizer's state in ``distributed/``."""
    folder = tmp_path_factory.mktemp("sharded") / "checkpoint-1"
    shutil.copytree(checkpoint, folder)
    model = tiny_moe_model("qwen3_moe", seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optimizer": {"state": dict(enumerate(optimizer.state.values())), "lr": 1e-3},
    }
    dcp.save(state, checkpoint_id=folder / "distributed", no_dist=True)
    assert {p.name for p in (folder / "distributed").iterdir()} == {".metadata", SHARD}
    return folder


def copied(sharded: Path, tmp_path: Path, damage) -> Path:
    folder = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(sharded, folder, symlinks=True)
    damage(folder / "distributed")
    return folder


def metadata_of(shards: Path):
    with open(shards / ".metadata", "rb") as file:
        return DCPMetadataUnpickler(file).load()


def rewrite(change):
    """Damage: ``.metadata`` rewritten with ``change(metadata)`` (the real Metadata, as torch pickles it)."""

    def damage(shards: Path):
        metadata = metadata_of(shards)
        change(metadata)
        (shards / ".metadata").write_bytes(pickle.dumps(metadata))

    return damage


def shard_path(path: str):
    def change(metadata):
        metadata.storage_data = {
            index: dataclasses.replace(info, relative_path=path) for index, info in metadata.storage_data.items()
        }

    return change


class RunsCommand:
    """A pickle that runs ``command`` in a shell when plain ``pickle.load`` reads it."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def hostile(marker: Path):
    return lambda shards: (shards / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))


def cut_metadata(shards: Path):
    data = (shards / ".metadata").read_bytes()
    (shards / ".metadata").write_bytes(data[: len(data) // 2])


def linked_out(name: str):
    def damage(shards: Path):
        elsewhere = shards.parent.parent / f"elsewhere-{name}"
        (shards / name).rename(elsewhere)
        (shards / name).symlink_to(elsewhere)

    return damage


def fifo(name: str):
    return lambda shards: ((shards / name).unlink(), os.mkfifo(shards / name))


#: case -> (damage, what the one line says). Before: a hostile .metadata ran its command on every rank, then an
#: AttributeError traceback; a truncated one an UnpicklingError traceback, a dict an AttributeError traceback.
DAMAGE = {
    ".metadata truncated": (
        cut_metadata,
        "distributed/.metadata cannot be read (UnpicklingError: pickle data was truncated); nothing in it was run",
    ),
    ".metadata empty": (
        lambda s: (s / ".metadata").write_bytes(b""),
        "distributed/.metadata cannot be read (EOFError",
    ),
    ".metadata garbage": (
        lambda s: (s / ".metadata").write_bytes(b"\x00\xff garbage"),
        "distributed/.metadata cannot be read (UnpicklingError: invalid load key",
    ),
    ".metadata a dict": (
        lambda s: (s / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}})),
        "distributed/.metadata holds a dict, where torch's distributed checkpoint reads its Metadata",
    ),
    ".metadata a tensor entry that is an int": (
        rewrite(lambda m: m.state_dict_metadata.update({"model.lm_head.weight": 3})),
        "distributed/.metadata describes 'model.lm_head.weight' by a int of other fields or types",
    ),
    ".metadata a model weight described as bytes": (
        rewrite(lambda m: m.state_dict_metadata.update({"model.lm_head.weight": BytesStorageMetadata()})),
        "distributed/.metadata describes 'model.lm_head.weight' by a BytesStorageMetadata, where the restore reads a "
        "tensor",
    ),
    ".metadata an optimizer state described as bytes": (
        rewrite(lambda m: m.state_dict_metadata.update({"optimizer.state.0.exp_avg": BytesStorageMetadata()})),
        "distributed/.metadata describes 'optimizer.state.0.exp_avg' by a BytesStorageMetadata, where the restore "
        "reads a tensor",
    ),
    ".metadata a shard offset that is text": (
        rewrite(
            lambda m: m.storage_data.update({k: dataclasses.replace(v, offset="0") for k, v in m.storage_data.items()})
        ),
        "distributed/.metadata places '",
    ),
    ".metadata a FIFO": (fifo(".metadata"), "distributed/.metadata is a FIFO, not a file the Trainer writes"),
    ".metadata a link out of the folder": (
        linked_out(".metadata"),
        re.compile(
            r"distributed/\.metadata is a link to .*elsewhere-\.metadata, "
            "outside the checkpoint folder"
        ),
    ),
    "a shard missing": (
        lambda s: (s / SHARD).unlink(),
        f"distributed/{SHARD}, a shard file its .metadata names, is missing",
    ),
    "a shard a link out of the folder": (
        linked_out(SHARD),
        re.compile(
            rf"distributed/{SHARD} is a link to .*elsewhere-{SHARD}, outside "
            "the checkpoint folder"
        ),
    ),
    "a shard a FIFO": (fifo(SHARD), f"distributed/{SHARD} is a FIFO"),
    "a shard cut short": (
        lambda s: (s / SHARD).write_bytes((s / SHARD).read_bytes()[:100]),
        re.compile(
            rf"distributed/{SHARD} holds 100 bytes, where its \.metadata reads up to byte "
            r"[\d,]+ \(cut short\)"
        ),
    ),
    "a shard path with ..": (
        rewrite(shard_path("../optimizer.pt")),
        "names the shard file '../optimizer.pt', a path out of distributed/",
    ),
    "an absolute shard path": (
        rewrite(shard_path("/etc/passwd")),
        "names the shard file '/etc/passwd', a path out of distributed/",
    ),
}


def says(expected, message: str) -> bool:
    return bool(expected.search(message)) if isinstance(expected, re.Pattern) else expected in message


def test_a_real_dcp_checkpoint_is_read_as_torch_reads_it_and_resumes(resumer, sharded, checkpoint):  # noqa: F811
    from torch.distributed.checkpoint import FileSystemReader

    ours = read_distributed_metadata(sharded, pytest.fail)
    theirs = FileSystemReader(sharded / "distributed").read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    assert any(key.startswith("optimizer.state.") for key in ours.state_dict_metadata)
    check_checkpoint_files(sharded)  # accepted
    resumes_exactly(resumer, sharded, checkpoint)  # (the model is not sharded: the Trainer ignores distributed/)


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_shard_checkpoint_is_refused_by_the_trainers_resume_in_one_line(resumer, sharded, tmp_path, case):  # noqa: F811
    damage, expected = DAMAGE[case]
    folder = copied(sharded, tmp_path, damage)
    message = refused_by_train(resumer, folder)
    assert says(expected, message), message
    with pytest.raises(DistributedCheckpointError):
        check_checkpoint_files(folder)


def test_a_hostile_metadata_is_never_run_by_the_trainers_resume(resumer, sharded, tmp_path):  # noqa: F811
    marker = tmp_path / "ran"
    folder = copied(sharded, tmp_path, hostile(marker))
    message = refused_by_train(resumer, folder)
    assert (
        "distributed/.metadata cannot be read (UnpicklingError: global 'posix.system' is not one torch's " in message
    )
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # the unpickler alone: refused at the global, nothing called
        DCPMetadataUnpickler(io.BytesIO((folder / "distributed" / ".metadata").read_bytes())).load()
    assert not marker.exists()
    pickle.loads((folder / "distributed" / ".metadata").read_bytes())  # what torch's reader would have done
    assert marker.exists()


def test_an_oversize_metadata_is_refused_unread(sharded, tmp_path, monkeypatch):
    size = (sharded / "distributed" / ".metadata").stat().st_size
    monkeypatch.setattr(checkpoint_files, "MAX_DCP_METADATA_BYTES", size - 1)
    with pytest.raises(
        DistributedCheckpointError,
        match=f"distributed/.metadata holds {size:,} bytes, more than the {size - 1:,} read",
    ):
        check_checkpoint_files(sharded)


def torch_loaded(model, folder: Path) -> dict[str, torch.Tensor]:
    """The model's weights in ``folder``'s shards, read by torch's own reader."""
    state = {"model": {name: torch.zeros_like(t) for name, t in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=folder / "distributed", no_dist=True)
    return state["model"]


@needs_expert_parallelism
def test_every_dcp_load_reads_the_checked_metadata_and_refuses_in_one_line(sharded, tmp_path):
    """distributed_checkpoint's loads (restore_model here; the optimizer's; also _load_best_model, which has no
    pre-flight) read .metadata through read_distributed_metadata and hand torch's reader the result (checked_reader):
    the weights come back; a hostile file is never run; a shard torch cannot read is one line (DCP's
    CheckpointException is a BaseException: it was a traceback)."""
    model = tiny_moe_model("qwen3_moe", seed=3)
    expected = torch_loaded(model, sharded)
    assert not all(torch.equal(model.state_dict()[name], expected[name]) for name in expected)
    distributed_checkpoint.restore_model(model, sharded)
    assert all(torch.equal(model.state_dict()[name], expected[name]) for name in expected)
    model = tiny_moe_model("qwen3_moe", seed=3)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    marker = tmp_path / "ran"
    hostile_folder = copied(sharded, tmp_path / "hostile", hostile(marker))
    zeroed = copied(sharded, tmp_path / "zeroed", lambda s: (s / SHARD).write_bytes(bytes((s / SHARD).stat().st_size)))
    for folder, says_ in [
        (hostile_folder, "distributed/.metadata cannot be read (UnpicklingError: global 'posix.system'"),
        (zeroed, "its shards cannot be read ("),
    ]:
        with pytest.raises(DistributedCheckpointError) as refused:
            distributed_checkpoint.restore_model(model, folder)
        assert says_ in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
        assert all(torch.equal(model.state_dict()[name], before[name]) for name in before)
    # torch's loader itself, handed the checked reader: the hostile file is refused there too (never run)
    with pytest.raises(BaseException) as refused:  # (DCP wraps every rank's failure in one CheckpointException)
        dcp.load(
            {"model": before},
            storage_reader=distributed_checkpoint.checked_reader(hostile_folder, DistributedCheckpointError),
            no_dist=True,
        )
    assert "global 'posix.system' is not one torch's distributed checkpoint writes" in repr(refused.value)
    assert not marker.exists()


def test_the_allowed_globals_are_what_dcp_save_writes_and_nothing_that_runs_code(tmp_path, monkeypatch):
    from trl_moe_replay.upstream.torch_seam import check_torch, dcp_metadata_globals

    state = {
        "weight": torch.zeros(2, 3),
        "half": torch.zeros(2, dtype=torch.bfloat16),
        "few": torch.zeros(2).to(torch.int8),
        "wide": torch.zeros(1, 2, 2, 2).to(memory_format=torch.channels_last),
        "step": 3,
        "name": "x",
    }
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    read = metadata_of(tmp_path)  # a real dcp.save's .metadata reads back through the unpickler
    assert set(read.state_dict_metadata) == set(state) and read.storage_data
    # the runtime probe (both trainers' construction) saves nothing and touches no device: cheap, and it holds where a
    # test pretends CUDA is there (test_async_grpo's use_cpu test failed in dcp.save's device path)
    monkeypatch.setattr(dcp, "save", lambda *a, **k: pytest.fail("the probe saved a checkpoint"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_torch() == ()
    allowed = dcp_metadata_globals()
    modules = {module for module, _ in allowed}
    assert modules == {
        "torch",
        "torch.serialization",
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "pathlib",
    }
    assert [name for module, name in allowed if module == "torch.serialization"] == ["_get_layout"]
    for module, name in [("os", "system"), ("builtins", "eval"), ("torch", "load"), ("subprocess", "Popen")]:
        with pytest.raises(pickle.UnpicklingError, match=f"global '{module}.{name}' is not one"):
            DCPMetadataUnpickler(io.BytesIO(b"")).find_class(module, name)


def test_the_probe_reports_a_torch_whose_dcp_differs(monkeypatch):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from trl_moe_replay.upstream import torch_seam

    monkeypatch.setattr(torch_seam, "dcp_metadata_globals", lambda: {("torch", "Size"): tuple})
    assert [f.problem for f in torch_seam.check_torch()] == [
        "torch.Size, a global DCP writes into .metadata, is gone or another object"
    ]
    monkeypatch.undo()
    monkeypatch.setattr(
        DefaultLoadPlanner,
        "set_up_planner",
        lambda self, state, *a, **k: (
            setattr(self, "mappings", {"a.b": ("a", "c")}) or setattr(self, "original_state_dict", state)
        ),
    )
    assert [f.problem for f in torch_seam.check_torch()] == [
        "DefaultLoadPlanner no longer maps a flattened key to its place in the state dict it loads"
    ]


def trained(seed: int):
    """A tiny MoE and an AdamW that has stepped, as a trainer holds them (the parts distributed_checkpoint reads)."""
    model = tiny_moe_model("qwen3_moe", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return SimpleNamespace(
        model=model,
        optimizer=optimizer,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        args=SimpleNamespace(should_save=True),
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint's shards as the package saves them (save_training_state: flattened AdamW state)."""
    folder = tmp_path_factory.mktemp("saved") / "checkpoint-1"
    distributed_checkpoint.save_training_state(trained(seed=0), str(folder))
    return folder


def bytes_entries(folder: Path) -> dict:
    metadata = metadata_of(folder / "distributed")
    return {
        key: entry for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata)
    }


@needs_expert_parallelism
def test_the_packages_optimizer_shards_resume_through_the_weights_only_planner(saved):
    """The entries DCP pickles (the param_groups values: floats, tuples, bools, None) all read with weights_only."""
    entries = bytes_entries(saved)
    assert {key.rpartition(".")[2] for key in entries} >= {
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
        "foreach",
        "maximize",
        "fused",
        "decoupled_weight_decay",
    }
    assert not [key for key in entries if key.startswith(checkpoint_files.TENSOR_ENTRIES)]
    check_checkpoint_files(saved)  # accepted
    original, fresh = trained(seed=0), trained(seed=1)
    fresh.optimizer.param_groups[0]["betas"] = (0.5, 0.5)
    distributed_checkpoint.restore_model(fresh.model, saved)
    distributed_checkpoint.restore_optimizer_and_scheduler(fresh, saved)
    theirs, ours = original.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert ours["param_groups"] == theirs["param_groups"] and ours["param_groups"][0]["betas"] == (0.8, 0.95)
    assert all(
        torch.equal(ours["state"][i][k], theirs["state"][i][k]) for i in theirs["state"] for k in theirs["state"][i]
    )


@needs_expert_parallelism
def test_a_hostile_shard_bytes_entry_is_refused_in_one_line_and_never_run(saved, tmp_path):
    """torch's DefaultLoadPlanner reads a bytes entry with torch.load(weights_only=False): a shard pickle ran its
    command during the optimizer's load (the pre-flight passes it: the metadata is DCP's own)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    marker = tmp_path / "ran"
    key = next(key for key in bytes_entries(saved) if key.endswith(".betas"))

    def damage(shards: Path):
        payload = io.BytesIO()
        torch.save(RunsCommand(f"touch {marker}"), payload)
        (shards / "evil.distcp").write_bytes(payload.getvalue())
        rewrite(
            lambda m: m.storage_data.update(
                {
                    index: dataclasses.replace(
                        info, relative_path="evil.distcp", offset=0, length=len(payload.getvalue())
                    )
                    for index, info in m.storage_data.items()
                    if index.fqn == key
                }
            )
        )(shards)

    folder = copied(saved, tmp_path, damage)
    check_checkpoint_files(folder)  # the metadata is DCP's own: the load is where the entry is read
    trainer = trained(seed=1)
    with pytest.raises(DistributedCheckpointError) as refused:
        distributed_checkpoint.restore_optimizer_and_scheduler(trainer, folder)
    message = str(refused.value)
    assert (
        message.startswith(f"checkpoint {folder} refused: its shard entry {key!r} is a pickle that would run code")
        and "GLOBAL posix.system" in message
        and "\n" not in message
    ), message
    assert not marker.exists()
    # torch's own planner, for the record: it runs the command
    state = {
        "optimizer": get_optimizer_state_dict(
            trainer.model, trainer.optimizer, options=distributed_checkpoint._options()
        )
    }
    dcp.load(
        state, storage_reader=distributed_checkpoint.checked_reader(folder, DistributedCheckpointError), no_dist=True
    )
    assert marker.exists()


@needs_expert_parallelism
def test_a_wrongly_typed_entry_is_one_line_from_the_restore_itself(sharded, saved, tmp_path, monkeypatch):
    """The pre-flight refuses it; the restore's own reads check the type too (it was an AttributeError traceback:
    'BytesStorageMetadata' object has no attribute 'size')."""
    monkeypatch.setattr(checkpoint_files, "TENSOR_ENTRIES", ("nothing.",))  # as if the pre-flight had let it through
    monkeypatch.setattr(checkpoint_files, "_layout_problem", lambda metadata: None)  # (it places no bytes for it)
    folder = copied(
        sharded,
        tmp_path / "model",
        rewrite(lambda m: m.state_dict_metadata.update({"model.lm_head.weight": BytesStorageMetadata()})),
    )
    with pytest.raises(
        DistributedCheckpointError,
        match="'lm_head.weight' is a BytesStorageMetadata in its shards, where the model holds a tensor",
    ):
        distributed_checkpoint.restore_model(tiny_moe_model("qwen3_moe", seed=3), folder)
    trainer = trained(seed=1)
    name, param = next(iter(trainer.model.named_parameters()))
    del trainer.optimizer.state[param]  # as PR2's predictors before they train: the restore allocates their state
    folder = copied(
        saved,
        tmp_path / "optimizer",
        rewrite(lambda m: m.state_dict_metadata.update({f"optimizer.state.{name}.exp_avg": BytesStorageMetadata()})),
    )
    with pytest.raises(
        DistributedCheckpointError,
        match=f"its optimizer state '{name}.exp_avg' is a BytesStorageMetadata, where a tensor is read",
    ):
        distributed_checkpoint.restore_optimizer_and_scheduler(trainer, folder)


# ----------------------------------------------------------------------------------------------- the recipe
# (last in the module: the recipe resets accelerate's state, which the trainers above share)
@pytest.mark.parametrize("case", ["hostile", ".metadata truncated", ".metadata a dict", "a shard path with .."])
def test_a_damaged_shard_checkpoint_is_one_line_on_the_recipe_before_the_model_is_built(
    recipe,  # noqa: F811 (the fixture imported above)
    sharded,
    tmp_path,
    case,
    capsys,
    monkeypatch,
):
    marker = tmp_path / "ran"
    damage, expected = (
        (hostile(marker), "distributed/.metadata cannot be read (UnpicklingError: global 'posix.system'")
        if case == "hostile"
        else DAMAGE[case]
    )
    folder = copied(sharded, tmp_path, damage)
    line, _ = recipe_refusal(recipe, folder, capsys, monkeypatch)
    assert says(expected, line), line
    assert not marker.exists()
