"""checkpoint_named_tensors: the trainer's weights under the names and layout save_pretrained writes (no vLLM)."""

import pytest
import torch
from safetensors.torch import load_file

from trl_moe_replay.testing import tiny_moe_model
from trl_moe_replay.weight_sync.vllm_weights import checkpoint_named_tensors


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_equals_what_save_pretrained_writes(family, tmp_path):
    model = tiny_moe_model(family, num_hidden_layers=3)
    model.save_pretrained(tmp_path)
    on_disk = {}
    for file in tmp_path.glob("*.safetensors"):
        on_disk.update(load_file(file))
    ours = dict(checkpoint_named_tensors(model))
    assert sorted(ours) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(ours[name], tensor), name
    if family in ("qwen3_moe", "olmoe"):  # fused in transformers 5, one tensor per expert on disk
        assert "model.layers.2.mlp.experts.7.up_proj.weight" in ours
        assert not any(name.endswith("experts.gate_up_proj") for name in ours)


def test_converts_the_tensors_it_is_given():
    model = tiny_moe_model("qwen3_moe")
    doubled = ((name, param.detach() * 2) for name, param in model.named_parameters())
    ours = dict(checkpoint_named_tensors(model, doubled))
    fused = model.model.layers[1].mlp.experts.gate_up_proj.detach()
    intermediate = fused.shape[1] // 2
    assert torch.equal(ours["model.layers.1.mlp.experts.3.gate_proj.weight"], 2 * fused[3, :intermediate])
    assert torch.equal(ours["model.layers.1.mlp.experts.3.up_proj.weight"], 2 * fused[3, intermediate:])


def test_a_peft_models_merged_weights_get_the_base_checkpoints_names(tmp_path):
    """What TRL's iterator yields for a LoRA model (merged weights under the base names, fused experts) converts with
    the base model's conversions: the names and values a checkpoint of the merged model holds on disk."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_moe_model("qwen3_moe"),
        LoraConfig(
            r=4,
            target_modules=["q_proj", "gate"],
            target_parameters=["mlp.experts.gate_up_proj"],
            init_lora_weights=False,
        ),
    )
    with torch.no_grad():
        model.merge_adapter()
        named = [
            (name.removeprefix("base_model.model.").replace(".base_layer", ""), param.detach().clone())
            for name, param in model.named_parameters()
            if "lora_" not in name
        ]
        ours = dict(checkpoint_named_tensors(model, named))
        merged = model.merge_and_unload()
    merged.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert sorted(ours) == sorted(on_disk) and "model.layers.1.mlp.experts.3.up_proj.weight" in ours
    assert all(torch.equal(ours[name], on_disk[name]) for name in on_disk)
