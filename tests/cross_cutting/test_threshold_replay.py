"""Threshold replay (``replay_score_threshold``) in both configs and both trainers, with LoRA and on ``rollout_func``
routes; the rule itself is tests/routing/test_replay_rule.py, vLLM's routes tests/cross_cutting/test_vllm_engine.py
(sync) and tests/cross_cutting/test_async_engine.py (async)."""

import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model

from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayGRPOConfig, RouterReplay
from trl_moe_replay.cli.progress import CompactProgressCallback
from trl_moe_replay.core.config_checks import ConfigTypeError, ConfigValueError
from trl_moe_replay.core.routing_options import ASYNC_TRAINER, SYNC_TRAINER, ReplaySettings
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

from tests.async_grpo.test_async_grpo_trainer import script, scripted_trainer
from tests.helpers import random_ids
from tests.rollouts.test_route_intake_rollout_func import EngineRollout, Spy, reward_len
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
    layers = {
        name for entry in trainer.state.log_history for name in entry if name.startswith("routing/replace_rate/")
    }
    return rates, layers


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_sync_trainer_trains_and_logs_the_replace_rate(tmp_path, mode):
    # two iterations per generation batch at a large learning rate: the second one's router has moved, so threshold
    # 1 replaces the replayed experts it no longer ranks in its top-k
    model = tiny_moe_model("qwen3_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(
        tmp_path,
        model,
        routing_replay=mode,
        replay_score_threshold=1.0,
        num_iterations=2,
        learning_rate=0.05,
        max_steps=4,
    )
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


# ------------------------------------------------------------------ with LoRA
LORA = dict(
    r=4,
    target_modules=["q_proj", "v_proj", "gate"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
)


def test_with_lora_on_the_router_the_scores_are_the_adapted_routers():
    """The base model's routes replayed at threshold 1 on a LoRA-adapted router give the adapted model's own outputs:
    the rule scores with the router that ran (base weight plus adapter), not the frozen base."""
    peft_model = get_peft_model(tiny_moe_model("qwen3_moe").eval(), LoraConfig(**LORA, init_lora_weights=False))
    plain, strict = RouterReplay(peft_model), RouterReplay(peft_model, 1.0)
    x = random_ids(2, 9)
    with torch.no_grad():
        adapted = peft_model(input_ids=x).logits
        with peft_model.disable_adapter(), plain.record() as rec:
            peft_model(input_ids=x)
        with plain.replay(rec.checked):
            base_routes = peft_model(input_ids=x).logits
        with strict.replay(rec.checked):
            thresholded = peft_model(input_ids=x).logits
    assert (base_routes - adapted).abs().max() > 1e-3  # the adapter moves the routes: plain replay differs
    torch.testing.assert_close(thresholded, adapted, rtol=0, atol=1e-6)
    assert all(replaced > 0 for replaced, _ in strict.take_replace_sums().values())
    plain.remove()
    strict.remove()


def test_sync_trainer_with_lora_trains_the_adapter_and_logs_the_replace_rate(tmp_path):
    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        trainer_kwargs={"peft_config": LoraConfig(**LORA)},
        routing_replay="r3",
        replay_score_threshold=1.0,
        num_iterations=2,
        learning_rate=0.05,
    )
    trainer.train()
    rates, layers = replace_rates(trainer)
    assert rates and all(0.0 <= rate <= 1.0 for rate in rates) and max(rates) > 0, rates
    assert layers == {f"routing/replace_rate/layer_{layer}" for layer in trainer._route_replay.moe_layers}
    lora_b = {n: p for n, p in trainer.model.named_parameters() if "lora_B" in n}
    assert any(".gate." in n for n in lora_b)  # lora_B starts at zero: every adapter, the router's too, trained
    assert all(p.detach().abs().sum() > 0 for p in lora_b.values())


# ------------------------------------------------------------------ on rollout_func routes
def test_rollout_func_routes_are_threshold_replayed(tmp_path):
    """A ``rollout_func`` returning its engine's routes (a copy of the policy): threshold 1 replaces none of them on a
    batch's first update and, once two updates at a large learning rate moved the router, some."""
    Spy.batches = []
    args = MoEReplayGRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        save_strategy="no",
        seed=0,
        routing_replay="r3",
        replay_score_threshold=1.0,
        num_iterations=2,
        learning_rate=0.05,
        **BASE,
    )
    rollout = EngineRollout()
    trainer = Spy(
        model=tiny_moe_model("qwen3_moe"),
        reward_funcs=reward_len,
        args=args,
        processing_class=tiny_tokenizer(),
        rollout_func=rollout,
        train_dataset=Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]}),
    )
    trainer.train()
    assert len(rollout.returned) == 1 and len(Spy.batches) == 1  # one generation batch, used by both updates
    assert logged(trainer, "routing/fallback_frac") == [0.0]  # every position had a route from the rollout
    rates, layers = replace_rates(trainer)
    assert len(rates) == 2 and rates[0] == 0.0 and rates[1] > 0, rates
    assert layers == {f"routing/replace_rate/layer_{layer}" for layer in trainer._route_replay.moe_layers}
