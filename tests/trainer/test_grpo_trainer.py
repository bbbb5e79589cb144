"""MoEReplayGRPOTrainer end to end on the transformers generation path (CPU, tiny models)."""

import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

from tests.helpers import run_two_ranks


METRICS = [
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/extreme_frac",
    "routing/mismatch_frac",
    "routing/token_any_mismatch",
    "routing/topk_agreement",
    "routing/fallback_frac",
    "routing/fallback_samples_frac",
]


def prompts_dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)][:n]})


def reward_len(completions, **kwargs):
    return [-abs(6 - len(c)) for c in completions]


def make_trainer(
    tmp_path, model, cls=MoEReplayGRPOTrainer, trainer_kwargs: dict | None = None, **overrides
) -> MoEReplayGRPOTrainer:
    """A tiny GRPO run of ``cls`` on ``model``: ``overrides`` go to the config, ``trainer_kwargs`` to the trainer."""
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-3,
        gradient_accumulation_steps=2,
        save_strategy="no",
        seed=0,
    )
    settings.update(overrides)
    return cls(
        model=model,
        reward_funcs=reward_len,
        args=MoEReplayGRPOConfig(**settings),
        train_dataset=prompts_dataset(),
        processing_class=tiny_tokenizer(),
        **(trainer_kwargs or {}),
    )


def logged(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


@pytest.mark.parametrize("mode", ["none", "r2", "r3"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "olmoe"])
def test_a_few_steps_log_finite_metrics_and_update_the_model(tmp_path, model_type, mode):
    model = tiny_moe_model(model_type)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(tmp_path, model, routing_replay=mode)
    trainer.train()
    for name in METRICS:
        values = logged(trainer, name)
        if mode == "none":  # plain TRL: no sampler log-probs on this path, no routes recorded
            assert values == [], name
        else:
            assert len(values) == 2 and all(math.isfinite(v) for v in values), name
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any("gate" in n or "router" in n for n in changed)  # the routers still learn under replay
    if mode == "r3":
        # fp32: the trainer's old-policy forward under the rollout routes reproduces the sampling log-probs
        assert max(logged(trainer, "mismatch/kl_k3")) < 1e-6
        assert max(abs(v) for v in logged(trainer, "mismatch/kl_k1")) < 1e-5
        assert logged(trainer, "routing/mismatch_frac") == [0.0, 0.0]
        assert logged(trainer, "routing/fallback_frac") == [0.0, 0.0]
        assert logged(trainer, "routing/fallback_samples_frac") == [0.0, 0.0]


@pytest.mark.parametrize("mode", ["none", "r3"])
def test_routing_metrics_are_logged_on_policy_without_the_engine_correction(tmp_path, mode):
    # on-policy without the IS correction TRL runs no old-logprob pass; routing_metrics still logs the comparison
    # (a no-grad forward of its own, replaying the rollout's routes under R3) and TRL's sampling/* stays off
    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        routing_replay=mode,
        routing_metrics=True,
        transformers_importance_sampling_correction=False,
    )
    trainer.train()
    for name in METRICS:
        values = logged(trainer, name)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), (name, values)
    assert logged(trainer, "sampling/importance_sampling_ratio/mean") == []
    if mode == "r3":  # fp32: replaying the rollout's routes reproduces the sampler's log-probs
        assert max(logged(trainer, "mismatch/kl_k3")) < 1e-6


def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    def trained_params(checkpointing: bool):
        torch.manual_seed(0)
        trainer = make_trainer(
            tmp_path / str(checkpointing),
            tiny_moe_model("qwen3_moe"),
            max_steps=1,
            gradient_checkpointing=checkpointing,
            routing_replay="r3",
        )
        trainer.train()
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    plain, checkpointed = trained_params(False), trained_params(True)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-6)


def test_aux_loss_is_turned_off_under_replay_and_kept_without(tmp_path):
    replayed = make_trainer(tmp_path / "r3", tiny_moe_model("qwen3_moe", router_aux_loss_coef=0.01), max_steps=1)
    plain = make_trainer(
        tmp_path / "none", tiny_moe_model("qwen3_moe", router_aux_loss_coef=0.01), max_steps=1, routing_replay="none"
    )
    assert not replayed.aux_loss_enabled and plain.aux_loss_enabled
    plain.train()
    replayed.train()
    assert logged(plain, "aux_loss") and not logged(replayed, "aux_loss")


def test_r2_replays_the_old_policy_routes(tmp_path):
    trainer = make_trainer(tmp_path, tiny_moe_model("olmoe"), routing_replay="r2", max_steps=1)
    seen = []
    original = trainer._compute_loss

    def spy(model, inputs):
        seen.append(trainer.replayed_routes(inputs))
        return original(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    assert seen and all(r is not None and r.dim() == 4 for r in seen)


def test_bad_config_values_raise():
    with pytest.raises(ValueError, match="routing_replay"):
        MoEReplayGRPOConfig(output_dir="x", routing_replay="r4", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="extreme_token_threshold"):
        MoEReplayGRPOConfig(output_dir="x", extreme_token_threshold=0.5, use_cpu=True, bf16=False)


def test_bf16_r3_reduces_the_logprob_mismatch_against_none(tmp_path):
    # bf16 generate (KV cache) vs bf16 full forward route a measurable share of (token, layer) pairs differently.
    # routing/mismatch_frac compares the trainer's *natural* choice with the rollout routes; replay does not change
    # the numerics behind it, so it stays about equal. What R3 removes is the effect: the experts actually used
    # are the rollout's, and the old-policy log-probs move towards the sampling ones.
    def run(mode):
        torch.manual_seed(0)
        model = tiny_moe_model(
            "qwen3_moe", dtype=torch.bfloat16, num_experts=32, num_experts_per_tok=4, initializer_range=0.1
        )
        # "none" measures too (routing_metrics), and scores the batch against the sampler like r3 does
        trainer = make_trainer(
            tmp_path / mode,
            model,
            routing_replay=mode,
            max_steps=1,
            learning_rate=0.0,
            max_completion_length=16,
            bf16=True,
            gradient_checkpointing=False,
            routing_metrics=True,
            transformers_importance_sampling_correction=True,
        )
        trainer.train()
        return logged(trainer, "routing/mismatch_frac")[0], logged(trainer, "mismatch/kl_k3")[0]

    (route_none, kl_none), (route_r3, kl_r3) = run("none"), run("r3")
    measured = (
        f"routing/mismatch_frac none={route_none:.4f} r3={route_r3:.4f}; kl_k3 none={kl_none:.2e} r3={kl_r3:.2e}"
    )
    assert route_none > 0 and route_r3 > 0, measured  # the routing mismatch is measurable on this config
    assert kl_r3 < kl_none / 2, measured  # measured 6.7e-5 -> 1.1e-5 (2 layers) and 9.8e-5 -> 1.5e-5 (4 layers)


@pytest.mark.slow  # torchrun, two processes
@pytest.mark.serial
def test_import_swap_script_runs_on_two_processes():
    script = Path(__file__).parents[1] / "scripts" / "grpo_swap.py"
    result = run_two_ranks(script)
    line = next(line for line in result.stdout.splitlines() if line.startswith("METRICS "))
    report = json.loads(line[len("METRICS ") :])
    assert report["world"] == 2
    logs = report["logs"]
    assert len(logs) == 2
    for entry in logs:  # fp32 R3 on both ranks: routes stayed with their samples
        assert entry["routing/mismatch_frac"] == 0.0
        assert entry["mismatch/kl_k3"] < 1e-6


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(routing_replay="r3", use_transformers_continuous_batching=True), "use_transformers_continuous_batching"),
        (
            dict(routing_replay="pr2", pr2_rollout_prediction=True, use_transformers_continuous_batching=True),
            "use_transformers_continuous_batching",
        ),
        (
            dict(
                routing_replay="r2",
                use_transformers_continuous_batching=True,
                transformers_importance_sampling_correction=True,
            ),
            "continuous_batching",
        ),
        (dict(routing_replay="r3", generation_kwargs={"num_beams": 2}), "num_beams=2"),
        (dict(routing_replay="none", routing_metrics=True, generation_kwargs={"num_beams": 2}), "beam search"),
    ],
)
def test_generation_settings_that_cannot_keep_routes_are_refused_when_configured(overrides, match):
    with pytest.raises(ValueError, match=match):
        MoEReplayGRPOConfig(output_dir="unused", use_cpu=True, **overrides)


def test_a_plain_grpo_config_with_continuous_batching_is_refused_when_the_trainer_is_built(tmp_path):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="use_transformers_continuous_batching"):  # GRPOConfig means r3 here
        MoEReplayGRPOTrainer(
            model=tiny_moe_model("qwen3_moe"),
            reward_funcs=reward_len,
            args=args,
            train_dataset=prompts_dataset(),
            processing_class=tiny_tokenizer(),
        )
