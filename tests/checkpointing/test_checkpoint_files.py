"""Resume: every weight, or one line (issue 38, item 3). A checkpoint that cannot be resumed exactly is refused by
``Trainer.train(resume_from_checkpoint=...)`` in one line before the model changes, and by the recipe before the model
is built: damaged or hostile files (the pre-flight, checkpointing/checkpoint_files.py; the weights,
checkpointing/checkpoint_weights.py), a stray PEFT adapter beside full weights, embeddings tied differently from the model.

One real checkpoint (a 1-step run: weights, optimizer, scheduler, RNG and trainer state) is built per module and
copied per case; one resuming trainer per tying serves every refusal, as a refusal leaves it as it was.
"""

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from trl_moe_replay.checkpointing import checkpoint_weights, checkpoints
from trl_moe_replay.checkpointing.checkpoint_files import STATE_FIELD_TYPES, CheckpointError
from trl_moe_replay.checkpointing.checkpoint_weights import restore_checkpoint_weights
from trl_moe_replay.testing import tiny_moe_model

from tests.async_grpo.test_async_grpo_trainer import DATASET, reward, settings
from tests.helpers import load_script
from tests.trainer.test_grpo_trainer import make_trainer


ROOT = Path(__file__).resolve().parents[2]
Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """checkpoint-1 of a 1-step run: what the Trainer writes (model.safetensors in the Hub layout, optimizer.pt,
    scheduler.pt, rng_state.pth, trainer_state.json)."""
    run = tmp_path_factory.mktemp("written")
    make_trainer(run, tiny_moe_model("qwen3_moe", seed=0), max_steps=1, save_strategy="steps", save_steps=1).train()
    folder = run / "checkpoint-1"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= {
        p.name for p in folder.iterdir()
    }
    return folder


@pytest.fixture(scope="module")
def resumer(tmp_path_factory):
    """The trainer that resumes (max_steps 1: a resume of checkpoint-1 loads everything and trains no step)."""
    return make_trainer(tmp_path_factory.mktemp("resumer"), tiny_moe_model("qwen3_moe", seed=1), max_steps=1)


@pytest.fixture(scope="module")
def tied_resumer(tmp_path_factory):
    model = tiny_moe_model("qwen3_moe", seed=1, tie_word_embeddings=True)
    return make_trainer(tmp_path_factory.mktemp("tied"), model, max_steps=1)


@pytest.fixture(scope="module")
def recipe():
    return load_script(ROOT / "recipes" / "grpo_r3.py", "grpo_r3_recipe_preflight")


def copied(checkpoint: Path, tmp_path: Path, damage) -> Path:
    folder = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(checkpoint, folder)
    damage(folder)
    return folder


def weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def says(expected: str | re.Pattern, message: str) -> bool:
    """``expected`` (text, or a pattern where the line names a path) is in the one line ``message``."""
    return bool(expected.search(message)) if isinstance(expected, re.Pattern) else expected in message


def resumes_exactly(trainer, folder: Path, checkpoint: Path) -> None:
    """``trainer.train(resume_from_checkpoint=folder)`` (max_steps 1: it loads everything and trains no step) leaves
    every weight as the untouched ``checkpoint``'s file holds it; every weight is moved away from it first."""
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(1.0)
    trainer.train(resume_from_checkpoint=str(folder))
    reference = tiny_moe_model("qwen3_moe", seed=5)
    restore_checkpoint_weights(reference, checkpoint)
    assert all(
        torch.equal(a, b) for a, b in zip(weights(reference).values(), weights(trainer.model).values(), strict=True)
    )


def refused_by_train(trainer, folder: Path) -> str:
    """``trainer.train(resume_from_checkpoint=folder)``'s one-line refusal; the model's weights unchanged."""
    before = weights(trainer.model)
    with pytest.raises(CheckpointError) as refused:
        trainer.train(resume_from_checkpoint=str(folder))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"checkpoint {folder} refused: "), message
    after = weights(trainer.model)
    assert all(torch.equal(after[name], before[name]) for name in before), "the model changed"
    return message


# ----------------------------------------------------------------------------------------------- damaged files
def cut(name, keep=0.5):
    def damage(folder: Path):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * keep)])

    return damage


class RunsCode:
    def __reduce__(self):
        return (print, ("this code ran",))


def write(name, data: bytes):
    return lambda folder: (folder / name).write_bytes(data)


def edit_state(change):
    def damage(folder: Path):
        state = json.loads((folder / "trainer_state.json").read_text())
        change(state)
        (folder / "trainer_state.json").write_text(json.dumps(state))

    return damage


def torch_saved(name, value):
    return lambda folder: torch.save(value, folder / name)


#: the Trainer's files beside the weights: case -> (damage, what the one line says). Each was a traceback (torch's
#: zip reader, EOFError, UnpicklingError, JSONDecodeError, TypeError) after the weights had been loaded.
FILE_DAMAGE = {
    "optimizer.pt truncated": (cut("optimizer.pt"), "optimizer.pt cannot be read (RuntimeError: PytorchStreamReader"),
    "optimizer.pt empty": (write("optimizer.pt", b""), "optimizer.pt cannot be read (EOFError"),
    "optimizer.pt a pickle that runs code": (
        write("optimizer.pt", pickle.dumps({"state": RunsCode()})),
        "optimizer.pt cannot be read (UnpicklingError: Weights only load failed",
    ),
    "optimizer.pt without param_groups": (
        torch_saved("optimizer.pt", {"state": {}}),
        "optimizer.pt holds no 'param_groups'",
    ),
    "scheduler.pt truncated": (cut("scheduler.pt"), "scheduler.pt cannot be read (RuntimeError: PytorchStreamReader"),
    "scheduler.pt empty": (write("scheduler.pt", b""), "scheduler.pt cannot be read (EOFError"),
    "scheduler.pt a list": (
        torch_saved("scheduler.pt", [1, 2]),
        "scheduler.pt holds a list, where the Trainer reads a",
    ),
    "rng_state.pth truncated": (cut("rng_state.pth"), "rng_state.pth cannot be read ("),
    "rng_state.pth empty": (write("rng_state.pth", b""), "rng_state.pth cannot be read (EOFError"),
    "rng_state.pth without numpy": (
        torch_saved("rng_state.pth", {"python": None, "cpu": torch.zeros(3)}),
        "rng_state.pth holds no 'numpy'",
    ),
    "scaler.pt a pickle that runs code": (
        write("scaler.pt", pickle.dumps(RunsCode())),
        "scaler.pt cannot be read (UnpicklingError",
    ),
    "trainer_state.json truncated": (cut("trainer_state.json"), "trainer_state.json is not valid JSON"),
    "trainer_state.json empty": (write("trainer_state.json", b""), "trainer_state.json is not valid JSON"),
    "trainer_state.json garbage": (write("trainer_state.json", b"\x00\xff garbage"), "is not valid JSON"),
    "trainer_state.json a list": (write("trainer_state.json", b"[1, 2]"), "trainer_state.json holds a JSON list"),
    "trainer_state.json an unknown field": (
        edit_state(lambda s: s.update(steps_done=3)),
        "trainer_state.json holds 'steps_done', which is no field",
    ),
    "trainer_state.json a step that is text": (
        edit_state(lambda s: s.update(global_step="1")),
        "global_step is '1', where the Trainer reads int",
    ),
    "trainer_state.json a negative step": (
        edit_state(lambda s: s.update(global_step=-4)),
        "global_step is -4, a negative step",
    ),
    "trainer_state.json log_history an object": (
        edit_state(lambda s: s.update(log_history={})),
        "log_history is dict, where the Trainer reads list",
    ),
    "trainer_state.json of empty objects": (
        write("trainer_state.json", b"[" + b"{}," * 5_000_000 + b"{}]"),
        "JSON values, more than the 8,388,608 read: refusing to parse it",
    ),
    "trainer_state.json a 5000-digit integer": (
        write("trainer_state.json", b'{"global_step": ' + b"7" * 5000 + b"}"),
        "trainer_state.json holds a number Python refuses to convert (Exceeds the limit (4300 digits)",
    ),  # was a bare ValueError naming no file
    "trainer_state.json a FIFO": (
        lambda f: ((f / "trainer_state.json").unlink(), os.mkfifo(f / "trainer_state.json")),
        "trainer_state.json is a FIFO, not a file the Trainer writes",
    ),
    "optimizer.pt a link out of the folder": (
        lambda f: (
            (f / "optimizer.pt").rename(f.parent / "elsewhere.pt"),
            (f / "optimizer.pt").symlink_to(f.parent / "elsewhere.pt"),
        ),
        re.compile("optimizer.pt is a link to .*elsewhere.pt, outside the checkpoint folder"),
    ),
}


@pytest.mark.parametrize("case", list(FILE_DAMAGE))
def test_a_damaged_file_is_refused_by_the_trainers_resume_before_the_model_changes(
    resumer, checkpoint, tmp_path, case, capsys
):
    damage, expected = FILE_DAMAGE[case]
    folder = copied(checkpoint, tmp_path, damage)
    message = refused_by_train(resumer, folder)
    assert says(expected, message), message
    assert message.endswith("Resume from another checkpoint-N of the run; nothing was loaded")
    assert "this code ran" not in capsys.readouterr().out


def test_the_state_field_table_names_fields_of_transformers_trainer_state():
    from transformers.trainer_callback import TrainerState

    assert set(STATE_FIELD_TYPES) <= set(TrainerState.__dataclass_fields__)


# ----------------------------------------------------------------------------------------------- damaged weights
def to_index(values):
    """model.safetensors as one shard of an index whose first two entries map to ``values``."""

    def damage(folder: Path):
        names = sorted(load_file(folder / "model.safetensors"))
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        weight_map = dict.fromkeys(names, "model-00001-of-00001.safetensors")
        weight_map[names[0]], weight_map[names[1]] = values
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return damage


def as_bin(change=lambda tensors: tensors, sharded=False):
    def damage(folder: Path):
        tensors = change(load_file(folder / "model.safetensors"))
        (folder / "model.safetensors").unlink()
        if not sharded:
            torch.save(tensors, folder / "pytorch_model.bin")
            return
        torch.save(tensors, folder / "pytorch_model-00001-of-00001.bin")
        weight_map = dict.fromkeys(tensors, "pytorch_model-00001-of-00001.bin")
        weight_map[sorted(weight_map)[0]] = "config.json"  # a file that is no torch file
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return damage


def linked_out(target_is_folder: bool):
    def damage(folder: Path):
        elsewhere = folder.parent / "elsewhere"
        elsewhere.mkdir()
        (folder / "model.safetensors").rename(elsewhere / "model.safetensors")
        (folder / "model.safetensors").symlink_to(elsewhere if target_is_folder else elsewhere / "model.safetensors")

    return damage


WEIGHT_DAMAGE = {
    "model.safetensors a link to another folder's file": (
        linked_out(False),
        re.compile("model.safetensors is a link to .*elsewhere/model.safetensors, outside the checkpoint folder"),
    ),
    "model.safetensors a link to another folder": (
        linked_out(True),
        re.compile("model.safetensors is a link to .*elsewhere, outside the checkpoint folder"),
    ),
    "weight_map values that are ints": (to_index((3, 4)), "to 3, which is not the name of a .safetensors file"),
    "weight_map values that are null": (to_index((None, None)), "to None, which is not the name of a .safetensors"),
    "weight_map a path out of the folder": (
        to_index(("../x.safetensors", "../x.safetensors")),
        "to '../x.safetensors', which is not the name of a .safetensors file",
    ),
    "a .bin index naming a non-torch file": (
        as_bin(sharded=True),
        "to 'config.json', which is not the name of a .bin file",
    ),
    "a .bin with an int key": (
        as_bin(lambda t: {**t, 7: torch.zeros(2)}),
        "pytorch_model.bin cannot be read (ValueError: holds the key 7 (int), where weight names are text",
    ),
    "a .bin with a sparse tensor": (
        as_bin(lambda t: {**t, Q: t[Q].to_sparse()}),
        f"'{Q}' is a torch.sparse_coo tensor, where model weights are dense",
    ),
}


@pytest.mark.parametrize("case", list(WEIGHT_DAMAGE))
def test_damaged_weights_are_refused_by_the_trainers_resume_before_the_model_changes(
    resumer, checkpoint, tmp_path, case
):
    damage, expected = WEIGHT_DAMAGE[case]
    message = refused_by_train(resumer, copied(checkpoint, tmp_path, damage))
    assert says(expected, message), message


def test_hub_layout_weights_without_config_json_resume_exactly(resumer, checkpoint, tmp_path):
    """save_pretrained's names in a folder without config.json (or generation_config.json, where transformers'
    own fallback fails with a TypeError): converted with the model's config, every weight restored."""
    folder = copied(
        checkpoint, tmp_path, lambda f: [(f / n).unlink() for n in ("config.json", "generation_config.json")]
    )
    resumes_exactly(resumer, folder, checkpoint)


def test_a_checkpoint_in_the_hub_cache_resumes_through_its_links_to_the_blobs(resumer, checkpoint, tmp_path):
    """snapshot_download's layout: a snapshot's files are links to the repository's blobs/, outside the checkpoint
    folder but its own."""
    repo = tmp_path / "models--org--run"
    folder = repo / "snapshots" / "0123abc" / "checkpoint-1"
    folder.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in checkpoint.iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (folder / file.name).symlink_to(os.path.relpath(blob, folder))
    resumes_exactly(resumer, folder, checkpoint)


# ----------------------------------------------------------------------------------------------- two runs, one folder
def with_stray_adapter(folder: Path) -> None:
    """What a LoRA run into the same output_dir leaves beside the full run's model.safetensors."""
    lora = get_peft_model(tiny_moe_model("qwen3_moe", seed=2), LoraConfig(r=4, target_modules=["q_proj"]))
    lora.save_pretrained(folder)


def test_a_stray_adapter_beside_full_weights_is_refused_by_the_trainers_resume(resumer, checkpoint, tmp_path):
    folder = copied(checkpoint, tmp_path, with_stray_adapter)
    message = refused_by_train(resumer, folder)
    assert (
        "it holds full model weights (model.safetensors) and a PEFT adapter (adapter_config.json, "
        "adapter_model.safetensors)"
    ) in message
    assert "Delete the other run's files" in message


def test_restore_checkpoint_weights_reads_only_the_weights_beside_a_stray_adapter(checkpoint, tmp_path):
    """Called alone (no pre-flight): the full model's weights, every one, never the adapter's conversion (which
    attached the adapter and left q_proj at its initial values)."""
    folder = copied(checkpoint, tmp_path, with_stray_adapter)
    model = tiny_moe_model("qwen3_moe", seed=3)
    restore_checkpoint_weights(model, folder)
    reference = tiny_moe_model("qwen3_moe", seed=4)
    restore_checkpoint_weights(reference, checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(weights(reference).values(), weights(model).values(), strict=True))


# ----------------------------------------------------------------------------------------------- tied embeddings
def own_names(model):
    """``model``'s weights under its own names (both names of a tied pair), as ``save_file`` of its state dict."""

    def write(folder: Path):
        folder.mkdir(parents=True)
        model.config.save_pretrained(folder)
        state = {n: t.contiguous().clone() for n, t in model.state_dict().items()}
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})

    return write


def test_an_untied_checkpoint_is_refused_by_a_tied_model_in_either_layout(tied_resumer, tmp_path):
    untied = tiny_moe_model("qwen3_moe", seed=0)
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    untied.save_pretrained(tmp_path / "hub" / "checkpoint-1")  # the Hub layout: through from_pretrained's conversion
    own_names(untied)(tmp_path / "own" / "checkpoint-1")  # the model's own names: loaded directly
    for layout in ("hub", "own"):
        message = refused_by_train(tied_resumer, tmp_path / layout / "checkpoint-1")
        assert (
            "it holds 'lm_head.weight' and 'model.embed_tokens.weight' with different values" in message
            or "it holds 'model.embed_tokens.weight' and 'lm_head.weight' with different values" in message
        ), message
        assert "Resume with tie_word_embeddings=False" in message
    model = tied_resumer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one weight


def test_a_tied_checkpoint_is_refused_by_an_untied_model_saying_why(resumer, tmp_path):
    tiny_moe_model("qwen3_moe", seed=0, tie_word_embeddings=True).save_pretrained(tmp_path / "checkpoint-1")
    message = refused_by_train(resumer, tmp_path / "checkpoint-1")
    assert "'lm_head.weight' is missing from it" in message
    assert "written by a model with tied embeddings (tie_word_embeddings=True)" in message


def test_a_tied_checkpoint_with_both_names_equal_resumes_a_tied_model(tmp_path):
    """torch.save(model.state_dict()) of a tied model holds both names, equal: one weight, restored."""
    saved = tiny_moe_model("qwen3_moe", seed=0, tie_word_embeddings=True)
    own_names(saved)(tmp_path / "checkpoint")
    model = tiny_moe_model("qwen3_moe", seed=1, tie_word_embeddings=True)
    restore_checkpoint_weights(model, tmp_path / "checkpoint")
    assert all(torch.equal(a, b) for a, b in zip(weights(saved).values(), weights(model).values(), strict=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight


# ----------------------------------------------------------------------------------------------- one function
def test_every_resume_path_reaches_the_one_pre_flight(resumer, tmp_path, monkeypatch):
    """Both trainers' train(resume_from_checkpoint=...) (a path, or True: the newest checkpoint) and the recipe's
    resolve_resume call check_checkpoint_files, before anything is loaded."""
    from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayAsyncGRPOTrainer
    from trl_moe_replay.testing.async_workers import NoOpWeightTransfer, ScriptedRolloutWorker

    class Reached(Exception):
        pass

    def pre_flight(folder):
        raise Reached(str(folder))

    monkeypatch.setattr(checkpoint_weights, "check_checkpoint_files", pre_flight)
    monkeypatch.setattr(checkpoints, "check_checkpoint_files", pre_flight)
    model_dir = tmp_path / "model"
    tiny_moe_model("qwen3_moe", seed=1).save_pretrained(model_dir)
    from trl_moe_replay.testing import tiny_tokenizer

    tiny_tokenizer().save_pretrained(model_dir)
    async_trainer = MoEReplayAsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward,
        train_dataset=DATASET,
        args=MoEReplayAsyncGRPOConfig(**settings(tmp_path / "async")),
        rollout_worker=ScriptedRolloutWorker([]),
        weight_transfer=NoOpWeightTransfer(),
    )
    (tmp_path / "async" / "checkpoint-3").mkdir(parents=True)
    (tmp_path / "async" / "checkpoint-3" / "trainer_state.json").write_text("{}")  # complete: True resolves to it
    for trainer, value, folder in [
        (resumer, str(tmp_path / "ck"), str(tmp_path / "ck")),
        (async_trainer, str(tmp_path / "ck"), str(tmp_path / "ck")),
        (async_trainer, True, str(tmp_path / "async" / "checkpoint-3")),
    ]:
        with pytest.raises(Reached, match=re.escape(folder)):
            trainer.train(resume_from_checkpoint=value)
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").write_text("{}")
    with pytest.raises(Reached, match="checkpoint-2"):
        checkpoints.resolve_resume("true", tmp_path / "out")


# ----------------------------------------------------------------------------------------------- the recipe
def recipe_refusal(recipe, folder, capsys, monkeypatch):
    """The recipe resumed from ``folder``: exit status 2, before the model is built, with one line on stderr that
    names the checkpoint and no traceback. Returns that line and everything captured."""
    monkeypatch.setattr(recipe, "cold_started_tiny_model", lambda *a, **k: pytest.fail("the model was built"))
    capsys.readouterr()
    assert recipe.run(["--output_dir", str(folder.parent), "--resume_from_checkpoint", str(folder)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert f": error: checkpoint {folder} refused: " in lines[0], lines[0]
    return lines[0], captured


# (last in the module: the recipe resets accelerate's state, which the trainers above share)
@pytest.mark.parametrize("case", list(FILE_DAMAGE))
def test_a_damaged_file_is_one_line_on_the_recipe_before_the_model_is_built(
    recipe, checkpoint, tmp_path, case, capsys, monkeypatch
):
    damage, expected = FILE_DAMAGE[case]
    folder = copied(checkpoint, tmp_path, damage)
    line, captured = recipe_refusal(recipe, folder, capsys, monkeypatch)
    assert says(expected, line), line
    assert "this code ran" not in captured.out
