"""Distributed-checkpoint resume checked by structure and by content (issue 51, item 1; item 3's EP checkpoint
resumed without EP). Each variant below loaded and trained on (rc 0) or ended in an allocation traceback; now each is
refused in one line, through the trainer's resume.

The checkpoint is what an expert-parallel run writes (checkpoint-N with model.safetensors, scheduler.pt, RNG and
trainer state, and the model's and optimizer's shards in distributed/ with their manifest, no optimizer.pt), from a
real 1-step run whose trainer saves it through ``save_training_state``. The damage edits its ``.metadata`` through
torch's own public classes (``ChunkStorageMetadata``, ``MetadataIndex``, ``dataclasses.replace``), pickled as torch
pickles it. The resuming trainer is not sharded at load time: it reads the weights from model.safetensors and, since
this issue, the optimizer and scheduler from the shards (before: started afresh, lr 0 at step 3 instead of 2e-4).
"""

import dataclasses
import io
import logging
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex

from trl_moe_replay import DistributedCheckpointError
from trl_moe_replay.checkpointing import checkpoint_files, dcp_manifest, distributed_checkpoint
from trl_moe_replay.checkpointing.checkpoint_files import CheckpointError, check_checkpoint_files
from trl_moe_replay.testing import tiny_moe_model

from tests.checkpointing.test_checkpoint_files import refused_by_train
from tests.checkpointing.test_distributed_checkpoint import metadata_of, needs_expert_parallelism, rewrite
from tests.trainer.test_grpo_trainer import make_trainer


#: the package's DCP save and restore (transformers.distributed.checkpoint) exist with expert parallelism only: the
#: oldest end (transformers 5.16) has neither, as for tests/checkpointing/test_distributed_checkpoint.py
pytestmark = needs_expert_parallelism


PARAM = "model.layers.0.self_attn.q_proj.weight"
OTHER = "model.layers.1.self_attn.q_proj.weight"
Q0, Q1 = f"model.{PARAM}", f"model.{OTHER}"  # their keys in the shards
MOMENT0, MOMENT1 = f"optimizer.state.{PARAM}.exp_avg", f"optimizer.state.{OTHER}.exp_avg"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the trainer of a 1-step run, its checkpoint-1 as an expert-parallel run writes it)."""
    run = tmp_path_factory.mktemp("ep_run")
    trainer = make_trainer(run, tiny_moe_model("qwen3_moe", seed=0), max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    folder = run / "checkpoint-1"
    (folder / "optimizer.pt").unlink()  # an EP run keeps its optimizer in the shards only
    distributed_checkpoint.save_training_state(trainer, str(folder))
    assert (folder / "distributed" / dcp_manifest.MANIFEST_NAME).is_file()
    return trainer, folder


@pytest.fixture(scope="module")
def resumer(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("resumer"), tiny_moe_model("qwen3_moe", seed=1), max_steps=1)


def copied(folder: Path, tmp_path: Path, *damage) -> Path:
    target = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(folder, target)
    for change in damage:
        change(target / "distributed")
    return target


def stored(shards: Path, info) -> bytes:
    with open(shards / info.relative_path, "rb") as file:
        file.seek(info.offset)
        return file.read(info.length)


def split_in_two(key: str):
    """A real two-chunk layout of ``key`` (as two ranks write it): its rows in two chunks, each ``torch.save``d into
    a shard file of its own, as torch's writer stores a chunk. Loads exactly (see the test below)."""

    def damage(shards: Path):
        metadata = metadata_of(shards)
        entry = metadata.state_dict_metadata[key]
        (chunk,) = entry.chunks
        info = metadata.storage_data.pop(MetadataIndex(key, chunk.offsets))
        tensor = torch.load(io.BytesIO(stored(shards, info)), weights_only=True)
        half = tensor.shape[0] // 2
        entry.chunks = []
        for n, (start, piece) in enumerate([(0, tensor[:half]), (half, tensor[half:])]):
            payload = io.BytesIO()
            torch.save(piece.clone(), payload)
            (shards / f"split_{n}.distcp").write_bytes(payload.getvalue())
            offsets = torch.Size([start, *[0] * (tensor.dim() - 1)])
            entry.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=piece.shape))
            metadata.storage_data[MetadataIndex(key, offsets)] = dataclasses.replace(
                info, relative_path=f"split_{n}.distcp", offset=0, length=len(payload.getvalue())
            )
        (shards / ".metadata").write_bytes(pickle.dumps(metadata))

    return damage


def on_chunk(key: str, number: int, change):
    """``change(chunk)`` -> the chunk that replaces chunk ``number`` of ``key`` (its storage entry follows it)."""

    def edit(metadata):
        entry = metadata.state_dict_metadata[key]
        old = entry.chunks[number]
        new = change(old)
        entry.chunks[number] = new
        info = metadata.storage_data.pop(MetadataIndex(key, old.offsets))
        metadata.storage_data[MetadataIndex(key, new.offsets)] = info

    return rewrite(edit)


def swap_storage(a: str, b: str):
    def edit(metadata):
        ia = MetadataIndex(a, metadata.state_dict_metadata[a].chunks[0].offsets)
        ib = MetadataIndex(b, metadata.state_dict_metadata[b].chunks[0].offsets)
        metadata.storage_data[ia], metadata.storage_data[ib] = metadata.storage_data[ib], metadata.storage_data[ia]

    return rewrite(edit)


def share_storage(a: str, b: str):
    def edit(metadata):
        ia = MetadataIndex(a, metadata.state_dict_metadata[a].chunks[0].offsets)
        ib = MetadataIndex(b, metadata.state_dict_metadata[b].chunks[0].offsets)
        metadata.storage_data[ib] = metadata.storage_data[ia]

    return rewrite(edit)


def resized(key: str, size: list[int]):
    def edit(metadata):
        entry = metadata.state_dict_metadata[key]
        (chunk,) = entry.chunks
        info = metadata.storage_data.pop(MetadataIndex(key, chunk.offsets))
        offsets = torch.Size([0] * len(size))
        entry.size = torch.Size(size)
        entry.chunks = [ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(size))]
        metadata.storage_data[MetadataIndex(key, offsets)] = info

    return rewrite(edit)


def oversized(shards: Path):
    """A 25 MB .metadata: the real one with 100,000 more entries of long names."""

    def edit(metadata):
        metadata.state_dict_metadata.update({f"extra.{n:0240d}": BytesStorageMetadata() for n in range(100_000)})

    rewrite(edit)(shards)


#: case -> (damage, what the one line says). Before: each loaded and trained (rc 0) at other weights, or (2^60) an
#: allocation traceback on every rank, or (25 MB) a MemoryError after minutes of unpickling.
STRUCTURE = {
    "an empty chunk list": (
        rewrite(lambda m: m.state_dict_metadata[Q0].chunks.clear()),
        f"covers 0 of the 4,096 elements of {Q0!r} with its 0 chunks (a gap, which would keep "
        "the values the model had there)",
    ),
    "one of two chunks dropped": (
        (split_in_two(Q0), rewrite(lambda m: m.state_dict_metadata[Q0].chunks.pop())),
        f"covers 2,048 of the 4,096 elements of {Q0!r} with its 1 chunks (a gap",
    ),
    "offsets negated": (
        (
            split_in_two(Q0),
            on_chunk(Q0, 1, lambda c: dataclasses.replace(c, offsets=torch.Size([-n for n in c.offsets]))),
        ),
        f"gives {Q0!r} (shape [64, 64]) a chunk at offsets [-32, 0] of sizes [32, 64], outside",
    ),
    "sizes [1e6, 64]": (
        on_chunk(Q0, 0, lambda c: dataclasses.replace(c, sizes=torch.Size([10**6, 64]))),
        "a chunk at offsets [0, 0] of sizes [1000000, 64], outside the tensor",
    ),
    "two chunks overlapping": (
        (split_in_two(Q0), on_chunk(Q0, 1, lambda c: dataclasses.replace(c, offsets=torch.Size([31, 0])))),
        f"gives {Q0!r} chunks that overlap (at offsets [0, 0] and [31, 0])",
    ),
    "two entries in shared bytes": (share_storage(Q0, Q1), "in shared bytes of '__0_0.distcp'"),
    "an optimizer entry of 2^60 elements": (
        resized(MOMENT0, [2**60]),
        f"stores the chunk of {MOMENT0!r} at offsets [0] (1,152,921,504,606,846,976 elements of torch.float32) in",
    ),
    "a 25 MB .metadata": (oversized, "bytes of shard files it describes (+1,048,576): torch's save writes"),
}


@pytest.mark.parametrize("case", list(STRUCTURE))
def test_a_structurally_wrong_metadata_is_refused_by_the_trainers_resume_before_anything_loads(
    written, resumer, tmp_path, case
):
    damage, expected = STRUCTURE[case]
    folder = copied(written[1], tmp_path, *(damage if isinstance(damage, tuple) else (damage,)))
    message = refused_by_train(resumer, folder)  # the pre-flight: the model is unchanged
    assert expected in message, message
    with pytest.raises(DistributedCheckpointError):
        check_checkpoint_files(folder)


def test_the_oversized_metadata_is_refused_unread(written, tmp_path, monkeypatch):
    folder = copied(written[1], tmp_path, oversized)
    size = (folder / "distributed" / ".metadata").stat().st_size
    assert size > 25 * 10**6
    monkeypatch.setattr(checkpoint_files.DCPMetadataUnpickler, "load", lambda self: pytest.fail("unpickled"))
    with pytest.raises(DistributedCheckpointError, match=f"distributed/.metadata holds {size:,} bytes, more than"):
        check_checkpoint_files(folder)


def optimizer_state(trainer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(param): name for name, param in trainer.model.named_parameters()}
    return {
        names[id(param)]: {field: value.clone() for field, value in state.items()}
        for param, state in trainer.optimizer.state.items()
    }


def as_loaded(trainer, monkeypatch) -> dict:
    """What ``trainer``'s resume restored: its optimizer state and scheduler just after the load (a resume at
    max_steps still trains a step, transformers' loop)."""
    seen: dict = {}
    load = trainer._load_optimizer_and_scheduler

    def spy(checkpoint):
        load(checkpoint)
        seen.update(
            optimizer=optimizer_state(trainer),
            scheduler=trainer.lr_scheduler.state_dict(),
            lr=trainer.lr_scheduler.get_last_lr(),
        )

    monkeypatch.setattr(trainer, "_load_optimizer_and_scheduler", spy)
    return seen


def test_an_ep_checkpoint_resumed_without_ep_restores_its_optimizer_and_scheduler(written, resumer, monkeypatch):
    """Before: the Trainer found no optimizer.pt and started both afresh (rc 0): no Adam moments, the schedule at
    step 0."""
    writer, folder = written
    check_checkpoint_files(folder)
    loaded = as_loaded(resumer, monkeypatch)
    resumer.train(resume_from_checkpoint=str(folder))
    theirs, ours = optimizer_state(writer), loaded["optimizer"]
    assert theirs.keys() == ours.keys() and len(ours) == len(list(resumer.model.parameters()))
    assert all(torch.equal(ours[name][field], theirs[name][field]) for name in theirs for field in theirs[name])
    assert loaded["scheduler"]["last_epoch"] == writer.lr_scheduler.state_dict()["last_epoch"] == 1
    assert loaded["lr"] == writer.lr_scheduler.get_last_lr()


def test_an_ep_checkpoint_resumed_under_fsdp_without_ep_is_refused_in_one_line(written, resumer, monkeypatch):
    folder = written[1]
    monkeypatch.setattr(resumer, "is_fsdp_enabled", True)
    with pytest.raises(DistributedCheckpointError) as refused:
        resumer._load_optimizer_and_scheduler(str(folder))
    message = str(refused.value)
    assert (
        message.startswith(
            f"checkpoint {folder} refused: its optimizer and scheduler are in torch distributed checkpoint shards"
        )
        and "which FSDP does not read" in message
        and "\n" not in message
    )


def test_swapped_optimizer_storage_is_refused_by_content_through_the_trainers_resume(written, resumer, tmp_path):
    """Two layers' exp_avg of one shape with their storage swapped: the structure is sound (the pre-flight passes);
    the loaded values differ from the manifest's checksums: refused before the first step."""
    folder = copied(written[1], tmp_path, swap_storage(MOMENT0, MOMENT1))
    check_checkpoint_files(folder)
    with pytest.raises(CheckpointError) as refused:
        resumer.train(resume_from_checkpoint=str(folder))
    message = str(refused.value)
    assert message.startswith(f"checkpoint {folder} refused: ") and "\n" not in message, message
    assert (
        f"{MOMENT0!r} as loaded from its shards has another checksum than the save wrote in "
        "distributed/manifest.json (2 of the "
    ) in message, message


def test_an_optimizer_state_larger_than_its_parameter_is_refused_before_the_load(written, resumer, tmp_path):
    """One row more than the parameter fits in the bytes torch.save spent on the chunk (the structure passes); the
    model's own size bounds it."""
    folder = copied(written[1], tmp_path, resized(MOMENT0, [65, 64]))
    check_checkpoint_files(folder)
    with pytest.raises(
        DistributedCheckpointError,
        match=rf"gives the optimizer state '{PARAM}.exp_avg' 4,160 "
        rf"elements \(shape \[65, 64\]\), more than the 4,096 of",
    ):
        resumer.train(resume_from_checkpoint=str(folder))


def test_a_checkpoint_without_manifest_is_checked_by_structure_and_says_so_in_one_line(
    written, resumer, tmp_path, caplog, monkeypatch
):
    folder = copied(written[1], tmp_path, lambda shards: (shards / dcp_manifest.MANIFEST_NAME).unlink())
    loaded = as_loaded(resumer, monkeypatch)
    with caplog.at_level(logging.WARNING, logger=dcp_manifest.__name__):
        resumer.train(resume_from_checkpoint=str(folder))
    lines = [r.getMessage() for r in caplog.records if r.name == dcp_manifest.__name__]
    assert lines == [
        f"checkpoint {folder}: distributed/ holds no manifest.json (not written by trl_moe_replay's "
        "trainers): its structure was checked, its values cannot be; resuming"
    ]
    assert torch.equal(loaded["optimizer"][PARAM]["exp_avg"], optimizer_state(written[0])[PARAM]["exp_avg"])
    damaged = copied(folder, tmp_path / "damaged", rewrite(lambda m: m.state_dict_metadata[Q0].chunks.clear()))
    assert "with its 0 chunks (a gap" in refused_by_train(resumer, damaged)


@needs_expert_parallelism
def test_a_split_layout_restores_exactly_and_swapped_model_storage_is_refused_with_the_model_unchanged(
    written, tmp_path
):
    """restore_model (the model sharded at load time): a real two-chunk layout loads exactly; two layers' q_proj
    storage swapped is refused by content before the model changes."""
    folder = copied(written[1], tmp_path / "split", split_in_two(Q0))
    model = tiny_moe_model("qwen3_moe", seed=3)
    distributed_checkpoint.restore_model(model, folder)
    expected = written[0].model.state_dict()
    assert all(torch.equal(model.state_dict()[name], expected[name]) for name in expected)
    swapped = copied(written[1], tmp_path / "swapped", swap_storage(Q0, Q1))
    check_checkpoint_files(swapped)
    model = tiny_moe_model("qwen3_moe", seed=3)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(DistributedCheckpointError) as refused:
        distributed_checkpoint.restore_model(model, swapped)
    assert f"{Q0!r} as loaded from its shards has another checksum than the save wrote" in str(refused.value)
    assert all(torch.equal(model.state_dict()[name], before[name]) for name in before)


def test_the_checksum_is_the_same_under_any_sharding_and_changes_when_values_move():
    tensor = torch.randn(6, 5, 4)
    whole = dcp_manifest._chunk_sums(tensor, (0, 0, 0), (6, 5, 4))
    parts = [
        dcp_manifest._chunk_sums(tensor[:2], (0, 0, 0), (6, 5, 4)),
        dcp_manifest._chunk_sums(tensor[2:, :3], (2, 0, 0), (6, 5, 4)),
        dcp_manifest._chunk_sums(tensor[2:, 3:], (2, 3, 0), (6, 5, 4)),
    ]
    assert whole == tuple(sum(p[n] for p in parts) % (2**31 - 1) for n in range(2))
    moved = tensor.clone()
    moved[[0, 1]] = moved[[1, 0]]
    assert dcp_manifest._chunk_sums(moved, (0, 0, 0), (6, 5, 4)) != whole
    changed = tensor.clone()
    changed[3, 2, 1] = torch.nextafter(changed[3, 2, 1], torch.tensor(math.inf))
    assert dcp_manifest._chunk_sums(changed, (0, 0, 0), (6, 5, 4)) != whole
    bf16 = tensor.to(torch.bfloat16)
    assert dcp_manifest._chunk_sums(bf16, (0, 0, 0), (6, 5, 4)) != dcp_manifest._chunk_sums(
        bf16.flip(0), (0, 0, 0), (6, 5, 4)
    )
