"""PEFT LoRA (attention, routers and expert parameters; a router in modules_to_save), the setups refused under
replay, and the offline LoRA recipe config."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_moe_replay.routing import RouterReplay
from trl_moe_replay.testing import tiny_moe_model

from tests.helpers import random_ids, shifted


def test_lora_on_attention_and_experts_replays_exactly_and_trains_every_adapter():
    model = tiny_moe_model("qwen3_moe").train()
    config = LoraConfig(
        r=4,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, config)
    rr = RouterReplay(peft_model)
    assert rr.moe_layers == [0, 1]
    x = random_ids(2, 8)
    with torch.no_grad():
        reference = peft_model(input_ids=x).logits
        with rr.record() as rec:
            peft_model(input_ids=x)
        with rr.replay(rec.routes):
            assert torch.equal(peft_model(input_ids=x).logits, reference)
    with rr.replay(shifted(rec.routes, rr.num_experts)):
        peft_model(input_ids=x, labels=x).loss.backward()
    lora_b = {n: p.grad for n, p in peft_model.named_parameters() if "lora_B" in n}
    assert any("experts" in n for n in lora_b) and any("q_proj" in n for n in lora_b)
    assert all(g is not None and g.abs().sum() > 0 for g in lora_b.values())


@pytest.mark.parametrize("hooks_before_wrapping", [False, True])
def test_router_in_modules_to_save_is_replayed_and_trained(hooks_before_wrapping):
    model = tiny_moe_model("qwen3_moe").train()
    rr = RouterReplay(model) if hooks_before_wrapping else None
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["gate"]))
    if rr is None:
        rr = RouterReplay(peft_model)
    assert rr.moe_layers == [0, 1]
    x = random_ids(2, 8)
    with torch.no_grad():
        reference = peft_model(input_ids=x).logits
        with rr.record() as rec:
            peft_model(input_ids=x)
        with rr.replay(rec.routes):
            assert torch.equal(peft_model(input_ids=x).logits, reference)
        with rr.replay(shifted(rec.routes, rr.num_experts)):
            assert not torch.equal(peft_model(input_ids=x).logits, reference)  # the trainable copy replays
    with rr.replay(shifted(rec.routes, rr.num_experts)):
        peft_model(input_ids=x, labels=x).loss.backward()
    trainable_routers = [p for n, p in peft_model.named_parameters() if "modules_to_save" in n and "gate" in n]
    assert trainable_routers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable_routers)
    # with the adapter disabled the frozen original router runs: it replays too (TRL's reference pass does this)
    with torch.no_grad(), peft_model.disable_adapter():
        base = peft_model(input_ids=x).logits
        with rr.replay(shifted(rec.routes, rr.num_experts)):
            assert not torch.equal(peft_model(input_ids=x).logits, base)


# ------------------------------------------------------------------ setups refused under replay (core/peft_replay.py)
ROUTER_AND_EXPERTS = dict(
    target_modules=["q_proj", "gate"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
)


def test_the_adapted_routing_modules_are_the_routers_and_experts_only():
    from trl_moe_replay.core.peft_replay import adapted_routing_modules

    attention_only = get_peft_model(tiny_moe_model("qwen3_moe"), LoraConfig(r=4, target_modules=["q_proj"]))
    assert adapted_routing_modules(attention_only) == []
    both = get_peft_model(tiny_moe_model("qwen3_moe"), LoraConfig(r=4, **ROUTER_AND_EXPERTS))
    touched = adapted_routing_modules(both)
    assert {name.rsplit(".", 1)[-1] for name in touched} == {"gate", "experts"} and len(touched) == 4  # 2 layers


@pytest.mark.parametrize(
    ("lora", "mode", "refused"),
    [
        (dict(target_modules=["gate"]), "r3", True),
        (dict(target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"]), "r3", True),
        (dict(target_modules=["q_proj", "v_proj"]), "r3", False),  # attention only: vLLM applies it as trained
        (dict(target_modules=["gate"]), "r2", False),  # R2 replays the trainer's own routes, not the engine's
    ],
)
def test_r3_with_adapter_only_vllm_sync_is_refused_when_the_adapter_touches_routing(lora, mode, refused):
    from trl_moe_replay.core.peft_replay import UnfaithfulPeftReplayError, check_peft_replay

    model = get_peft_model(tiny_moe_model("qwen3_moe"), LoraConfig(r=4, **lora))
    check_peft_replay(model, mode, adapter_only_sync=False)  # merged sync: always faithful
    if not refused:
        check_peft_replay(model, mode, adapter_only_sync=True)
        return
    with pytest.raises(UnfaithfulPeftReplayError, match="--enable-lora") as error:
        check_peft_replay(model, mode, adapter_only_sync=True)
    assert "\n" not in str(error.value) and "without --enable-lora" in str(error.value)


@pytest.mark.parametrize("mode", ["r3", "r2", "pr2"])
def test_a_prompt_learning_adapter_is_refused_at_construction_under_replay(tmp_path, mode):
    from peft import PromptTuningConfig, TaskType

    from trl_moe_replay.core.peft_replay import UnfaithfulPeftReplayError

    from tests.trainer.test_grpo_trainer import make_trainer

    prompt_tuning = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    with pytest.raises(UnfaithfulPeftReplayError, match="PROMPT_TUNING adapter: its virtual tokens") as error:
        make_trainer(
            tmp_path, tiny_moe_model("qwen3_moe"), trainer_kwargs=dict(peft_config=prompt_tuning), routing_replay=mode
        )
    assert "\n" not in str(error.value)
    # plain TRL takes it as TRL does
    make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), trainer_kwargs=dict(peft_config=prompt_tuning), routing_replay="none"
    )


def test_the_async_trainer_refuses_r3_with_adapter_only_sync_on_the_router(tmp_path, monkeypatch):
    """The async trainer reaches the same check once TRL has chosen its sync mode (adapter-only needs a server with
    --enable-lora; here TRL's choice is forced)."""
    from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayAsyncGRPOTrainer
    from trl_moe_replay.async_grpo import async_grpo_trainer
    from trl_moe_replay.core.peft_replay import UnfaithfulPeftReplayError
    from trl_moe_replay.testing import tiny_tokenizer
    from trl_moe_replay.testing.async_workers import NoOpWeightTransfer, ScriptedRolloutWorker

    from tests.async_grpo.test_async_grpo_trainer import DATASET, reward, settings

    tiny_moe_model("qwen3_moe").save_pretrained(tmp_path / "model")  # TRL's async trainer loads by path
    monkeypatch.setattr(async_grpo_trainer, "async_adapter_only_sync", lambda trainer: True)
    with pytest.raises(UnfaithfulPeftReplayError, match="LoRA on model.layers.0.mlp.gate synced to vLLM"):
        MoEReplayAsyncGRPOTrainer(
            model=str(tmp_path / "model"),
            reward_funcs=reward,
            args=MoEReplayAsyncGRPOConfig(**settings(tmp_path)),
            train_dataset=DATASET,
            processing_class=tiny_tokenizer(),
            rollout_worker=ScriptedRolloutWorker([]),
            weight_transfer=NoOpWeightTransfer(),
            peft_config=LoraConfig(r=4, target_modules=["gate"]),
        )


# ------------------------------------------------------------------ the offline LoRA recipe config
@pytest.mark.slow  # runs the recipe: cold start and training
@pytest.mark.ci
def test_tiny_lora_recipe_trains_the_adapter_with_r3(tmp_path, capsys):
    """recipes/configs/tiny_lora_r3.yaml end to end at a small size: the adapter on attention, routers and experts
    trains, and every scored position replays the route generate used."""
    from pathlib import Path

    from safetensors.torch import load_file

    from tests.helpers import load_script

    root = Path(__file__).resolve().parents[2]
    recipe = load_script(root / "recipes" / "grpo_r3.py", "grpo_r3_recipe_lora")
    script_args, training_args, model_args = recipe.parse_args(
        [
            "--config",
            str(root / "recipes" / "configs" / "tiny_lora_r3.yaml"),
            "--output_dir",
            str(tmp_path / "run"),
            "--sft_cache_dir",
            str(tmp_path / "cache"),
            "--max_steps",
            "2",
            "--sft_steps",
            "30",
            "--per_device_train_batch_size",
            "16",
            "--synthetic_samples",
            "64",
            "--plot",
            "false",
        ]
    )
    assert model_args.use_peft and training_args.routing_replay == "r3" and model_args.model_name_or_path is None
    recipe.main(script_args, training_args, model_args)
    assert "mean reward:" in capsys.readouterr().out
    logged = [
        h for h in json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"] if "reward" in h
    ]
    assert len(logged) == 2
    assert all(h["routing/fallback_frac"] == 0.0 and h["routing/mismatch_frac"] == 0.0 for h in logged)
    adapter = load_file(tmp_path / "run" / "adapter_model.safetensors")
    for target in ("q_proj", "v_proj", "mlp.gate", "experts"):
        lora_b = [value for key, value in adapter.items() if target in key and "lora_B" in key]
        assert lora_b and any(value.abs().sum() > 0 for value in lora_b), target  # lora_B starts at zero: it trained
