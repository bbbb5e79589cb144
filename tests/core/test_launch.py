"""The launch configuration against what the trainer gets: precision follows the training arguments, and a run that
asked for FSDP or DeepSpeed but got something else stops (``trl_moe_replay.core.launch``)."""

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from trl_moe_replay.core.launch import LaunchMismatchError, check_launched_engine, check_launched_precision
from trl_moe_replay.testing import tiny_moe_model

from tests.trainer.test_grpo_trainer import make_trainer


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
    with pytest.raises(
        LaunchMismatchError,
        match="asked for FSDP .* set up MULTI_CPU. accelerate switches to FSDP "
        "only on GPU-type devices .* recipes/accelerate/ddp.yaml",
    ):
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
    with caplog.at_level("WARNING", logger="trl_moe_replay.core.launch"):
        make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="none")
    assert "LAUNCH MISMATCH" in caplog.text and "bf16=False" in caplog.text
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # an FSDP config; one CPU process: no FSDP here
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # accelerate's FSDP plugin writes it; undone after
    with pytest.raises(LaunchMismatchError, match="asked for FSDP .* set up NO"):
        make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="pr2")


# ----------------------------------------------------------------------------- model names
def closed_port_endpoint() -> str:
    """A Hub endpoint nothing listens on: the connection is refused at once, as where the network is absent."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_org_name_is_a_local_path_only_if_that_folder_exists(tmp_path, monkeypatch):
    from trl_moe_replay.core.launch import HubModelError, ModelPathError, check_model_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "someorg").mkdir()  # a folder named like the org does not make "someorg/moe" a path
    with pytest.raises(HubModelError, match="someorg/moe is not a local folder, and offline mode .HF_HUB_OFFLINE=1."):
        check_model_path("someorg/moe")
    (tmp_path / "someorg" / "moe").mkdir()  # the folder itself does
    with pytest.raises(ModelPathError, match="someorg/moe holds no config.json") as error:
        check_model_path("someorg/moe")
    assert not isinstance(error.value, HubModelError)
    (tmp_path / "someorg" / "moe" / "config.json").write_text("{}")
    check_model_path("someorg/moe")


def test_an_unreachable_hub_is_one_error_naming_offline_mode_and_a_local_folder(tmp_path, monkeypatch):
    import time

    from huggingface_hub import constants

    from trl_moe_replay.core.launch import HubModelError, check_model_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    endpoint = closed_port_endpoint()
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # what HF_ENDPOINT sets when huggingface_hub is imported
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    start = time.monotonic()
    with pytest.raises(HubModelError) as error:
        check_model_path("someorg/no-such-moe")
    assert time.monotonic() - start < 20  # one refused connection, no retries (transformers: 28 s of them)
    message = str(error.value)
    assert f"someorg/no-such-moe is not a local folder and the Hub ({endpoint}) cannot be reached" in message
    assert "HF_HUB_OFFLINE=1" in message and "local folder that holds config.json" in message
    # runs/typo next to runs/type: a Hub id, but the message points at the folder that probably was meant
    (tmp_path / "runs" / "type").mkdir(parents=True)
    with pytest.raises(HubModelError, match=r"\(no folder runs/typo here either; did you mean runs/type\?\)"):
        check_model_path("runs/typo")
