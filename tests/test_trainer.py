"""MoEReplayGRPOTrainer end to end on the transformers generation path (CPU, tiny models)."""

import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.core.route_flow import ROUTE_ROWS, RouteBuffer, StaleRouteRowsError
from trl_moe_replay.routing import RouteLayout, RouterReplay, check_routes, has_route
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

from .helpers import run_two_ranks


METRICS = [
    "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/extreme_frac", "routing/mismatch_frac",
    "routing/token_any_mismatch", "routing/topk_agreement", "routing/fallback_frac", "routing/fallback_samples_frac",
]


def prompts_dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)][:n]})


def reward_len(completions, **kwargs):
    return [-abs(6 - len(c)) for c in completions]


def make_trainer(tmp_path, model, cls=MoEReplayGRPOTrainer, trainer_kwargs: dict | None = None,
                 **overrides) -> MoEReplayGRPOTrainer:
    """A tiny GRPO run of ``cls`` on ``model``: ``overrides`` go to the config, ``trainer_kwargs`` to the trainer."""
    settings = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=2, logging_steps=1,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, learning_rate=1e-3,
        gradient_accumulation_steps=2, save_strategy="no", seed=0,
    )
    settings.update(overrides)
    return cls(
        model=model, reward_funcs=reward_len, args=MoEReplayGRPOConfig(**settings),
        train_dataset=prompts_dataset(), processing_class=tiny_tokenizer(), **(trainer_kwargs or {}),
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
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay=mode, routing_metrics=True,
                           transformers_importance_sampling_correction=False)
    trainer.train()
    for name in METRICS:
        values = logged(trainer, name)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), (name, values)
    assert logged(trainer, "sampling/importance_sampling_ratio/mean") == []
    if mode == "r3":  # fp32: replaying the rollout's routes reproduces the sampler's log-probs
        assert max(logged(trainer, "mismatch/kl_k3")) < 1e-6


class RouteAlignmentSpy(MoEReplayGRPOTrainer):
    """Checks, for every training micro-batch, that its replayed routes are the natural routes of its own tokens."""

    checked_rows = 0

    def _compute_loss(self, model, inputs):
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        routes = self.replayed_routes(inputs)  # the rows of the trainer's buffer this micro-batch names
        assert routes.shape[:2] == input_ids.shape
        probe = RouterReplay(self.accelerator.unwrap_model(model))
        with torch.no_grad(), probe.record() as rec:
            self.accelerator.unwrap_model(model)(input_ids=input_ids, attention_mask=attention_mask,
                                                 position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0))
        probe.remove()
        routed = has_route(routes).all(-1)
        # every real token but the last of each sequence has a route; pads have none
        assert not routed[attention_mask == 0].any()
        assert routed.sum() == attention_mask.sum() - attention_mask.shape[0]
        natural = rec.routes.long().sort(-1).values
        replayed = routes.long().sort(-1).values
        assert torch.equal(natural[routed], replayed[routed])
        type(self).checked_rows += input_ids.shape[0]
        return super()._compute_loss(model, inputs)


def test_routes_stay_aligned_with_their_samples_through_shuffle_split_and_eval(tmp_path):
    # lr 0: the policy never changes, so in fp32 the rollout routes must equal each micro-batch's natural routes
    RouteAlignmentSpy.checked_rows = 0
    trainer = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), cls=RouteAlignmentSpy,
        trainer_kwargs=dict(eval_dataset=prompts_dataset(8)), learning_rate=0.0, steps_per_generation=4,
        eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4, routing_replay="r3", seed=42,
    )
    trainer.train()
    # 2 optimizer steps x 2 accumulation micro-batches of 4 rows, plus the evaluation batches (eval mid-buffer)
    assert RouteAlignmentSpy.checked_rows >= 16
    assert logged(trainer, "eval_routing/mismatch_frac")


def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    def trained_params(checkpointing: bool):
        torch.manual_seed(0)
        trainer = make_trainer(tmp_path / str(checkpointing), tiny_moe_model("qwen3_moe"), max_steps=1,
                               gradient_checkpointing=checkpointing, routing_replay="r3")
        trainer.train()
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    plain, checkpointed = trained_params(False), trained_params(True)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-6)


def test_aux_loss_is_turned_off_under_replay_and_kept_without(tmp_path):
    replayed = make_trainer(tmp_path / "r3", tiny_moe_model("qwen3_moe", router_aux_loss_coef=0.01), max_steps=1)
    plain = make_trainer(tmp_path / "none", tiny_moe_model("qwen3_moe", router_aux_loss_coef=0.01), max_steps=1,
                         routing_replay="none")
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
        model = tiny_moe_model("qwen3_moe", dtype=torch.bfloat16, num_experts=32, num_experts_per_tok=4,
                               initializer_range=0.1)
        # "none" measures too (routing_metrics), and scores the batch against the sampler like r3 does
        trainer = make_trainer(tmp_path / mode, model, routing_replay=mode, max_steps=1, learning_rate=0.0,
                               max_completion_length=16, bf16=True, gradient_checkpointing=False,
                               routing_metrics=True, transformers_importance_sampling_correction=True)
        trainer.train()
        return logged(trainer, "routing/mismatch_frac")[0], logged(trainer, "mismatch/kl_k3")[0]

    (route_none, kl_none), (route_r3, kl_r3) = run("none"), run("r3")
    print(f"bf16 routing/mismatch_frac none={route_none:.4f} r3={route_r3:.4f}; kl_k3 none={kl_none:.2e} r3={kl_r3:.2e}")
    assert route_none > 0 and route_r3 > 0  # the routing mismatch is measurable on this config
    assert kl_r3 < kl_none / 2  # measured 6.7e-5 -> 1.1e-5 (2 layers) and 9.8e-5 -> 1.5e-5 (4 layers)


@pytest.mark.slow  # torchrun, two processes
def test_import_swap_script_runs_on_two_processes():
    script = Path(__file__).parent / "scripts" / "grpo_swap.py"
    result = run_two_ranks(script)
    line = next(line for line in result.stdout.splitlines() if line.startswith("METRICS "))
    report = json.loads(line[len("METRICS "):])
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
        (dict(routing_replay="pr2", pr2_rollout_prediction=True, use_transformers_continuous_batching=True),
         "use_transformers_continuous_batching"),
        (dict(routing_replay="r2", use_transformers_continuous_batching=True,
              transformers_importance_sampling_correction=True), "continuous_batching"),
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
        MoEReplayGRPOTrainer(model=tiny_moe_model("qwen3_moe"), reward_funcs=reward_len, args=args,
                             train_dataset=prompts_dataset(), processing_class=tiny_tokenizer())


# transformers' default continuous-batching cache is sized for a GPU: on CPU a small one is ~20x faster
from .test_golden_trl import SMALL_CB_CACHE  # noqa: E402 - page_size was block_size before transformers 5.18


class ReplaySpy(MoEReplayGRPOTrainer):
    """Counts the training micro-batches that carried routes to replay."""

    replayed = 0

    def _compute_loss(self, model, inputs):
        self.replayed += ROUTE_ROWS in inputs
        return super()._compute_loss(model, inputs)


def test_r2_trains_with_continuous_batching_and_beam_search_when_nothing_is_recorded(tmp_path):
    # nothing recorded during generate: continuous batching and beam search are TRL's business; R2 records its own
    # routes in the old-logprob pass (off-policy here: num_iterations=2)
    trainer = make_trainer(tmp_path / "cb", tiny_moe_model("qwen3_moe"), cls=ReplaySpy, routing_replay="r2",
                           use_transformers_continuous_batching=True, num_iterations=2, max_steps=2,
                           transformers_continuous_batching_config=SMALL_CB_CACHE)
    assert not trainer.replay_settings.records_generation
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.replayed == 4
    trainer = make_trainer(tmp_path / "beams", tiny_moe_model("qwen3_moe"), cls=ReplaySpy, routing_replay="r2",
                           routing_metrics=False, transformers_importance_sampling_correction=False,
                           generation_kwargs={"num_beams": 2}, num_iterations=2, max_steps=2)
    assert not trainer.replay_settings.records_generation
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.replayed == 4


def test_r3_checks_routes_once_per_generation_batch_not_at_every_forward(tmp_path, monkeypatch):
    """The routes are checked where they enter (``RouteIntake.align``, once per generation batch) and that fact
    travels through TRL's buffer, shuffle and micro-batch split: no forward runs ``validate_routes``' host pass."""
    from trl_moe_replay.rollouts.route_intake import RouteIntake
    from trl_moe_replay.routing import routes as routes_module

    aligned, host_passes, replayed = [], [], []
    align, full_pass, replay = RouteIntake.align, routes_module._every_row_valid, RouterReplay.replay
    monkeypatch.setattr(RouteIntake, "align", lambda self, *a, **kw: (aligned.append(1), align(self, *a, **kw))[1])
    monkeypatch.setattr(routes_module, "_every_row_valid",
                        lambda *a, **kw: (host_passes.append(1), full_pass(*a, **kw))[1])
    monkeypatch.setattr(RouterReplay, "replay", lambda self, routes: (replayed.append(1), replay(self, routes))[1])
    # generate every steps_per_generation x num_iterations = 8 micro-batches = 4 optimizer steps: 2 generation batches
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="r3", steps_per_generation=4,
                           num_iterations=2, max_steps=8)
    trainer.train()
    assert len(aligned) == 2
    assert len(replayed) >= 16  # every training micro-batch replayed its routes (plus the old-logprob passes)
    assert host_passes == []
    assert logged(trainer, "routing/mismatch_frac") and max(logged(trainer, "routing/mismatch_frac")) == 0.0


@pytest.mark.parametrize("mode", ["r2", "pr2"])
def test_r2_and_pr2_replay_recorded_routes_without_a_host_pass(tmp_path, monkeypatch, mode):
    """The old pass's recorded routes (checked by construction) keep their mark through the batch's concatenation,
    TRL's shuffle and split: the off-policy updates replay them without ``validate_routes``' host pass."""
    from trl_moe_replay.routing import routes as routes_module

    host_passes, replayed = [], []
    full_pass, replay = routes_module._every_row_valid, RouterReplay.replay
    monkeypatch.setattr(routes_module, "_every_row_valid",
                        lambda *a, **kw: (host_passes.append(1), full_pass(*a, **kw))[1])
    monkeypatch.setattr(RouterReplay, "replay", lambda self, routes: (replayed.append(1), replay(self, routes))[1])
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay=mode, steps_per_generation=4,
                           num_iterations=2, max_steps=8)
    trainer.train()
    assert len(replayed) >= 16 and host_passes == []


def test_a_stale_route_index_is_refused_in_one_line(tmp_path):
    """The batch dict carries only ``route_rows`` into the trainer's route buffer: rows of a generation batch it no
    longer holds (here a subclass that hands the first batch's rows to the second) are refused in one line, never
    replayed as another batch's routes."""

    class Stale(MoEReplayGRPOTrainer):
        first_rows = None

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self.first_rows is None:
                self.first_rows = output[ROUTE_ROWS]
            else:
                output[ROUTE_ROWS] = self.first_rows
            return output

    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), cls=Stale, routing_replay="r3", max_steps=2)
    with pytest.raises(StaleRouteRowsError, match=r"route_rows name generation batch\(es\) \[1\], but the trainer "
                                                  r"holds the routes of \[2\] only"):
        trainer.train()


def test_the_route_buffer_keeps_one_batch_per_slot_and_gives_each_micro_batch_its_own_rows():
    layout = RouteLayout(num_layers=1, top_k=2, num_experts=4, moe_layers=(0,))
    train = check_routes(torch.tensor([[[[0, 1]]], [[[2, 3]]], [[[1, 3]]]], dtype=torch.uint8), layout)
    buffer = RouteBuffer()
    rows = buffer.store(train, slot="train")
    evaluation = buffer.store(check_routes(torch.full((1, 1, 1, 2), 255, dtype=torch.uint8), layout), slot="eval")
    micro = buffer.gather(rows[[2, 0]])  # shuffled and split, as TRL does
    assert torch.equal(micro.tensor(), train.tensor()[[2, 0]])
    assert torch.equal(buffer.gather(evaluation).tensor(), torch.full((1, 1, 1, 2), 255, dtype=torch.uint8))
    buffer.store(train, slot="train")  # the next generation batch: the previous one's rows are stale
    with pytest.raises(StaleRouteRowsError, match="name generation batch"):
        buffer.gather(rows[:1])
    with pytest.raises(StaleRouteRowsError, match="name generation batch"):  # rows of two batches in one
        buffer.gather(torch.cat([evaluation, buffer.store(train, slot="train")[:1]]))
    with pytest.raises(StaleRouteRowsError, match=r"name rows \[3\] of a batch of 3 samples"):
        buffer.gather(torch.tensor([[rows[0, 0].item() + 3, 3]]))  # the current batch, a row it does not have
    taken = buffer.store(train)  # no slot: held until taken (the async trainer's packed rows)
    buffer.gather(taken, take=True)
    with pytest.raises(StaleRouteRowsError):
        buffer.gather(taken)
