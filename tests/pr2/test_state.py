"""PR2 (Predictive Routing Replay): predictors, predicted routes, the predictor loss, and the trainer integration."""

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.core.route_flow import ROUTE_ROWS
from trl_moe_replay.pr2.predictor import RoutePredictors, predictor_kl
from trl_moe_replay.pr2.state import CACHE_KEYS, PREDICTORS_FILE, PredictiveRoutingReplay, cached_positions
from trl_moe_replay.routing import RouterReplay
from trl_moe_replay.testing import supported_model_types, tiny_moe_model

from tests.helpers import no_route, random_ids, run_two_ranks
from tests.trainer.test_grpo_trainer import logged, make_trainer


# GA 1, every generation batch used twice: update 1 is on-policy (predictors skip), update 2 is off-policy (they train)
OFF_POLICY = dict(gradient_accumulation_steps=1, num_iterations=2)


def randomise(predictors: RoutePredictors, scale: float, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for linear in predictors.layers.values():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * scale)


def predictor_state(trainer) -> dict[str, torch.Tensor]:
    """The predictors as the model holds them (``<model>.pr2_predictors``), by their names in the predictors file."""
    prefix = "pr2_predictors."
    return {n.split(prefix, 1)[1]: p.detach().clone() for n, p in trainer.model.named_parameters() if prefix in n}


# ---------------------------------------------------------------------- predictors and predicted routes
@pytest.mark.parametrize(
    ("model_type", "dtype"),
    [(model_type, torch.float32) for model_type in supported_model_types()]
    + [
        (model_type, torch.bfloat16)
        for model_type in ("qwen3_moe", "deepseek_v3", "gpt_oss", "granitemoe", "jamba")
        if model_type in supported_model_types()
    ],
)
def test_zero_predictors_give_the_natural_routes_and_others_move_them(model_type, dtype):
    model = tiny_moe_model(model_type, dtype=dtype)
    rr = RouterReplay(model)
    predictors = RoutePredictors(rr.routers())
    for predictor in predictors.layers.values():  # bias-free, fp32, zero
        assert [n for n, _ in predictor.named_parameters()] == ["weight"] and predictor.weight.dtype == torch.float32
        assert (predictor.weight == 0).all()
    assert not any(p is q for p in predictors.parameters() for q in model.parameters())
    x = random_ids(2, 9)
    with torch.no_grad():
        with rr.record() as natural:
            reference = model(x).logits
        with rr.steer(predictors.choose), rr.record() as steered:
            out = model(x).logits
        assert torch.equal(out, reference) and torch.equal(steered.routes, natural.routes)
        randomise(predictors, scale=1.0)
        with rr.steer(predictors.choose), rr.record() as moved:
            model(x)
    assert not torch.equal(moved.routes, natural.routes)


def test_predicted_route_is_the_top_k_of_shifted_logits_and_replays_bit_for_bit():
    model = tiny_moe_model("qwen3_moe")
    rr = RouterReplay(model)
    predictors = RoutePredictors(rr.routers())
    randomise(predictors, scale=0.3)
    x = random_ids(2, 9)
    calls = []
    with torch.no_grad():
        with rr.steer(predictors.choose), rr.record() as steered, rr.observe(calls.append):
            out = model(x).logits
        with rr.replay(steered.routes):
            replayed = model(x).logits
    assert torch.equal(out, replayed)  # the old-logprob pass and a first on-policy update agree exactly
    changed = 0
    for call in calls:
        shifted = call.logits + predictors.shift(call.layer, call.router_input)  # softmax(p + h W_p^T) ranks these
        expected = shifted.topk(rr.top_k, dim=-1).indices.sort(-1).values
        assert torch.equal(call.used.sort(-1).values, expected)
        changed += int((call.used.sort(-1).values != call.natural.sort(-1).values).any(-1).sum())
    assert changed > 0


def test_cached_positions_are_evenly_spaced_completion_tokens():
    # 3 rows, prompt width 2, completion width 6; completion lengths 6, 3, 0
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    assert cached_positions(mask, 6, 3).tolist() == [[2, 4, 7], [2, 3, 4], [-1, -1, -1]]
    assert cached_positions(mask, 6, 100).tolist() == [[2, 3, 4, 5, 6, 7], [2, 3, 4, -1, -1, -1], [-1] * 6]
    with pytest.raises(ValueError, match="logits_to_keep"):
        cached_positions(mask, 9, 3)


def test_predictor_loss_falls_and_predicted_routes_follow_a_synthetic_router_drift():
    torch.manual_seed(0)
    model = tiny_moe_model("qwen3_moe", num_experts=16, num_experts_per_tok=4)
    rr = RouterReplay(model)
    pr2 = PredictiveRoutingReplay(rr, cached_tokens_per_sequence=64, rollout_prediction=False)
    x = random_ids(4, 24)
    mask = torch.ones_like(x)
    routers = rr.routers()
    drift = {
        layer: torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(layer)) * 0.3
        for layer, router in routers.items()
    }

    def routes(steer: bool) -> torch.Tensor:
        with torch.no_grad(), pr2.steering() if steer else contextlib.nullcontext(), rr.record() as rec:
            model(x)
        return rec.routes[:, :, rr.moe_layers].long()

    # old-logprob pass at the old router weights (zero predictors: the natural routes)
    with torch.no_grad(), pr2.old_pass_chunk(mask, 16, steer=True, cache=True), rr.record() as old:
        model(x)
    cache = pr2.take_old_pass_cache(global_step=0)
    assert cache["pr2_router_inputs"].shape == (4, 16, 2, model.config.hidden_size)
    assert cache["pr2_old_logits"].shape == (4, 16, 2, 16) and cache["pr2_old_logits"].dtype == torch.float32
    old_natural = routes(steer=False)
    with torch.no_grad():
        for layer, router in routers.items():
            router.weight += drift[layer]
    drifted_natural = routes(steer=False)
    optimizer = torch.optim.Adam(pr2.predictors.parameters(), lr=3e-2)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        with torch.no_grad(), rr.replay(old.routes), pr2.watch_training_forward(cache):
            model(x)
        loss, sums = pr2.training_loss(1, grad_scale=1.0)
        loss.backward()
        losses.append(pr2.metrics(sums)["pr2/loss"])
        optimizer.step()
    assert losses[-1] < 0.2 * losses[0], f"predictor loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    # back at the old weights, the predicted routes anticipate the drifted router's choice
    with torch.no_grad():
        for layer, router in routers.items():
            router.weight -= drift[layer]
    predicted = routes(steer=True)

    def agreement(a, b):
        return (a[..., :, None] == b[..., None, :]).sum(-1).float().mean().item()

    before, after = agreement(old_natural, drifted_natural), agreement(predicted, drifted_natural)
    assert after > before + 0.1, f"top-k overlap with the drifted router: natural {before:.3f}, predicted {after:.3f}"


def test_predictor_kl_is_zero_on_a_match_and_only_the_shift_gets_gradient():
    old = torch.randn(5, 8, requires_grad=True)
    current = torch.randn(5, 8, requires_grad=True)
    shift = (current - old).detach().requires_grad_()
    assert predictor_kl(old, shift, current).abs().max() < 1e-6
    other = torch.zeros(5, 8, requires_grad=True)
    predictor_kl(old, other, current).sum().backward()
    assert old.grad is None and current.grad is None and other.grad.abs().sum() > 0


# ---------------------------------------------------------------------- trainer
class _PredictorSnapshots(TrainerCallback):
    def __init__(self):
        self.trainer, self.after_step = None, []

    def on_step_end(self, args, state, control, **kwargs):
        self.after_step.append(predictor_state(self.trainer))


def test_frozen_zero_predictors_reproduce_r2_exactly(tmp_path):
    def run(mode):
        seen = []

        class Spy(MoEReplayGRPOTrainer):
            def _compute_loss(self, model, inputs):
                seen.append(self.replayed_routes(inputs))
                return super()._compute_loss(model, inputs)

        torch.manual_seed(0)
        trainer = make_trainer(
            tmp_path / mode,
            tiny_moe_model("olmoe"),
            cls=Spy,
            max_steps=3,
            routing_replay=mode,
            pr2_lr_multiplier=0.0,
            **OFF_POLICY,
        )
        trainer.train()
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return trainer, seen, params

    r2, r2_routes, r2_params = run("r2")
    pr2, pr2_routes, pr2_params = run("pr2")
    assert len(pr2_routes) == len(r2_routes) == 3
    assert all(torch.equal(a, b) for a, b in zip(r2_routes, pr2_routes, strict=True))
    assert logged(pr2, "loss") == logged(r2, "loss") and len(logged(r2, "loss")) == 3
    assert all(torch.equal(pr2_params[n], r2_params[n]) for n in r2_params)
    assert len(logged(pr2, "pr2/loss")) == 1  # trained (with lr 0) on the one off-policy update only
    assert all((p == 0).all() for p in predictor_state(pr2).values())


def test_predictors_train_on_off_policy_updates_only_and_log_their_metrics(tmp_path):
    snapshots = _PredictorSnapshots()
    trainer = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="pr2", max_steps=3, pr2_lr_multiplier=10.0, **OFF_POLICY
    )
    snapshots.trainer = trainer
    trainer.add_callback(snapshots)
    trainer.train()
    groups = trainer.optimizer.param_groups
    named = dict(trainer.model.named_parameters())
    predictors = [p for n, p in named.items() if n.startswith("pr2_predictors.")]
    assert groups[-1]["params"] == predictors and groups[-1]["weight_decay"] == 0.0
    assert groups[-1]["initial_lr"] == pytest.approx(1e-3 * 10.0)
    # step 1 on-policy: untouched; step 2 off-policy: trained; step 3 (new generation batch, on-policy): untouched
    zero = [all((p == 0).all() for p in snap.values()) for snap in snapshots.after_step]
    assert zero == [True, False, False]
    assert all(torch.equal(snapshots.after_step[2][n], snapshots.after_step[1][n]) for n in snapshots.after_step[1])
    assert len(logged(trainer, "pr2/loss")) == 1 and logged(trainer, "pr2/loss")[0] > 0
    agreement, gap = logged(trainer, "pr2/topk_agreement"), logged(trainer, "pr2/coverage_gap")
    assert len(agreement) == len(gap) == 3 and all(0 <= v <= 1 for v in agreement + gap)
    assert agreement[0] == 1.0  # on-policy with zero predictors the replayed routes are the router's own
    assert agreement[1] < 1.0  # after an update the router has moved away from some replayed routes
    # registered in the model, but only in their own optimizer group (never saved with the model: see
    # test_checkpoint_saves_predictors_apart_and_resume_restores_them)
    assert sorted(n for n in named if n.startswith("pr2_predictors.")) == [
        "pr2_predictors.layers.0.weight",
        "pr2_predictors.layers.1.weight",
    ]
    assert [id(p) for group in groups for p in group["params"]].count(id(predictors[0])) == 1


def test_the_predictor_cache_stays_with_the_trainer_and_the_batch_dict_carries_only_route_rows(tmp_path):
    """PR2's cache is kept beside the routes in the trainer's route buffer (core/route_flow.py), and each micro-batch
    of an off-policy update gathers its own rows of it there."""
    seen = {"keys": set(), "cached": []}

    class Spy(MoEReplayGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            seen["keys"] |= set(output)
            return output

        def _add_pr2_predictor_loss(self, loss):
            cache = self._micro_batch.held.per_sample  # the micro-batch's own rows of the buffer
            seen["cached"].append(
                sorted(cache) == sorted(CACHE_KEYS)
                and len(cache["pr2_positions"]) == self.args.per_device_train_batch_size
            )
            return super()._add_pr2_predictor_loss(loss)

    trainer = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), cls=Spy, routing_replay="pr2", max_steps=2, **OFF_POLICY
    )
    trainer.train()
    assert ROUTE_ROWS in seen["keys"] and not [key for key in seen["keys"] if key.startswith("pr2_")]
    assert seen["cached"] and all(seen["cached"])
    assert len(logged(trainer, "pr2/loss")) == 1  # the gathered cache trained the predictors


def test_no_gradient_crosses_between_policy_and_predictors(tmp_path):
    checks = {"policy": 0, "predictor": 0}

    class CrossGradSpy(MoEReplayGRPOTrainer):
        def _add_pr2_predictor_loss(self, loss):
            predictors = list(self._pr2.predictors.parameters())
            own = {id(p) for p in predictors}
            policy = [p for p in self.model.parameters() if p.requires_grad and id(p) not in own]
            assert all(g is None for g in torch.autograd.grad(loss, predictors, allow_unused=True, retain_graph=True))
            checks["policy"] += 1
            training_loss = self._pr2.training_loss

            def checked(*args, **kwargs):
                predictor_loss, sums = training_loss(*args, **kwargs)
                if predictor_loss is not None:
                    assert all(
                        g is None
                        for g in torch.autograd.grad(predictor_loss, policy, allow_unused=True, retain_graph=True)
                    )
                    grads = torch.autograd.grad(predictor_loss, predictors, retain_graph=True)
                    assert all(g.abs().sum() > 0 for g in grads)
                    checks["predictor"] += 1
                return predictor_loss, sums

            self._pr2.training_loss = checked
            try:
                total = super()._add_pr2_predictor_loss(loss)
            finally:
                del self._pr2.training_loss
            assert total.item() == loss.item()  # the logged loss stays the policy loss
            return total

    trainer = make_trainer(
        tmp_path, tiny_moe_model("mixtral"), cls=CrossGradSpy, routing_replay="pr2", seed=42, **OFF_POLICY
    )
    trainer.train()
    assert checks == {"policy": 2, "predictor": 1}


def test_old_pass_predicted_routes_are_replayed_in_training(tmp_path):
    # policy and predictors frozen (lr 0): every micro-batch must replay its own samples' predicted routes
    checked = []

    class Spy(MoEReplayGRPOTrainer):
        def _compute_loss(self, model, inputs):
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            with torch.no_grad(), self._pr2.steering(), self._route_replay.record() as rec:
                model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
                )
            real = attention_mask.bool()
            replayed = self.replayed_routes(inputs)
            assert torch.equal(rec.routes[real].long().sort(-1).values, replayed[real].long().sort(-1).values)
            checked.append(int(real.sum()))
            return super()._compute_loss(model, inputs)

    trainer = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), cls=Spy, learning_rate=0.0, routing_replay="pr2", seed=42
    )
    randomise(trainer._pr2.predictors, scale=0.05)
    trainer.train()
    assert len(checked) == 4
    # the predicted routes differ from what natural generation used, so the old-logprob pass sees other routes
    assert min(logged(trainer, "routing/mismatch_frac")) > 0


def test_rollout_prediction_replays_the_routes_generate_used(tmp_path):
    captured = []

    class Spy(MoEReplayGRPOTrainer):
        def _generate(self, prompts):
            output = super()._generate(prompts)
            captured.append(
                [turns[0].rows.clone() for turns in self._routes.batch.turns.turns]
            )  # generate's own, per sample
            return output

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            replayed, prompt_width = self.replayed_routes(output), output["prompt_mask"].shape[1]
            for i, rows in enumerate(captured[-1]):  # rows: positions 0 .. p + c - 2 of the sample
                start = prompt_width - int(output["prompt_mask"][i].sum())
                assert torch.equal(replayed[i, start : start + len(rows)], rows)
                assert no_route(replayed[i, :start]).all() and no_route(replayed[i, start + len(rows) :]).all()
            return output

    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        cls=Spy,
        routing_replay="pr2",
        pr2_rollout_prediction=True,
        pr2_lr_multiplier=0.0,
        seed=42,
        **OFF_POLICY,
    )
    randomise(trainer._pr2.predictors, scale=0.05)
    trainer.train()
    assert len(captured) == 1
    # generate routed by the predictors: the old pass's natural routes differ from them, yet replaying them
    # reproduces the sampling log-probs (fp32) as R3 does
    assert logged(trainer, "routing/mismatch_frac")[0] > 0
    assert logged(trainer, "mismatch/kl_k3")[0] < 1e-6
    assert logged(trainer, "pr2/loss") and all(math.isfinite(v) for v in logged(trainer, "pr2/loss"))


def test_checkpoint_saves_predictors_apart_and_resume_restores_them(tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(
        out,
        tiny_moe_model("qwen3_moe"),
        routing_replay="pr2",
        max_steps=2,
        pr2_lr_multiplier=10.0,
        save_strategy="steps",
        save_steps=1,
        **OFF_POLICY,
    )
    trainer.train()
    final = predictor_state(trainer)
    folder = out / "checkpoint-2"
    saved = load_file(folder / PREDICTORS_FILE)
    assert set(saved) == {"layers.0.weight", "layers.1.weight"}
    assert all(torch.equal(saved[n], final[n]) for n in final) and any(v.abs().sum() > 0 for v in saved.values())
    model_keys = set(load_file(folder / "model.safetensors"))
    assert model_keys and not any("pr2" in key for key in model_keys)
    assert all((v == 0).all() for v in load_file(out / "checkpoint-1" / PREDICTORS_FILE).values())

    restored = {}

    class ResumeSpy(MoEReplayGRPOTrainer):
        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            restored["predictors"] = predictor_state(self)
            state = self.optimizer.state
            restored["adam"] = [state[p]["exp_avg"].clone() for p in self._pr2.predictors.parameters()]

    resumed = make_trainer(
        out,
        tiny_moe_model("qwen3_moe"),
        cls=ResumeSpy,
        max_steps=3,
        routing_replay="pr2",
        pr2_lr_multiplier=10.0,
        seed=42,
        **OFF_POLICY,
    )
    resumed.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(restored["predictors"][n], saved[n]) for n in saved)
    saved_optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    predictor_ids = saved_optimizer["param_groups"][-1]["params"]
    for exp_avg, param_id in zip(restored["adam"], predictor_ids, strict=True):
        assert torch.equal(exp_avg, saved_optimizer["state"][param_id]["exp_avg"]) and exp_avg.abs().sum() > 0
    assert resumed.state.global_step == 3


def test_peft_lora_with_router_in_modules_to_save_and_a_reference_model(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["gate"])
    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        trainer_kwargs=dict(peft_config=lora),
        beta=0.04,
        save_strategy="steps",
        save_steps=2,
        routing_replay="pr2",
        pr2_lr_multiplier=10.0,
        seed=42,
        **OFF_POLICY,
    )
    trainer.train()
    assert len(logged(trainer, "pr2/loss")) == 1 and any((p != 0).any() for p in predictor_state(trainer).values())
    adapter = load_file(tmp_path / "checkpoint-2" / "adapter_model.safetensors")
    assert any("gate" in key for key in adapter) and not any("pr2" in key for key in adapter)
    assert set(load_file(tmp_path / "checkpoint-2" / PREDICTORS_FILE)) == {"layers.0.weight", "layers.1.weight"}


@pytest.mark.parametrize("mode", ["r2", "pr2"])
def test_r2_and_pr2_with_lora_on_the_router_and_experts_train_checkpoint_and_resume(tmp_path, mode):
    """LoRA wraps each router's weight (PEFT's ParamWrapper) and the fused experts: the replayed routes are the adapted
    router's own (R2), PR2's predictors steer that router and train, and a resume restores adapter and predictors."""
    from peft import LoraConfig

    lora = LoraConfig(
        r=4, target_modules=["q_proj", "gate"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    )
    out = tmp_path / "run"
    pr2 = dict(pr2_lr_multiplier=10.0) if mode == "pr2" else {}
    trainer = make_trainer(
        out,
        tiny_moe_model("qwen3_moe"),
        trainer_kwargs=dict(peft_config=lora),
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        routing_replay=mode,
        seed=42,
        **pr2,
        **OFF_POLICY,
    )
    trainer.train()
    assert logged(trainer, "routing/fallback_frac") and all(v == 0 for v in logged(trainer, "routing/fallback_frac"))
    folder = out / "checkpoint-2"
    adapter = load_file(folder / "adapter_model.safetensors")
    assert any("mlp.gate" in key for key in adapter) and any("experts" in key for key in adapter)
    if mode == "pr2":
        assert len(logged(trainer, "pr2/loss")) == 1  # step 2 is the off-policy update of the first batch
        assert any((p != 0).any() for p in predictor_state(trainer).values())
        assert set(load_file(folder / PREDICTORS_FILE)) == {"layers.0.weight", "layers.1.weight"}
    restored = {}

    class ResumeSpy(MoEReplayGRPOTrainer):
        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            restored["params"] = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            restored["predictors"] = predictor_state(self)

    resumed = make_trainer(
        out,
        tiny_moe_model("qwen3_moe"),
        cls=ResumeSpy,
        trainer_kwargs=dict(peft_config=lora),
        max_steps=3,
        routing_replay=mode,
        seed=42,
        **pr2,
        **OFF_POLICY,
    )
    resumed.train(resume_from_checkpoint=str(folder))
    adapted = {n.replace(".default", ""): p for n, p in restored["params"].items() if "lora_" in n}
    assert len(adapted) == len(adapter) and all(torch.equal(adapted[n], adapter[n]) for n in adapter)
    if mode == "pr2":
        saved = load_file(folder / PREDICTORS_FILE)
        assert all(torch.equal(restored["predictors"][n], saved[n]) for n in saved)
    assert resumed.state.global_step == 3


def test_pr2_config_errors():
    with pytest.raises(ValueError, match="pr2_rollout_prediction needs routing_replay='pr2'"):
        MoEReplayGRPOConfig(output_dir="x", use_cpu=True, bf16=False, routing_replay="r2", pr2_rollout_prediction=True)
    with pytest.raises(ValueError, match="use_vllm"):
        MoEReplayGRPOConfig(
            output_dir="x", use_cpu=True, bf16=False, routing_replay="pr2", pr2_rollout_prediction=True, use_vllm=True
        )
    with pytest.raises(ValueError, match="pr2_lr_multiplier"):
        MoEReplayGRPOConfig(output_dir="x", use_cpu=True, bf16=False, pr2_lr_multiplier=-1.0)
    with pytest.raises(ValueError, match="pr2_cached_tokens_per_sequence"):
        MoEReplayGRPOConfig(output_dir="x", use_cpu=True, bf16=False, pr2_cached_tokens_per_sequence=0)


@pytest.mark.slow  # torchrun, two processes
@pytest.mark.serial
def test_predictors_stay_identical_across_ddp_ranks(tmp_path):
    script = Path(__file__).parents[1] / "scripts" / "pr2_ddp.py"
    run_two_ranks(script, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    first, second = (torch.tensor(r["weights"]) for r in ranks)
    assert first.abs().sum() > 0 and torch.equal(first, second)
    assert all(len(r["pr2_loss"]) == 1 for r in ranks)
