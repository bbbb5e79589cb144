"""The trainers' mismatch and routing metrics (trl_moe_replay.core.metrics) when there is nothing to measure: no data
(NaN), never a zero that passes for a perfect step, and no-data steps leave a logging window's average alone (issue
16)."""

import math

import pytest

from trl_moe_replay.testing import (
    FakeVLLMServer,
    tiny_moe_model,
    trl_vllm_transport_stub,
)

from tests.trainer.test_grpo_trainer import logged, make_trainer


MISMATCH = ["mismatch/kl_k1", "mismatch/kl_k3", "mismatch/extreme_frac"]
ROUTING = ["routing/mismatch_frac", "routing/token_any_mismatch", "routing/topk_agreement"]


# ----------------------------------------------------------------------------- metrics without data
def test_mismatch_metrics_are_no_data_not_zero_when_every_completion_is_masked(tmp_path):
    # every completion runs to max_completion_length without EOS and is masked (mask_truncated_completions):
    # no completion token is measured, so 0.0 (a perfect score) would be a lie
    trainer = make_trainer(
        tmp_path,
        tiny_moe_model("qwen3_moe"),
        max_steps=1,
        mask_truncated_completions=True,
        generation_kwargs={"min_new_tokens": 6},
    )
    trainer.train()
    (entry,) = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
    for name in MISMATCH:
        assert entry[name] is None, name  # TRL's log: NaN for every value of the window -> None ("no data")
    assert entry["routing/fallback_frac"] == 0.0  # prompt positions were measured: a real 0
    assert all(math.isfinite(entry[name]) for name in ROUTING)


def test_routing_ratios_are_no_data_when_no_route_arrived(tmp_path):
    # batch 2: no payload at all (every request aborted): nothing to compare the trainer's routing with
    tamper = lambda call, choice, payload: None if call == 1 else payload  # noqa: E731
    with FakeVLLMServer(tiny_moe_model("qwen3_moe"), tamper=tamper) as server, trl_vllm_transport_stub(server):
        trainer = make_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe"),
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=server.url,
            vllm_weight_sync="trl",
        )
        trainer.train()
    assert logged(trainer, "routing/fallback_frac") == [0.0, 1.0]
    for name in ROUTING:
        first, second = logged(trainer, name)
        assert math.isfinite(first) and second is None, name


def test_no_data_steps_do_not_pull_the_average_of_a_logging_window(tmp_path):
    # TRL averages a logging window with NaN filtered out: a no-data step leaves the others' mean as it is
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1)
    trainer.model.train()
    trainer._metrics["train"]["mismatch/kl_k3"] = [0.2, math.nan, 0.4]  # TRL's metric buffer: what log() averages
    logs = {}
    trainer.log(logs)
    assert logs["mismatch/kl_k3"] == pytest.approx(0.3)
