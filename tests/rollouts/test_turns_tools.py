"""R3 with TRL's tools: multi-turn rollouts replay, at every position, the route of the turn that forwarded it first."""

import json
import math
import re

import pytest
from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig
from trl_moe_replay.routing import decode_routed_experts
from trl_moe_replay.testing import (
    FakeVLLMServer,
    fake_colocated_vllm,
    scripted_generation,
    tiny_moe_model,
    tiny_tokenizer,
    trl_vllm_transport_stub,
)

from tests.route_checks import RouteCheckingTrainer, RouteOracle


MAX_COMPLETION = 240


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def div(a: int, b: int) -> float:
    """Divide two integers.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def echo(text: str) -> str:
    """Repeat a text many times.

    Args:
        text: The text.
    """
    return text * 100


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def script(prompt: str) -> str:
    """The rollout of each question, turn by turn (a turn is told by the tool responses already in the prompt)."""
    question = re.search(r"user\n(.*?)<\|im_end\|>", prompt).group(1)
    turn = prompt.count("<tool_response>")
    if question == "5+2=":  # answers at once: a single turn
        return "\\boxed{7}"
    if question == "3+4=":  # one tool call, then the answer
        return [call("add", a=3, b=4), "\\boxed{7}"][turn]
    if question == "1+1=":  # two tool calls: three turns
        return [call("add", a=1, b=1), call("add", a=2, b=0), "\\boxed{2}"][turn]
    if question == "9/0=":  # the tool raises: TRL returns the error as the tool result
        return [call("div", a=9, b=0), "\\boxed{0}"][turn]
    if question == "say":  # the tool result would not fit max_completion_length: TRL drops it, the sample ends
        return [call("echo", text="abcdefgh"), "never"][turn]
    if question == "7+7=":  # the answer after the tool runs past max_completion_length: TRL truncates it
        return [call("add", a=7, b=7), "\\boxed{14}" + "x" * 300][turn]
    if question == "twin":  # both samples of the group call the same tool alike; only one result fits (flaky)
        return [call("flaky", text="ab"), "\\boxed{1}"][turn]
    raise AssertionError(question)


QUESTIONS = ["5+2=", "3+4=", "1+1=", "9/0=", "say", "7+7="]


class Flaky:
    """A tool whose result is too long to fit on every other call: of two samples that call it alike, in TRL's order,
    the first one's result is dropped (the sample ends there) and the second one goes on."""

    calls = 0

    @classmethod
    def result(cls, text: str) -> str:
        cls.calls += 1
        return text * 200 if cls.calls % 2 else text


def flaky(text: str) -> str:
    """Repeat a text, sometimes.

    Args:
        text: The text.
    """
    return Flaky.result(text)


class Calculator:
    """An environment (TRL's environment_factory): its public methods are the tools."""

    def reset(self, **kwargs) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b

    def div(self, a: int, b: int) -> float:
        """Divide two integers.

        Args:
            a: The dividend.
            b: The divisor.
        """
        return a / b

    def echo(self, text: str) -> str:
        """Repeat a text many times.

        Args:
            text: The text.
        """
        return text * 100

    def flaky(self, text: str) -> str:
        """Repeat a text, sometimes.

        Args:
            text: The text.
        """
        return Flaky.result(text)


def tool_trainer(tmp_path, model_type="qwen3_moe", trainer_kwargs=None, questions=QUESTIONS, **overrides):
    tokenizer = tiny_tokenizer(tools=True)
    prompts = [[{"role": "user", "content": q}] for q in questions for _ in range(2)]
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=12,
        num_generations=2,
        max_completion_length=MAX_COMPLETION,
        learning_rate=1e-3,
        num_iterations=2,
        save_strategy="no",
        seed=0,
        routing_replay="r3",
    )
    settings.update(overrides)
    return RouteCheckingTrainer(
        model=tiny_moe_model(model_type, max_position_embeddings=2048),
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=MoEReplayGRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        **(trainer_kwargs or {"tools": [add, div, echo, flaky]}),
    )


def run_checked(trainer, engine_model, engine_rr):
    """Train with scripted tool rollouts on ``engine_model``, whose every generate call routes differently (its
    experts shifted by the call's index), so a later turn's prefill of a prefix never routes it like the turn that
    forwarded it first."""
    trainer.oracle = oracle = RouteOracle(engine_rr.num_layers, engine_rr.top_k)
    num_experts = engine_rr.num_experts

    def shifted(call):
        return lambda layer, router, router_input, logits, natural: (natural + call) % num_experts

    with scripted_generation(engine_model, trainer.processing_class, script):
        engine_model.generate = oracle.record_generate(
            engine_model.generate, engine_rr, trainer.processing_class.eos_token_id, steer=shifted
        )
        trainer.train()
    logs = trainer.state.log_history
    assert logs[0]["tools/call_frequency"] >= 1.0 and logs[0]["tools/failure_frequency"] > 0  # div(9, 0) raised
    assert logs[0]["routing/fallback_frac"] == 0.0
    assert trainer.forwards == 3 and trainer.checked_positions > 12 * 40  # old-logprob pass + two updates
    assert all(math.isfinite(entry.get("loss", 0.0)) for entry in logs)
    return logs


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_tool_rollouts_replay_every_position_from_the_turn_that_forwarded_it(tmp_path, model_type):
    trainer = tool_trainer(tmp_path, model_type)
    # the trainer's own RouterReplay, whose observe() sees the routes each forward used (no public handle on it)
    logs = run_checked(trainer, trainer.model, trainer._route_replay)
    assert logs[0]["mismatch/kl_k3"] < 1e-6  # fp32, replayed: the sampler's log-probs, tool tokens left out


def test_tool_rollouts_with_a_vllm_server_ask_only_for_the_routes_they_lack(tmp_path):
    with (
        FakeVLLMServer(tiny_moe_model("qwen3_moe", max_position_embeddings=2048)) as server,
        trl_vllm_transport_stub(server),
    ):
        trainer = tool_trainer(
            tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_weight_sync="trl"
        )
        run_checked(trainer, server.engine.model, server.engine.router_replay)
    first, *later = list(server.batches)
    assert first.request.get("routed_experts_prompt_start", 0) == 0
    starts = [batch.request["routed_experts_prompt_start"] for batch in later]
    assert later and all(start > 0 for start in starts)
    for batch, start in zip(later, starts, strict=True):  # rows only from the first position not yet held
        for completion, payload in zip(batch.completions, batch.payloads, strict=True):
            rows = decode_routed_experts(payload)
            assert rows.shape[0] == len(completion.prompt_ids) + len(completion.token_ids) - 1 - start
    assert min(starts) > 20  # the shared system and user prompt at least


def test_tool_rollouts_with_a_colocated_vllm(tmp_path):
    with fake_colocated_vllm(tiny_moe_model("qwen3_moe", max_position_embeddings=2048)) as llm_class:
        trainer = tool_trainer(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_weight_sync="trl")
        llm = llm_class.instances[0]
        run_checked(trainer, llm.engine.model, llm.engine.router_replay)
    starts = [request.get("routed_experts_prompt_start", 0) for request in llm.requests]
    assert starts[0] == 0 and len(starts) > 2 and all(start > 20 for start in starts[1:])


def test_environment_factory_rollouts_replay_like_tools(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = tool_trainer(tmp_path, trainer_kwargs={"environment_factory": Calculator})
    run_checked(trainer, trainer.model, trainer._route_replay)


@pytest.mark.parametrize("loop", ["tools", "environment_factory"])
def test_two_samples_with_the_same_tool_call_where_one_goes_on_replay_their_own_routes(tmp_path, loop, monkeypatch):
    """Two samples of a group write the same first turn (a tool call) and only the second goes on: TRL drops the
    first one's overlong tool result. The later turn belongs to the second sample (TRL's tool loop says which), not to
    the first one, whose sequence is a prefix of it too: under R3 the run trains, every position replays the route
    of the engine forward that produced it, and nothing falls back."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Flaky.calls = 0
    kwargs = {"environment_factory": Calculator} if loop == "environment_factory" else None
    trainer = tool_trainer(tmp_path, trainer_kwargs=kwargs, questions=["twin", *QUESTIONS[1:]])
    run_checked(trainer, trainer.model, trainer._route_replay)
    assert Flaky.calls == 2  # once per sample of the group: the first result dropped, the second kept
