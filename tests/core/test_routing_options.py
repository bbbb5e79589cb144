"""The routing options both trainers share: declared once, resolved alike, and the mode a type (core/routing_options.py)."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
from transformers import HfArgumentParser

import trl_moe_replay
from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayGRPOConfig
from trl_moe_replay.core.routing_options import (
    ASYNC_TRAINER,
    MODES,
    SYNC_TRAINER,
    ReplayMode,
    ReplaySettings,
    RouteSource,
    RoutingOptions,
    resolve_weight_sync,
)


PACKAGE = Path(trl_moe_replay.__file__).parent
BASE = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none")


def test_both_configs_declare_the_shared_options_once():
    shared = {field.name: field for field in dataclasses.fields(RoutingOptions)}
    for config in (MoEReplayGRPOConfig, MoEReplayAsyncGRPOConfig):
        fields = {field.name: field for field in dataclasses.fields(config)}
        for name, declared in shared.items():
            assert fields[name].default == declared.default, (config.__name__, name)
            assert fields[name].metadata["help"] == declared.metadata["help"], (config.__name__, name)


@pytest.mark.parametrize("mode", ["none", "r3"])
@pytest.mark.parametrize("metrics", [None, True, False])
def test_both_configs_resolve_every_shared_option_alike(mode, metrics):
    values = dict(BASE, routing_replay=mode, routing_metrics=metrics, extreme_token_threshold=3.0)
    sync_config = MoEReplayGRPOConfig(**values, use_vllm=True)  # a vLLM engine, as the async trainer always has
    async_config = MoEReplayAsyncGRPOConfig(**values)
    sync = ReplaySettings.from_args(sync_config)
    asynchronous = ReplaySettings.from_args(async_config, ASYNC_TRAINER)
    for name in ("mode", "routing_metrics", "extreme_token_threshold", "carries_routes", "vllm_sync_check"):
        assert getattr(sync, name) == getattr(asynchronous, name), name
    assert sync.vllm_sync_check == sync.carries_routes  # the engine sync check wherever routes are carried
    assert sync_config.vllm_sync_check == async_config.vllm_sync_check  # and the configs store the same value
    # vllm_weight_sync="auto" on this CPU: the one documented difference (docs/async.md) is plain TRL's sync trainer,
    # which keeps TRL's own sync; TRL's async trainer has none off CUDA
    weight_sync = (
        resolve_weight_sync(sync_config, sync.mode, sync.routing_metrics, SYNC_TRAINER),
        resolve_weight_sync(async_config, asynchronous.mode, asynchronous.routing_metrics, ASYNC_TRAINER),
    )
    assert weight_sync == (("reload", "reload") if sync.carries_routes else ("trl", "reload"))


def test_a_mode_is_a_str_enum_in_python_yaml_cli_and_json(tmp_path):
    config = MoEReplayGRPOConfig(**dict(BASE, routing_replay="r2"))
    assert config.routing_replay is ReplayMode.R2 and config.routing_replay == "r2"
    assert (
        type(config.to_dict()["routing_replay"]) is str
        and json.loads(config.to_json_string())["routing_replay"] == "r2"
    )
    (parsed,) = HfArgumentParser(MoEReplayGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--routing_replay", "pr2"]
    )
    assert parsed.routing_replay is ReplayMode.PR2
    path = tmp_path / "config.yaml"
    path.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nrouting_replay: none\n")
    (from_yaml,) = HfArgumentParser(MoEReplayGRPOConfig).parse_yaml_file(str(path))
    assert from_yaml.routing_replay is ReplayMode.NONE
    assert f"{ReplayMode.R3}" == "r3" and repr(ReplayMode.R3) == "'r3'"  # messages read as the user wrote it


def test_what_a_mode_implies_lives_with_the_mode():
    assert [m.source for m in ReplayMode] == [None, RouteSource.OLD_PASS, RouteSource.ENGINE, RouteSource.PREDICTED]
    assert [m for m in ReplayMode if m.async_trainer_accepts] == [ReplayMode.NONE, ReplayMode.R3]
    assert [m for m in ReplayMode if m.needs_engine_routes] == [ReplayMode.R3]
    assert [m for m in ReplayMode if m.records_old_pass] == [ReplayMode.R2, ReplayMode.PR2]
    with pytest.raises(ValueError, match="routing_replay must be one of"):
        ReplayMode.parse("r4")
    with pytest.raises(ValueError, match="old-policy forward"):
        ReplayMode.parse("r2", ASYNC_TRAINER)


def _mode_comparisons(path: Path) -> list[str]:
    """``x == "r3"``, ``x in ("r2", "pr2")``, ``mode != "none"`` and the like in ``path`` ("none" alone is a mode only
    next to a name that says so: ``scale_rewards == "none"`` is not one)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        about_modes = any(word in ast.unparse(node.left) for word in ("replay", "mode"))
        for operand in node.comparators:
            constants = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            values = {c.value for c in constants if isinstance(c, ast.Constant) and c.value in MODES}
            if values - {"none"} or (values and about_modes):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_mode_is_compared_as_a_string_outside_its_definition():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "routing_options.py"
        for hit in _mode_comparisons(path)
    ]
    assert found == []


def test_a_plain_trl_config_reads_the_declared_defaults():
    """``option`` falls back to the default the config declares (RoutingOptions', and MoEReplayGRPOConfig's own
    fields), for a plain TRL config that lacks the field; our config's own value wins."""
    from trl import GRPOConfig

    from trl_moe_replay.core.routing_options import option

    plain = GRPOConfig(**BASE)
    declared = {f.name: f.default for f in dataclasses.fields(MoEReplayGRPOConfig)}
    for name in (
        "replay_reference_model",
        "transformers_importance_sampling_correction",
        "pr2_lr_multiplier",
        "pr2_cached_tokens_per_sequence",
        "pr2_rollout_prediction",
        "router_shift_weighting",
        "router_shift_gamma_min",
        "minirl_is_cap",
        "extreme_token_threshold",
    ):
        assert not hasattr(plain, name), name
        assert option(plain, name) == declared[name], name
    ours = MoEReplayGRPOConfig(**BASE, routing_replay="none", minirl_is_cap=2.0)
    assert option(ours, "minirl_is_cap") == 2.0
    with pytest.raises(KeyError):  # a TRL field is never given a default of ours
        option(plain, "loss_type_typo")


def _getattr_defaults(path: Path) -> list[str]:
    """``getattr(x, "name", default)`` calls in ``path`` whose ``name`` is a field of our configs with a default."""
    declared = {
        f.name
        for config in (MoEReplayGRPOConfig, MoEReplayAsyncGRPOConfig)
        for f in dataclasses.fields(config)
        if f.default is not dataclasses.MISSING
    }
    from trl import GRPOConfig

    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) == 3
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in declared - trl_fields
        ):
            hits.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return hits


def test_no_config_default_is_restated_in_a_getattr_in_the_trainers_or_their_core():
    """The trainers and what they share read our fields through ``option`` (one declared default), never
    ``getattr(args, name, x)``."""
    paths = [path for part in ("trainer", "core", "async_grpo") for path in sorted((PACKAGE / part).glob("*.py"))]
    assert len(paths) > 15  # the scan sees the packages
    found = [hit for path in paths for hit in _getattr_defaults(path)]
    assert found == []
