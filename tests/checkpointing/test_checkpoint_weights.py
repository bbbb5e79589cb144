"""Resume integrity (trl_moe_replay/checkpointing/checkpoint_weights.py): a resume restores every weight of the model from
the checkpoint, in every layout transformers writes and on both trainers, or refuses in one line naming the checkpoint
and the first problem, leaving the model as it was.

The check is independent of the code under test: each test first saves the model with every weight element set to
its own index (exact in float32), reads the files back with safetensors / torch.load, and so learns where each
element of each parameter lands in the files; after the resume every parameter must equal the file at those places.
"""

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayAsyncGRPOTrainer
from trl_moe_replay.checkpointing import checkpoint_weights
from trl_moe_replay.checkpointing.checkpoint_weights import CheckpointWeightsError
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer
from trl_moe_replay.testing.async_workers import NoOpWeightTransfer, ScriptedRolloutWorker

from tests.async_grpo.test_async_grpo_trainer import DATASET, reward, settings
from tests.trainer.test_grpo_trainer import make_trainer


QWEN = "Qwen3MoeForCausalLM"


# ----------------------------------------------------------------------------------------------- saving, each layout
def save_layout(model, folder: Path, layout: str) -> None:
    """``model``'s weights in ``folder`` as transformers writes them in ``layout``."""
    folder.mkdir(parents=True)
    if layout == "safetensors":
        model.save_pretrained(folder)
    elif layout == "sharded":
        model.save_pretrained(folder, max_shard_size="100KB")
        assert (folder / "model.safetensors.index.json").is_file()
    elif layout == "fused":  # the model's own names (a state dict saved as it is)
        model.config.save_pretrained(folder)
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()},
            folder / "model.safetensors",
            metadata={"format": "pt"},
        )
    elif layout in ("bin", "bin_sharded"):  # transformers 4.x with save_safetensors=False: the Hub names in .bin
        model.save_pretrained(folder)
        tensors = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        if layout == "bin":
            torch.save(tensors, folder / "pytorch_model.bin")
        else:
            names = sorted(tensors)
            halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
            for file, part in halves.items():
                torch.save({n: tensors[n] for n in part}, folder / file)
            weight_map = {n: file for file, part in halves.items() for n in part}
            (folder / "pytorch_model.bin.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map})
            )
    else:
        raise ValueError(layout)


def file_values(folder: Path) -> torch.Tensor:
    """Every tensor of the folder's weight files, flattened into one float64 vector (fixed order), read directly."""
    parts = []
    for file in sorted(folder.iterdir()):
        if file.suffix == ".safetensors":
            tensors = load_file(file)
        elif file.suffix == ".bin":
            tensors = torch.load(file, weights_only=True)
        else:
            continue
        parts += [tensors[name].double().flatten() for name in sorted(tensors)]
    return torch.cat(parts)


def unique_weights(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen, unique = set(), {}
    for name, param in params.items():
        if id(param) not in seen:
            seen.add(id(param))
            unique[name] = param
    return unique


def where_in_file(model, params: dict[str, torch.Tensor], folder: Path, save) -> dict[str, torch.Tensor]:
    """For each of ``params``: the positions of its elements in :func:`file_values` of what ``save`` writes."""
    offsets, start = {}, 1
    with torch.no_grad():
        for name, param in params.items():
            offsets[name] = start
            param.copy_(torch.arange(start, start + param.numel(), dtype=torch.float64).view(param.shape))
            start += param.numel()
    assert start < 2**24  # exact in float32
    save(folder)
    ids = file_values(folder).long()
    position = torch.full((start,), -1, dtype=torch.long)
    position[ids] = torch.arange(len(ids))
    return {name: position[offsets[name] : offsets[name] + p.numel()] for name, p in params.items()}


def randomize(params, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in params.values():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64))


def assert_restored(params, positions, folder):
    values = file_values(folder)
    for name, param in params.items():
        assert (positions[name] >= 0).all(), f"{name} is not in the checkpoint"
        assert torch.equal(param.detach().double().flatten(), values[positions[name]]), name


# ----------------------------------------------------------------------------------------------- trainers
@pytest.fixture(scope="module")
def sync_trainer(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("sync"), tiny_moe_model("qwen3_moe", seed=1))


@pytest.fixture(scope="module")
def async_trainer(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("async_model")
    tiny_moe_model("qwen3_moe", seed=1).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    return MoEReplayAsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward,
        train_dataset=DATASET,
        args=MoEReplayAsyncGRPOConfig(**settings(tmp_path_factory.mktemp("async"))),
        rollout_worker=ScriptedRolloutWorker([]),
        weight_transfer=NoOpWeightTransfer(),
    )


@pytest.fixture(params=["sync", "async"])
def trainer(request):
    return request.getfixturevalue(f"{request.param}_trainer")


LAYOUTS = ["safetensors", "sharded", "fused", "bin", "bin_sharded"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_resume_restores_every_weight_from_the_file(trainer, tmp_path, layout):
    model = trainer.model
    params = unique_weights(dict(model.state_dict(keep_vars=True)))
    positions = where_in_file(model, params, tmp_path / "probe", lambda folder: save_layout(model, folder, layout))
    randomize(params, seed=0)  # the run's weights at the checkpoint
    save_layout(model, tmp_path / "checkpoint", layout)
    randomize(params, seed=1)  # the weights of the process that resumes
    trainer._load_from_checkpoint(str(tmp_path / "checkpoint"))
    assert_restored(params, positions, tmp_path / "checkpoint")


def test_load_best_model_restores_every_weight(trainer, tmp_path):
    model = trainer.model
    params = unique_weights(dict(model.state_dict(keep_vars=True)))
    positions = where_in_file(
        model, params, tmp_path / "probe", lambda folder: save_layout(model, folder, "safetensors")
    )
    randomize(params, seed=2)
    save_layout(model, tmp_path / "checkpoint-7", "safetensors")
    randomize(params, seed=3)
    trainer.state.best_model_checkpoint = str(tmp_path / "checkpoint-7")
    trainer._load_best_model()
    assert_restored(params, positions, tmp_path / "checkpoint-7")


def test_a_lora_resume_restores_the_adapter_and_modules_to_save_and_keeps_the_base(tmp_path):
    trainer = make_trainer(
        tmp_path / "run",
        tiny_moe_model("qwen3_moe"),
        trainer_kwargs=dict(
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["gate"])
        ),
    )
    model = trainer.model
    everything = dict(model.state_dict(keep_vars=True))
    adapter = {name: p for name, p in everything.items() if "lora_" in name or "modules_to_save" in name}
    assert any("lora_B" in n for n in adapter) and any("modules_to_save" in n for n in adapter)
    positions = where_in_file(model, adapter, tmp_path / "probe", model.save_pretrained)
    randomize(adapter, seed=0)
    model.save_pretrained(tmp_path / "checkpoint")
    assert not (tmp_path / "checkpoint" / "model.safetensors").exists()  # adapters only
    randomize(adapter, seed=1)
    base = {name: p.detach().clone() for name, p in everything.items() if name not in adapter}
    trainer._load_from_checkpoint(str(tmp_path / "checkpoint"))
    assert_restored(adapter, positions, tmp_path / "checkpoint")
    assert all(torch.equal(everything[name], value) for name, value in base.items())  # the base stays


def test_each_trainer_resume_and_best_model_go_through_the_one_function(sync_trainer, async_trainer, monkeypatch):
    calls = []
    monkeypatch.setattr(
        checkpoint_weights, "restore_checkpoint_weights", lambda model, folder: calls.append((model, folder))
    )
    for trainer in (sync_trainer, async_trainer):
        trainer._load_from_checkpoint("ckpt-resume")
        trainer.state.best_model_checkpoint = "ckpt-best"
        trainer._load_best_model()
    assert calls == [
        (sync_trainer.model, "ckpt-resume"),
        (sync_trainer.model, "ckpt-best"),
        (async_trainer.model, "ckpt-resume"),
        (async_trainer.model, "ckpt-best"),
    ]


# ----------------------------------------------------------------------------------------------- refusals
def rewrite(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    save_file(change(tensors), folder / "model.safetensors", metadata={"format": "pt"})


def non_finite(name, value=float("nan")):
    def change(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = value
        return tensors

    return change


def fused_without(*fragments):
    """The model's own (fused) names, some left out."""

    def write(folder: Path):
        state = tiny_moe_model("qwen3_moe", seed=0).state_dict()
        save_file(
            {n: t.contiguous() for n, t in without(*fragments)(state).items()},
            folder / "model.safetensors",
            metadata={"format": "pt"},
        )

    return write


def without(*fragments):
    return lambda tensors: {n: t for n, t in tensors.items() if not any(f in n for f in fragments)}


Q = "model.layers.1.self_attn.q_proj.weight"


def hostile_pickle(folder: Path) -> None:
    class RunsCode:
        def __reduce__(self):
            return (print, ("this code ran",))

    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"x": RunsCode()}))


def truncated(name):
    def cut(folder: Path):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])

    return cut


def as_bin(folder: Path) -> None:
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def index_naming_an_absent_shard(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = dict.fromkeys(
        load_file(folder / "model-00001-of-00002.safetensors"), "model-00001-of-00002.safetensors"
    )
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {**weight_map, Q: "model-00002-of-00002.safetensors"}})
    )


REFUSALS = {
    # name: (what is done to a save_pretrained checkpoint, what the one line says)
    "empty file": (
        lambda f: rewrite(f, lambda t: {}),
        r"'model.embed_tokens.weight' is missing from it \(25 of the 25",
    ),
    "experts and q_proj missing": (
        lambda f: rewrite(f, without(".mlp.experts.", Q)),
        "'model.layers.0.mlp.experts.gate_up_proj' is missing from it",
    ),
    "fused names without the experts and q_proj": (
        fused_without(".mlp.experts.", Q),
        "'model.layers.0.mlp.experts.gate_up_proj' is missing from it "
        r"\(5 of the 25",
    ),
    "q_proj missing": (lambda f: rewrite(f, without(Q)), f"'{Q}' is missing from it \\(1 of the 69"),
    "one expert missing": (
        lambda f: rewrite(f, without("layers.1.mlp.experts.3.down_proj")),
        "'model.layers.1.mlp.experts.3.down_proj.weight' is missing",
    ),
    "an extra name": (
        lambda f: rewrite(f, lambda t: {**t, "model.layers.9.mlp.gate.weight": t[Q].clone()}),
        "it holds 'model.layers.9.mlp.gate.weight', which is no weight of " + QWEN,
    ),
    "NaN": (lambda f: rewrite(f, non_finite(Q)), f"'{Q}' holds NaN or infinite values"),
    "inf in an expert": (
        lambda f: rewrite(f, non_finite("model.layers.0.mlp.experts.5.up_proj.weight", float("inf"))),
        "'model.layers.0.mlp.experts.5.up_proj.weight' holds NaN or infinite values",
    ),
    "wrong shape": (
        lambda f: rewrite(f, lambda t: {**t, Q: t[Q][:-1].contiguous()}),
        f"'{Q}' has shape \\[63, 64\\] where {QWEN} has \\[64, 64\\]",
    ),
    "wrong dtype": (
        lambda f: rewrite(f, lambda t: {**t, Q: t[Q].bfloat16()}),
        f"'{Q}' is torch.bfloat16 where {QWEN} holds torch.float32",
    ),
    "truncated safetensors": (truncated("model.safetensors"), "model.safetensors cannot be read .SafetensorError: "),
    "truncated bin": (
        lambda f: (as_bin(f), truncated("pytorch_model.bin")(f)),
        "pytorch_model.bin cannot be read .(RuntimeError|UnpicklingError|EOFError)",
    ),
    "a pickle that runs code": (
        hostile_pickle,
        "pytorch_model.bin cannot be read .UnpicklingError: Weights only load",
    ),
    "no weights at all": (lambda f: (f / "model.safetensors").unlink(), "it holds no model weights"),
    "a shard missing": (
        index_naming_an_absent_shard,
        "model.safetensors.index.json names shard 'model-00002-of-00002.safetensors', which is not",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_checkpoint_that_cannot_restore_every_weight_is_refused_in_one_line(sync_trainer, tmp_path, case, capsys):
    damage, says = REFUSALS[case]
    tiny_moe_model("qwen3_moe", seed=0).save_pretrained(tmp_path / "checkpoint")
    damage(tmp_path / "checkpoint")
    before = {name: t.clone() for name, t in sync_trainer.model.state_dict().items()}
    with pytest.raises(CheckpointWeightsError) as refused:
        sync_trainer._load_from_checkpoint(str(tmp_path / "checkpoint"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"checkpoint {tmp_path / 'checkpoint'} refused: "), message
    assert re.search(says, message), message
    assert all(torch.equal(t, before[name]) for name, t in sync_trainer.model.state_dict().items())  # unchanged
    assert "this code ran" not in capsys.readouterr().out


def test_the_async_trainer_refuses_the_same_way(async_trainer, tmp_path):
    tiny_moe_model("qwen3_moe", seed=0).save_pretrained(tmp_path / "checkpoint")
    rewrite(tmp_path / "checkpoint", without("layers.1.mlp.experts.3.down_proj"))
    with pytest.raises(CheckpointWeightsError, match="'model.layers.1.mlp.experts.3.down_proj.weight' is missing"):
        async_trainer._load_from_checkpoint(str(tmp_path / "checkpoint"))


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_tied_embeddings_are_one_weight_not_a_missing_one(tmp_path, layout):
    """save_pretrained writes a tied lm_head once (under the embeddings' name): no false refusal, and both names
    hold the file's embeddings afterwards."""
    model = tiny_moe_model("qwen3_moe", seed=1, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = unique_weights(dict(model.state_dict(keep_vars=True)))
    positions = where_in_file(model, params, tmp_path / "probe", lambda folder: save_layout(model, folder, layout))
    randomize(params, seed=0)
    save_layout(model, tmp_path / "checkpoint", layout)
    randomize(params, seed=1)
    checkpoint_weights.restore_checkpoint_weights(model, tmp_path / "checkpoint")
    assert_restored(params, positions, tmp_path / "checkpoint")
    assert model.lm_head.weight is model.model.embed_tokens.weight
