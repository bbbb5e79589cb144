"""What differs between vLLM releases: setups refused on the vLLM versions whose source shows they cannot work."""

import pytest

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer
from trl_moe_replay.trainer import grpo_config
from trl_moe_replay.trainer.grpo_config import UnprovenEngineSetupError

from tests.trainer.test_grpo_trainer import prompts_dataset, reward_len


def colocate_config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_tensor_parallel_size=2,
        per_device_train_batch_size=4,
        num_generations=4,
    )
    return MoEReplayGRPOConfig(**{**settings, **overrides})


@pytest.mark.parametrize("vllm", ["0.31.0", "0.33.0"])
def test_colocate_with_tensor_parallelism_is_refused_on_vllm_031_and_later_when_the_trainer_is_built(
    tmp_path, monkeypatch, vllm
):
    monkeypatch.setattr(grpo_config, "installed_vllm_version", lambda: vllm)
    with pytest.raises(UnprovenEngineSetupError, match=rf"vllm_tensor_parallel_size=2 on vLLM {vllm}.*first tensor"):
        MoEReplayGRPOTrainer(
            model=tiny_moe_model("qwen3_moe"),
            reward_funcs=reward_len,
            args=colocate_config(tmp_path),
            train_dataset=prompts_dataset(),
            processing_class=tiny_tokenizer(),
        )


def test_the_refusal_spares_older_vllm_one_gpu_and_runs_without_engine_routes(tmp_path, monkeypatch):
    check = grpo_config.check_colocate_tensor_parallel
    monkeypatch.setattr(grpo_config, "installed_vllm_version", lambda: "0.30.0")
    tp2, tp1 = colocate_config(tmp_path), colocate_config(tmp_path, vllm_tensor_parallel_size=1)
    check(tp2, generation_routes=True)
    monkeypatch.setattr(grpo_config, "installed_vllm_version", lambda: "0.33.0")
    check(tp1, generation_routes=True)
    check(tp2, generation_routes=False)  # r2 without routing metrics: no routes asked of vLLM
    with pytest.raises(UnprovenEngineSetupError):
        check(tp2, generation_routes=True)
