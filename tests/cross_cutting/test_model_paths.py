"""Model names (issue 38, item 4): ``~`` in a local model path is expanded as a shell would, on every entry point (the
trainers, the recipe, ``audit``); transformers alone took ``~/models/x`` for a malformed Hub id ("Repo id must use
alphanumeric chars"). The async trainer checks its model name like the sync one: one line, not transformers' raw
``OSError``."""

import os
from pathlib import Path

import pytest

import trl_moe_replay
from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayAsyncGRPOTrainer
from trl_moe_replay.core.launch import HubModelError, ModelPathError, check_model_path
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer
from trl_moe_replay.testing.async_workers import NoOpWeightTransfer, ScriptedRolloutWorker

from tests.async_grpo.test_async_grpo_trainer import DATASET, reward, settings
from tests.helpers import load_script
from tests.trainer.test_grpo_trainer import make_trainer


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A home folder holding models/tiny (a saved tiny MoE and its tokenizer)."""
    home = tmp_path_factory.mktemp("home")
    tiny_moe_model("qwen3_moe", seed=0).save_pretrained(home / "models" / "tiny")
    tiny_tokenizer().save_pretrained(home / "models" / "tiny")
    return home


@pytest.fixture
def at_home(home, monkeypatch) -> Path:
    monkeypatch.setenv("HOME", str(home))
    return home


def test_check_model_path_returns_the_name_to_load(at_home, tmp_path, monkeypatch):
    assert check_model_path("~/models/tiny") == str(at_home / "models" / "tiny")
    monkeypatch.chdir(at_home)
    assert check_model_path("./models/tiny") == "./models/tiny"  # relative paths stay relative
    assert check_model_path("models/tiny") == "models/tiny"
    with pytest.raises(ModelPathError, match="no model folder at ~/models/tinny: .*did you mean .*models/tiny"):
        check_model_path("~/models/tinny")
    with pytest.raises(HubModelError, match="someorg/moe is not a local folder, and offline mode"):
        check_model_path("someorg/moe")  # a Hub id: checked, never expanded


def test_the_sync_trainer_loads_a_model_named_with_a_tilde(at_home, tmp_path):
    trainer = make_trainer(tmp_path, "~/models/tiny")
    assert trainer.model.config._name_or_path == str(at_home / "models" / "tiny")


def async_trainer(model, output_dir):
    return MoEReplayAsyncGRPOTrainer(
        model=model,
        reward_funcs=reward,
        train_dataset=DATASET,
        args=MoEReplayAsyncGRPOConfig(**settings(output_dir)),
        rollout_worker=ScriptedRolloutWorker([]),
        weight_transfer=NoOpWeightTransfer(),
    )


def test_the_async_trainer_checks_its_model_name_as_the_sync_one(at_home, tmp_path, monkeypatch):
    trainer = async_trainer("~/models/tiny", tmp_path / "out")
    assert trainer.model.config._name_or_path == str(at_home / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelPathError, match="no model folder at ./no/such/model: it reads as a local path"):
        async_trainer("./no/such/model", tmp_path / "out")  # was transformers' OSError
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match="empty holds no config.json"):
        async_trainer(str(tmp_path / "empty"), tmp_path / "out")
    with pytest.raises(HubModelError, match="someorg/no-such-moe is not a local folder, and offline mode"):
        async_trainer("someorg/no-such-moe", tmp_path / "out")


def test_audit_loads_a_model_named_with_a_tilde(at_home):
    import torch

    from trl_moe_replay.cli.audit import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("~/models/tiny", torch.float32)
    assert model.config._name_or_path == str(at_home / "models" / "tiny")


def test_the_recipe_passes_the_expanded_path_to_the_trainer(at_home, tmp_path, monkeypatch):
    recipe = load_script(ROOT / "recipes" / "grpo_r3.py", "grpo_r3_recipe_paths")
    built = {}

    class Stop(Exception):
        pass

    def trainer(model, **kwargs):
        built["model"] = model
        raise Stop

    monkeypatch.setattr(trl_moe_replay, "MoEReplayGRPOTrainer", trainer)
    with pytest.raises(Stop):
        recipe.main(
            *recipe.parse_args(
                [
                    "--model_name_or_path",
                    "~/models/tiny",
                    "--output_dir",
                    str(tmp_path / "run"),
                    "--synthetic_samples",
                    "16",
                    "--plot",
                    "false",
                ]
            )
        )
    assert built["model"] == str(at_home / "models" / "tiny") and os.path.isdir(built["model"])
