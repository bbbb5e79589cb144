"""R3 with TRL's AsyncGRPOTrainer, trainer side, without a server: scripted rollout samples (tests/async_checks.py
checks the routes used token by token). The rollout side against the real vLLM CPU server is tests/cross_cutting/test_async_engine.py.
"""

import json
import math
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from datasets import Dataset
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, packing as trl_packing
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from trl_moe_replay import (
    MoEReplayAsyncGRPOConfig,
    MoEReplayAsyncGRPOTrainer,
    RouterReplay,
    RoutesUnavailableError,
    RouteValidationError,
    upstream,
)
from trl_moe_replay.async_grpo import cpu_tree_attention
from trl_moe_replay.async_grpo.async_grpo_trainer import _RoutedCollator
from trl_moe_replay.async_grpo.async_rollout_worker import (
    RoutedRolloutSample,
    _TurnRoutes,
    held_positions,
    turns_for_row,
)
from trl_moe_replay.async_grpo.packing import RoutedTreeRow, TorchVarlenAttention
from trl_moe_replay.core.launch import LaunchMismatchError
from trl_moe_replay.core.output_lock import LOCK_NAME, OutputDirInUseError
from trl_moe_replay.core.route_flow import ROUTE_ROWS, RouteBuffer
from trl_moe_replay.routing.codec import EngineTurn
from trl_moe_replay.routing.routes import RouteLayout, check_routes
from trl_moe_replay.testing import tiny_moe_model
from trl_moe_replay.testing.async_workers import NoOpWeightTransfer, ScriptedRolloutWorker, sampled_routes

from tests.async_checks import capture_used_experts, check_row, packed_row
from tests.helpers import hooks_of_ours, module_hooks


STEPS = 2
DATASET = Dataset.from_dict(
    {"prompt": [[{"role": "user", "content": f"{a}+{b}="}] for a in range(4) for b in range(4)]}
)
BATCH = 8  # samples per micro-batch (FixedCountBatcher: token_budget=0)
TRL_FLASH_ATTN = trl_packing._flash_attn  # TRL's FlashAttention-3 lookup, as imported


def reward(completions, **kwargs):
    return [0.0] * len(completions)


def perturbed(model, seed):
    """The same model after some updates: other weights, other routes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def script(checkpoint, versions, *, routes=True, seed=0, malformed=(), shared_prompt=False):
    """Groups of 4 samples sharing a prompt; group ``g`` was sampled by version ``versions[g]`` (its routes from
    those weights); with ``shared_prompt`` groups 0 and 1 have the same prompt. Returns the samples and
    ``{tokens: [engine rows]}`` for the check."""
    from transformers import AutoModelForCausalLM

    engines = {}
    generator = torch.Generator().manual_seed(seed)
    samples, engine_rows = [], {}
    for group, version in enumerate(versions):
        if version not in engines:
            engine = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
            engines[version] = perturbed(engine, version) if version else engine
        prompt = torch.randint(10, 60, (5,), generator=generator).tolist()
        if shared_prompt and group == 1:
            prompt = samples[0].input_ids[:5].tolist()
        for _ in range(4):
            completion = torch.randint(
                10, 60, (int(torch.randint(3, 7, (1,), generator=generator)),), generator=generator
            ).tolist()
            ids = prompt + completion
            rows = sampled_routes(engines[version], ids)
            engine_rows.setdefault(tuple(ids), []).append(rows)
            fields = dict(
                prompt=[{"role": "user", "content": "x"}],
                completion=[{"role": "assistant", "content": "y"}],
                input_ids=np.array(ids),
                completion_mask=np.array([0] * len(prompt) + [1] * len(completion)),
                old_log_probs=(-torch.rand(len(ids), generator=generator) * 3).numpy().astype(np.float32),
                advantage=float(torch.randn(1, generator=generator)),
                model_version=version,
                group_id=group,
                metrics={"reward": 0.5},
            )
            if not routes:
                samples.append(RolloutSample(**fields))
                continue
            turn_rows = "not base64!" if len(samples) in malformed else rows
            samples.append(
                RoutedRolloutSample(
                    **fields,
                    route_turns=[EngineTurn(turn_rows, len(prompt), len(completion))],
                    route_prompt_length=len(prompt),
                    sampled_versions=(version, version),
                )
            )
    return samples, engine_rows


def settings(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=STEPS,
        logging_steps=1,
        per_device_train_batch_size=BATCH,
        num_generations=4,
        save_strategy="no",
        seed=0,
        token_budget=0,
        max_staleness=100,
        learning_rate=1e-2,
        bf16=False,
    )
    values.update(overrides)
    return values


def scripted_trainer(tmp_path, checkpoint, samples, cls=None, **overrides):
    """A trainer (``cls``, default ours) fed ``samples`` by the scripted worker, with no weight transfer and no sync
    check (no engine to probe); ``overrides`` go to the config."""
    cls = cls or MoEReplayAsyncGRPOTrainer
    args = MoEReplayAsyncGRPOConfig(**settings(tmp_path, vllm_sync_check=False, **overrides))
    return cls(
        model=checkpoint,
        reward_funcs=reward,
        train_dataset=DATASET,
        args=args,
        rollout_worker=ScriptedRolloutWorker(samples),
        weight_transfer=NoOpWeightTransfer(),
    )


class CheckedTrainer(MoEReplayAsyncGRPOTrainer):
    """Checks, in every training forward, the experts used against the engine's rows (tests/async_checks.py)."""

    engine_rows: dict = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        row = packed_row(inputs)
        with capture_used_experts(self.accelerator.unwrap_model(model)) as used:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        found, checked, mismatched = check_row(row, used, self.engine_rows, self._route_replay.moe_layers)
        self.checks = [*getattr(self, "checks", []), (found, checked, mismatched)]
        return loss


def test_r3_replays_each_sample_routes_in_packed_rows_mixing_versions(tmp_path, checkpoint):
    # micro-batch 1 mixes versions 0 and 1 (same prompt in groups 0 and 1: a shared prefix routed differently); every
    # version is one the trainer has published when the sample is taken (version 1 after the cold sync: the batches
    # are taken ahead of the step that syncs version 2, and a version the trainer never published is dropped)
    samples, engine_rows = script(
        checkpoint, versions=[0, 1, 0, 1, 0, 0], shared_prompt=True
    )  # + 1 batch accelerate prefetches
    CheckedTrainer.engine_rows = engine_rows
    trainer = scripted_trainer(tmp_path, checkpoint, samples, cls=CheckedTrainer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert len(trainer.checks) == STEPS
    for found, checked, mismatched in trainer.checks:
        assert found == BATCH and checked > 40 and mismatched == 0
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["routing/fallback_frac"] == 0.0 for entry in logs)
    assert logs[0]["routing/batch_versions_max"] == 2.0  # the first micro-batch mixed two policy versions
    # staleness: the trainer is at version 1 after its cold sync, then 2
    assert logs[0]["routing/version_lag_max"] == 1.0 and logs[1]["routing/version_lag_max"] == 2.0
    assert logs[0]["routing/mismatch_frac"] > 0  # the trainer's own routing disagrees with version 1's routes
    assert math.isfinite(logs[0]["mismatch/kl_k3"])
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_r3_with_token_budget_packing_replays_each_sample_routes(tmp_path, checkpoint):
    """TRL's default packing (``token_budget`` None: the server's max_model_len; here 128): its TokenBudgetBatcher
    builds rows through the name ``TreeRow`` and also uses it as a type, so the routed rows must stand in as a class
    (a factory function failed at the first micro-batch: ``TypeError`` in ``TreeRow | None``)."""
    samples, engine_rows = script(checkpoint, versions=[0, 1, 0, 1] + [1] * 12, shared_prompt=True)
    CheckedTrainer.engine_rows = engine_rows
    trainer = scripted_trainer(tmp_path, checkpoint, samples, cls=CheckedTrainer, token_budget=128)
    trainer.train()
    assert len(trainer.checks) == STEPS
    for found, checked, mismatched in trainer.checks:
        assert found > BATCH and checked > 40 and mismatched == 0  # more samples than a fixed count: budget-packed
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["routing/fallback_frac"] == 0.0 for entry in logs)


@pytest.fixture
def route_checks(monkeypatch):
    """Counts the full host passes of ``validate_routes`` (its flat check of every row) and the replayed forwards."""
    from trl_moe_replay.routing import routes as routes_module

    counts = {"host_passes": 0, "replays": 0}
    full_pass, replay = routes_module._every_row_valid, RouterReplay.replay

    def counted_pass(*args, **kwargs):
        counts["host_passes"] += 1
        return full_pass(*args, **kwargs)

    def counted_replay(self, routes):
        counts["replays"] += 1
        return replay(self, routes)

    monkeypatch.setattr(routes_module, "_every_row_valid", counted_pass)
    monkeypatch.setattr(RouterReplay, "replay", counted_replay)
    return counts


def run_checked(tmp_path, checkpoint, versions):
    samples, engine_rows = script(checkpoint, versions=versions)
    CheckedTrainer.engine_rows = engine_rows
    trainer = scripted_trainer(tmp_path, checkpoint, samples, cls=CheckedTrainer)
    trainer.train()
    assert len(trainer.checks) == STEPS
    for found, checked, mismatched in trainer.checks:  # every sample's routes used, token by token
        assert found == BATCH and checked > 40 and mismatched == 0
    return trainer


def test_r3_checks_routes_where_they_enter_not_at_every_training_forward(tmp_path, checkpoint, route_checks):
    """Routes are checked where they enter (``RouteIntake.align``, by construction), packed from checked parts, and
    held by the trainer while the batch carries their ``route_rows`` through the collator, accelerate's dispatch and
    compute_loss's mask: no forward runs the host pass."""
    run_checked(tmp_path, checkpoint, versions=[0, 1, 0, 1, 0, 0])
    assert route_checks["replays"] == STEPS
    assert route_checks["host_passes"] == 0


def test_r3_routes_from_an_unchecked_source_are_checked_in_full_where_they_enter_the_row(
    tmp_path, checkpoint, route_checks, monkeypatch
):
    align = MoEReplayAsyncGRPOTrainer._align_sample
    monkeypatch.setattr(
        MoEReplayAsyncGRPOTrainer, "_align_sample", lambda self, sample: align(self, sample).tensor()
    )  # a plain tensor: not what the intake checked
    run_checked(tmp_path, checkpoint, versions=[0, 1, 0, 1, 0, 0])
    assert route_checks["replays"] == STEPS
    assert route_checks["host_passes"] >= STEPS * BATCH  # each sample's, once, as it entered a packed row


def test_without_replay_the_same_check_finds_mismatches(tmp_path, checkpoint):
    """Negative control: routing_replay='none' with routing_metrics carries the routes but does not replay them."""
    samples, engine_rows = script(checkpoint, versions=[1] * 6)
    CheckedTrainer.engine_rows = engine_rows
    trainer = scripted_trainer(
        tmp_path, checkpoint, samples, cls=CheckedTrainer, routing_replay="none", routing_metrics=True
    )
    trainer.train()
    assert all(found == BATCH for found, _, _ in trainer.checks)
    assert sum(mismatched for _, _, mismatched in trainer.checks) > 0
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["routing/mismatch_frac"] > 0 for entry in logs)


def test_malformed_routes_fall_back_per_sample_and_the_run_goes_on(tmp_path, checkpoint):
    samples, _ = script(checkpoint, versions=[0] * 6, malformed=(3, 9))
    trainer = scripted_trainer(tmp_path, checkpoint, samples)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == STEPS
    assert 0 < logs[0]["routing/fallback_frac"] < 0.3 and 0 < logs[1]["routing/fallback_frac"] < 0.3
    assert trainer._route_intake.fallback_samples == 2
    # whole samples, counted as they are aligned (leaving the queue, which runs ahead of the training forwards)
    whole = [entry["routing/fallback_samples_frac"] for entry in logs]
    assert 0 < max(whole) and all(0 <= value < 0.3 for value in whole)


def test_r3_without_any_routes_in_the_first_sample_stops_with_a_clear_error(tmp_path, checkpoint):
    samples, _ = script(checkpoint, versions=[0, 0], routes=False)
    trainer = scripted_trainer(tmp_path, checkpoint, samples)
    with pytest.raises(RoutesUnavailableError, match="enable-return-routed-experts"):
        trainer.train()


def test_one_bad_sample_arriving_first_falls_back_and_the_run_goes_on(tmp_path, checkpoint):
    """The first-batch rule waits for a whole batch: the first dequeued sample without routes, and the second one row
    short, fall back like any other sample (they ended the run when the rule judged the first sample alone)."""
    samples, _ = script(checkpoint, versions=[0] * 6)
    samples[0].route_turns = []
    turn = samples[1].route_turns[0]
    samples[1].route_turns = [EngineTurn(turn.rows[:-1], turn.prompt_length, turn.completion_length)]
    trainer = scripted_trainer(tmp_path, checkpoint, samples)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == STEPS and 0 < logs[0]["routing/fallback_frac"] < 0.4 and logs[1]["routing/fallback_frac"] == 0
    assert trainer._route_intake.fallback_samples == 2
    # the trainer held the CPU tree attention only while it trained: TRL's kernel lookup is back in place
    assert trl_packing._flash_attn is TRL_FLASH_ATTN


def test_routes_that_stop_arriving_end_the_run_when_configured(tmp_path, checkpoint):
    good, _ = script(checkpoint, versions=[0, 0])
    bare, _ = script(checkpoint, versions=[0] * 6, routes=False, seed=1)
    trainer = scripted_trainer(tmp_path, checkpoint, good + bare, max_steps=4, max_route_fallback_steps=2)
    with pytest.raises(
        RoutesUnavailableError,
        match="vLLM routes stopped arriving: every sample of the last 2 batches .* max_route_fallback_steps is 2",
    ):
        trainer.train()
    # step 1 replayed; the samples of steps 2 and 3 all fell back: the error comes as accelerate fetches step 3's
    # batch, ahead, before step 2's optimizer step
    assert trainer.state.global_step == 1


def test_samples_with_versions_the_trainer_never_published_are_dropped_and_counted(tmp_path, checkpoint):
    samples, _ = script(checkpoint, versions=[0] * 7)
    samples[2].model_version = 10**9  # newer than the trainer: not this run's policy
    samples[9].model_version = "1"  # not an integer (TRL's staleness check would raise on it)
    samples[12].model_version = -1
    trainer = scripted_trainer(tmp_path, checkpoint, samples)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == STEPS
    assert sum(entry.get("sample/dropped_bad_version_total", 0) for entry in logs) == 3
    assert all(0 <= entry["routing/version_lag_mean"] <= entry["routing/version_lag_max"] <= 2 for entry in logs)


def test_route_intake_warns_once_when_routes_stop_arriving_and_again_after_they_come_back(caplog):
    from trl_moe_replay.rollouts.route_intake import RouteIntake

    layout = RouteLayout(num_layers=2, top_k=1, num_experts=4, moe_layers=(0, 1))
    good = [EngineTurn(np.zeros((3, 2, 1), dtype=np.uint8), 2, 2)]
    bad = [EngineTurn(None, 4, 0)]

    def align(intake, turns):
        intake.align(
            [turns],
            layout,
            prompt_lengths=[turns[0].prompt_length],
            completion_lengths=[2 if turns is good else 0],
            prompt_width=turns[0].prompt_length,
            completion_width=2 if turns is good else 0,
        )

    intake = RouteIntake(None, source="vLLM", required=True, batch_samples=2)
    align(intake, bad)  # first sample bad, second good: the first batch fits, no error
    align(intake, good)
    with caplog.at_level("WARNING"):
        for _ in range(2 * 3):  # three batches in a row fall back
            align(intake, bad)
        assert sum("routes stopped arriving" in r.message for r in caplog.records) == 1
        for _ in range(2 * 3):  # still falling back: no second warning for the same run of batches
            align(intake, bad)
        assert sum("routes stopped arriving" in r.message for r in caplog.records) == 1
        align(intake, good)  # routes are back, then stop again
        for _ in range(2 * 3):
            align(intake, bad)
        assert sum("routes stopped arriving" in r.message for r in caplog.records) == 2
    with pytest.raises(RoutesUnavailableError, match="first batch fits .*2 samples here"):
        whole_first_batch_bad = RouteIntake(None, source="vLLM", required=True, batch_samples=2)
        align(whole_first_batch_bad, bad)
        align(whole_first_batch_bad, bad)


def test_max_route_fallback_steps_is_checked(tmp_path):
    with pytest.raises(ValueError, match="max_route_fallback_steps must be >= 1, got 0"):
        MoEReplayAsyncGRPOConfig(output_dir=str(tmp_path), max_route_fallback_steps=0, use_cpu=True, bf16=False)


def test_use_cpu_builds_on_a_machine_with_cuda(tmp_path, checkpoint, monkeypatch):
    """TRL's MFU lookup asks CUDA for the name of the trainer's device; with use_cpu on a CUDA machine that device is
    the CPU, and CUDA refuses (issue 30: 5 tests failed on a GPU machine). Simulated: CUDA 'available', and
    get_device_name refusing a CPU device as CUDA does."""

    def device_name(device=None):
        if torch.device(device if device is not None else "cuda").type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return "NVIDIA H200"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", device_name)
    samples, _ = script(checkpoint, versions=[0, 0])
    trainer = MoEReplayAsyncGRPOTrainer(
        model=checkpoint,
        reward_funcs=reward,
        train_dataset=DATASET,
        args=MoEReplayAsyncGRPOConfig(**settings(tmp_path)),
        rollout_worker=ScriptedRolloutWorker(samples),
    )
    assert trainer.accelerator.device.type == "cpu" and trainer._on_cpu
    assert type(trainer.weight_transfer).__name__ == "ReloadWeightTransfer"  # "auto" off CUDA: no NCCL


def test_a_second_async_run_on_a_held_output_dir_is_refused_and_end_releases_the_lock(tmp_path, checkpoint):
    """The sync trainer's lock (tests/core/test_output_lock.py), by the same code: a live run of another process holds
    output_dir (its lock names the parent process of this one, alive on this host): train() refuses in one line."""
    lock_path = tmp_path / LOCK_NAME
    lock_path.write_text(
        json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "token": "theirs", "started": "earlier"})
    )
    samples, _ = script(checkpoint, versions=[0, 0, 1, 1, 2, 2])
    trainer = scripted_trainer(tmp_path, checkpoint, samples, max_steps=1)
    model = trainer.accelerator.unwrap_model(trainer.model)
    before = module_hooks(model)
    assert hooks_of_ours(model) == 7  # RouterReplay's: the routers, MoE blocks and stack of the 2-layer model
    with pytest.raises(OutputDirInUseError, match=f"in use by another trainer: pid {os.getppid()} on ") as refused:
        trainer.train()
    assert "\n" not in str(refused.value) and trainer.state.global_step == 0
    assert json.loads(lock_path.read_text())["token"] == "theirs"  # left alone
    assert hooks_of_ours(model) == 0  # the cleanup ran on the exception out of train()
    lock_path.unlink()  # that run ended
    trainer.train()  # the hooks are back for it
    assert trainer.state.global_step == 1 and hooks_of_ours(model) == 7
    assert json.loads(lock_path.read_text())["pid"] == os.getpid()  # held after train(): save_model comes next
    trainer.end()
    assert not lock_path.exists()  # a later run, of any process, starts
    # no hook of ours left; the others are the model's own and transformers'
    assert hooks_of_ours(model) == 0
    assert all(
        key[2].startswith("transformers.") for key, count in module_hooks(model).items() if count > before.get(key, 0)
    )


def test_the_async_trainer_checks_the_launch_like_the_sync_one(tmp_path, checkpoint, monkeypatch):
    samples, _ = script(checkpoint, versions=[0, 0])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch` exports from a bf16 config
    with pytest.raises(LaunchMismatchError, match="bf16=False"):
        scripted_trainer(tmp_path, checkpoint, samples)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # an FSDP config; one CPU process: no FSDP here
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # accelerate's FSDP plugin writes it; undone after
    with pytest.raises(LaunchMismatchError, match="asked for FSDP .* set up NO"):
        scripted_trainer(tmp_path, checkpoint, samples)


def test_r2_and_pr2_are_refused_with_the_reason(tmp_path):
    for mode in ("r2", "pr2"):
        with pytest.raises(ValueError, match="old-policy forward"):
            MoEReplayAsyncGRPOConfig(output_dir=str(tmp_path), routing_replay=mode, use_cpu=True, bf16=False)


# --------------------------------------------------------------------------------------------- packing with routes
LAYOUT = RouteLayout(num_layers=2, top_k=2, num_experts=8, moe_layers=(0, 1))  # tiny qwen3_moe's


def row_sample(ids, routes, group=0):
    return {
        "input_ids": torch.tensor(ids),
        "completion_mask": torch.tensor([0, 0] + [1] * (len(ids) - 2)),
        "old_log_probs": torch.zeros(len(ids)),
        "advantage": 1.0,
        "group_id": group,
        "replay_routes": routes,
    }


def routes_of(values, length):
    """A sample's routes as the intake hands them over: checked, ``[1, length, 2, 2]``."""
    return check_routes(torch.tensor(values, dtype=torch.uint8).reshape(1, 1, 1, 2).expand(1, length, 2, 2), LAYOUT)


def test_a_shared_prefix_is_shared_only_where_the_routes_agree():
    same, other = routes_of([1, 2], 5), routes_of([3, 4], 5)
    shared = RoutedTreeRow(LAYOUT)
    shared.add(row_sample([5, 6, 7, 8, 9], same))
    shared.add(row_sample([5, 6, 7, 11, 12], routes_of([2, 1], 5)))  # same experts, listed in another order
    assert len(shared.tokens) == 8  # 2 shared (TRL forks one token before the tokens differ) + 3 + 3
    forked = RoutedTreeRow(LAYOUT)
    forked.add(row_sample([5, 6, 7, 8, 9], same))
    forked.add(row_sample([5, 6, 7, 11, 12], other))  # sampled by other weights: nothing shared
    assert len(forked.tokens) == 10
    packed = forked.pack()
    routes = forked.packed_routes.tensor()[0]
    assert routes.shape == (10, 2, 2)
    # every sample's positions carry its own routes, the last token none (never forwarded by the engine)
    assert sorted(routes[packed["route_expected"]][:, 0, 0].tolist()) == [1] * 4 + [3] * 4
    assert (routes[~packed["route_expected"]] == 255).all()


def test_without_routes_the_row_is_trl_row():
    trl_row, ours = upstream.async_tree_row_class()(), RoutedTreeRow(LAYOUT)
    for ids in ([5, 6, 7, 8, 9], [5, 6, 7, 11, 12], [5, 6, 1]):
        trl_row.add(row_sample(ids, None))
        ours.add(row_sample(ids, None))
    theirs, mine = trl_row.pack(), ours.pack()
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key


def test_routed_batchers_build_routed_rows_and_leave_trl_module_alone():
    """TRL's batchers build the routed rows through their own code (seam entry ``async_batcher_rows``) while TRL's
    module keeps its own ``TreeRow``: nothing is swapped while they run (another batcher, in any thread, builds TRL's
    rows)."""
    import collections
    import sys

    from trl_moe_replay.async_grpo.async_grpo_trainer import _RoutedFixedCountBatcher, _RoutedTokenBudgetBatcher

    trl_module = sys.modules[upstream.TokenBudgetBatcher.__module__]
    trl_row, row_class = upstream.async_tree_row_class(), RoutedTreeRow.for_layout(LAYOUT)
    seen = []

    def samples():
        for ids in ([5, 6, 7, 8, 9], [5, 6, 7, 11, 12], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7]):
            seen.append(trl_module.TreeRow)  # what TRL's module holds while its batcher runs
            yield row_sample(ids, routes_of([1, 2], len(ids)))

    budget = _RoutedTokenBudgetBatcher(samples(), 1, 10, collections.defaultdict(list), row_class=row_class)
    fixed = _RoutedFixedCountBatcher(samples(), 1, 2, row_class=row_class)
    for batcher, micro_batches in ((budget, 1), (fixed, 2)):
        seen.clear()
        rows = [row for micro_batch in batcher for row in micro_batch]
        assert len(rows) == micro_batches and all(type(row) is row_class for row in rows)
        assert len(rows[0].samples) == 2 and len(rows[0].tokens) == 8  # the first two share a prefix of two
        assert seen == [trl_row] * 4 and trl_module.TreeRow is trl_row


def test_a_packed_row_is_built_from_checked_routes_and_a_plain_tensor_is_checked_as_it_enters(route_checks):
    """pack() lays the intake's checked routes onto the packed positions (checked by construction: the forward needs
    no host pass); a plain tensor in a sample is checked in full as it enters the row, and an invalid one is refused
    there, before any forward."""
    model = tiny_moe_model("qwen3_moe")
    rr = RouterReplay(model)  # 2 layers, top-2 of 8 experts: LAYOUT
    assert rr.layout == LAYOUT

    def packed(*routes):
        row = RoutedTreeRow(LAYOUT)
        for index, sample_routes in enumerate(routes):
            row.add(row_sample([5, 6, 7, 8 + index, 9], sample_routes))
        return row, row.pack()

    passes = route_checks["host_passes"]
    row, out = packed(routes_of([1, 2], 5), routes_of([3, 4], 5), None)  # None: a sample without routes
    assert route_checks["host_passes"] == passes + 2  # the two checks where the routes entered (routes_of)
    with torch.no_grad(), rr.replay(row.packed_routes):
        model(out["input_ids"][None])
    assert route_checks["host_passes"] == passes + 2  # no host pass at the forward

    raw = torch.tensor([1, 2], dtype=torch.uint8).expand(1, 5, 2, 2).clone()
    passes = route_checks["host_passes"]
    row, out = packed(routes_of([3, 4], 5), raw)
    assert route_checks["host_passes"] == passes + 2  # routes_of's, and the raw tensor's as it entered the row
    assert torch.equal(row.packed_routes.tensor()[0, 5:9], raw[0, :4])  # the second sample, after the first
    raw[0, 2, 0] = torch.tensor([6, 6], dtype=torch.uint8)  # a duplicate id
    with pytest.raises(RouteValidationError, match="names the same expert twice"):
        packed(routes_of([3, 4], 5), raw)


def test_with_several_processes_the_collator_sends_the_other_rows_routes_padded():
    """Row i goes to rank i: the main process keeps its own row's routes (route_rows), the others travel in the batch
    as ``replay_routes``, one row per rank, padded with "no route" to the longest row."""
    rows = [RoutedTreeRow(LAYOUT), RoutedTreeRow(LAYOUT)]
    rows[0].add({**row_sample([5, 6, 7, 8, 9], routes_of([1, 2], 5)), "model_version": 2, "metrics": {}})
    rows[1].add({**row_sample([5, 6, 7], routes_of([3, 4], 3)), "model_version": 3, "metrics": {}})
    buffer = RouteBuffer()
    collator = _RoutedCollator(pad_token_id=0, num_processes=2, version_fn=lambda: 3, route_buffer=buffer)
    batch = collator.torch_call([rows])
    assert batch[ROUTE_ROWS][1].tolist() == [-1, -1]  # the other rank's row is not in this process's buffer
    assert torch.equal(buffer.gather(batch[ROUTE_ROWS][:1]).tensor(), rows[0].packed_routes.tensor())
    routes = batch["replay_routes"]
    assert routes.shape == (2, 5, 2, 2)
    assert torch.equal(routes[1, :3], rows[1].packed_routes.tensor()[0])
    assert (routes[1, 3:] == 0).all()  # past the row's end: compute_loss strips it with the attention mask
    assert collator.metrics["routing/version_lag_max"] == [1.0]


def test_cpu_tree_attention_matches_per_sample_attention(checkpoint):
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention

    register_tree_attention()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=TREE_ATTENTION).eval()
    row = upstream.async_tree_row_class()()
    samples = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 20, 21], [5, 6, 30, 31, 32, 33, 34]]
    for ids in samples:
        row.add(row_sample(ids, None))
    packed = row.pack()
    with torch.no_grad(), cpu_tree_attention():
        logits = model(
            input_ids=packed["input_ids"][None],
            position_ids=packed["position_ids"][None],
            tree_kv_index=packed["tree_kv_index"],
            tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
            tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
        ).logits[0]
        model.config._attn_implementation = "sdpa"
        kv, cu = packed["tree_kv_index"].tolist(), packed["tree_cu_seqlens_k"].tolist()
        leaves = [kv[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]
        for ids in samples:
            path = next(p for p in leaves if packed["input_ids"][p].tolist() == ids)
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            assert (logits[path] - alone).abs().max() < 1e-4
    assert TorchVarlenAttention.flash_attn_varlen_func is not None


def test_rows_keep_the_turns_that_made_their_tokens():
    first = _TurnRoutes([1, 2], [3, 4], "rows0", (0, 0))
    second = _TurnRoutes([1, 2, 3, 4, 9], [5], "rows1", (0, 1))
    kept, prompt = turns_for_row([1, 2, 3, 4, 9, 5], [first, second])
    assert prompt == 2 and [t.rows for t in kept] == ["rows0", "rows1"]
    assert (kept[1].prompt_length, kept[1].completion_length) == (5, 1)
    # a fork re-tokenized the first turn's output: that turn is not this row's
    kept, prompt = turns_for_row([1, 2, 7, 4, 9, 5], [first, _TurnRoutes([1, 2, 7, 4, 9], [5], "r", (1, 1))])
    assert prompt == 5 and [t.rows for t in kept] == ["r"]


def test_a_later_turn_asks_only_for_the_positions_the_conversation_does_not_hold():
    rows = lambda n: np.zeros((n, 2, 2), dtype=np.uint8)  # noqa: E731 - [positions, layers, top-k]
    first = _TurnRoutes([1, 2], [3, 4], rows(3), (0, 0))  # prompt 2 + output 2: positions 0..2 forwarded
    assert held_positions([1, 2, 3, 4, 9], [first]) == 3  # the last output token was never forwarded
    second = _TurnRoutes([1, 2, 3, 4, 9], [5, 6], rows(6 - 3), (0, 0), prompt_start=3)
    assert held_positions([1, 2, 3, 4, 9, 5, 6, 7], [first, second]) == 6
    # a fork (TRL re-tokenized the first turn's output): nothing of this prompt is held
    assert held_positions([1, 2, 7, 4, 9], [first]) == 0
    # rows that did not decode, or of the wrong length, hold nothing: the next turn asks for those positions again
    assert held_positions([1, 2, 3, 4, 9], [_TurnRoutes([1, 2], [3, 4], "not base64", (0, 0))]) == 0
    assert held_positions([1, 2, 3, 4, 9], [_TurnRoutes([1, 2], [3, 4], rows(2), (0, 0))]) == 0
    # a turn whose rows start after what was held leaves a gap: it does not count
    assert held_positions([1, 2, 3, 4, 9, 5, 6, 7], [_TurnRoutes([1, 2, 3, 4, 9], [5, 6], rows(3), (0, 0), 3)]) == 0
    # the turn's prompt_start reaches the trainer's alignment with its rows
    kept, prompt = turns_for_row([1, 2, 3, 4, 9, 5, 6], [first, second])
    assert prompt == 2 and [t.prompt_start for t in kept] == [0, 3]


# --------------------------------------------------------------------------------------------- golden
def test_none_is_trl_async_grpo_bit_for_bit(tmp_path, checkpoint):
    """routing_replay='none': the same scripted samples through TRL's AsyncGRPOTrainer and ours, identical logs and
    parameters (both with the CPU tree attention, and the MFU lookup off as our trainer turns it off on CPU)."""
    samples, _ = script(checkpoint, versions=[0, 0, 1, 1, 2, 2, 2, 2], routes=False)
    values = settings(tmp_path, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3)
    with upstream.async_trainer_globals(get_peak_flops_per_device=lambda *a, **k: None):
        theirs = AsyncGRPOTrainer(
            model=checkpoint,
            reward_funcs=reward,
            train_dataset=DATASET,
            args=AsyncGRPOConfig(**{**values, "output_dir": str(tmp_path / "trl")}),
            rollout_worker=ScriptedRolloutWorker(samples),
            weight_transfer=NoOpWeightTransfer(),
        )
    with cpu_tree_attention():
        theirs.train()
    ours = MoEReplayAsyncGRPOTrainer(
        model=checkpoint,
        reward_funcs=reward,
        train_dataset=DATASET,
        args=MoEReplayAsyncGRPOConfig(**{**values, "output_dir": str(tmp_path / "ours")}, routing_replay="none"),
        rollout_worker=ScriptedRolloutWorker(samples),
        weight_transfer=NoOpWeightTransfer(),
    )
    assert ours._route_replay is None and ours._route_intake is None  # nothing built
    ours.train()
    wall_clock = (
        "perf/",
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "sample/time_in_queue_s",
    )
    assert len(ours.state.log_history) == len(theirs.state.log_history) == 4
    for mine, trl in zip(ours.state.log_history, theirs.state.log_history, strict=True):
        assert set(trl) <= set(mine) and all(name.startswith("precision/") for name in set(mine) - set(trl))
        for name, value in trl.items():
            if name.startswith(wall_clock):
                continue
            same = mine[name] == value or (isinstance(value, float) and math.isnan(value) and math.isnan(mine[name]))
            assert same, f"{name}: {mine[name]!r} ours, {value!r} TRL's"
    theirs_params = dict(theirs.model.named_parameters())
    for name, param in ours.model.named_parameters():
        assert torch.equal(param, theirs_params[name]), name
    assert any(
        not torch.equal(p, q)
        for (_, p), q in zip(ours.model.named_parameters(), tiny_moe_model("qwen3_moe").parameters(), strict=True)
    )


# --------------------------------------------------------------------------------------------- sync check
class ScriptedEngine:
    """The engine's answers to the sync probe, in order (a stand-in server for the sync check)."""

    def __init__(self, answers):
        self.answers = list(answers)

    def __call__(self, probe):
        return torch.tensor(self.answers.pop(0))


SCORED_MODEL = torch.nn.Linear(1, 1)  # the scripted trainer answers stand for its forward


def guard_with(monkeypatch, engine_answers, trainer_answers):
    from trl_moe_replay.weight_sync.sync_check import SyncCheck

    trainer = iter(trainer_answers)
    return SyncCheck(
        ScriptedEngine(engine_answers), lambda model, probe: torch.tensor(next(trainer)), [1, 2, 3], tolerance=0.05
    )


def test_sync_guard_passes_delivered_syncs(monkeypatch):
    # engine: before/after sync 1, before/after sync 2 (it follows the trainer, with some batch noise)
    guard = guard_with(
        monkeypatch, [[-1.0, -2.0], [-1.0, -2.0], [-1.001, -2.0], [-1.5, -2.3]], [[-1.0, -2.0], [-1.5, -2.3]]
    )
    guard.before_sync(), guard.after_sync(SCORED_MODEL), guard.before_sync()
    assert guard.after_sync(SCORED_MODEL) == pytest.approx(0.0)


def test_sync_guard_catches_a_transfer_that_delivers_nothing(monkeypatch):
    from trl_moe_replay.weight_sync.sync_check import WeightSyncNotDeliveredError

    guard = guard_with(
        monkeypatch, [[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.001]], [[-1.0, -2.0], [-1.5, -2.3]]
    )
    guard.before_sync(), guard.after_sync(SCORED_MODEL), guard.before_sync()
    with pytest.raises(WeightSyncNotDeliveredError, match="did not deliver"):
        guard.after_sync(SCORED_MODEL)


def test_sync_guard_catches_engine_weights_changed_between_syncs(monkeypatch):
    from trl_moe_replay.weight_sync.sync_check import EngineWeightsChangedError

    # after sync 1 the engine holds the trainer's weights; before sync 2 it answers like its checkpoint again
    guard = guard_with(monkeypatch, [[-3.0, -3.0], [-1.0, -2.0], [-3.0, -3.0]], [[-1.0, -2.0]])
    guard.before_sync(), guard.after_sync(SCORED_MODEL)
    with pytest.raises(EngineWeightsChangedError, match="restarted"):
        guard.before_sync()


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_sync_guard_refuses_an_engine_answering_non_finite_log_probs(monkeypatch, bad):
    from trl_moe_replay.weight_sync.sync_check import EngineProbeNotFiniteError

    # NaN compares false with any tolerance: without a finite check both checks pass, at the default tolerance too
    guard = guard_with(monkeypatch, [[-1.0, -2.0], [-1.0, bad]], [[-1.0, -2.0]])
    guard.before_sync()
    message = f"after a weight sync, 1 of the vLLM server's 2 log-probs .* not finite \\({bad} at token 2\\)"
    with pytest.raises(EngineProbeNotFiniteError, match=message):
        guard.after_sync(SCORED_MODEL)
    guard = guard_with(monkeypatch, [[bad, -2.0]], [])
    with pytest.raises(EngineProbeNotFiniteError, match="before a weight sync"):
        guard.before_sync()


def test_the_installed_trl_matches_the_async_seam():
    assert upstream.check_async_trl() == ()


def test_the_async_trainers_model_card_names_the_mode_and_cites_r3(tmp_path, checkpoint):
    """The model card of both trainers: TRL's, with the routing mode and the methods' citations (issue 43)."""
    trainer = scripted_trainer(tmp_path, checkpoint, [])
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert "trained with MoE Replay Async GRPO (routing_replay=r3, loss_type=" in card
    assert "routing-replay-r3" in card and "arXiv:2402.03300" in card and "arXiv:2510.11370" in card


def test_the_async_model_card_needs_nothing_of_the_sync_trainer(tmp_path):
    """A process that imports the async trainer alone (never the sync config, whose module declares the sync-only
    options' defaults) names the methods of its model card: this test's neighbour failed so, with a KeyError, when its
    module ran by itself."""
    code = (
        "import sys\n"
        "from trl_moe_replay.async_grpo.async_grpo_config import MoEReplayAsyncGRPOConfig\n"
        "from trl_moe_replay.core.model_card import methods_used\n"
        "assert 'trl_moe_replay.trainer.grpo_config' not in sys.modules\n"
        f"args = MoEReplayAsyncGRPOConfig(output_dir={str(tmp_path)!r}, use_cpu=True)\n"
        "print(methods_used(args, 'r3'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "['r3']"


@pytest.mark.slow
@pytest.mark.serial  # two processes (torchrun's default port)
@pytest.mark.parametrize("parallel", ["ddp", "ep"])
def test_two_training_processes_train_the_weights_of_one_and_replay_each_rank_row(tmp_path, checkpoint, parallel):
    """tests/scripts/async_scripted_ranks.py on one process, then under torchrun on two (gloo): the same scripted
    samples, 8 per micro-batch (one row of 8, or a row of 4 per rank, rank 1's routes crossing the process boundary).
    TRL normalizes each rank's loss by the global token count, so the two runs take the same steps. ``ep``: the
    model sharded at load time, experts split between the ranks (ep_size 2, fsdp_size 2, all_to_all dispatch)."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import CPU_ONLY_ENV, run_two_ranks

    script_path = Path(__file__).parents[1] / "scripts" / "async_scripted_ranks.py"
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **CPU_ONLY_ENV}
    single = subprocess.run(
        [sys.executable, str(script_path), str(one), checkpoint], env=env, capture_output=True, text=True, timeout=300
    )
    assert single.returncode == 0, single.stderr[-3000:]
    run_two_ranks(script_path, two, checkpoint, *(["ep"] if parallel == "ep" else []))
    (alone,) = [json.loads((one / "rank0.json").read_text())]
    ranks = [json.loads((two / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    assert [r["sharded"] for r in ranks] == [parallel == "ep"] * 2 and not alone["sharded"]
    # each rank trained its own group of 4 at both steps, every position routed as the engine did (step 2 on stale
    # routes: the trained router picks otherwise on most of them)
    for report in ranks:
        assert [found for found, _, _ in report["checks"]] == [4] * STEPS
        assert all(checked > 20 and mismatched == 0 for _, checked, mismatched in report["checks"])
    assert [found for found, _, _ in alone["checks"]] == [8] * STEPS
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(alone["loss"], ranks[0]["loss"], strict=True))
    weights_one, weights_two = torch.load(one / "weights.pt"), torch.load(two / "weights.pt")
    from transformers import AutoModelForCausalLM

    initial = dict(AutoModelForCausalLM.from_pretrained(checkpoint).named_parameters())
    assert min(float((weights_one[name] - initial[name].detach()).abs().max()) for name in initial) > 5e-3
    differ = max(float((weights_one[name] - weights_two[name]).abs().max()) for name in weights_one)
    # the ranks' gradients are summed in another order than one process sums them; Adam's step for a gradient near
    # its eps amplifies that fp32 rounding: 6.4e-6 measured (1.0e-5 with ep), against steps of about the learning
    # rate (1e-2)
    assert differ < 5e-5, differ
