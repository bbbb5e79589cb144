"""R3 with a custom ``rollout_func`` that returns the engine's routes in vLLM's layout."""

import pytest
import torch
from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.rollouts import RoutesUnavailableError
from trl_moe_replay.routing import encode_routed_experts
from trl_moe_replay.testing import TransformersEngine, tiny_moe_model, tiny_tokenizer

from tests.helpers import no_route, with_routes


class EngineRollout:
    """A rollout_func sampling with its own engine (a copy of the policy), returning vLLM-layout routes."""

    def __init__(self, encode: bool = True, prompt_start: int = 0, with_routes: bool = True):
        self.engine = TransformersEngine(tiny_moe_model("qwen3_moe"))
        self.encode, self.prompt_start, self.with_routes = encode, prompt_start, with_routes
        self.returned: list[list] = []

    def __call__(self, prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        completions = [group[0] for group in self.engine.generate(prompt_ids, n=1, max_tokens=6)]
        rows = [c.routed_experts[self.prompt_start :] for c in completions]
        self.returned.append(rows)
        output = {
            "prompt_ids": prompt_ids,
            "completion_ids": [c.token_ids for c in completions],
            "logprobs": [c.logprobs for c in completions],
            "difficulty": [1.0] * len(prompts),  # an extra field the reward function receives
        }
        if self.with_routes:
            output["routed_experts"] = [encode_routed_experts(r) if self.encode else r for r in rows]
            if self.prompt_start:
                output["routed_experts_prompt_start"] = self.prompt_start
        return output


class Spy(MoEReplayGRPOTrainer):
    batches: list

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        type(self).batches.append(with_routes(self, output))
        return output


def reward_len(completions, difficulty, **kwargs):
    assert "routed_experts" not in kwargs and "routed_experts_prompt_start" not in kwargs  # taken out for replay
    return [-abs(6 - len(c)) * d for c, d in zip(completions, difficulty, strict=True)]


def train(tmp_path, rollout, routing_replay="r3"):
    Spy.batches = []
    args = MoEReplayGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        logging_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
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


@pytest.mark.parametrize("encode", [True, False], ids=["base64", "arrays"])
def test_routes_a_rollout_func_returns_are_replayed_where_they_belong(tmp_path, encode):
    rollout = EngineRollout(encode=encode)
    trainer = train(tmp_path, rollout)
    (batch,) = Spy.batches
    replayed, prompt_width = batch["replay_routes"], batch["prompt_ids"].shape[1]
    for i, rows in enumerate(rollout.returned[0]):
        start = prompt_width - int(batch["prompt_mask"][i].sum())
        assert torch.equal(replayed[i, start : start + len(rows)], torch.from_numpy(rows.astype("int16")))
        assert no_route(replayed[i, :start]).all() and no_route(replayed[i, start + len(rows) :]).all()
    log = trainer.state.log_history[0]
    assert log["routing/fallback_frac"] == 0.0 and log["mismatch/kl_k3"] < 1e-6  # the engine's own weights, fp32


def test_a_prompt_start_leaves_the_skipped_prefix_to_the_trainer(tmp_path):
    trainer = train(tmp_path, EngineRollout(prompt_start=2))
    (batch,) = Spy.batches
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    routable = attention.sum(-1) - 1  # every real position but the last
    expected = (2 * len(routable)) / routable.sum().item()  # two unrouted prompt positions per sample
    assert trainer.state.log_history[0]["routing/fallback_frac"] == pytest.approx(expected)


def test_r3_needs_the_routes_and_r2_does_not(tmp_path):
    with pytest.raises(RoutesUnavailableError, match="output\\['routed_experts'\\]"):
        train(tmp_path / "r3", EngineRollout(with_routes=False))
    trainer = train(tmp_path / "r2", EngineRollout(with_routes=False), routing_replay="r2")
    assert trainer.state.global_step == 1
