"""Loss options in the trainer: gspo / rspo (router-shift weighting) / minirl, against TRL and hand computations."""

import dataclasses
import math

import pytest
import torch
from transformers import HfArgumentParser
from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from trl_moe_replay import MoEReplayGRPOConfig
from trl_moe_replay.testing import tiny_moe_model
from trl_moe_replay.trainer.losses import completion_aligned, minirl_token_weights

from tests.trainer.test_grpo_trainer import logged, make_trainer


LN2 = math.log(2.0)


# These tests drive the loss on hand-made micro-batches, so they call TRL's private loss entry points
# (_generate_and_score_completions, _compute_loss) and open the micro-batch's routes (RouteFlow) the way train() does;
# what they assert goes through logged metrics.
def first_micro_batch(trainer) -> dict:
    """One generation batch scored by the trainer (old-logprob pass included), and its first micro-batch."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    prompts = [{"prompt": p} for p in ["1+2=", "3+1="] for _ in range(trainer.num_generations)]
    batch = trainer._generate_and_score_completions(prompts)
    return split_tensor_dict(batch, 2)[0]


def held(trainer, micro) -> dict:
    """RSPO's per-sample inputs of ``micro``, held by the trainer with its routes (route_flow step 4), not in the
    batch dict."""
    return trainer._routes.buffer.gather_held(micro["route_rows"]).per_sample


def with_old_router_probs(trainer, micro, probs) -> dict:
    """``micro`` naming held rows whose old router probabilities are ``probs`` (as if the old router had given them)."""
    rows = trainer._routes.buffer.gather_held(micro["route_rows"])
    moved = dataclasses.replace(rows, per_sample={**rows.per_sample, "old_router_probs": probs})
    return dict(micro, route_rows=trainer._routes.buffer.store(moved))


def trl_compute_loss(trainer, inputs):
    """TRL's own _compute_loss on ``inputs``, under the same engine correction our trainer applies."""
    with trainer._engine_correction():
        return GRPOTrainer._compute_loss(trainer, trainer.model, inputs)


def loss_and_grads(trainer, compute):
    trainer.model.zero_grad()
    loss = compute()
    loss.backward()
    trainer._end_micro_batch()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def flush_logs(trainer) -> dict:
    """The metrics logged since the last call, as ``trainer.log`` writes them to ``state.log_history`` (TRL averages
    each metric over the calls since the last log, so one call = that call's value)."""
    trainer.log({})
    return trainer.state.log_history[-1]


def assert_same(result, expected, exact: bool):
    (loss, grads), (loss_expected, grads_expected) = result, expected
    assert grads.keys() == grads_expected.keys() and grads
    if exact:
        assert torch.equal(loss, loss_expected)
        assert all(torch.equal(grads[n], grads_expected[n]) for n in grads)
    else:
        torch.testing.assert_close(loss, loss_expected, rtol=1e-5, atol=1e-7)
        for n in grads:
            torch.testing.assert_close(grads[n], grads_expected[n], rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------- rspo / gspo
def test_rspo_equals_trl_with_gamma_one_and_with_hand_shifted_old_logps_after_the_router_moved(tmp_path):
    torch.manual_seed(0)
    # routing_replay="none" is on-policy TRL here; recording generate's log-probs brings TRL's old-logprob pass
    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        loss_type="rspo",
        routing_replay="none",
        router_shift_gamma_min=0.5,
        transformers_importance_sampling_correction=True,
    )
    assert trainer.loss_type == "grpo" and trainer.importance_sampling_level == "sequence"
    assert (trainer.epsilon_low, trainer.epsilon_high) == (3e-4, 4e-4)
    micro = first_micro_batch(trainer)
    assert "old_router_ids" not in micro and "old_router_probs" not in micro  # TRL's batch holds TRL's keys
    old = held(trainer, micro)
    assert old["old_router_ids"].dtype == torch.uint8 and old["old_router_probs"].dtype == torch.float16
    assert old["old_router_ids"].shape == old["old_router_probs"].shape
    assert old["old_router_ids"].shape[:2] == (4, micro["prompt_ids"].shape[1] + micro["completion_ids"].shape[1])

    def trl_loss(inputs):  # TRL's own _compute_loss on the same inputs, without our γ
        return loss_and_grads(trainer, lambda: trl_compute_loss(trainer, inputs))

    flush_logs(trainer)  # the scoring pass's metrics
    ours = loss_and_grads(trainer, lambda: trainer._compute_loss(trainer.model, micro))
    assert flush_logs(trainer)["rspo/gamma_min"] == 1.0  # same weights as the old pass: γ == 1 exactly
    assert_same(ours, trl_loss(micro), exact=True)

    # Let the old router have given half the probability at layer 0 on every even position: Δ = ln2 / 2 there
    # (mean over the 2 MoE layers), γ = 2^-1/2; odd positions keep γ = 1.
    probs = old["old_router_probs"].clone()
    probs[:, ::2, 0] *= 2
    moved = with_old_router_probs(trainer, micro, probs)
    old_before = micro["old_per_token_logps"].clone()
    flush_logs(trainer)  # TRL's own loss above logs too
    ours = loss_and_grads(trainer, lambda: trainer._compute_loss(trainer.model, moved))
    logs = flush_logs(trainer)
    assert torch.equal(moved["old_per_token_logps"], old_before)  # the buffered batch is never shifted in place
    seq = old["old_router_ids"].shape[1]
    gamma_at_position = torch.tensor([2**-0.5 if p % 2 == 0 else 1.0 for p in range(seq)]).expand(4, seq)
    gamma = completion_aligned(gamma_at_position, micro["completion_ids"].shape[1])
    by_hand = dict(micro, old_per_token_logps=micro["old_per_token_logps"] - gamma.log())
    assert_same(ours, trl_loss(by_hand), exact=False)  # γ is a constant: same loss and same gradients
    valid = micro["completion_mask"].bool()
    assert logs["rspo/gamma_mean"] == pytest.approx(gamma[valid].mean().item(), rel=1e-4)
    assert logs["rspo/gamma_min"] == pytest.approx(2**-0.5, rel=1e-4)
    assert logs["rspo/floor_frac"] == 0.0


def test_router_shift_weighting_with_a_token_level_trl_loss_applies_gamma_before_clipping(tmp_path):
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("mixtral"),
        loss_type="dapo",
        router_shift_weighting=True,
        routing_replay="r3",
        router_shift_gamma_min=0.8,
    )
    micro = first_micro_batch(trainer)
    moved = with_old_router_probs(trainer, micro, held(trainer, micro)["old_router_probs"] * 2)  # Δ = ln2: γ floored
    flush_logs(trainer)  # the scoring pass's metrics
    ours = loss_and_grads(trainer, lambda: trainer._compute_loss(trainer.model, moved))
    logs = flush_logs(trainer)
    assert logs["rspo/floor_frac"] == 1.0
    assert logs["rspo/shift_mean"] == pytest.approx(LN2, rel=1e-3)
    by_hand = dict(micro, old_per_token_logps=micro["old_per_token_logps"] - math.log(0.8))

    def trl_with_replay():
        with trainer._micro_batch_of(micro):
            return trl_compute_loss(trainer, by_hand)

    assert_same(ours, loss_and_grads(trainer, trl_with_replay), exact=False)
    # ratio·γ = 0.8 < 1 - 0.2: every negative-advantage token is clipped on the low side
    negative = (micro["advantages"] < 0).unsqueeze(1) & micro["completion_mask"].bool()
    assert logs["clip_ratio/low_mean"] == pytest.approx(
        negative.sum().item() / micro["completion_mask"].sum().item(), rel=1e-5
    )


# ---------------------------------------------------------------------------------------------- minirl
def test_minirl_loss_matches_the_hand_computation(tmp_path):
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), loss_type="minirl", routing_replay="r2", minirl_is_cap=1.001
    )
    assert trainer.scale_rewards == "none" and (trainer.epsilon_low, trainer.epsilon_high) == (0.2, 0.27)
    micro = first_micro_batch(trainer)
    # pretend the rollout engine and the old policy differed: shifts that cross the cap and the clipping bounds
    completion = micro["completion_ids"].shape[1]
    offsets = torch.tensor([0.0, 0.3, -0.3, 0.01, -0.01, 0.5])[:completion]
    micro = dict(
        micro,
        sampling_per_token_logps=micro["sampling_per_token_logps"] + offsets,
        old_per_token_logps=micro["old_per_token_logps"] - offsets.flip(0),
    )
    flush_logs(trainer)  # the scoring pass's metrics
    ours = loss_and_grads(trainer, lambda: trainer._compute_loss(trainer.model, micro))
    logs = flush_logs(trainer)

    def by_hand():
        input_ids = torch.cat([micro["prompt_ids"], micro["completion_ids"]], dim=1)
        attention_mask = torch.cat([micro["prompt_mask"], micro["completion_mask"]], dim=1)
        with trainer._micro_batch_of(micro):
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, completion
            )
        advantages = micro["advantages"].unsqueeze(1)
        weights = minirl_token_weights(
            logps,
            logps - micro["old_per_token_logps"],
            micro["sampling_per_token_logps"],
            advantages,
            0.2,
            0.27,
            1.001,
        )
        assert weights.truncated.any() and (weights.low_clipped | weights.high_clipped).any()
        # summed over tokens (no length normalisation), divided by the batch's loss-token count as TRL's dapo does:
        # the generation batch's count over the micro-batches it is split into (one process, no accumulation here)
        normaliser = micro["num_items_in_batch"] / trainer.args.steps_per_generation
        return (-weights.weight * advantages * logps * micro["completion_mask"]).sum() / normaliser

    assert_same(ours, loss_and_grads(trainer, by_hand), exact=False)
    assert 0 < logs["minirl/is_truncated_frac"] < 1 and 0 < logs["clip_ratio/region_mean"] < 1


def test_minirl_with_kl_entropy_mask_and_off_policy_mask(tmp_path):
    torch.manual_seed(0)
    tiny_moe_model("qwen3_moe").save_pretrained(tmp_path / "model")  # beta != 0: TRL loads the reference by path
    trainer = make_trainer(
        tmp_path,
        str(tmp_path / "model"),
        loss_type="minirl",
        routing_replay="r3",
        max_steps=1,
        beta=0.04,
        top_entropy_quantile=0.5,
        off_policy_mask_threshold=0.5,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    (kl,) = logged(trainer, "kl")
    assert kl >= 0 and math.isfinite(kl) and math.isfinite(logged(trainer, "loss")[0])
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())


# ---------------------------------------------------------------------------------------------- a few steps
@pytest.mark.parametrize("mode", ["none", "r2", "r3"])
@pytest.mark.parametrize("loss", ["rspo", "minirl", "gspo"])
def test_a_few_steps_with_each_replay_mode(tmp_path, loss, mode):
    torch.manual_seed(0)
    model = tiny_moe_model("qwen3_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # num_iterations=2: step 1 is the first (on-policy) pass over the batch, step 2 reuses it after an update
    trainer = make_trainer(
        tmp_path,
        model,
        loss_type=loss,
        routing_replay=mode,
        num_iterations=2,
        learning_rate=1e-2,
        gradient_accumulation_steps=1,
        per_device_train_batch_size=8,
        router_shift_weighting=loss != "gspo",
    )
    trainer.train()
    assert len(logged(trainer, "loss")) == 2 and all(math.isfinite(v) for v in logged(trainer, "loss"))
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
    assert len(logged(trainer, "clip_ratio/region_mean")) == 2
    if loss == "gspo":
        assert not logged(trainer, "rspo/gamma_mean")
        return
    gamma_mean, gamma_min = logged(trainer, "rspo/gamma_mean"), logged(trainer, "rspo/gamma_min")
    assert gamma_min[0] == 1.0 and gamma_mean[0] == 1.0 and logged(trainer, "rspo/shift_mean")[0] == 0.0
    assert gamma_mean[1] < 1.0 and logged(trainer, "rspo/shift_mean")[1] > 0
    assert 0.8 <= logged(trainer, "rspo/gamma_p10")[1] <= gamma_mean[1]
    if loss == "minirl":
        assert logged(trainer, "clip_ratio/region_mean")[0] == 0.0  # on-policy: r = 1, nothing masked
        weights = logged(trainer, "minirl/is_weight_mean")
        assert all(math.isfinite(w) for w in weights)
        if mode == "r3":  # fp32, rollout routes replayed: the trainer reproduces the sampler, weight 1
            assert weights[0] == pytest.approx(1.0, abs=1e-5)


def test_without_an_old_logprob_pass_gamma_is_one(tmp_path):
    # no importance-sampling correction and on-policy: TRL skips the old pass, old = current (detached)
    trainer = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), loss_type="rspo", max_steps=1, vllm_importance_sampling_correction=False
    )
    seen = []
    original = trainer._compute_loss

    def spy(model, inputs):
        rows = trainer._routes.micro_rows(inputs)
        seen.append("old_per_token_logps" in inputs or (rows is not None and "old_router_ids" in rows.per_sample))
        return original(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    assert seen and not any(seen)
    assert logged(trainer, "rspo/gamma_mean") == [1.0] and logged(trainer, "rspo/gamma_min") == [1.0]


# ---------------------------------------------------------------------------------------------- config
def config(**kwargs):
    return MoEReplayGRPOConfig(output_dir="x", use_cpu=True, bf16=False, **kwargs)


def test_loss_defaults_are_filled_only_when_unset():
    gspo = config(loss_type="gspo")
    assert (gspo.epsilon, gspo.epsilon_high, gspo.importance_sampling_level) == (3e-4, 4e-4, "sequence")
    assert gspo.router_shift_weighting is False and gspo.scale_rewards == "group"
    rspo = config(loss_type="rspo")
    assert rspo.router_shift_weighting is True and rspo.router_shift_gamma_min == 0.8
    own = config(loss_type="gspo", epsilon=1e-3)
    assert (own.epsilon, own.epsilon_high) == (1e-3, None)  # TRL's rule: epsilon_high = epsilon
    minirl = config(loss_type="minirl")
    assert (minirl.epsilon, minirl.epsilon_high, minirl.scale_rewards) == (0.2, 0.27, "none")
    assert minirl.minirl_is_cap == 5.0
    dapo = config()
    assert (dapo.epsilon, dapo.epsilon_high, dapo.scale_rewards, dapo.importance_sampling_level) == (
        0.2,
        None,
        "group",
        "token",
    )
    assert config(scale_rewards=False).scale_rewards == "none"
    (parsed,) = HfArgumentParser(MoEReplayGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "x", "--use_cpu", "--bf16", "False", "--loss_type", "rspo", "--router_shift_gamma_min", "0.7"]
    )
    assert (parsed.epsilon, parsed.router_shift_weighting, parsed.router_shift_gamma_min) == (3e-4, True, 0.7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(loss_type="minirl", vllm_importance_sampling_correction=False), "vllm_importance_sampling_correction"),
        (dict(loss_type="minirl", use_transformers_continuous_batching=True), "continuous"),
        (dict(loss_type="minirl", scale_rewards="group"), "scale_rewards"),
        (dict(loss_type="minirl", scale_rewards=True), "scale_rewards"),
        (dict(loss_type="minirl", multi_objective_aggregation="normalize_then_sum"), "normalize_then_sum"),
        (dict(loss_type="minirl", importance_sampling_level="sequence"), "weights tokens"),
        (dict(loss_type="minirl", delta=2.0), "delta"),
        (
            dict(loss_type="minirl", transformers_importance_sampling_correction=False),
            "transformers_importance_sampling_correction",
        ),
        (dict(loss_type="rspo", beta=0.04), "use_bias_correction_kl"),
        (dict(loss_type="minirl", minirl_is_cap=0.0), "minirl_is_cap"),
        (dict(loss_type="gspo", importance_sampling_level="token"), "sequence-level"),
        (dict(loss_type="rspo", router_shift_weighting=False), "loss_type='gspo'"),
        (dict(router_shift_weighting=True, router_shift_gamma_min=0.0), "router_shift_gamma_min"),
        (dict(router_shift_weighting=True, router_shift_gamma_min=1.5), "router_shift_gamma_min"),
    ],
)
def test_bad_loss_combinations_raise_at_config_time(kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(**kwargs)
