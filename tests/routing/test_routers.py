"""Every supported router family: exact natural replay, replay that changes outputs, gradients, recording."""

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING

from trl_moe_replay.routing import RouterReplay, TransformersTooOldError, family_of, has_route, routers
from trl_moe_replay.testing import supported_model_types, tiny_moe_model, unavailable_model_types
from trl_moe_replay.upstream import transformers_seam

from tests.helpers import experts_module, no_route, random_ids, shifted


FAMILIES = supported_model_types()


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_weight_function_reproduces_router_bit_for_bit(model_type, dtype):
    model = tiny_moe_model(model_type, dtype=dtype)
    routers = [m for m in model.modules() if family_of(m) is not None]
    assert routers, "no router found"
    hidden = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    for router in routers:
        logits, weights, ids = transformers_seam.split_router_output(
            router(hidden), transformers_seam.router_ids_first(router), ""
        )
        recomputed = family_of(router).gate_weights(router, logits, ids)
        assert recomputed.dtype == weights.dtype
        assert torch.equal(recomputed, weights)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_natural_replay_is_bit_exact_and_other_routes_change_outputs(model_type, dtype):
    model = tiny_moe_model(model_type, dtype=dtype)
    rr = RouterReplay(model)
    x = random_ids(2, 12)
    with torch.no_grad():
        reference = model(x).logits
        with rr.record() as rec:
            model(x)
        routes = rec.routes
        assert routes.shape == (2, 12, rr.num_layers, rr.top_k)
        assert has_route(routes[:, :, rr.moe_layers]).all()
        with rr.replay(routes):
            replayed = model(x).logits
        with rr.replay(shifted(routes, rr.num_experts)):
            moved = model(x).logits
    assert torch.equal(replayed, reference)
    assert (moved.float() - reference.float()).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", FAMILIES)
def test_order_of_ids_in_a_row_does_not_matter(model_type):
    model = tiny_moe_model(model_type)
    rr = RouterReplay(model)
    x = random_ids(2, 10)
    with torch.no_grad():
        with rr.record() as rec:
            reference = model(x).logits
        alt = shifted(rec.routes, rr.num_experts, by=3)
        with rr.replay(alt):
            forward = model(x).logits
        with rr.replay(alt.flip(-1)):
            flipped = model(x).logits
        with rr.replay(rec.routes.flip(-1)):
            natural_flipped = model(x).logits
    assert torch.equal(forward, flipped)
    assert torch.equal(natural_flipped, reference)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_gradients_reach_router_and_exactly_the_replayed_experts(model_type):
    model = tiny_moe_model(model_type).train()
    rr = RouterReplay(model)
    x = random_ids(2, 12, seed=3)
    layer = rr.moe_layers[0]
    with torch.no_grad(), rr.record() as rec:
        model(x)
    forced = rec.routes.clone()
    forced[:, :, layer, :] = torch.tensor([3, 5][: rr.top_k], dtype=forced.dtype)
    model.zero_grad()
    with rr.replay(forced):
        model(x, labels=x).loss.backward()
    router = next(m for n, m in model.named_modules() if family_of(m) is not None and f"layers.{layer}." in n)
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    experts = experts_module(model, layer)
    touched = set()
    for param in experts.parameters():
        if param.dim() == 3 and param.shape[0] == rr.num_experts and param.grad is not None:
            per_expert = param.grad.abs().flatten(1).sum(-1)
            touched |= {int(e) for e in per_expert.nonzero().flatten()}
    assert touched == {3, 5}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_natural_replay_gives_the_same_gradients_as_no_replay(model_type):
    model = tiny_moe_model(model_type).train()
    x = random_ids(2, 12, seed=4)
    model(x, labels=x).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    rr = RouterReplay(model)
    with torch.no_grad(), rr.record() as rec:
        model(x)
    model.zero_grad()
    with rr.replay(rec.routes):
        model(x, labels=x).loss.backward()
    for name, param in model.named_parameters():
        if name in reference:
            torch.testing.assert_close(param.grad, reference[name], rtol=0, atol=1e-7)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generate_recording_equals_one_full_forward_in_fp32(model_type):
    model = tiny_moe_model(model_type)
    rr = RouterReplay(model)
    prompts = random_ids(3, 5, seed=5)
    with torch.no_grad():
        with rr.record() as rec:
            sequences = model.generate(
                prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6, do_sample=False, min_new_tokens=6
            )
        with rr.record() as full:
            model(sequences)
    assert rec.routes.shape[:2] == sequences.shape
    assert no_route(rec.routes[:, -1]).all()  # the final sampled token was never fed forward
    assert torch.equal(rec.routes[:, :-1], full.routes[:, :-1])


# ---------------------------------------------------------------------- transformers versions
def test_families_this_transformers_predates_are_refused_naming_the_version_they_need(monkeypatch):
    """At the oldest declared transformers (5.16.1) Jamba and Aria exist without a router class: replay refuses
    them. Where no family this transformers predates can be built (the newest: none is unavailable; 5.22: only
    dots3_note_text, whose model type it does not know), the same refusal is shown on Jamba under a pretended 5.20."""
    unavailable = unavailable_model_types()
    cases = [(t, unavailable[t]) for t in unavailable if t in CONFIG_MAPPING]
    if not cases:
        monkeypatch.setattr(transformers_seam, "transformers_version", lambda: "5.20.0")
        cases = [("jamba", "5.21.0")]
    for model_type, needed in cases:
        model = tiny_moe_model(model_type)
        with pytest.raises(
            TransformersTooOldError, match=rf"transformers >= {needed}.*{transformers_seam.transformers_version()}"
        ):
            RouterReplay(model)


def test_unavailable_families_are_exactly_those_newer_than_the_installed_transformers():
    from packaging.version import Version

    installed = Version(transformers.__version__)
    newer = {f.name for f in routers.ROUTER_FAMILIES if Version(f.min_transformers) > installed}
    listed = {family_of_type(t) for t in unavailable_model_types()}
    assert listed == newer
    assert not set(unavailable_model_types()) & set(FAMILIES)


def family_of_type(model_type: str) -> str:
    return next(f.name for f in routers.ROUTER_FAMILIES if model_type in f.model_types)


def test_the_trainer_refuses_such_a_family_when_it_is_built(tmp_path, monkeypatch):
    from tests.trainer.test_grpo_trainer import make_trainer

    monkeypatch.setattr(
        transformers_seam, "transformers_version", lambda: "5.20.0"
    )  # Jamba's router arrived in 5.21.0
    with pytest.raises(TransformersTooOldError, match=r"Jamba models need transformers >= 5\.21\.0"):
        make_trainer(tmp_path, tiny_moe_model("jamba"), routing_replay="r2")


def test_the_docs_family_table_shows_each_family_minimum_transformers():
    from pathlib import Path

    rows = [
        line
        for line in (Path(__file__).parents[2] / "docs" / "families.md").read_text().splitlines()
        if line.startswith("| ")
    ]
    for family in routers.ROUTER_FAMILIES:
        row = next(r for r in rows if family.name in r.split("|")[1])
        assert family.min_transformers in row.split("|")[-2], (family.name, family.min_transformers)
