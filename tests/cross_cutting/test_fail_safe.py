"""Training keeps going, and says so, when inputs are bad or absent (issue 16): a fuzz of corrupted vLLM route
payloads, through the alignment and through a whole run. The other halves of issue 16 are tests of their modules:
metrics without data (tests/core/test_metrics.py), one output directory per trainer (tests/core/test_output_lock.py)."""

import collections

import numpy as np
import pytest
import torch

from trl_moe_replay.routing.codec import decode_routed_experts, encode_routed_experts, engine_dtype, routes_from_engine
from trl_moe_replay.routing.routes import has_route, no_route_value
from trl_moe_replay.testing import (
    CORRUPTIONS,
    NEVER_WRITTEN,
    FakeVLLMServer,
    RouteFuzzer,
    corrupt_route_payload,
    tiny_moe_model,
    trl_vllm_transport_stub,
)

from tests.helpers import no_route
from tests.rollouts.test_vllm_routes import BatchSpy
from tests.trainer.test_grpo_trainer import logged, make_trainer


# ----------------------------------------------------------------------------- fuzz: corrupted vLLM route payloads
def test_every_corruption_kind_is_rejected_per_sample_in_alignment():
    """Hundreds of corruptions over many synthetic generation batches, through the alignment the vLLM trainer uses
    (routes_from_engine with on_error): exactly the corrupted samples fall back, the others keep their routes; a
    never-written route costs its sample that one position (reported), not its other routes."""
    rng = np.random.default_rng(0)
    seen = collections.Counter()
    for batch in range(40):
        layers, top_k = int(rng.integers(2, 5)), int(rng.integers(1, 5))
        num_experts = int(rng.choice([8, 64, 256, 300]))
        moe = sorted(rng.choice(layers, int(rng.integers(1, layers + 1)), replace=False).tolist())
        prompts, completions = rng.integers(1, 9, 16).tolist(), rng.integers(0, 9, 16).tolist()
        clean, payloads, bad, unwritten = [], [], [], {}
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            ids = [rng.permutation(num_experts)[:top_k] for _ in range((p + c - 1) * layers)]
            rows = np.array(ids, dtype=engine_dtype(num_experts)).reshape(p + c - 1, layers, top_k)
            rows[:, [layer for layer in range(layers) if layer not in moe]] = 0  # dense layers: zeros, as vLLM
            clean.append(rows)
            payload = encode_routed_experts(rows)
            if rng.random() < 0.6:
                kind, payload = corrupt_route_payload(payload, rng, num_experts=num_experts, moe_layers=moe)
                seen[kind] += 1
                if kind == NEVER_WRITTEN:  # the position whose route at one MoE layer is all zeros
                    unwritten[i] = int(np.flatnonzero(~decode_routed_experts(payload)[:, moe].any(-1).all(-1))[0])
                else:
                    bad.append(i)
            payloads.append(payload)
        errors, reports = [], []
        layout = dict(
            prompt_lengths=prompts,
            completion_lengths=completions,
            prompt_width=8,
            completion_width=8,
            num_layers=layers,
            top_k=top_k,
            moe_layers=moe,
            num_experts=num_experts,
        )
        routes = routes_from_engine(payloads, on_error=errors.append, on_unwritten=reports.append, **layout)
        missing = [i for i in bad if payloads[i] is None]
        assert sorted(e.sample for e in errors) == [i for i in bad if i not in missing], batch
        assert [(r.sample, r.count, r.first) for r in reports] == [(i, 1, q) for i, q in sorted(unwritten.items())]
        assert no_route(routes[bad]).all()
        good = [i for i in range(16) if i not in bad]
        good_layout = {
            **layout,
            "prompt_lengths": [prompts[i] for i in good],
            "completion_lengths": [completions[i] for i in good],
        }
        expected = routes_from_engine([clean[i] for i in good], **good_layout)
        for row, i in enumerate(good):
            if i in unwritten:  # that position alone: "no route" at every layer
                expected[row, 8 - prompts[i] + unwritten[i]] = no_route_value(routes.dtype)
        assert torch.equal(routes[good], expected)
    assert sum(seen.values()) >= 300 and set(seen) == set(CORRUPTIONS), seen


def test_fuzzed_route_payloads_never_end_the_run_and_fallback_frac_is_exact(tmp_path):
    model_kwargs = dict(num_hidden_layers=3, mlp_only_layers=[0])  # layer 0 dense: zeros on the wire
    fuzzer = RouteFuzzer(seed=3, num_experts=8, moe_layers=[1, 2], rate=0.6)
    with (
        FakeVLLMServer(tiny_moe_model("qwen3_moe", **model_kwargs), tamper=fuzzer) as server,
        trl_vllm_transport_stub(server),
    ):
        trainer = make_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe", **model_kwargs),
            cls=BatchSpy,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=server.url,
            max_steps=6,
            vllm_weight_sync="trl",
            per_device_train_batch_size=16,
        )
        trainer.train()
    assert trainer.state.global_step == 6  # no single sample ended the run
    assert len(server.batches) == 6 and all(len(b.payloads) == 32 for b in server.batches)
    assert len(fuzzer.corrupted) >= 100 and set(fuzzer.corrupted.values()) == set(CORRUPTIONS)
    expected, expected_samples = [], []
    for call, batch in enumerate(trainer.batches):
        bad, unwritten = fuzzer.whole(call), fuzzer.unwritten(call)
        assert no_route(batch["replay_routes"][bad]).all()
        routed = has_route(batch["replay_routes"][:, :, 1:]).all(-1).sum(1)  # positions with a route
        routable = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1) - 1).float()
        assert routed[unwritten].tolist() == (routable[unwritten] - 1).tolist()  # one position each fell back
        expected.append(((routable[bad].sum() + len(unwritten)) / routable.sum()).item())
        expected_samples.append(len(bad) / len(routable))
    assert logged(trainer, "routing/fallback_frac") == pytest.approx(expected, abs=1e-6)
    assert logged(trainer, "routing/fallback_samples_frac") == pytest.approx(expected_samples)
    assert logged(trainer, "routing/mismatch_frac") == [0.0] * 6  # the good samples replayed the server's routes
