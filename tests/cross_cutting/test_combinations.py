"""Features that were built apart, run together: vLLM server mode with RSPO and PR2, and PR2 with RSPO."""

import math

import torch

from trl_moe_replay.routing import has_route
from trl_moe_replay.testing import FakeVLLMServer, tiny_moe_model, trl_vllm_transport_stub

from tests.rollouts.test_vllm_routes import make_trainer as make_vllm_trainer
from tests.trainer.test_grpo_trainer import logged


# one generation batch used for two updates: update 1 on-policy, update 2 after the router moved
TWO_UPDATES = dict(gradient_accumulation_steps=1, num_iterations=2, per_device_train_batch_size=8, learning_rate=1e-2)


def test_rspo_with_r3_routes_from_a_vllm_server(tmp_path):
    with FakeVLLMServer(tiny_moe_model("qwen3_moe")) as server, trl_vllm_transport_stub(server):
        trainer = make_vllm_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe"),
            vllm_mode="server",
            vllm_server_base_url=server.url,
            loss_type="rspo",
            **TWO_UPDATES,
        )
        trainer.train()
    batch = trainer.batches[0]
    # γ is taken at the experts the old pass used, i.e. the server's routes wherever it sent one
    used = batch["old_router_ids"]
    replayed = batch["replay_routes"]
    sent = has_route(replayed)[..., None].expand_as(replayed)
    assert sent.any() and torch.equal(used[sent], replayed[sent])
    assert logged(trainer, "routing/mismatch_frac") == [0.0] and logged(trainer, "mismatch/kl_k3")[0] < 1e-6
    gamma_min, gamma_mean = logged(trainer, "rspo/gamma_min"), logged(trainer, "rspo/gamma_mean")
    assert gamma_min[0] == 1.0 and gamma_mean[0] == 1.0  # update 1: the router has not moved
    assert gamma_mean[1] < 1.0  # update 2: it has


def test_pr2_with_a_vllm_server_chooses_its_routes_in_the_old_pass(tmp_path):
    with FakeVLLMServer(tiny_moe_model("qwen3_moe"), return_routes=False) as server, trl_vllm_transport_stub(server):
        trainer = make_vllm_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe"),
            vllm_mode="server",
            vllm_server_base_url=server.url,
            routing_replay="pr2",
            pr2_lr_multiplier=10.0,
            **TWO_UPDATES,
        )
        trainer.train()
    # the server sent no route, and the run finished: PR2 needs none from the engine (it asks for them for the metrics)
    assert trainer.state.global_step == trainer.args.max_steps
    # the predictors are registered in the trained model, but vLLM's model has none: the weight sync leaves them out
    names = [n for n, _ in trainer.model.named_parameters()]
    assert any(n.startswith("pr2_predictors.") for n in names)
    assert [sorted(u.received) for u in server.weight_updates] == [
        sorted(n for n in names if not n.startswith("pr2_predictors."))
    ] * len(server.weight_updates) and server.weight_updates
    # the old pass's (predicted) routes ride with the batch and are replayed in the updates
    assert has_route(trainer.batches[0]["replay_routes"]).any()
    assert all("replay_routes" in inputs for inputs in trainer.trained)
    # the predictors trained on the off-policy update, from the cache of the server-sampled batch
    losses = logged(trainer, "pr2/loss")
    assert len(losses) == 1 and math.isfinite(losses[0]) and losses[0] > 0
    assert any((p != 0).any() for n, p in trainer.model.named_parameters() if n.startswith("pr2_predictors."))
    assert logged(trainer, "pr2/topk_agreement")[0] == 1.0  # zero predictors, on-policy: the router's own routes


def test_pr2_with_rspo_weights_the_predicted_routes(tmp_path):
    from tests.trainer.test_grpo_trainer import make_trainer

    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        routing_replay="pr2",
        loss_type="rspo",
        pr2_lr_multiplier=10.0,
        **TWO_UPDATES,
    )
    trainer.train()
    gamma_min, gamma_mean = logged(trainer, "rspo/gamma_min"), logged(trainer, "rspo/gamma_mean")
    assert gamma_min[0] == 1.0 and gamma_mean[0] == 1.0
    assert gamma_mean[1] < 1.0
    assert len(logged(trainer, "pr2/loss")) == 1
    assert any((p != 0).any() for n, p in trainer.model.named_parameters() if n.startswith("pr2_predictors."))
