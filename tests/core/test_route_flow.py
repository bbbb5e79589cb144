"""The route flow (trl_moe_replay.core.route_flow): each sample's routes reach the micro-batch that trains it, through
TRL's buffer, shuffle, split and evaluation, checked once where they enter; the trainer's route buffer and its refusal
of stale rows."""

import pytest
import torch

from trl_moe_replay import MoEReplayGRPOTrainer
from trl_moe_replay.core.route_flow import (
    ROUTE_ROWS,
    GenerationBatch,
    HeldRows,
    MicroBatch,
    RouteBuffer,
    StaleRouteRowsError,
)
from trl_moe_replay.routing import RouteLayout, RouterReplay, check_routes, has_route
from trl_moe_replay.testing import tiny_moe_model

# transformers' default continuous-batching cache is sized for a GPU: on CPU a small one is ~20x faster
from tests.cross_cutting.test_golden_trl import SMALL_CB_CACHE  # page_size was block_size before transformers 5.18
from tests.trainer.test_grpo_trainer import logged, make_trainer, prompts_dataset


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
            self.accelerator.unwrap_model(model)(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
            )
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
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        cls=RouteAlignmentSpy,
        trainer_kwargs=dict(eval_dataset=prompts_dataset(8)),
        learning_rate=0.0,
        steps_per_generation=4,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=4,
        routing_replay="r3",
        seed=42,
    )
    trainer.train()
    # 2 optimizer steps x 2 accumulation micro-batches of 4 rows, plus the evaluation batches (eval mid-buffer)
    assert RouteAlignmentSpy.checked_rows >= 16
    assert logged(trainer, "eval_routing/mismatch_frac")


class ReplaySpy(MoEReplayGRPOTrainer):
    """Counts the training micro-batches that carried routes to replay."""

    replayed = 0

    def _compute_loss(self, model, inputs):
        self.replayed += ROUTE_ROWS in inputs
        return super()._compute_loss(model, inputs)


def test_r2_trains_with_continuous_batching_and_beam_search_when_nothing_is_recorded(tmp_path):
    # nothing recorded during generate: continuous batching and beam search are TRL's business; R2 records its own
    # routes in the old-logprob pass (off-policy here: num_iterations=2)
    trainer = make_trainer(
        tmp_path / "cb",
        tiny_moe_model("qwen3_moe"),
        cls=ReplaySpy,
        routing_replay="r2",
        use_transformers_continuous_batching=True,
        num_iterations=2,
        max_steps=2,
        transformers_continuous_batching_config=SMALL_CB_CACHE,
    )
    assert not trainer.replay_settings.records_generation
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.replayed == 4
    trainer = make_trainer(
        tmp_path / "beams",
        tiny_moe_model("qwen3_moe"),
        cls=ReplaySpy,
        routing_replay="r2",
        routing_metrics=False,
        transformers_importance_sampling_correction=False,
        generation_kwargs={"num_beams": 2},
        num_iterations=2,
        max_steps=2,
    )
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
    monkeypatch.setattr(
        routes_module, "_every_row_valid", lambda *a, **kw: (host_passes.append(1), full_pass(*a, **kw))[1]
    )
    monkeypatch.setattr(RouterReplay, "replay", lambda self, routes: (replayed.append(1), replay(self, routes))[1])
    # generate every steps_per_generation x num_iterations = 8 micro-batches = 4 optimizer steps: 2 generation batches
    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        routing_replay="r3",
        steps_per_generation=4,
        num_iterations=2,
        max_steps=8,
    )
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
    monkeypatch.setattr(
        routes_module, "_every_row_valid", lambda *a, **kw: (host_passes.append(1), full_pass(*a, **kw))[1]
    )
    monkeypatch.setattr(RouterReplay, "replay", lambda self, routes: (replayed.append(1), replay(self, routes))[1])
    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        routing_replay=mode,
        steps_per_generation=4,
        num_iterations=2,
        max_steps=8,
    )
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
    with pytest.raises(
        StaleRouteRowsError,
        match=r"route_rows name generation batch\(es\) \[1\], but the trainer "
        r"holds the routes of \[2\] only",
    ):
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


def test_per_sample_inputs_are_held_with_the_routes_row_for_row():
    """RSPO's old router ids/probs stay with the trainer, keyed by the same route_rows as the routes (not in TRL's
    batch dict); a batch with per-sample inputs and no routes to replay still gets its rows."""
    layout = RouteLayout(num_layers=1, top_k=2, num_experts=4, moe_layers=(0,))
    routes = check_routes(torch.tensor([[[[0, 1]]], [[[2, 3]]], [[[1, 3]]]], dtype=torch.uint8), layout)
    probs = torch.tensor([[0.1], [0.2], [0.3]])
    buffer = RouteBuffer()
    rows = buffer.store(HeldRows(routes, {"old_router_probs": probs}), slot="train")
    micro = buffer.gather_held(rows[[2, 0]])
    assert torch.equal(micro.routes.tensor(), routes.tensor()[[2, 0]])
    assert torch.equal(micro.per_sample["old_router_probs"], probs[[2, 0]])
    only_inputs = buffer.store(HeldRows(None, {"old_router_probs": probs}), slot="eval")
    assert only_inputs.shape == (3, 2) and buffer.gather(only_inputs) is None  # nothing to replay
    assert torch.equal(buffer.gather_held(only_inputs[1:]).per_sample["old_router_probs"], probs[1:])
    batch = GenerationBatch()
    assert batch.old_router_inputs() == {}
    batch.add_old_router(torch.zeros(2, 1, dtype=torch.uint8), probs[:2])
    batch.add_old_router(torch.ones(1, 1, dtype=torch.uint8), probs[2:])
    assert torch.equal(batch.old_router_inputs()["old_router_probs"], probs)
    assert batch.old_router_inputs()["old_router_ids"].flatten().tolist() == [0, 0, 1]


def test_a_micro_batch_is_a_value_with_a_copy_of_its_loss_inputs():
    inputs = {"old_per_token_logps": torch.zeros(2, 3), "advantages": torch.ones(2)}
    micro = MicroBatch.of(inputs)
    micro.inputs["old_per_token_logps"] = torch.ones(2, 3)  # what RSPO's γ shift does to the loss inputs
    assert torch.equal(inputs["old_per_token_logps"], torch.zeros(2, 3))  # the buffered batch is untouched
    assert torch.equal(micro.old_logps, torch.zeros(2, 3)) and micro.routes is None and micro.gamma is None
