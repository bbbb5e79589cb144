"""The launch configuration against what the trainer gets: precision follows the training arguments, and a run that
asked for FSDP or DeepSpeed but got something else stops (``trl_moe_replay.trainer.launch``)."""

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from trl_moe_replay.testing import tiny_moe_model
from trl_moe_replay.trainer.launch import LaunchMismatchError, check_launched_engine, check_launched_precision

from .test_trainer import make_trainer


def args(bf16=False, fp16=False, deepspeed=None, fsdp=None):
    return SimpleNamespace(bf16=bf16, fp16=fp16, deepspeed=deepspeed, fsdp=fsdp, fsdp_plugin_args=None)


def test_precision_follows_the_training_arguments():
    check_launched_precision(args(), {"ACCELERATE_MIXED_PRECISION": "no"})
    check_launched_precision(args(bf16=True), {"ACCELERATE_MIXED_PRECISION": "bf16"})
    check_launched_precision(args(bf16=True), {})  # the arguments turn bf16 on themselves
    for launched in ("bf16", "fp16"):
        with pytest.raises(LaunchMismatchError, match=f"--{launched} true .* --mixed_precision no"):
            check_launched_precision(args(), {"ACCELERATE_MIXED_PRECISION": launched})


def test_an_fsdp_launch_that_became_data_parallel_stops():
    fsdp_env = {"ACCELERATE_USE_FSDP": "true"}
    with pytest.raises(LaunchMismatchError, match="asked for FSDP .* set up MULTI_CPU. accelerate switches to FSDP "
                                                  "only on GPU-type devices .* recipes/accelerate/ddp.yaml"):
        check_launched_engine(args(), DistributedType.MULTI_CPU, fsdp_env)
    with pytest.raises(LaunchMismatchError, match="asked for FSDP"):  # the fsdp training argument, no config
        check_launched_engine(args(fsdp=True), DistributedType.MULTI_CPU, {})
    with pytest.raises(LaunchMismatchError, match="asked for DeepSpeed .* set up MULTI_GPU"):
        check_launched_engine(args(), DistributedType.MULTI_GPU, {"ACCELERATE_USE_DEEPSPEED": "true"})
    check_launched_engine(args(), DistributedType.FSDP, fsdp_env)
    check_launched_engine(args(deepspeed={"zero_optimization": {"stage": 2}}), DistributedType.DEEPSPEED, {})
    check_launched_engine(args(), DistributedType.MULTI_CPU, {})


def test_trainer_refuses_a_launch_that_does_not_match(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch` exports from a bf16 config
    with pytest.raises(LaunchMismatchError, match="bf16=False"):
        make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="r3")
    # routing_replay="none" is plain GRPOTrainer, which TRL would run: a loud warning, no refusal
    with caplog.at_level("WARNING", logger="trl_moe_replay.trainer.launch"):
        make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="none")
    assert "LAUNCH MISMATCH" in caplog.text and "bf16=False" in caplog.text
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # an FSDP config; one CPU process: no FSDP here
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # accelerate's FSDP plugin writes it; undone after
    with pytest.raises(LaunchMismatchError, match="asked for FSDP .* set up NO"):
        make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="pr2")
