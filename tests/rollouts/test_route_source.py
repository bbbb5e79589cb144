"""The route-source interface: every engine implements it, the trainers reach engine rows only through it, and the
rollout_func source takes its fields out whether or not the trainer keeps them."""

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trl_moe_replay.async_grpo.async_rollout_worker import RoutedAsyncRolloutWorker, SampleRoutes
from trl_moe_replay.rollouts.hf_generate import TransformersRouteSource
from trl_moe_replay.rollouts.rollout_func import RolloutFuncFields, RolloutFuncRoutes
from trl_moe_replay.rollouts.route_choice import sync_trainer_engine_classes, sync_trainer_route_source
from trl_moe_replay.rollouts.route_intake import RoutesUnavailableError
from trl_moe_replay.rollouts.route_source import RouteSourceProtocol, TurnRequest, TurnRows
from trl_moe_replay.rollouts.sglang_routes import SGLangRollout
from trl_moe_replay.rollouts.vllm_routes import VLLMRouteSource, llm_returning_routes


ROOT = Path(__file__).resolve().parents[2]
TRAINERS = [ROOT / "trl_moe_replay/trainer/grpo_trainer.py", ROOT / "trl_moe_replay/async_grpo/async_grpo_trainer.py"]
SOURCES = [
    VLLMRouteSource,
    TransformersRouteSource,
    RolloutFuncFields,
    RolloutFuncRoutes,
    SGLangRollout,
    SampleRoutes,
    RoutedAsyncRolloutWorker,
]


@pytest.mark.parametrize("source", SOURCES, ids=lambda cls: cls.__name__)
def test_every_engine_implements_the_interface(source):
    instance = object.__new__(source)  # the protocol's members are the class's: no engine needed
    if source is RolloutFuncRoutes:
        instance.name, instance.remedy = "x", "y"  # set from its rollout part in __init__
    assert isinstance(instance, RouteSourceProtocol)
    for name in ("generate_turn", "rollout_turns", "take_metrics"):
        ours, theirs = inspect.signature(getattr(source, name)), inspect.signature(getattr(RouteSourceProtocol, name))
        assert list(ours.parameters) == list(theirs.parameters), (source.__name__, name)


def names_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | {
        node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
    }


def test_the_trainers_reach_engine_rows_only_through_the_interface():
    """No trainer names an engine's route class or request field, nor asks ``use_vllm`` on the route path."""
    engine_names = {
        "VLLMRouteSource",
        "TransformersRolloutRecorder",
        "local_rows",
        "vllm_request_fields",
        "llm_returning_routes",
        "request_prompt_start",
        "take_received_bytes",
        "RolloutTurns",
        "SGLangRollout",
        "decode_sglang_routes",
    }
    for path in TRAINERS:
        assert names_in(path) & engine_names == set(), path.name
        tree = ast.parse(path.read_text())
        strings = {
            node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }
        assert {"routed_experts", "routed_experts_prompt_start"} & strings == set(), path.name  # read by their sources
        route_path = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            and node.name
            in (
                "_generate_single_turn",
                "_build_route_source",
                "_build_route_intake",
                "_align_sample",
                "_route_source",
            )
        ]
        assert route_path, path.name
        for node in route_path:
            assert "use_vllm" not in ast.unparse(node), (path.name, node.name)


def test_the_sync_trainers_choice_of_source():
    vllm = SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    plain = SimpleNamespace(use_vllm=False, vllm_mode="server")
    recorder = TransformersRouteSource(None, lambda: None, 1.0, 0, return_logprobs=False)
    assert sync_trainer_route_source(plain, keep_routes=True, required=True, generate_source=recorder) is recorder
    assert sync_trainer_route_source(vllm, keep_routes=False, required=False, generate_source=recorder) is None
    wrapped = sync_trainer_route_source(
        plain, keep_routes=True, required=True, generate_source=recorder, rollout_func=lambda prompts, trainer: {}
    )
    assert isinstance(wrapped, RolloutFuncRoutes) and wrapped.turns is recorder and wrapped.name == "rollout_func"
    sglang = SGLangRollout("http://x", num_layers=2, top_k=2)
    own = sync_trainer_route_source(plain, keep_routes=True, required=True, rollout_func=sglang)
    assert own.rollouts is sglang and own.name == "SGLang"
    assert sync_trainer_engine_classes(vllm, keep_routes=True) == {"LLM": llm_returning_routes}
    assert (
        sync_trainer_engine_classes(vllm, keep_routes=False)
        == {}
        == sync_trainer_engine_classes(plain, keep_routes=True)
    )


def test_a_rollout_funcs_fields_are_taken_out_whether_kept_or_not():
    rows = [np.zeros((3, 2, 2), np.uint8)]
    for keep in (True, False):
        source = RolloutFuncRoutes(RolloutFuncFields(), None, keep=keep, required=False)
        fields = {"routed_experts": list(rows), "routed_experts_prompt_start": 0, "difficulty": [1.0]}
        turns = source.rollout_turns([[1, 2]], [[3, 4]], fields)
        assert fields == {"difficulty": [1.0]}  # the reward functions see only their own fields
        assert (turns is not None) is keep
    required = RolloutFuncRoutes(RolloutFuncFields(), None, keep=True, required=True)
    with pytest.raises(RoutesUnavailableError, match="output\\['routed_experts'\\]"):
        required.rollout_turns([[1]], [[2]], {})


def test_a_rollout_funcs_later_tool_turns_go_to_the_trainers_turn_engine():
    class Turns:
        def generate_turn(self, request, generate):
            return generate(), TurnRows(["rows"], 3)

        def take_metrics(self):
            return {"engine/bytes": 2.0}

    source = RolloutFuncRoutes(RolloutFuncFields(), Turns(), keep=True, required=False)
    output, turn = source.generate_turn(TurnRequest([[1]], later_turn=True, held=3), lambda: ([[2]], None))
    assert output == ([[2]], None) and turn == TurnRows(["rows"], 3)
    assert source.take_metrics() == {"engine/bytes": 2.0}
    alone = RolloutFuncRoutes(RolloutFuncFields(), None, keep=True, required=False)
    assert alone.generate_turn(TurnRequest([[1]]), lambda: ([[2]], None)) == (([[2]], None), TurnRows())
