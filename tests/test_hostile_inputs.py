"""Hostile configuration and arguments answered in one line (issue 21): config field types checked when the config is
built (YAML included), the nested generation_kwargs replay reads, a lock path that is a folder, a negative
``audit --vllm_timeout``."""

import asyncio
import inspect
import math
import time

import numpy as np
import pytest
from transformers.utils import get_json_schema
from trl import TrlParser

from trl_moe_replay import MoEReplayGRPOConfig, OutputDirInUseError
from trl_moe_replay.cli import main
from trl_moe_replay.engines.tool_timeout import ToolTimeoutError, with_timeout
from trl_moe_replay.trainer.grpo_config import ConfigTypeError
from trl_moe_replay.trainer.output_lock import LOCK_NAME, OutputDirLock
from trl_moe_replay.testing import FakeVLLMServer, tiny_moe_model

from .test_cli import audit_server, one_line_error
from .test_trainer import make_trainer


def config(**kwargs):
    return MoEReplayGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **kwargs)


@pytest.mark.parametrize("name, value, message", [
    ("pr2_cached_tokens_per_sequence", 1.5, "pr2_cached_tokens_per_sequence must be an int, got float 1.5"),
    ("pr2_cached_tokens_per_sequence", "2048", "must be an int, got str '2048'"),
    ("pr2_cached_tokens_per_sequence", True, "must be an int, got bool True"),
    ("router_shift_gamma_min", "0.8", "router_shift_gamma_min must be a float, got str '0.8'"),
    ("epsilon", "0.2", "epsilon must be a float or None, got str '0.2'"),
    ("extreme_token_threshold", None, "extreme_token_threshold must be a float, got NoneType None"),
    ("routing_metrics", "yes", "routing_metrics must be a bool or None, got str 'yes'"),
    ("replay_reference_model", 1, "replay_reference_model must be a bool, got int 1"),
    ("routing_replay", 3, "routing_replay must be a str, got int 3"),
])
def test_config_field_types_are_checked_when_the_config_is_built(name, value, message):
    with pytest.raises(ConfigTypeError, match=message) as error:
        config(**{name: value})
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)


def test_floats_take_ints_and_numpy_scalars_become_python_numbers():
    built = config(router_shift_gamma_min=1, pr2_cached_tokens_per_sequence=np.int64(16),
                   extreme_token_threshold=np.float32(3.0), scale_rewards=True)
    assert built.router_shift_gamma_min == 1 and built.scale_rewards == "group"  # TRL's bool spelling kept
    assert type(built.pr2_cached_tokens_per_sequence) is int and built.pr2_cached_tokens_per_sequence == 16
    assert type(built.extreme_token_threshold) is float


@pytest.mark.parametrize("generation_kwargs, message", [
    ({"num_beams": "4"}, r"generation_kwargs\['num_beams'\] must be an int >= 1, got str '4'"),
    ({"num_beams": 0}, r"generation_kwargs\['num_beams'\] must be an int >= 1, got int 0"),
    ({"routed_experts_prompt_start": 1.5}, r"\['routed_experts_prompt_start'\] must be an int >= 0, got float 1.5"),
    ({"routed_experts_prompt_start": -1}, r"\['routed_experts_prompt_start'\] must be an int >= 0, got int -1"),
])
def test_generation_kwargs_replay_reads_are_checked(generation_kwargs, message):
    with pytest.raises(ConfigTypeError, match=message):
        config(generation_kwargs=generation_kwargs)
    built = config(generation_kwargs={"num_beams": 1, "routed_experts_prompt_start": np.int64(2)})
    assert type(built.generation_kwargs["routed_experts_prompt_start"]) is int


def test_yaml_values_of_the_wrong_type_are_refused_when_parsed(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("output_dir: out\nuse_cpu: true\nbf16: false\npr2_cached_tokens_per_sequence: 1.5\n")
    with pytest.raises(ConfigTypeError, match="pr2_cached_tokens_per_sequence must be an int, got float 1.5"):
        TrlParser((MoEReplayGRPOConfig,)).parse_args_and_config(["--config", str(recipe)])
    recipe.write_text("output_dir: out\nuse_cpu: true\nbf16: false\ngeneration_kwargs:\n  num_beams: '4'\n")
    with pytest.raises(ConfigTypeError, match=r"generation_kwargs\['num_beams'\] must be an int >= 1, got str '4'"):
        TrlParser((MoEReplayGRPOConfig,)).parse_args_and_config(["--config", str(recipe)])


def test_a_lock_path_that_is_a_folder_is_one_clear_error(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(OutputDirInUseError, match=f"{LOCK_NAME} is a folder, not this package's lock file") as error:
        OutputDirLock(tmp_path).acquire()
    assert "\n" not in str(error.value) and (tmp_path / LOCK_NAME).is_dir()  # left as it was
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1)
    with pytest.raises(OutputDirInUseError, match="is a folder"):
        trainer.train()


@pytest.mark.parametrize("timeout", ["-5", "nan", "inf"])
def test_audit_refuses_a_timeout_that_is_no_duration(capsys, timeout):
    line = one_line_error(capsys, ["audit", "--model", "tiny:qwen3_moe", "--vllm_server_url", "http://127.0.0.1:9",
                                   "--vllm_timeout", timeout])
    assert "--vllm_timeout) must be a number of seconds >= 0" in line and "accepts connections" not in line


# ----------------------------------------------------------------------------- a tool that hangs
def slow_add(a: int, b: int, delay: float = 0.0) -> int:
    """Add two integers, slowly.

    Args:
        a: The first integer.
        b: The second integer.
        delay: Seconds to wait first.
    """
    time.sleep(delay)
    if a < 0:
        raise ValueError("negative")
    return a + b


async def slow_add_async(a: int, b: int, delay: float = 0.0) -> int:
    """Add two integers, slowly.

    Args:
        a: The first integer.
        b: The second integer.
        delay: Seconds to wait first.
    """
    await asyncio.sleep(delay)
    return a + b


def test_a_tool_with_a_timeout_keeps_its_schema_and_gives_up_in_time():
    bounded = with_timeout(slow_add, 0.5)
    assert get_json_schema(bounded) == get_json_schema(slow_add)  # TRL builds the same tool description
    assert bounded(2, b=3) == 5
    with pytest.raises(ValueError, match="negative"):  # the tool's own errors pass through
        bounded(-1, 1)
    start = time.monotonic()
    with pytest.raises(ToolTimeoutError, match="tool slow_add did not return within 0.5 s"):
        bounded(1, 1, delay=30)  # TRL's loop would block 30 s; TRL turns the error into the tool's result
    assert time.monotonic() - start < 10

    bounded_async = with_timeout(slow_add_async, 0.5)
    assert inspect.iscoroutinefunction(bounded_async)  # TRL still runs it on its event loop
    assert get_json_schema(bounded_async) == get_json_schema(slow_add_async)
    assert asyncio.run(bounded_async(2, 3)) == 5
    with pytest.raises(ToolTimeoutError):
        asyncio.run(bounded_async(1, 1, delay=30))
    for seconds in (0, -1, math.inf, "5"):
        with pytest.raises(ValueError, match="finite number of seconds > 0"):
            with_timeout(slow_add, seconds)


def test_audit_of_a_server_with_one_malformed_payload_falls_back_for_it_alone():
    # the audit aligns through the trainer's RouteIntake: a malformed payload is one sample's fallback, not an exit
    server = FakeVLLMServer(tiny_moe_model("qwen3_moe"), tamper=lambda call, choice, p: p[:-5] if choice == 1 else p)
    report = audit_server(server, num_prompts=1)
    r3 = report.row("r3")
    assert 0 < r3.fallback_frac < 1 and r3.route_mismatch_frac == 0.0
    assert any("1 of 3 completions came with routes that do not fit their tokens" in n for n in report.notes)
