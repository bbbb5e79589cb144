"""The loss math (trl_moe_replay.trainer.losses) against hand computations, and router-probability capture on tiny
models."""

import math

import pytest
import torch

from trl_moe_replay.routing import RouterReplay
from trl_moe_replay.routing.router_probs import RouterProbes
from trl_moe_replay.testing import tiny_moe_model
from trl_moe_replay.trainer.losses import (
    clip_masks,
    clipped_surrogate,
    completion_aligned,
    lower_quantile,
    minirl_token_weights,
    router_shift,
    router_shift_gamma,
    sequence_log_weights,
    shift_old_logps,
)

from tests.helpers import no_route, random_ids, shifted


LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------- router shift
def two_layer_example():
    """B=1, S=2, L=3 (layer 0 dense), K=2; probabilities that float16 holds exactly."""
    ids = torch.tensor([[[[-1, -1], [0, 3], [1, 2]], [[-1, -1], [5, 6], [7, 4]]]], dtype=torch.int16)
    old = torch.tensor(
        [[[[0, 0], [0.5, 0.25], [0.25, 0.125]], [[0, 0], [0.5, 0.5], [0.25, 0.25]]]], dtype=torch.float16
    )
    current = torch.tensor([[[[0.9, 0.9], [0.25, 0.25], [0.5, 0.125]], [[0.3, 0.3], [0.5, 0.5], [0.25, 0.25]]]])
    return old, current, ids


def test_router_shift_by_hand():
    old, current, ids = two_layer_example()
    delta = router_shift(old, current, ids)
    # position 0: layer 1 mean(|ln .25/.5|, 0) = ln2/2; layer 2 mean(ln2, 0) = ln2/2; dense layer 0 is left out
    # (its "current" 0.9 would count otherwise). position 1: nothing moved.
    assert delta.shape == (1, 2)
    torch.testing.assert_close(delta, torch.tensor([[LN2 / 2, 0.0]]))
    gamma = router_shift_gamma(delta, gamma_min=0.5)
    torch.testing.assert_close(gamma, torch.tensor([[2**-0.5, 1.0]]))
    assert torch.equal(router_shift_gamma(delta, gamma_min=0.8), torch.tensor([[0.8, 1.0]]))  # the floor binds


def test_gamma_is_exactly_one_when_the_router_is_unchanged():
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 5, 2, 8, generator=generator), dim=-1)[..., :2]
    ids = torch.randint(0, 8, (3, 5, 2, 2), generator=generator, dtype=torch.int16)
    stored = probs.to(torch.float16)
    # the current router in float32 differs from the stored float16 value below half precision: still exactly 1
    delta = router_shift(stored, probs, ids)
    assert torch.equal(delta, torch.zeros(3, 5))
    assert torch.equal(router_shift_gamma(delta, 0.8), torch.ones(3, 5))
    # a moved router gives gamma < 1 wherever an expert's probability changed
    moved = probs.clone()
    moved[1, 2, 0, 0] *= 0.7
    gamma = router_shift_gamma(router_shift(stored, moved, ids), 0.1)
    assert gamma[1, 2] < 1 and (gamma < 1).sum() == 1


def test_no_gradient_flows_through_gamma():
    old, current, ids = two_layer_example()
    current = current.clone().requires_grad_(True)
    gamma = router_shift_gamma(router_shift(old, current, ids), gamma_min=0.5)
    assert not gamma.requires_grad
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ratio = torch.exp(logps - shift_old_logps(torch.tensor([[-1.2, -2.0]]), gamma))
    ratio.sum().backward()
    assert current.grad is None
    # d(γ·w)/d logp = γ·w: γ is a constant factor
    torch.testing.assert_close(logps.grad, gamma[0].unsqueeze(0) * torch.exp(torch.tensor([[0.2, 0.0]])))


def test_shift_old_logps_rescales_the_ratio_and_leaves_old_untouched_at_gamma_one():
    logps = torch.tensor([[-0.5, -1.5, -3.0]])
    old = torch.tensor([[-0.7, -1.4, -2.0]])
    gamma = torch.tensor([[0.9, 1.0, 0.8]])
    torch.testing.assert_close(torch.exp(logps - shift_old_logps(old, gamma)), gamma * torch.exp(logps - old))
    assert torch.equal(shift_old_logps(old, torch.ones_like(old)), old)
    # sequence level: GSPO's ratio of the rescaled token weights = s · geometric mean of γ over valid tokens
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    s_tilde = torch.exp(sequence_log_weights(logps - shift_old_logps(old, gamma), mask))
    s = math.exp(((-0.5 + 0.7) + (-1.5 + 1.4)) / 2)
    torch.testing.assert_close(s_tilde, torch.tensor([[s * math.sqrt(0.9 * 1.0)]]))


def test_completion_alignment_picks_the_position_before_each_token():
    per_position = torch.arange(10.0).view(1, 10)  # P=6 prompt positions, C=4 completion tokens
    # token t sits at position 6+t and is scored by the forward at position 5+t
    assert completion_aligned(per_position, 4).tolist() == [[5.0, 6.0, 7.0, 8.0]]
    with pytest.raises(ValueError, match="completion_length"):
        completion_aligned(per_position, 10)


def test_router_shift_rejects_mismatched_shapes():
    old, current, ids = two_layer_example()
    with pytest.raises(ValueError, match=r"\[B, S, L, K\]"):
        router_shift(old, current[:, :1], ids)


# ---------------------------------------------------------------------------------------------- GSPO / clipping
def test_sequence_log_weights_and_clipped_surrogate_by_hand():
    log_ratio = torch.tensor([[0.1, 0.3, 5.0], [-0.2, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(sequence_log_weights(log_ratio, mask), torch.tensor([[0.2], [-0.2]]))

    ratio = torch.tensor([[1.5], [0.5], [1.1], [0.5]])
    advantages = torch.tensor([[1.0], [-1.0], [2.0], [1.0]])
    loss = clipped_surrogate(ratio, advantages, 0.2, 0.28)
    # -min(1.5, 1.28) = -1.28; -min(-0.5, -0.8) = 0.8; inside the region: -2.2; below with A>0: -0.5 (not clipped)
    torch.testing.assert_close(loss, torch.tensor([[-1.28], [0.8], [-2.2], [-0.5]]))
    low, high = clip_masks(ratio, advantages, 0.2, 0.28)
    assert low.flatten().tolist() == [False, True, False, False]
    assert high.flatten().tolist() == [True, False, False, False]


# ---------------------------------------------------------------------------------------------- MiniRL
def test_minirl_token_weights_by_hand():
    # four tokens of one completion (A = +1) and four of another (A = -1)
    current = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.4, 0.3, 0.5, 0.5], [0.6, 0.7, 0.5, 0.5]]))
    sampling = torch.log(torch.tensor([[0.5, 0.5, 0.05, 0.25], [0.5, 0.5, 0.5, float("nan")]]))
    advantages = torch.tensor([[1.0], [-1.0]])
    logps = current.clone().requires_grad_(True)
    weights = minirl_token_weights(
        logps, logps - old, sampling, advantages, epsilon_low=0.2, epsilon_high=0.27, is_cap=5.0
    )
    # r = [1.25, 1.667, 1, 1] and [0.833, 0.714, 1, 1]: A>0 & r>1.27 masks token (0,1); A<0 & r<0.8 masks (1,1)
    assert weights.high_clipped.tolist() == [[False, True, False, False], [False] * 4]
    assert weights.low_clipped.tolist() == [[False] * 4, [False, True, False, False]]
    # IS weight π/μ: 1, 1, 10 -> truncated to 5, 2; 1, 1, 1, NaN rollout log-prob -> 1
    torch.testing.assert_close(weights.is_weight, torch.tensor([[1.0, 1.0, 5.0, 2.0], [1.0, 1.0, 1.0, 1.0]]))
    assert weights.truncated.tolist() == [[False, False, True, False], [False] * 4]
    keep = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0]])
    torch.testing.assert_close(weights.weight, keep * weights.is_weight)
    # the weight is detached: TRL's -weight · Â · log π has gradient -M·w·Â per token
    assert not weights.weight.requires_grad
    (-weights.weight * advantages * logps).sum().backward()
    torch.testing.assert_close(logps.grad, -keep * weights.is_weight * advantages)


def test_minirl_gamma_rescales_both_ratios_before_mask_and_truncation():
    current = torch.log(torch.tensor([[0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    sampling = torch.log(torch.tensor([[0.5, 0.09]]))  # weights 1 and 5.56
    gamma = torch.tensor([[0.75, 0.85]])
    weights = minirl_token_weights(
        current, current - old, sampling, torch.tensor([[-1.0]]), 0.2, 0.27, 5.0, gamma=gamma
    )
    # γ·r = 0.75 < 0.8 with A<0: masked; the second token's weight 5.56·0.85 = 4.72 is no longer truncated
    assert weights.low_clipped.tolist() == [[True, False]]
    torch.testing.assert_close(weights.is_weight, torch.tensor([[0.75, 0.5 / 0.09 * 0.85]]))
    assert weights.weight[0, 0] == 0 and not weights.truncated.any()


def test_lower_quantile_matches_torch_quantile_and_skips_nan():
    values = torch.tensor([0.9, float("nan"), 0.8, 1.0, 0.85, 0.95])
    expected = torch.quantile(values[~values.isnan()], 0.1)
    torch.testing.assert_close(lower_quantile(values, 0.1), expected)
    assert lower_quantile(torch.tensor([float("nan")]), 0.1).isnan()


# ---------------------------------------------------------------------------------------------- router probes
def router_logits_probs(model, input_ids) -> dict[int, torch.Tensor]:
    """Reference: softmax of the router logits the model returns, per MoE layer ([N, E])."""
    with torch.no_grad():
        out = model(input_ids=input_ids, output_router_logits=True)
    rr = RouterReplay(model)
    rr.remove()
    return {
        layer: torch.softmax(logits.float(), -1)
        for layer, logits in zip(rr.moe_layers, out.router_logits, strict=True)
    }


def test_capture_stores_the_ids_actually_used_and_their_probabilities():
    torch.manual_seed(0)
    model = tiny_moe_model("qwen3_moe").eval()
    rr = RouterReplay(model)
    probes = RouterProbes(rr)
    input_ids = random_ids(2, 7)
    with torch.no_grad(), rr.record() as rec, probes.capture(2, 7) as cap:
        model(input_ids=input_ids)
    assert cap.ids.dtype == torch.uint8 and cap.probs.dtype == torch.float16  # 8 experts: one byte per id
    assert cap.ids.shape == cap.probs.shape == (2, 7, rr.num_layers, rr.top_k)
    assert torch.equal(cap.ids, rec.routes)  # no replay: the natural top-k
    reference = router_logits_probs(model, input_ids)
    for layer in rr.moe_layers:
        expected = reference[layer].gather(1, cap.ids[:, :, layer].reshape(-1, rr.top_k).long())
        torch.testing.assert_close(cap.probs[:, :, layer].reshape(-1, rr.top_k), expected.half())

    # under replay the ids captured are the replayed ones, and the probabilities are read there
    routes = shifted(rec.routes, rr.num_experts)
    with torch.no_grad(), rr.replay(routes), probes.capture(2, 7) as replayed:
        model(input_ids=input_ids)
    assert torch.equal(replayed.ids.sort(-1).values, routes.sort(-1).values)  # replay puts a new set in order
    layer = rr.moe_layers[0]
    expected = reference[layer].gather(1, replayed.ids[:, :, layer].reshape(-1, rr.top_k).long())
    torch.testing.assert_close(replayed.probs[:, :, layer].reshape(-1, rr.top_k), expected.half())


def test_capture_above_256_experts_holds_int16_ids_with_minus_one_in_dense_layers():
    model = tiny_moe_model("glm4_moe", n_routed_experts=300).eval()  # layer 0 is dense
    rr = RouterReplay(model)
    probes = RouterProbes(rr)
    with torch.no_grad(), rr.record() as rec, probes.capture(2, 5) as cap:
        model(input_ids=random_ids(2, 5))
    assert cap.ids.dtype == torch.int16 == rec.routes.dtype  # one byte no longer holds every id
    assert (cap.ids[:, :, 0] == -1).all() and (cap.ids[:, :, 1] >= 0).all()
    assert torch.equal(cap.ids, rec.routes)


def test_reading_at_old_ids_gives_gamma_one_at_the_same_weights_and_skips_dense_layers():
    torch.manual_seed(0)
    model = tiny_moe_model("glm4_moe").eval()  # layer 0 is dense
    rr = RouterReplay(model)
    assert rr.moe_layers == [1]
    probes = RouterProbes(rr)
    input_ids = random_ids(2, 6)
    with torch.no_grad(), probes.capture(2, 6) as cap:
        model(input_ids=input_ids)
    assert no_route(cap.ids[:, :, 0]).all() and (cap.probs[:, :, 0] == 0).all()
    with torch.no_grad(), probes.at(cap.ids) as reading:
        model(input_ids=input_ids)
    assert reading.probs.dtype == torch.float32
    assert torch.equal(router_shift(cap.probs, reading.probs, cap.ids), torch.zeros(2, 6))
    with torch.no_grad():
        router_weights = [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
        assert len(router_weights) == 1
        router_weights[0].add_(0.05 * torch.randn_like(router_weights[0]))  # move the router
    with torch.no_grad(), probes.at(cap.ids) as moved:
        model(input_ids=input_ids)
    assert (router_shift(cap.probs, moved.probs, cap.ids) > 0).all()


def test_gamma_of_token_t_uses_the_routing_of_the_position_that_scored_it():
    # Change completion token t0 of the training input: the router changes at positions >= P+t0 only. Token t's
    # log-prob depends on positions <= P+t-1, so with the right alignment exactly the tokens t > t0 see a shift,
    # and those are exactly the tokens whose log-prob changed context.
    torch.manual_seed(0)
    model = tiny_moe_model("qwen3_moe").eval()
    rr = RouterReplay(model)
    probes = RouterProbes(rr)
    prompt_len, completion_len, t0 = 5, 6, 2
    old_ids = random_ids(1, prompt_len + completion_len)
    new_ids = old_ids.clone()
    new_ids[0, prompt_len + t0] = (old_ids[0, prompt_len + t0] + 7) % 100 + 6
    with torch.no_grad(), probes.capture(1, old_ids.shape[1]) as cap:
        old_logits = model(input_ids=old_ids).logits
    with torch.no_grad(), probes.at(cap.ids) as reading:
        new_logits = model(input_ids=new_ids).logits
    delta = completion_aligned(router_shift(cap.probs, reading.probs, cap.ids), completion_len)[0]
    assert torch.equal(delta[: t0 + 1], torch.zeros(t0 + 1))
    assert (delta[t0 + 1 :] > 0).all()
    # the same split in the predictive distributions that score the completion tokens (TRL: logits[:, -C-1:-1]);
    # earlier positions may differ in the last bits only (experts batch a different token set)
    change = (completion_aligned(old_logits, completion_len) - completion_aligned(new_logits, completion_len)).abs()
    assert (change.amax(-1)[0] > 1e-3).tolist() == [t > t0 for t in range(completion_len)]


def test_backward_recompute_is_ignored_and_bad_ids_raise():
    torch.manual_seed(0)
    model = tiny_moe_model("qwen3_moe")
    model.gradient_checkpointing_enable()
    model.train()
    rr = RouterReplay(model)
    probes = RouterProbes(rr)
    input_ids = random_ids(2, 5)
    with torch.no_grad(), probes.capture(2, 5) as cap:
        model(input_ids=input_ids)
    with probes.at(cap.ids) as reading:  # backward inside: the recompute runs every router a second time
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert reading.probs.shape == cap.probs.shape
    with pytest.raises(Exception, match="expert ids must be in"):
        with probes.at(torch.full_like(cap.ids, rr.num_experts)):
            pass
    with pytest.raises(Exception, match="declared as 2x4"):
        with torch.no_grad(), probes.capture(2, 4):
            model(input_ids=input_ids)
    probes.remove()
    with pytest.raises(RuntimeError, match="removed"):
        with probes.capture(2, 5):
            pass
