"""The public replay rule (routing/replay_rule.py): plain replay, threshold replay against a brute-force count, and the
combine weights it returns (the router family's own, bit for bit at the router's own ids)."""

from functools import partial

import pytest
import torch

from trl_moe_replay import RouterReplay
from trl_moe_replay.routing import family_of
from trl_moe_replay.routing.replay_rule import ScoreThresholdError, canonical_ids, replay_rule
from trl_moe_replay.routing.routers import softmax_then_renormalise
from trl_moe_replay.routing.routes import NO_ROUTE, check_routes
from trl_moe_replay.testing import supported_model_types, tiny_moe_model
from trl_moe_replay.upstream import transformers_seam

from tests.helpers import random_ids, shifted


N, E, K = 400, 16, 4
COMBINE = partial(softmax_then_renormalise, None)  # Mixtral's normalisation reads nothing of its router


def random_case(seed: int, no_route_share: float = 0.2):
    """Random logits [N, E], the router's top-k, and replayed rows of K distinct random experts (some without a
    route)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=generator) * 2
    natural = logits.topk(K, dim=-1).indices
    replayed = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(N)])
    without = torch.rand(N, generator=generator) < no_route_share
    replayed[without] = NO_ROUTE
    return logits, natural, replayed, without


def brute_force(logits, natural, replayed, threshold):
    """The rule token by token, as PR #2703 words it: (ids as a set, slots replaced)."""
    probs = torch.softmax(logits.float(), dim=-1)
    ids, replaced = [], 0
    for n in range(logits.shape[0]):
        if replayed[n, 0] == NO_ROUTE:
            ids.append(set(natural[n].tolist()))
            continue
        own = sorted(natural[n].tolist(), key=lambda e: -probs[n, e].item())
        weakest = min(probs[n, e].item() for e in own)
        kept = [e for e in replayed[n].tolist() if probs[n, e].item() >= threshold * weakest]
        replaced += len(replayed[n]) - len(kept)
        for e in own:
            if len(kept) == len(replayed[n]):
                break
            if e not in kept:
                kept.append(e)
        ids.append(set(kept))
    return ids, replaced


def test_threshold_zero_is_todays_replay_op_for_op():
    logits, natural, replayed, without = random_case(0)
    choice = replay_rule(replayed, natural, logits, COMBINE, 0.0)
    expected = canonical_ids(torch.where(without[:, None], natural, replayed), natural)
    assert torch.equal(choice.ids, expected) and choice.replaced is None
    assert torch.equal(choice.routed, ~without)


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("seed", [1, 2])
def test_replace_count_and_ids_equal_a_brute_force_count(threshold, seed):
    logits, natural, replayed, without = random_case(seed)
    choice = replay_rule(replayed, natural, logits, COMBINE, threshold)
    ids, replaced = brute_force(logits, natural, replayed, threshold)
    assert [set(row) for row in choice.ids.tolist()] == ids
    assert int(choice.replaced.sum()) == replaced
    assert not choice.replaced[without].any()  # no route: nothing to replace
    if threshold >= 0.3:
        assert replaced > 0  # the case exercises the refill


@pytest.mark.parametrize("threshold", [0.0, 0.2, 0.6, 1.0])
def test_no_expert_twice_and_every_id_in_range(threshold):
    logits, natural, replayed, _ = random_case(3)
    ids = replay_rule(replayed, natural, logits, COMBINE, threshold).ids
    ordered = ids.sort(dim=-1).values
    assert (ordered[:, 1:] != ordered[:, :-1]).all()
    assert ids.min() >= 0 and ids.max() < E


def test_threshold_one_is_the_routers_own_top_k_where_scores_are_not_tied():
    logits, natural, replayed, _ = random_case(4)
    probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values
    assert (probs[:, K - 1] > probs[:, K]).all()  # continuous random scores: no tie at the k-th place
    ids = replay_rule(replayed, natural, logits, COMBINE, 1.0).ids
    assert torch.equal(ids.sort(dim=-1).values, natural.sort(dim=-1).values)


@pytest.mark.parametrize("model_type", supported_model_types())
def test_the_weights_are_the_routers_own_at_its_own_ids_and_its_familys_normalisation_elsewhere(model_type):
    model = tiny_moe_model(model_type)
    router = next(m for m in model.modules() if family_of(m) is not None)
    hidden = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits, weights, ids = transformers_seam.split_router_output(
        router(hidden), transformers_seam.router_ids_first(router), ""
    )
    combine = partial(family_of(router).gate_weights, router)
    for threshold in (0.0, 1.0):  # its own routes replayed: its own ids and weights, bit for bit
        choice = replay_rule(ids, ids, logits, combine, threshold)
        assert torch.equal(choice.ids, ids) and torch.equal(choice.weights, weights)
        assert choice.weights.dtype == weights.dtype
    moved = (ids + 1) % router.num_experts  # other experts: the family's normalisation at them, in the graph
    choice = replay_rule(moved, ids, logits, combine, 0.0)
    assert torch.equal(choice.ids.sort(dim=-1).values, moved.sort(dim=-1).values)
    assert torch.equal(choice.weights, family_of(router).gate_weights(router, logits, choice.ids))
    assert not torch.equal(choice.weights, weights)
    choice.weights.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0  # the router still trains


def test_threshold_replay_in_the_model_keeps_what_passes_and_counts_replacements():
    model = tiny_moe_model("qwen3_moe").eval()
    plain, strict = RouterReplay(model), RouterReplay(model, 1.0)
    ids = random_ids(2, 7)
    with torch.no_grad(), plain.record() as rec:
        natural_logits = model(ids).logits
    own = rec.checked
    moved = check_routes(shifted(rec.routes, plain.num_experts), plain.layout)
    with torch.no_grad():
        with plain.replay(moved):
            moved_logits = model(ids).logits
        with strict.replay(moved):  # every shifted expert the router does not rank in its top-k is replaced
            strict_logits = model(ids).logits
        with strict.replay(own):
            own_logits = model(ids).logits
    assert not torch.equal(moved_logits, natural_logits)
    torch.testing.assert_close(strict_logits, natural_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(own_logits, natural_logits, rtol=0, atol=1e-6)
    sums = strict.take_replace_sums()
    assert sorted(sums) == plain.moe_layers and strict.take_replace_sums() == {}
    positions = ids.numel()
    for replaced, slots in sums.values():  # two forwards: every slot of the shifted routes that left the top-k
        assert slots == 2 * positions * plain.top_k and 0 < replaced <= positions * plain.top_k
    plain.remove()
    strict.remove()


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_a_threshold_out_of_range_is_refused_in_one_line(value):
    with pytest.raises(ScoreThresholdError, match=r"must be a number in \[0, 1\]") as info:
        RouterReplay(tiny_moe_model("qwen3_moe"), value)
    assert "\n" not in str(info.value)
