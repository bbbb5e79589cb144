"""Training keeps going, and says so, when inputs are bad or absent (issue 16): metrics without data, one output
directory per trainer, and a fuzz of corrupted vLLM route payloads."""

import collections
import contextlib
import gc
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trl_moe_replay.core.output_lock import LOCK_NAME, STALE_AFTER_S, OutputDirInUseError, OutputDirLock
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

from .helpers import no_route, run_two_ranks
from .test_trainer import logged, make_trainer
from .test_vllm_generation import BatchSpy


MISMATCH = ["mismatch/kl_k1", "mismatch/kl_k3", "mismatch/extreme_frac"]
ROUTING = ["routing/mismatch_frac", "routing/token_any_mismatch", "routing/topk_agreement"]


# ----------------------------------------------------------------------------- metrics without data
def test_mismatch_metrics_are_no_data_not_zero_when_every_completion_is_masked(tmp_path):
    # every completion runs to max_completion_length without EOS and is masked (mask_truncated_completions):
    # no completion token is measured, so 0.0 (a perfect score) would be a lie
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1, mask_truncated_completions=True,
                           generation_kwargs={"min_new_tokens": 6})
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
        trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), use_vllm=True, vllm_mode="server",
                               vllm_server_base_url=server.url, vllm_weight_sync="trl")
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


# ----------------------------------------------------------------------------- one trainer per output_dir
HOLD_LOCK = """
import sys
from trl_moe_replay.core.output_lock import OutputDirLock
lock = OutputDirLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()  # until the test kills it (or, should the test die, closes the pipe): however long the test takes
"""


@contextlib.contextmanager
def lock_held_by_another_process(output_dir):
    """Another process holding ``output_dir``'s lock, as a second trainer would; killed (not released) on exit."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(output_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow  # a second process holds the lock
def test_a_second_trainer_on_a_busy_output_dir_is_refused_and_a_crashed_ones_lock_is_taken_over(tmp_path, caplog):
    lock_path = tmp_path / LOCK_NAME
    with lock_held_by_another_process(tmp_path) as holder:
        trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1)
        with pytest.raises(OutputDirInUseError, match=f"in use by another trainer: pid {holder.pid} on "):
            trainer.train()
        assert trainer.state.global_step == 0 and json.loads(lock_path.read_text())["pid"] == holder.pid
    # the holder was killed without releasing: a crashed run. Its lock is stale and taken over, with a warning.
    assert json.loads(lock_path.read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="trl_moe_replay.core.output_lock"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert f"process {holder.pid} is gone" in caplog.text
    assert json.loads(lock_path.read_text())["pid"] == os.getpid()
    trainer.end()
    assert not lock_path.exists()


def test_trainers_of_one_process_reuse_an_output_dir_one_after_the_other(tmp_path):
    lock_path = tmp_path / LOCK_NAME
    first = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1, save_strategy="steps", save_steps=1)
    first.train()
    assert lock_path.exists()  # held after train(): save_model / save_state come next
    # a second trainer object of the same process (a notebook cell run again, a resumed run) takes over ...
    second = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=2, save_strategy="steps", save_steps=1)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 2
    token = json.loads(lock_path.read_text())["token"]
    # ... and the first one, collected later, does not drop its successor's lock
    del first
    gc.collect()
    assert json.loads(lock_path.read_text())["token"] == token
    del second
    gc.collect()
    assert not lock_path.exists()


def test_a_lock_of_another_host_is_judged_by_its_heartbeat(tmp_path, caplog):
    lock_path = tmp_path / LOCK_NAME
    lock_path.write_text(json.dumps({"pid": 4242, "host": "node-7", "token": "theirs", "started": "earlier"}))
    lock = OutputDirLock(tmp_path)
    with pytest.raises(OutputDirInUseError, match="pid 4242 on node-7"):  # fresh heartbeat: live (can't see the pid)
        lock.acquire()
    old = time.time() - STALE_AFTER_S - 10
    os.utime(lock_path, (old, old))
    with caplog.at_level(logging.WARNING, logger="trl_moe_replay.core.output_lock"):
        lock.acquire()
    assert "no heartbeat for" in caplog.text and lock.held
    lock.release()
    assert not lock_path.exists()


@pytest.mark.slow  # a second process holds the lock
def test_plain_trl_on_a_busy_output_dir_only_warns(tmp_path, caplog):
    # routing_replay="none" is plain GRPOTrainer, which TRL would run: a loud warning, not a refusal
    with lock_held_by_another_process(tmp_path) as holder:
        trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1, routing_replay="none")
        with caplog.at_level(logging.WARNING, logger="trl_moe_replay.trainer.grpo_trainer"):
            trainer.train()
        assert trainer.state.global_step == 1
        assert "OUTPUT DIR IN USE" in caplog.text and f"pid {holder.pid}" in caplog.text
        trainer.end()


@pytest.mark.slow  # torchrun, two processes, twice
def test_the_main_process_alone_holds_the_lock_under_data_parallelism(tmp_path):
    result = run_two_ranks(Path(__file__).parent / "scripts" / "output_lock_ddp.py", tmp_path / "run")
    # raw_decode: print() writes text and newline separately, so the other rank's output may follow on the same line
    reports = [json.JSONDecoder().raw_decode(line[len("REPORT "):])[0]
               for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    main = next(r for r in reports if r["rank"] == 0)
    for report in reports:  # during training both ranks see one lock, the main process's
        assert report["lock_pid"] == main["pid"] and report["steps"] == 1
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released by end()
    # and a busy output_dir stops both ranks (not only the main one, which would leave the other hanging)
    with lock_held_by_another_process(tmp_path / "run"):
        failed = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(Path(__file__).parent / "scripts" / "output_lock_ddp.py"), str(tmp_path / "run")],
            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert failed.returncode != 0 and failed.stderr.count("OutputDirInUseError") >= 2


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
        layout = dict(prompt_lengths=prompts, completion_lengths=completions, prompt_width=8, completion_width=8,
                      num_layers=layers, top_k=top_k, moe_layers=moe, num_experts=num_experts)
        routes = routes_from_engine(payloads, on_error=errors.append, on_unwritten=reports.append, **layout)
        missing = [i for i in bad if payloads[i] is None]
        assert sorted(e.sample for e in errors) == [i for i in bad if i not in missing], batch
        assert [(r.sample, r.count, r.first) for r in reports] == [(i, 1, q) for i, q in sorted(unwritten.items())]
        assert no_route(routes[bad]).all()
        good = [i for i in range(16) if i not in bad]
        good_layout = {**layout, "prompt_lengths": [prompts[i] for i in good],
                       "completion_lengths": [completions[i] for i in good]}
        expected = routes_from_engine([clean[i] for i in good], **good_layout)
        for row, i in enumerate(good):
            if i in unwritten:  # that position alone: "no route" at every layer
                expected[row, 8 - prompts[i] + unwritten[i]] = no_route_value(routes.dtype)
        assert torch.equal(routes[good], expected)
    assert sum(seen.values()) >= 300 and set(seen) == set(CORRUPTIONS), seen


def test_fuzzed_route_payloads_never_end_the_run_and_fallback_frac_is_exact(tmp_path):
    model_kwargs = dict(num_hidden_layers=3, mlp_only_layers=[0])  # layer 0 dense: zeros on the wire
    fuzzer = RouteFuzzer(seed=3, num_experts=8, moe_layers=[1, 2], rate=0.6)
    with FakeVLLMServer(tiny_moe_model("qwen3_moe", **model_kwargs), tamper=fuzzer) as server, \
            trl_vllm_transport_stub(server):
        trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe", **model_kwargs), cls=BatchSpy, use_vllm=True,
                               vllm_mode="server", vllm_server_base_url=server.url, max_steps=6, vllm_weight_sync="trl",
                               per_device_train_batch_size=16)
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


@pytest.mark.parametrize("content", [
    "[" + ",".join(["{}"] * 5_000) + "]",  # 15 KB, 10,000 values
    json.dumps({"pid": 1, "padding": "x" * 100_000}),  # 100 KB
], ids=["many values", "many bytes"])
def test_a_lock_file_far_larger_than_a_lock_is_replaced_without_being_parsed(tmp_path, caplog, monkeypatch, content):
    """Read with a bound (trl_moe_replay/bounded_json.py): a hostile lock file cannot make the lock's reader build
    many times its size in objects; it is not one of ours, so it is replaced, with a warning."""
    (tmp_path / LOCK_NAME).write_text(content)
    parsed, loads = [], json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **k: parsed.append(len(text)) or loads(text, *a, **k))
    lock = OutputDirLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trl_moe_replay.core.output_lock"):
        lock.acquire()
    try:
        assert lock.held and "it is not a lock file this package wrote" in caplog.text
        assert parsed and max(parsed) < 1_000  # only our own lock was parsed
    finally:
        lock.release()


def test_a_lock_file_holding_a_number_python_will_not_convert_is_replaced(tmp_path, caplog):
    # json raises a plain ValueError on an integer of more than 4,300 digits: it was a traceback from acquire()
    (tmp_path / LOCK_NAME).write_text('{"pid": ' + "1" * 5000 + "}")
    lock = OutputDirLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trl_moe_replay.core.output_lock"):
        lock.acquire()
    try:
        assert lock.held and "it is not a lock file this package wrote" in caplog.text
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
