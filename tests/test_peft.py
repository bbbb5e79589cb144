"""PEFT LoRA (attention and expert parameters) and a router in modules_to_save."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_moe_replay.routing import RouterReplay
from trl_moe_replay.testing import tiny_moe_model

from .helpers import random_ids, shifted


def test_lora_on_attention_and_experts_replays_exactly_and_trains_every_adapter():
    model = tiny_moe_model("qwen3_moe").train()
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
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
