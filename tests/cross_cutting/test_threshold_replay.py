"""Threshold replay (``replay_score_threshold``) in both configs and both trainers; the rule itself is
tests/routing/test_replay_rule.py."""

import math

import pytest
import torch

from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayGRPOConfig
from trl_moe_replay.cli.progress import CompactProgressCallback
from trl_moe_replay.core.config_checks import ConfigTypeError, ConfigValueError
from trl_moe_replay.core.routing_options import ASYNC_TRAINER, SYNC_TRAINER, ReplaySettings
from trl_moe_replay.testing import tiny_moe_model

from tests.async_grpo.test_async_grpo_trainer import script, scripted_trainer
from tests.trainer.test_grpo_trainer import logged, make_trainer


BASE = dict(use_cpu=True, bf16=False)


@pytest.mark.parametrize("config_class", [MoEReplayGRPOConfig, MoEReplayAsyncGRPOConfig])
@pytest.mark.parametrize("value", [-0.5, 1.01, float("nan"), float("inf")])
def test_out_of_range_is_refused_in_one_line(tmp_path, config_class, value):
    with pytest.raises(ConfigValueError, match="replay_score_threshold must be") as info:
        config_class(output_dir=str(tmp_path), replay_score_threshold=value, **BASE)
    assert "\n" not in str(info.value)


def test_a_threshold_that_is_no_number_is_refused(tmp_path):
    with pytest.raises(ConfigTypeError, match="replay_score_threshold"):
        MoEReplayGRPOConfig(output_dir=str(tmp_path), replay_score_threshold="0.5", **BASE)


@pytest.mark.parametrize("config_class", [MoEReplayGRPOConfig, MoEReplayAsyncGRPOConfig])
def test_with_none_a_threshold_is_refused_as_the_other_replay_only_fields_are(tmp_path, config_class):
    with pytest.raises(ConfigValueError, match=r"routing_replay='none' replays none.*\(r2, r3, pr2\)") as info:
        config_class(output_dir=str(tmp_path), routing_replay="none", replay_score_threshold=0.5, **BASE)
    assert "\n" not in str(info.value)
    config = config_class(output_dir=str(tmp_path), routing_replay="none", replay_score_threshold=0.0, **BASE)
    kind = ASYNC_TRAINER if config_class is MoEReplayAsyncGRPOConfig else SYNC_TRAINER
    assert ReplaySettings.from_args(config, kind).replay_score_threshold == 0.0


@pytest.mark.parametrize("mode", ["r3", "r2", "pr2"])
def test_valid_with_every_mode_that_replays(tmp_path, mode):
    config = MoEReplayGRPOConfig(output_dir=str(tmp_path), routing_replay=mode, replay_score_threshold=1, **BASE)
    assert ReplaySettings.from_args(config).replay_score_threshold == 1.0


def replace_rates(trainer):
    rates = logged(trainer, "routing/replace_rate")
    layers = {name for entry in trainer.state.log_history for name in entry if name.startswith("routing/replace_rate/")}
    return rates, layers


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_sync_trainer_trains_and_logs_the_replace_rate(tmp_path, mode):
    # two iterations per generation batch at a large learning rate: the second one's router has moved, so threshold
    # 1 replaces the replayed experts it no longer ranks in its top-k
    model = tiny_moe_model("qwen3_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(tmp_path, model, routing_replay=mode, replay_score_threshold=1.0, num_iterations=2,
                           learning_rate=0.05, max_steps=4)
    assert trainer._route_replay.score_threshold == 1.0
    trainer.train()
    rates, layers = replace_rates(trainer)
    assert rates and all(0.0 <= rate <= 1.0 for rate in rates) and max(rates) > 0, rates
    assert layers == {f"routing/replace_rate/layer_{layer}" for layer in trainer._route_replay.moe_layers}
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())


def test_without_a_threshold_nothing_is_logged_or_shown(tmp_path):
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="r3", max_steps=1)
    trainer.train()
    assert replace_rates(trainer) == ([], set())
    shown = CompactProgressCallback()._summary({"routing/replace_rate": 0.25, "reward": 1.0})
    assert shown == {"replace": "0.25", "reward": "1"}  # on the line once logged (threshold > 0)


def test_async_trainer_trains_and_logs_the_replace_rate(tmp_path, checkpoint):
    # samples drawn by perturbed weights (version 1): their routes differ from the trainer's own top-k
    samples, _ = script(checkpoint, versions=[1, 1, 1, 1, 1, 1])
    trainer = scripted_trainer(tmp_path, checkpoint, samples, replay_score_threshold=1.0)
    trainer.train()
    rates, layers = replace_rates(trainer)
    assert rates and all(0.0 < rate <= 1.0 for rate in rates), rates
    assert layers == {f"routing/replace_rate/layer_{layer}" for layer in trainer._route_replay.moe_layers}
