"""One entry point from engine rows to replayed routes (issue 21): every source -- vLLM server and colocate,
``rollout_func``, transformers ``generate``, the ``audit`` command -- reaches ``RouteIntake.align``, which applies
the per-sample fallback, its warning and metric, and the first-batch rule. The fuzz of the package's 16 corruptions
runs through each source: no single sample ends a run, and ``routing/fallback_frac`` is exactly the bad samples'
share of positions, plus one position per never-written route (issue 45: those fall back per position)."""

import ast
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import trl_moe_replay
from trl_moe_replay.rollouts import RoutesUnavailableError
from trl_moe_replay.rollouts.route_intake import RouteIntake
from trl_moe_replay.rollouts.turns import RolloutTurns
from trl_moe_replay.routing import RouteLayout, encode_routed_experts
from trl_moe_replay.routing.codec import EngineTurn
from trl_moe_replay.testing import (
    CORRUPTIONS,
    NEVER_WRITTEN,
    RouteFuzzer,
    TransformersEngine,
    fake_colocated_vllm,
    tiny_moe_model,
)

from tests.helpers import no_route
from tests.rollouts.test_route_intake_rollout_func import EngineRollout, Spy as RolloutSpy, train as train_with_rollout
from tests.rollouts.test_vllm_routes import BatchSpy, restored_environ  # noqa: F401 - a fixture
from tests.trainer.test_grpo_trainer import logged, make_trainer


PACKAGE = Path(trl_moe_replay.__file__).parent
MODEL = dict(num_hidden_layers=3, mlp_only_layers=[0])  # layer 0 dense: zeros in the engine's rows


# ----------------------------------------------------------------------------- no path around the intake
def _calls_to(name: str) -> dict[str, int]:
    """``{module path: number of calls}`` of the function ``name`` (called by name or as an attribute)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if called == name:
                    key = str(path.relative_to(PACKAGE))
                    found[key] = found.get(key, 0) + 1
    return found


def test_only_the_route_intake_aligns_engine_rows():
    # routes_from_engine (and its per-sample helpers) is called in exactly one place in the package: RouteIntake
    assert _calls_to("routes_from_engine") == {"routing/codec.py": 1}  # inside checked_routes_from_engine
    assert _calls_to("checked_routes_from_engine") == {"rollouts/route_intake.py": 1}
    for helper in ("_place_turns", "_sample_rows"):
        assert set(_calls_to(helper)) == {"routing/codec.py"}, helper
    # and every engine's rows are handed to the intake: the trainer (vLLM, colocate, rollout_func, generate) and
    # the audit command, and the async trainer (rows its rollout worker carried through TRL's queue)
    sources = {"trainer/grpo_trainer.py", "async_grpo/async_grpo_trainer.py", "cli/audit.py"}
    assert set(_calls_to("align")) >= sources
    assert set(_calls_to("RouteIntake")) == sources


def test_the_intake_counts_warns_and_applies_the_first_batch_rule(caplog):
    layout = (RouteLayout(num_layers=1, top_k=2, num_experts=4, moe_layers=(0,)),)  # align(samples, layout, ...)
    widths = dict(prompt_lengths=[2, 2, 2], completion_lengths=[2, 2, 2], prompt_width=2, completion_width=2)
    good = np.array([[[0, 1]], [[2, 3]], [[1, 2]]], dtype=np.uint8)
    bad = good[:, :, :1]  # top-1 rows for a top-2 model
    intake = RouteIntake(None, source="test engine", required=True, remedy="Check the engine.")
    with pytest.raises(RoutesUnavailableError, match="no route test engine returned .* top-2.* Check the engine"):
        intake.align([[EngineTurn(bad, 2, 2)]] * 3, *layout, **widths)
    with caplog.at_level(logging.WARNING):
        routes = intake.align(
            [[EngineTurn(good, 2, 2)], [EngineTurn(None, 2, 2)], [EngineTurn(bad, 2, 2)]], *layout, **widths
        ).tensor()  # after the first batch: one missing, one malformed sample fall back
    assert no_route(routes[1:]).all() and not no_route(routes[0, :3]).any()
    assert intake.fallback_samples == 2  # the first batch raised: nothing trained on it
    assert "2 of 3 samples on this rank have no usable test engine routes (1 missing, 1 malformed)" in caplog.text
    # a multi-turn sample failing in two turns is one malformed sample
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        intake.align(
            [[EngineTurn(bad, 2, 1), EngineTurn(bad, 3, 1)]] + [[EngineTurn(good, 2, 2)]] * 2, *layout, **widths
        )
    assert "1 of 3 samples" in caplog.text and "(0 missing, 1 malformed)" in caplog.text


def test_never_written_positions_fall_back_alone_and_a_sample_counts_whole_only_without_any_turn(caplog):
    """Issue 45: a never-written position costs that position; the first-batch rule and routing/fallback_samples_frac
    count a sample as fallen back only when none of its turns could be placed."""
    layout = (RouteLayout(num_layers=1, top_k=2, num_experts=4, moe_layers=(0,)),)
    widths = dict(prompt_lengths=[2, 2, 2], completion_lengths=[2, 2, 2], prompt_width=2, completion_width=2)
    good = np.array([[[0, 1]], [[2, 3]], [[1, 2]]], dtype=np.uint8)
    holed = good.copy()
    holed[1] = 0  # vLLM never wrote position 1
    intake = RouteIntake(None, source="test engine", required=True, remedy="Check the engine.")
    with caplog.at_level(logging.WARNING):  # a first batch of holed samples has routes to replay: no error
        routes = intake.align([[EngineTurn(holed, 2, 2)]] * 3, *layout, **widths).tensor()
    assert no_route(routes[:, 1]).all() and not no_route(routes[:, [0, 2]]).any()
    assert intake.fallback_samples == 0 and intake.unwritten_positions == 3
    assert "3 positions in 3 of 3 samples on this rank were never written by test engine" in caplog.text
    assert "first: sample 0, position 1" in caplog.text
    sums = intake.take_sample_sums()
    assert (sums["fallback_samples"].item(), sums["samples"].item()) == (0, 3)
    # every row never written: nothing to replay, the sample falls back whole; a multi-turn sample with one good turn
    # is replayed there (a partial loss, not a fallen-back sample)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        routes = intake.align(
            [
                [EngineTurn(np.zeros_like(good), 2, 2)],
                [EngineTurn(good[:, :, :1], 2, 1), EngineTurn(good, 2, 2)],
                [EngineTurn(good, 2, 2)],
            ],
            *layout,
            **widths,
        ).tensor()
    assert no_route(routes[0]).all() and not no_route(routes[1:, :3]).any()
    assert (
        intake.fallback_samples == 1 and "1 of 3 samples" in caplog.text and "(0 missing, 1 malformed)" in caplog.text
    )
    assert "1 more lost the routes of some of their turns" in caplog.text
    sums = intake.take_sample_sums()
    assert (sums["fallback_samples"].item(), sums["samples"].item()) == (1, 3)
    # a first batch whose every sample is wholly unwritten has nothing that fits: the first-batch rule stands
    with pytest.raises(RoutesUnavailableError, match="all-zero top-2 route .* no route is left to replay"):
        RouteIntake(None, source="test engine", required=True).align(
            [[EngineTurn(np.zeros_like(good), 2, 2)]] * 3, *layout, **widths
        )


# ----------------------------------------------------------------------------- rollout_func
class FuzzedRollout:
    """A rollout_func sampling with its own engine, whose route payloads go through ``fuzzer`` and whose per-sample
    ``routed_experts_prompt_start`` is broken for some samples (negative, a float, a string, past the prompt)."""

    BAD_STARTS = (-1, 1.5, "0", 10_000, None)

    def __init__(self, fuzzer: RouteFuzzer, seed: int = 0):
        self.engine = TransformersEngine(tiny_moe_model("qwen3_moe", **MODEL))
        self.fuzzer = fuzzer
        self.rng = np.random.default_rng(seed)
        self.bad_starts: dict[tuple[int, int], object] = {}
        self.calls = 0

    def __call__(self, prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        completions = [group[0] for group in self.engine.generate(prompt_ids, n=1, max_tokens=6)]
        payloads, starts = [], []
        for choice, completion in enumerate(completions):
            payloads.append(self.fuzzer(self.calls, choice, encode_routed_experts(completion.routed_experts)))
            start = np.int64(0)  # a numpy integer is an integer
            if (self.calls, choice) not in self.fuzzer.corrupted and choice and self.rng.random() < 0.15:
                start = self.BAD_STARTS[int(self.rng.integers(len(self.BAD_STARTS)))]
                self.bad_starts[self.calls, choice] = start
            starts.append(start)
        self.calls += 1
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [c.token_ids for c in completions],
            "logprobs": [c.logprobs for c in completions],
            "routed_experts": payloads,
            "routed_experts_prompt_start": starts,
        }

    def bad(self, call: int) -> list[int]:
        """The samples of ``call`` that fall back whole."""
        return sorted({*self.fuzzer.whole(call), *(c for (k, c) in self.bad_starts if k == call)})


def expected_fallback(batch, bad: list[int], unwritten: list[int] = ()) -> float:
    """The share of routable positions of ``bad`` samples, and one for each ``unwritten`` one."""
    routable = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1) - 1).float()
    return ((routable[bad].sum() + len(unwritten)) / routable.sum()).item()


def test_fuzzed_rollout_func_routes_never_end_the_run_and_fallback_frac_is_exact(tmp_path, caplog):
    fuzzer = RouteFuzzer(seed=7, num_experts=8, moe_layers=[1, 2], rate=0.5)
    rollout = FuzzedRollout(fuzzer)
    RolloutSpy.batches = []
    with caplog.at_level(logging.WARNING, logger="trl_moe_replay.rollouts.route_intake"):
        trainer = make_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe", **MODEL),
            cls=RolloutSpy,
            max_steps=4,
            per_device_train_batch_size=16,
            trainer_kwargs={"rollout_func": rollout},
        )
        trainer.train()
    assert trainer.state.global_step == 4  # no single sample ended the run
    assert set(fuzzer.corrupted.values()) == set(CORRUPTIONS), fuzzer.corrupted
    assert {type(v) for v in rollout.bad_starts.values()} >= {int, float, str}
    expected = []
    for call, batch in enumerate(RolloutSpy.batches):
        bad = rollout.bad(call)
        assert no_route(batch["replay_routes"][bad]).all()
        good = [i for i in range(len(batch["replay_routes"])) if i not in bad]
        assert not no_route(batch["replay_routes"][good][:, -batch["completion_ids"].shape[1] :, 1:]).all()
        expected.append(expected_fallback(batch, bad, fuzzer.unwritten(call)))
    assert 0 < min(expected) and logged(trainer, "routing/fallback_frac") == pytest.approx(expected, abs=1e-6)
    assert any(fuzzer.unwritten(call) for call in range(rollout.calls))
    assert trainer._route_intake.fallback_samples == sum(len(rollout.bad(call)) for call in range(rollout.calls))
    assert "have no usable rollout_func routes" in caplog.text and "first problem: sample" in caplog.text


def test_a_numpy_integer_prompt_start_is_an_integer(tmp_path):
    trainer = train_with_rollout(tmp_path / "np", EngineRollout(prompt_start=np.int64(2)))
    reference = train_with_rollout(tmp_path / "int", EngineRollout(prompt_start=2))
    assert trainer.state.log_history[0]["routing/fallback_frac"] == pytest.approx(
        reference.state.log_history[0]["routing/fallback_frac"]
    )
    assert 0 < trainer.state.log_history[0]["routing/fallback_frac"] < 1
    turns = RolloutTurns([[1, 2, 3]] * 2, [[4]] * 2, [None] * 2, np.array([0, 1]))
    assert [turn[0].prompt_start for turn in turns.turns] == [0, 1]
    with pytest.raises(ValueError, match="routed_experts_prompt_start has 3 entries for 2 samples"):
        RolloutTurns([[1, 2, 3]] * 2, [[4]] * 2, [None] * 2, [0, 0, 0])


class MisfitRollout(EngineRollout):
    """Every sample's routes are top-1, for a top-2 model: another checkpoint than the trainer's."""

    def __call__(self, prompts, trainer):
        output = super().__call__(prompts, trainer)
        output["routed_experts"] = [
            encode_routed_experts(np.ascontiguousarray(rows[:, :, :1])) for rows in self.returned[-1]
        ]
        return output


def test_a_first_rollout_func_batch_without_a_fitting_route_stops_r3_like_vllm(tmp_path):
    with pytest.raises(
        RoutesUnavailableError,
        match="no route rollout_func returned for the first batch fits .*"
        "rollout_func's engine serve the same checkpoint",
    ):
        train_with_rollout(tmp_path / "r3", MisfitRollout())
    # R2 does not need them: the batch falls back with a warning and trains on
    trainer = train_with_rollout(tmp_path / "r2", MisfitRollout(), routing_replay="r2")
    assert trainer.state.global_step == 1 and trainer.state.log_history[0]["routing/fallback_frac"] == 1.0


@pytest.mark.parametrize("rows", ["abc", 7, {"routed_experts": []}], ids=["str", "int", "dict"])
def test_routed_experts_that_are_no_list_stop_with_one_message(tmp_path, rows):
    class Broken(EngineRollout):
        def __call__(self, prompts, trainer):
            return {**super().__call__(prompts, trainer), "routed_experts": rows}

    with pytest.raises(RoutesUnavailableError, match="return a list with one entry per completion"):
        train_with_rollout(tmp_path, Broken())


# ----------------------------------------------------------------------------- colocate
def test_fuzzed_colocated_routes_never_end_the_run_and_fallback_frac_is_exact(
    tmp_path,
    restored_environ,  # noqa: F811 - the fixture
):
    fuzzer = RouteFuzzer(seed=11, num_experts=8, moe_layers=[1, 2], rate=0.6)
    with fake_colocated_vllm(tiny_moe_model("qwen3_moe", **MODEL), tamper=fuzzer):
        trainer = make_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe", **MODEL),
            cls=BatchSpy,
            use_vllm=True,
            vllm_mode="colocate",
            vllm_weight_sync="trl",
            max_steps=4,
            per_device_train_batch_size=16,
        )
        trainer.train()
    assert trainer.state.global_step == 4
    assert set(fuzzer.corrupted.values()) == set(CORRUPTIONS), fuzzer.corrupted
    expected = []
    for call, batch in enumerate(trainer.batches):
        bad = fuzzer.whole(call)
        assert no_route(batch["replay_routes"][bad]).all()
        expected.append(expected_fallback(batch, bad, fuzzer.unwritten(call)))
    assert logged(trainer, "routing/fallback_frac") == pytest.approx(expected, abs=1e-6)
    assert logged(trainer, "routing/mismatch_frac") == [0.0] * 4  # the good samples replayed the engine's routes
    assert trainer._route_intake.fallback_samples == sum(len(fuzzer.whole(call)) for call in range(4))
    assert (
        sum(kind == NEVER_WRITTEN for kind in fuzzer.corrupted.values()) == trainer._route_intake.unwritten_positions
    )


# ----------------------------------------------------------------------------- transformers generate
def stub_generate(input_ids, attention_mask=None, **kwargs):
    """``model.generate`` replaced as TRL's own tests do: fixed tokens, no forward pass."""
    return torch.cat([input_ids, torch.full((input_ids.shape[0], 3), 7, dtype=input_ids.dtype)], dim=1)


def test_a_generate_stub_without_forwards_is_a_clear_error_under_r3(tmp_path):
    trainer = make_trainer(tmp_path / "r3", tiny_moe_model("qwen3_moe"), max_steps=1)
    trainer.model.generate = stub_generate
    with pytest.raises(
        RoutesUnavailableError,
        match="no route transformers generate returned .* no sample here came with routes.*replaced model.generate",
    ):
        trainer.train()
    # R2 replays its own old-pass routes: the stub is fine, the generation rows fall back (counted)
    trainer = make_trainer(
        tmp_path / "r2",
        tiny_moe_model("qwen3_moe"),
        max_steps=1,
        routing_replay="r2",
        transformers_importance_sampling_correction=False,
    )
    trainer.model.generate = stub_generate
    trainer.train()
    assert trainer.state.global_step == 1 and logged(trainer, "routing/fallback_frac") == [1.0]
