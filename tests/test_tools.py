"""R3 with TRL's tools: multi-turn rollouts replay, at every position, the route of the turn that forwarded it first."""

import json
import math
import re

import pytest
import torch
from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.routing import RouterReplay, decode_routed_experts
from trl_moe_replay.testing import scripted_generation, tiny_moe_model, tiny_tokenizer
from trl_moe_replay.testing_vllm import FakeVLLMServer, fake_colocated_vllm, trl_vllm_transport_stub

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
    raise AssertionError(question)


QUESTIONS = ["5+2=", "3+4=", "1+1=", "9/0=", "say", "7+7="]


class RouteOracle:
    """The experts generate actually used, by token prefix: the route of position j of a sequence s depends on
    s[: j + 1] only; the first forward of a prefix is kept (a later turn's prefill never replaces it)."""

    def __init__(self, model, eos_token_id: int):
        self.eos_token_id = eos_token_id
        self.routes: dict[tuple[int, ...], torch.Tensor] = {}
        self.rr = RouterReplay(model)

    def record(self, generate, steering_rr: RouterReplay):
        """Wrap ``generate``; each call routes differently (its experts shifted by the call's index), so a later
        turn's prefill of a prefix never routes it like the turn that forwarded it first."""
        calls = iter(range(1_000))

        def recorded(*args, **kwargs):
            shift = next(calls)
            num_experts = steering_rr.num_experts

            def shifted(layer, router, router_input, logits, natural):
                return (natural + shift) % num_experts

            with steering_rr.steer(shifted), self.rr.record() as rec:
                out = generate(*args, **kwargs)
            mask = kwargs["attention_mask"]
            width = mask.shape[1]
            eos = self.eos_token_id
            for row, row_mask, routes in zip(out, mask, rec.routes, strict=True):
                start = width - int(row_mask.sum())
                completion = row[width:].tolist()
                end = completion.index(eos) + 1 if eos in completion else len(completion)  # TRL cuts at the EOS
                tokens = row[start : width + end].tolist()
                # the final sampled token is never forwarded for this sample (a batch's finished rows keep being fed
                # EOS/padding by generate, but no engine forwards a finished sequence)
                for j in range(len(tokens) - 1):
                    self.routes.setdefault(tuple(tokens[: j + 1]), routes[start + j])
            return out

        return recorded

    def expected(self, input_ids, attention_mask):
        """[B, S, L, K] expected routes for a forward's input (-1 where no generate forwarded the prefix)."""
        batch, seq = input_ids.shape
        out = torch.full((batch, seq, self.rr.num_layers, self.rr.top_k), -1, dtype=torch.int16)
        for i in range(batch):
            start = int((attention_mask[i].cumsum(0) == 0).sum())
            tokens = input_ids[i, start:][attention_mask[i, start:].bool()].tolist()
            for j in range(len(tokens)):
                route = self.routes.get(tuple(tokens[: j + 1]))
                if route is not None:
                    out[i, start + j] = route
        return out


class CheckedTrainer(MoEReplayGRPOTrainer):
    """Compares the experts every scoring and training forward actually used with the oracle, token by token."""

    oracle: RouteOracle
    checked_positions = 0
    forwards = 0

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        used: dict[int, list[torch.Tensor]] = {}
        with self._route_replay.observe(lambda call: used.setdefault(call.layer, []).append(call.used.detach())):
            result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                                *args, **kwargs)
        expected = self.oracle.expected(input_ids.cpu(), attention_mask.cpu())
        # every real position except each sequence's last one was forwarded by some turn (the last one too when TRL
        # truncated the sample: the engine went on generating, but that position scores no token)
        last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).int().argmax(-1)
        scored = attention_mask.bool().cpu().clone()
        scored[torch.arange(scored.shape[0]), last.cpu()] = False
        assert (expected[scored] >= 0).all()
        for layer, calls in used.items():
            ids = torch.cat(calls).view(input_ids.shape[0], input_ids.shape[1], -1).cpu()
            got, want = ids.sort(-1).values[scored], expected[:, :, layer].long().sort(-1).values[scored]
            assert torch.equal(got, want), f"layer {layer}: experts used differ from the engine's"
        has_route = scored
        self.checked_positions += int(has_route.sum())
        self.forwards += 1
        return result


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


def tool_trainer(tmp_path, model_type="qwen3_moe", trainer_kwargs=None, **overrides):
    tokenizer = tiny_tokenizer(tools=True)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS for _ in range(2)]
    settings = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=2, logging_steps=1,
        per_device_train_batch_size=12, num_generations=2, max_completion_length=MAX_COMPLETION, learning_rate=1e-3,
        num_iterations=2, save_strategy="no", seed=0, routing_replay="r3",
    )
    settings.update(overrides)
    return CheckedTrainer(
        model=tiny_moe_model(model_type, max_position_embeddings=2048),
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=MoEReplayGRPOConfig(**settings), train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer, **(trainer_kwargs or {"tools": [add, div, echo]}),
    )


def run_checked(trainer, engine_model, engine_rr):
    """Train with scripted tool rollouts on ``engine_model``, whose every generate call routes differently."""
    trainer.oracle = oracle = RouteOracle(engine_model, trainer.processing_class.eos_token_id)
    with scripted_generation(engine_model, trainer.processing_class, script):
        engine_model.generate = oracle.record(engine_model.generate, engine_rr)
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
    logs = run_checked(trainer, trainer.model, trainer._route_replay)
    assert logs[0]["mismatch/kl_k3"] < 1e-6  # fp32, replayed: the sampler's log-probs, tool tokens left out


def test_tool_rollouts_with_a_vllm_server_ask_only_for_the_routes_they_lack(tmp_path):
    with FakeVLLMServer(tiny_moe_model("qwen3_moe", max_position_embeddings=2048)) as server, \
            trl_vllm_transport_stub(server):
        trainer = tool_trainer(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url)
        run_checked(trainer, server.engine.model, server.engine.router_replay)
    first, *later = [batch for batch in server.batches]
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
        trainer = tool_trainer(tmp_path, use_vllm=True, vllm_mode="colocate")
        llm = llm_class.instances[0]
        run_checked(trainer, llm.engine.model, llm.engine.router_replay)
    starts = [request.get("routed_experts_prompt_start", 0) for request in llm.requests]
    assert starts[0] == 0 and len(starts) > 2 and all(start > 20 for start in starts[1:])


def test_environment_factory_rollouts_replay_like_tools(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = tool_trainer(tmp_path, trainer_kwargs={"environment_factory": Calculator})
    run_checked(trainer, trainer.model, trainer._route_replay)
