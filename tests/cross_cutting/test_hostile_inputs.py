"""Hostile configuration and arguments answered in one line (issue 21): config field types checked when the config is
built (YAML included), the nested generation_kwargs replay reads, a lock path that is a folder, a negative
``audit --vllm_timeout``."""

import asyncio
import inspect
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.torch
import torch
from transformers.utils import get_json_schema
from trl import TrlParser

from trl_moe_replay import MoEReplayGRPOConfig, OutputDirInUseError
from trl_moe_replay.core.output_lock import LOCK_NAME, OutputDirLock
from trl_moe_replay.rollouts.tool_timeout import ToolTimeoutError, with_timeout
from trl_moe_replay.testing import FakeVLLMServer, tiny_moe_model, tiny_tokenizer
from trl_moe_replay.trainer.grpo_config import ConfigTypeError

from tests.cli.test_audit import audit_server
from tests.cli.test_plotting import one_line_error
from tests.trainer.test_grpo_trainer import make_trainer


def config(**kwargs):
    return MoEReplayGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **kwargs)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("pr2_cached_tokens_per_sequence", 1.5, "pr2_cached_tokens_per_sequence must be an int, got float 1.5"),
        ("pr2_cached_tokens_per_sequence", "2048", "must be an int, got str '2048'"),
        ("pr2_cached_tokens_per_sequence", True, "must be an int, got bool True"),
        ("router_shift_gamma_min", "0.8", "router_shift_gamma_min must be a float, got str '0.8'"),
        (
            "minirl_is_cap",
            "5",
            "minirl_is_cap must be a float, got str '5'",
        ),  # ours; TRL's fields: test_config_drop_in
        ("extreme_token_threshold", None, "extreme_token_threshold must be a float, got NoneType None"),
        ("routing_metrics", "yes", "routing_metrics must be a bool or None, got str 'yes'"),
        ("replay_reference_model", 1, "replay_reference_model must be a bool, got int 1"),
        ("routing_replay", 3, "routing_replay must be a str, got int 3"),
    ],
)
def test_config_field_types_are_checked_when_the_config_is_built(name, value, message):
    with pytest.raises(ConfigTypeError, match=message) as error:
        config(**{name: value})
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)


def test_floats_take_ints_and_numpy_scalars_become_python_numbers():
    built = config(
        router_shift_gamma_min=1,
        pr2_cached_tokens_per_sequence=np.int64(16),
        extreme_token_threshold=np.float32(3.0),
        scale_rewards=True,
    )
    assert built.router_shift_gamma_min == 1 and built.scale_rewards == "group"  # TRL's bool spelling kept
    assert type(built.pr2_cached_tokens_per_sequence) is int and built.pr2_cached_tokens_per_sequence == 16
    assert type(built.extreme_token_threshold) is float


@pytest.mark.parametrize(
    "generation_kwargs, message",
    [
        ({"num_beams": "4"}, r"generation_kwargs\['num_beams'\] must be an int >= 1, got str '4'"),
        ({"num_beams": 0}, r"generation_kwargs\['num_beams'\] must be an int >= 1, got int 0"),
        (
            {"routed_experts_prompt_start": 1.5},
            r"\['routed_experts_prompt_start'\] must be an int >= 0, got float 1.5",
        ),
        ({"routed_experts_prompt_start": -1}, r"\['routed_experts_prompt_start'\] must be an int >= 0, got int -1"),
    ],
)
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
    line = one_line_error(
        capsys,
        ["audit", "--model", "tiny:qwen3_moe", "--vllm_server_url", "http://127.0.0.1:9", "--vllm_timeout", timeout],
    )
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


# ----------------------------------------------------------------------------- audit arguments (issue 33)
@pytest.mark.parametrize(
    "args, says",
    [
        (["--device", "meta"], "--device meta holds shapes, not numbers"),
        (["--device", "gar_bage"], "--device 'gar_bage' is not a torch device: pass cpu, cuda or cuda:N"),
        (
            ["--device", "cuda:99"],
            "--device cuda:99: this machine has ",
        ),  # no cuda here; too few GPUs on a GPU machine
        (
            ["--prompt", "fine", "--prompt", "ab\udcffc"],
            "prompt 2 (--prompt) is not UTF-8 text: byte 0xff at character 3",
        ),
        (["--prompt", "lone \ud800"], "prompt 1 (--prompt) is not UTF-8 text: lone surrogate U+D800 at character 6"),
        (
            ["--extreme_threshold", "nan"],
            "extreme_threshold (--extreme_threshold) must be a finite probability ratio > 1",
        ),
        (["--extreme_threshold", "0.5"], "must be a finite probability ratio > 1 (2: a token is extreme when"),
        (["--extreme_threshold", "1"], "must be a finite probability ratio > 1"),
        (["--extreme_threshold", "inf"], "must be a finite probability ratio > 1"),
        (["--temperature", "inf"], "temperature (--temperature) must be a finite number > 0"),
        (["--temperature", "nan"], "temperature (--temperature) must be a finite number > 0"),
        (["--temperature", "0"], "temperature (--temperature) must be a finite number > 0"),
        (["--temperature", "-1"], "temperature (--temperature) must be a finite number > 0"),
        (["--num_prompts", "-1"], "num_prompts (--num_prompts) must be an int >= 1, got -1"),
        (["--num_generations", "0"], "num_generations (--num_generations) must be an int >= 1, got 0"),
    ],
    ids=lambda value: " ".join(value).encode("ascii", "backslashreplace").decode() if isinstance(value, list) else "",
)
def test_audit_argument_mistakes_are_one_line(capsys, monkeypatch, args, says):
    import trl_moe_replay.cli.audit as audit

    loaded = []
    monkeypatch.setattr(audit, "load_model_and_tokenizer", lambda *a, **kw: loaded.append(a) or 1 / 0)
    if "cuda:99" in args:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = one_line_error(capsys, ["audit", "--model", "tiny:qwen3_moe", *args])
    assert says in line
    assert not loaded  # refused before a model is loaded


def test_a_device_this_machine_lacks_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = one_line_error(capsys, ["audit", "--model", "tiny:qwen3_moe", "--device", "cuda"])
    assert "--device cuda: this machine has no cuda device" in line and line.endswith("pass cpu")


@pytest.fixture(scope="module")
def saved_tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "checkpoint"
    tiny_moe_model("qwen3_moe").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("damage", ["half", "header", "empty", "bin"])
def test_audit_of_a_truncated_weight_file_is_one_line(capsys, tmp_path, saved_tiny_model, damage):
    model = tmp_path / "model"
    shutil.copytree(saved_tiny_model, model)
    weights = model / "model.safetensors"
    if damage == "bin":  # transformers 4.x with save_safetensors=False
        state = safetensors.torch.load_file(weights)
        weights.unlink()
        weights = model / "pytorch_model.bin"
        torch.save(state, weights)
    size = {"header": 4, "empty": 0}.get(damage, weights.stat().st_size // 2)
    os.truncate(weights, size)
    line = one_line_error(capsys, ["audit", "--model", str(model), "--num_prompts", "1", "--max_new_tokens", "2"])
    assert f"the weights of {model} cannot be read (" in line
    assert "the file is damaged, probably truncated" in line


@pytest.mark.slow  # the command in a subprocess: the bytes reach Python through argv, as from a shell
def test_audit_of_a_prompt_that_is_not_utf8_from_the_shell_is_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "trl_moe_replay.cli", "audit", "--model", "tiny:qwen3_moe", "--prompt", b"2+2=\xff?"],
        capture_output=True,
        timeout=600,
        env={**os.environ, "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"},
    )
    output = (result.stdout + result.stderr).decode("utf-8", "replace")
    assert result.returncode == 2 and "Traceback" not in output, output
    assert "prompt 1 (--prompt) is not UTF-8 text: byte 0xff at character 5" in output
    assert len(result.stderr.decode().strip().splitlines()) <= 3
