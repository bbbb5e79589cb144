"""SGLang's routed experts through the route-source interface, against the stand-in server built to its contract
(docs/sglang.md): the routes align where they belong, bad payloads fall back per sample or per position as vLLM's do,
and a multi-turn rollout asks each later turn only for what it does not hold."""

import base64

import numpy as np
import pytest
import torch
from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.rollouts.route_source import RouteSourceProtocol
from trl_moe_replay.rollouts.sglang_routes import SGLangRollout, decode_sglang_routes
from trl_moe_replay.testing import FakeSGLangServer, sglang_payload, tiny_moe_model, tiny_tokenizer

from tests.helpers import no_route, with_routes


TOOL = [5, 6, 7]  # a tool result's tokens, appended after the first turn of the multi-turn rollout


class Spy(MoEReplayGRPOTrainer):
    batches: list

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        type(self).batches.append(with_routes(self, output))
        return output


def reward_len(completions, **kwargs):
    return [-abs(6 - len(c)) for c in completions]


def rollout_for(server, **kwargs) -> SGLangRollout:
    config = server.engine.model.config
    return SGLangRollout(
        server.url, num_layers=config.num_hidden_layers, top_k=config.num_experts_per_tok, max_new_tokens=6, **kwargs
    )


def train(tmp_path, rollout, routing_replay="r3", batch_size=4):
    Spy.batches = []
    args = MoEReplayGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        logging_steps=1,
        per_device_train_batch_size=batch_size,
        num_generations=4,
        max_completion_length=16,
        save_strategy="no",
        seed=0,
        routing_replay=routing_replay,
    )
    trainer = Spy(
        model=tiny_moe_model("qwen3_moe"),
        reward_funcs=reward_len,
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]}),
        rollout_func=rollout,
    )
    trainer.train()
    return trainer


@pytest.fixture
def server():
    with FakeSGLangServer(tiny_moe_model("qwen3_moe")) as running:
        yield running


def placed(batch, i: int) -> tuple[torch.Tensor, int]:
    """Sample ``i``'s replayed routes from its first real position on, and that position's column."""
    start = batch["prompt_ids"].shape[1] - int(batch["prompt_mask"][i].sum())
    return batch["replay_routes"][i, start:], start


# ----------------------------------------------------------------------------- the wire format
def test_a_payload_decodes_to_rows_of_the_models_layers_and_top_k_or_is_left_as_sent():
    routes = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    assert np.array_equal(decode_sglang_routes(sglang_payload(routes), 3, 2), routes)
    odd = base64.b64encode(routes.tobytes()[:-4]).decode()  # not a whole number of rows
    for payload in (odd, "not base64!", None):
        assert decode_sglang_routes(payload, 3, 2) is payload  # the intake reports it and routes natively


def test_the_rollout_is_a_route_source():
    assert isinstance(SGLangRollout("http://x", num_layers=2, top_k=2), RouteSourceProtocol)


# ----------------------------------------------------------------------------- through the trainer
def test_sglang_routes_are_replayed_where_they_belong(tmp_path, server):
    trainer = train(tmp_path, rollout_for(server))
    (batch,) = Spy.batches
    (request,) = server.requests
    assert request["return_routed_experts"] is True and request["routed_experts_start_len"] == 0
    (served,) = server.routes
    for i, rows in enumerate(served):
        replayed, _ = placed(batch, i)
        assert torch.equal(replayed[: len(rows)], torch.from_numpy(rows.astype("int16")))
        assert no_route(replayed[len(rows) :]).all()  # the last token was never forwarded; then padding
    log = trainer.state.log_history[0]
    assert log["routing/fallback_frac"] == 0.0 and log["mismatch/kl_k3"] < 1e-6  # the engine's own weights, fp32
    assert log["sglang/route_bytes"] > 0


def tampered(call: int, index: int, payload):
    """Call 0's payloads broken one way per index: 0 kept, 1 not base64, 2 not a whole row, 3 missing, 4 an id out of
    range; 5 one position of -1s and 6 one all-zero position (the engine never wrote them: per position)."""
    if call != 0 or index == 0:
        return payload
    routes = decode_sglang_routes(payload, 2, 2).copy()
    if index == 1:
        return "%%%"
    if index == 2:
        return base64.b64encode(routes.tobytes()[:-4]).decode()
    if index == 3:
        return None
    if index == 4:
        routes[0, 1, 0] = 999
    if index == 5:
        routes[1] = -1
    if index >= 6:
        routes[2] = 0
    return sglang_payload(routes)


def test_bad_payloads_fall_back_per_sample_and_never_written_positions_per_position(tmp_path):
    with FakeSGLangServer(tiny_moe_model("qwen3_moe"), tamper=tampered) as server:
        config = server.engine.model.config
        assert (config.num_hidden_layers, config.num_experts_per_tok) == (2, 2)  # what tampered() decodes
        trainer = train(tmp_path, rollout_for(server), batch_size=8)
    (batch,) = Spy.batches
    intake = trainer._route_intake
    assert len(server.routes[0]) == 8
    assert intake.fallback_samples == 4  # indices 1-4: the whole sample
    assert intake.unwritten_positions == 3  # index 5's position 1, and position 2 of 6 and 7
    for i in (1, 2, 3, 4):
        assert no_route(batch["replay_routes"][i]).all()
    replayed, _ = placed(batch, 5)
    assert no_route(replayed[1]).all() and not no_route(replayed[0]).all() and not no_route(replayed[2]).all()
    assert 0 < trainer.state.log_history[0]["routing/fallback_frac"] < 1


def test_r3_without_routes_stops_with_the_servers_flag_and_r2_trains(tmp_path):
    with FakeSGLangServer(tiny_moe_model("qwen3_moe"), return_routes=False) as server:
        with pytest.raises(Exception, match="--enable-return-routed-experts"):
            train(tmp_path / "r3", rollout_for(server))
        assert train(tmp_path / "r2", rollout_for(server), routing_replay="r2").state.global_step == 1


# ----------------------------------------------------------------------------- multi-turn
def two_turns(rollout, prompt_ids, trainer):
    """Every other sample calls a 'tool': its result (TOOL) is appended and SGLang continues the conversation."""
    first = rollout.generate(prompt_ids)
    continued = list(range(0, len(prompt_ids), 2))
    second = rollout.generate([prompt_ids[i] + first[i].token_ids + TOOL for i in continued], samples=continued)
    completion_ids, logprobs, env_mask = [], [], []
    for i, turn in enumerate(first):
        ids, values, mask = list(turn.token_ids), list(turn.logprobs), [1] * len(turn.token_ids)
        if i in continued:
            later = second[continued.index(i)]
            ids += TOOL + later.token_ids
            values += [0.0] * len(TOOL) + later.logprobs
            mask += [0] * len(TOOL) + [1] * len(later.token_ids)
        completion_ids.append(ids)
        logprobs.append(values)
        env_mask.append(mask)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs, "env_mask": env_mask}


def test_a_multi_turn_rollout_replays_each_position_from_the_first_turn_that_forwarded_it(tmp_path, server):
    trainer = train(tmp_path, rollout_for(server, conversation=two_turns))
    (batch,) = Spy.batches
    first, second = server.requests
    held = [
        len(prompt) + len(output) - 1 for prompt, output in zip(first["input_ids"], server.outputs[0], strict=True)
    ]
    continued = list(range(0, len(first["input_ids"]), 2))
    assert second["routed_experts_start_len"] == min(held[i] for i in continued)  # only what is not held yet
    start = second["routed_experts_start_len"]
    for j, i in enumerate(continued):
        replayed, _ = placed(batch, i)
        expected = np.concatenate([server.routes[0][i], server.routes[1][j][held[i] - start :]])
        assert (
            len(expected)
            == len(first["input_ids"][i]) + len(server.outputs[0][i]) + len(TOOL) + len(server.outputs[1][j]) - 1
        )  # every position of prompt + completion but the last
        assert torch.equal(replayed[: len(expected)], torch.from_numpy(expected.astype("int16")))
    assert trainer.state.log_history[0]["routing/fallback_frac"] == 0.0
