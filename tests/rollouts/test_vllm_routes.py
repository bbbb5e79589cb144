"""R3 through vLLM, on CPU: TRL's real client against a vLLM-contract HTTP server, and a colocated ``LLM`` stand-in.

The server (trl_moe_replay.testing.FakeVLLMServer) answers TRL's ``VLLMClient`` over HTTP on 127.0.0.1 the
way vLLM 0.33 does, ``routed_experts`` included (base64 ``.npy``, uint8/uint16, dense layers zero). Only TRL's
NCCL weight transport is stubbed (no CUDA): its tensors reach the server's model in-process.
"""

import base64
import io
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trl_moe_replay import MoEReplayGRPOTrainer
from trl_moe_replay.rollouts import RoutesUnavailableError, vllm_routes
from trl_moe_replay.rollouts.vllm_routes import VLLMRouteSource
from trl_moe_replay.routing import has_route
from trl_moe_replay.testing import (
    FakeVLLMServer,
    fake_colocated_vllm,
    tiny_moe_model,
    tiny_tokenizer,
    trl_vllm_transport_stub,
)

from tests.helpers import as_signed, no_route, run_two_ranks, with_routes
from tests.trainer.test_grpo_trainer import logged, make_trainer as make_tiny_trainer


class BatchSpy(MoEReplayGRPOTrainer):
    """Keeps every generation batch as TRL builds it, and the routes each training forward replays."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.__dict__.setdefault("batches", []).append(with_routes(self, output))
        return output

    def _compute_loss(self, model, inputs):
        self.__dict__.setdefault("trained", []).append(with_routes(self, inputs))
        return super()._compute_loss(model, inputs)


def make_trainer(tmp_path, model, cls=BatchSpy, **overrides):
    """The tests' tiny GRPO run (tests/trainer/test_grpo_trainer.py), generating with vLLM. The stand-ins take TRL's own weight
    sync (the NCCL transport stubbed); vLLM's reload path runs against the real engine (tests/cross_cutting/test_vllm_engine.py)."""
    overrides.setdefault("vllm_weight_sync", "trl")
    return make_tiny_trainer(tmp_path, model, cls=cls, use_vllm=True, **overrides)


def npy_b64decode(payload):
    """The decode vLLM documents in its protocol comments, independent of trl_moe_replay's codec."""
    return np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)


def npy_b64encode(array):
    """vLLM's ``numpy2base64`` (vllm/utils/serial_utils.py), stdlib codec; any dtype, as a broken server might send."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def expected_routes(batch, engine_rows, starts, moe_layers):
    """Engine rows placed token by token at TRL's columns (left-padded prompt, right-padded completion)."""
    prompt_mask, completion_mask = batch["prompt_mask"], batch["completion_mask"]
    prompt_width = prompt_mask.shape[1]
    b, width = prompt_mask.shape[0], prompt_width + completion_mask.shape[1]
    _, layers, top_k = next(r for r in engine_rows if r is not None).shape
    out = torch.full((b, width, layers, top_k), -1, dtype=torch.long)
    for i, rows in enumerate(engine_rows):
        if rows is None:
            continue
        p = int(prompt_mask[i].sum())
        for j, row in enumerate(rows):
            position = starts[i] + j  # token position in prompt + completion
            out[i, prompt_width - p + position] = torch.from_numpy(row.astype(np.int64))
    dense = [layer for layer in range(layers) if layer not in moe_layers]
    out[:, :, dense] = -1
    return out


def assert_batches_match_the_engine(trainer, served, starts=None):
    """Generation batch k carries exactly the routes the engine sent for completion k, at the right columns."""
    assert len(trainer.batches) == len(served)
    moe_layers = trainer._route_replay.moe_layers
    for batch, completions, rows in served:
        for i, tokens in enumerate(completions):  # same completions, same order
            c = int(batch["completion_mask"][i].sum())
            assert batch["completion_ids"][i, :c].tolist() == tokens
        starts_k = starts or [0] * len(rows)
        torch.testing.assert_close(
            as_signed(batch["replay_routes"]), expected_routes(batch, rows, starts_k, moe_layers), rtol=0, atol=0
        )
    # and every training forward replayed routes of its own sequence (TRL shuffles and splits the buffer)
    by_sequence = {}
    for batch, _, _ in served:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        for i in range(ids.shape[0]):
            by_sequence.setdefault(tuple(ids[i].tolist()), []).append(batch["replay_routes"][i])
    checked = 0
    for inputs in trainer.trained:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        for i in range(ids.shape[0]):
            candidates = by_sequence[tuple(ids[i].tolist())]
            assert any(torch.equal(inputs["replay_routes"][i], r) for r in candidates)
            checked += 1
    assert checked == sum(len(inputs["prompt_ids"]) for inputs in trainer.trained) > 0


# ----------------------------------------------------------------------------- server mode
@pytest.mark.parametrize(
    "model_kwargs, start",
    [
        # 8 experts: uint8 payloads; two completions per batch cut short by a stop string (rows trimmed alike)
        ({}, 0),
        # 300 experts: uint16 payloads; layer 0 dense (zero rows on the wire); first 2 prompt rows not sent
        ({"num_experts": 300, "num_hidden_layers": 3, "mlp_only_layers": [0]}, 2),
    ],
    ids=["uint8-stop-trimmed", "uint16-dense-layer-prompt-start"],
)
def test_server_mode_replays_the_routes_the_server_sent(tmp_path, model_kwargs, start):
    extra = {"generation_kwargs": {"routed_experts_prompt_start": start}} if start else {}
    stop_trim = None if model_kwargs else (lambda call, choice: 2 if choice in (1, 6) else 0)
    server = FakeVLLMServer(tiny_moe_model("qwen3_moe", **model_kwargs), stop_trim=stop_trim)
    with server, trl_vllm_transport_stub(server):
        trainer = make_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe", **model_kwargs),
            vllm_mode="server",
            vllm_server_base_url=server.url,
            **extra,
        )
        trainer.train()

    # the real client path ran: health, model list, server info, weight sync control, completions
    calls = server.endpoint_calls
    for endpoint in (
        "GET /health",
        "GET /v1/models",
        "GET /server_info",
        "POST /init_weight_transfer_engine",
        "POST /update_weights",
        "POST /reset_prefix_cache",
        "POST /v1/completions",
    ):
        assert endpoint in calls
    request = server.batches[0].request
    assert request["return_token_ids"] and request["n"] == 4 and request.get("routed_experts_prompt_start", 0) == start
    expected_dtype = np.uint16 if model_kwargs else np.uint8
    assert all(npy_b64decode(p).dtype == expected_dtype for b in server.batches for p in b.payloads)
    if model_kwargs:  # dense layer 0 travels as zeros, as vLLM leaves it
        assert all(not npy_b64decode(p)[:, 0].any() for p in server.batches[0].payloads)
    # one weight sync per step, every parameter, each followed by a prefix-cache reset (fresh routes)
    names = [n for n, _ in trainer.model.named_parameters()]
    assert [sorted(u.received) for u in server.weight_updates] == [sorted(names)] * 2
    assert server.prefix_cache_resets == 2

    served = [
        (batch, [c.token_ids for c in sb.completions], [npy_b64decode(p) for p in sb.payloads])
        for batch, sb in zip(trainer.batches, server.batches, strict=True)
    ]
    if stop_trim:  # the trimmed completions came back shorter than the rest and ended without EOS
        eos = tiny_tokenizer().eos_token_id
        trimmed = [sb.completions[i].token_ids for sb in server.batches for i in (1, 6)]
        assert all(len(ids) < 6 and ids[-1] != eos for ids in trimmed)
    assert_batches_match_the_engine(trainer, served, starts=[start] * 8)
    # fp32, weights synced: the trainer under the server's routes reproduces the server's log-probs
    assert max(logged(trainer, "mismatch/kl_k3")) < 1e-6
    assert logged(trainer, "routing/mismatch_frac") == [0.0, 0.0]
    fallback = logged(trainer, "routing/fallback_frac")
    if start:  # the first `start` prompt positions were not sent: routed natively, and counted
        for value, (batch, _, _) in zip(fallback, served, strict=True):
            routable = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum()) - len(batch["prompt_mask"])
            assert value == pytest.approx(start * len(batch["prompt_mask"]) / routable)
    else:
        assert fallback == [0.0, 0.0]


def test_a_user_start_at_or_past_a_prompts_length_is_sent_below_the_shortest_prompt(tmp_path, caplog):
    """vLLM's engine dies on a routed_experts_prompt_start at or past a prompt's length (vLLM CPU 0.28's scheduler
    asserts; the stand-in answers 500 as that server does): each request asks from one position before the end of its
    shortest prompt instead, with one warning, and the routes still land where the engine's rows say."""
    server = FakeVLLMServer(tiny_moe_model("qwen3_moe"))
    with server, trl_vllm_transport_stub(server):
        trainer = make_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe"),
            vllm_mode="server",
            vllm_server_base_url=server.url,
            generation_kwargs={"routed_experts_prompt_start": 1000},
        )
        with caplog.at_level(logging.WARNING, logger="trl_moe_replay.trainer.grpo_trainer"):
            trainer.train()
    starts = [batch.request["routed_experts_prompt_start"] for batch in server.batches]
    assert starts == [min(map(len, batch.request["prompt"])) - 1 for batch in server.batches] and len(starts) == 2
    assert sum("at or past the length of some prompts" in record.message for record in caplog.records) == 1
    for batch, served, start in zip(trainer.batches, server.batches, starts, strict=True):
        rows = [npy_b64decode(payload) for payload in served.payloads]
        torch.testing.assert_close(
            as_signed(batch["replay_routes"]),
            expected_routes(batch, rows, [start] * len(rows), trainer._route_replay.moe_layers),
            rtol=0,
            atol=0,
        )
    assert logged(trainer, "routing/mismatch_frac") == [0.0, 0.0]


@pytest.mark.parametrize("routes_field", [True, False], ids=["flag-off-null", "no-such-field"])
def test_server_without_routes_fails_at_the_first_batch_with_the_command(tmp_path, routes_field):
    server = FakeVLLMServer(tiny_moe_model("qwen3_moe"), return_routes=False, routes_field=routes_field)
    with server, trl_vllm_transport_stub(server):
        trainer = make_trainer(
            tmp_path, tiny_moe_model("qwen3_moe"), vllm_mode="server", vllm_server_base_url=server.url
        )
        with pytest.raises(RoutesUnavailableError) as error:
            trainer.train()
    message = str(error.value)
    assert "trl vllm-serve --model tiny-moe --enable-return-routed-experts" in message
    assert "prefix caching" in message and "VLLM_USE_V2_MODEL_RUNNER" in message
    assert len(server.batches) == 1 and trainer.state.global_step == 0


def test_routes_that_never_fit_the_model_fail_at_the_first_batch(tmp_path):
    # e.g. the server serves another checkpoint: every payload has the wrong layer count
    tamper = lambda call, choice, payload: npy_b64encode(np.concatenate([npy_b64decode(payload)] * 2, 1))  # noqa: E731
    with FakeVLLMServer(tiny_moe_model("qwen3_moe"), tamper=tamper) as server, trl_vllm_transport_stub(server):
        trainer = make_trainer(
            tmp_path, tiny_moe_model("qwen3_moe"), vllm_mode="server", vllm_server_base_url=server.url
        )
        with pytest.raises(RoutesUnavailableError, match=r"2 decoder layers, top-2.*got \(\d+, 4, 2\)"):
            trainer.train()
    assert trainer.state.global_step == 0


def test_missing_or_malformed_payloads_mid_run_fall_back_and_are_counted(tmp_path, caplog):
    def tamper(call, choice, payload):
        if call != 1:
            return payload
        rows = npy_b64decode(payload)
        return {
            0: None,  # aborted request: no routes
            1: npy_b64encode(rows[:-1]),  # one row short of prompt + completion - 1
            2: "not base64 at all!",
            3: npy_b64encode(rows[..., :1]),  # top-1 where the model routes top-2
            5: npy_b64encode(rows.astype(np.float32)),  # not integer ids
        }.get(choice, payload)

    with FakeVLLMServer(tiny_moe_model("qwen3_moe"), tamper=tamper) as server, trl_vllm_transport_stub(server):
        trainer = make_trainer(
            tmp_path, tiny_moe_model("qwen3_moe"), vllm_mode="server", vllm_server_base_url=server.url
        )
        with caplog.at_level(logging.WARNING, logger="trl_moe_replay.rollouts.vllm_routes"):
            trainer.train()

    assert trainer.state.global_step == 2  # the run went on
    bad = [0, 1, 2, 3, 5]
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "5 of 8 samples" in warning and "1 missing, 4 malformed" in warning and "sample 1:" in warning
    batch = trainer.batches[1]
    assert no_route(batch["replay_routes"][bad]).all()  # the router's own choice
    good = [i for i in range(8) if i not in bad]
    served = [
        (
            batch,
            [server.batches[1].completions[i].token_ids for i in good],
            [npy_b64decode(server.batches[1].payloads[i]) for i in good],
        )
    ]
    torch.testing.assert_close(
        as_signed(batch["replay_routes"][good]),
        expected_routes(
            {k: batch[k][good] for k in ("prompt_mask", "completion_mask")},
            served[0][2],
            [0] * 6,
            trainer._route_replay.moe_layers,
        ),
        rtol=0,
        atol=0,
    )
    # counted: the bad samples' routable positions over all routable positions of the batch
    routable = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1) - 1).float()
    expected_frac = (routable[bad].sum() / routable.sum()).item()
    assert logged(trainer, "routing/fallback_frac") == [0.0, pytest.approx(expected_frac)]
    assert max(logged(trainer, "mismatch/kl_k3")) < 1e-6  # natural routing in fp32 matches the engine anyway


def test_repeated_ids_and_time_dtypes_fall_back_whole_and_never_written_rows_per_position_mid_run(tmp_path):
    # each payload decodes and has the right shape and length; the problem is inside the rows (issues 16, 45)
    unwritten = {4: [0, -1], 6: [1, 2, 3]}  # rows vLLM never wrote (all zeros at a MoE layer), by sample

    def tamper(call, choice, payload):
        if call != 1 or choice not in (2, 4, 6, 7):
            return payload
        rows = npy_b64decode(payload).copy()
        if choice == 2:
            rows[len(rows) // 2, 1, 1] = rows[len(rows) // 2, 1, 0]  # an expert named twice in one route
        elif choice in unwritten:
            rows[unwritten[choice], choice % 2] = 0  # at one MoE layer: the whole position falls back
        else:
            rows = rows.astype("m8[s]")  # passes np.issubdtype(..., np.integer)
        return npy_b64encode(rows)

    with FakeVLLMServer(tiny_moe_model("qwen3_moe"), tamper=tamper) as server, trl_vllm_transport_stub(server):
        trainer = make_trainer(
            tmp_path, tiny_moe_model("qwen3_moe"), vllm_mode="server", vllm_server_base_url=server.url
        )
        trainer.train()

    assert trainer.state.global_step == 2  # the run went on
    bad = [2, 7]
    batch = trainer.batches[1]
    assert no_route(batch["replay_routes"][bad]).all()
    # every other sample replays the server's routes, the never-written positions excepted (the router's own choice)
    good = [i for i in range(8) if i not in bad]
    rows = [npy_b64decode(server.batches[1].payloads[i]).copy() for i in good]
    for i, sample_rows in zip(good, rows, strict=True):
        if i in unwritten:
            assert len(sample_rows) > 3 and not sample_rows[unwritten[i], i % 2].any()
            sample_rows[unwritten[i]] = 0  # expected_routes -> "no route" below
    expected = expected_routes(
        {k: batch[k][good] for k in ("prompt_mask", "completion_mask")},
        rows,
        [0] * 6,
        trainer._route_replay.moe_layers,
    )
    expected[~expected.bool().any(-1).any(-1)] = -1  # an all-zero position: no route, at every layer
    torch.testing.assert_close(as_signed(batch["replay_routes"][good]), expected, rtol=0, atol=0)
    routable = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1) - 1).float()
    marked = sum(len(positions) for positions in unwritten.values())
    assert (~has_route(batch["replay_routes"][good]).all(-1)).logical_and(
        torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)[good].bool()
    ).sum() == marked + len(good)
    # counted per position: the bad samples' routable positions and the 5 never-written ones; whole samples: 2 of 8
    expected_frac = ((routable[bad].sum() + marked) / routable.sum()).item()
    assert logged(trainer, "routing/fallback_frac") == [0.0, pytest.approx(expected_frac)]
    assert logged(trainer, "routing/fallback_samples_frac") == [0.0, 2 / 8]
    assert trainer._route_intake.unwritten_positions == marked and trainer._route_intake.fallback_samples == 2


def test_fallback_frac_and_the_comparison_are_logged_without_an_old_logprob_pass(tmp_path):
    # on-policy and no importance-sampling correction: TRL computes no old log-probs; the metrics' own no-grad forward
    # (trainer._metrics_pass) gives the natural routing to compare with, and missing routes are counted
    tamper = lambda call, choice, payload: None if choice == 0 else payload  # noqa: E731
    with FakeVLLMServer(tiny_moe_model("qwen3_moe"), tamper=tamper) as server, trl_vllm_transport_stub(server):
        trainer = make_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe"),
            vllm_mode="server",
            max_steps=1,
            vllm_server_base_url=server.url,
            vllm_importance_sampling_correction=False,
            gradient_accumulation_steps=1,
            per_device_train_batch_size=8,
        )
        trainer.train()
    (mismatch,) = logged(trainer, "routing/mismatch_frac")
    assert 0.0 <= mismatch < 0.05  # the server serves the trainer's weights (fp32 on both sides)
    (value,) = logged(trainer, "routing/fallback_frac")
    batch = trainer.batches[0]
    routable = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1) - 1).float()
    assert value == pytest.approx((routable[0] / routable.sum()).item())


# ----------------------------------------------------------------------------- colocate mode
@pytest.fixture
def restored_environ():
    """TRL's colocate setup exports RANK, WORLD_SIZE, MASTER_ADDR, ... for vLLM; keep them out of later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_colocate_mode_builds_the_llm_with_routes_and_replays_them(tmp_path, restored_environ):
    from trl.generation import vllm_generation

    with fake_colocated_vllm(tiny_moe_model("qwen3_moe")) as llm_class:
        trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), vllm_mode="colocate")
        (llm,) = llm_class.instances
        assert vllm_generation.LLM is llm_class  # the constructor patch was undone
        trainer.train()

    assert llm.kwargs["enable_return_routed_experts"] is True
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher"  # TRL's own arguments kept
    assert llm.prefix_cache_resets == 2
    served = [
        (
            batch,
            [c.token_ids for request in outputs for c in request.outputs],
            [c.routed_experts for request in outputs for c in request.outputs],
        )
        for batch, outputs in zip(trainer.batches, llm.outputs, strict=True)
    ]
    assert all(rows.dtype == np.uint8 for _, _, batch_rows in served for rows in batch_rows)
    assert_batches_match_the_engine(trainer, served)
    assert max(logged(trainer, "mismatch/kl_k3")) < 1e-6
    assert logged(trainer, "routing/fallback_frac") == [0.0, 0.0]


def test_colocated_engine_without_routes_fails_at_the_first_batch(tmp_path, restored_environ):
    with fake_colocated_vllm(tiny_moe_model("qwen3_moe")) as llm_class:
        trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), vllm_mode="colocate")
        llm_class.instances[0].return_routes = False  # as if this vLLM build ignored the flag
        with pytest.raises(RoutesUnavailableError, match="enable_return_routed_experts=True"):
            trainer.train()
    assert trainer.state.global_step == 0


def test_r2_and_none_with_vllm_need_no_routes(tmp_path):
    with FakeVLLMServer(tiny_moe_model("qwen3_moe"), return_routes=False) as server, trl_vllm_transport_stub(server):
        trainer = make_trainer(
            tmp_path,
            tiny_moe_model("qwen3_moe"),
            vllm_mode="server",
            max_steps=1,
            vllm_server_base_url=server.url,
            routing_replay="r2",
        )
        trainer.train()
    assert trainer.state.global_step == 1
    assert "replay_routes" in trainer.batches[0]  # R2: the old-policy pass's own routes
    # routing_metrics (on with r2) asked for the engine's routes; without them there is nothing to compare
    assert not [name for entry in trainer.state.log_history for name in entry if name.startswith("routing/")]


# ----------------------------------------------------------------------------- two processes
@pytest.mark.slow  # torchrun, two processes
@pytest.mark.serial
def test_two_ranks_each_receive_only_their_own_route_payloads():
    script = Path(__file__).parents[1] / "scripts" / "grpo_vllm_server.py"
    result = run_two_ranks(script)
    reports = {}
    for line in result.stdout.splitlines():
        if line.startswith("REPORT "):  # raw_decode: the other rank's output may follow on the same line
            report = json.JSONDecoder().raw_decode(line[len("REPORT ") :])[0]
            reports[report["rank"]] = report
    assert set(reports) == {0, 1} and reports[0]["world"] == reports[1]["world"] == 2
    served = reports[0]["served"]  # per generation batch: [sha256, bytes] of each rank's share of the payloads
    assert len(served) == 2
    for k, shares in enumerate(served):
        for rank in (0, 1):
            received = reports[rank]["received"][k]
            assert received["samples"] == received["payloads"] == 8  # its own 8 completions, each with routes
            assert [received["sha256"], received["bytes"]] == shares[rank]  # exactly its own share
        assert shares[0][0] != shares[1][0]
    for metrics in reports[0]["metrics"]:  # routes stayed with their samples on both ranks
        assert metrics["routing/mismatch_frac"] == 0.0 and metrics["routing/fallback_frac"] == 0.0
        assert metrics["mismatch/kl_k3"] < 1e-6


# ----------------------------------------------------------------------------- one start per request
def route_source(mode, *, processes=1, tp_size=1):
    """A VLLMRouteSource on a non-main rank (no client to hook) of a TRL VLLMGeneration stand-in."""
    generation = SimpleNamespace(mode=mode, generation_kwargs={}, tensor_parallel_size=tp_size, tp_group="tp-group")
    accelerator = SimpleNamespace(num_processes=processes, is_main_process=False)
    return VLLMRouteSource(generation, accelerator)


def test_server_mode_asks_for_what_every_rank_holds(monkeypatch):
    """TRL's main process sends every rank's prompts in one request: its start is the minimum over all ranks, and a
    rank without samples in the turn (None) does not pull it to 0."""
    gathered = []

    def gather_object(values):  # accelerate's gather_object: every rank's list, concatenated in rank order
        gathered.append(values)
        return [40, *values, None, 25]

    monkeypatch.setattr(vllm_routes, "gather_object", gather_object)
    source = route_source("server", processes=4)
    assert source.request_prompt_start(31, [40, 60]) == 25 and gathered == [[31]]
    assert source.request_prompt_start(None, []) == 25  # no samples here: the others decide
    assert source.request_prompt_start(7, [8]) == 7
    assert source.request_prompt_start(31, [40, 20]) == 19 and gathered[-1] == [19]  # below this rank's shortest
    assert source.request_prompt_start(None, [12]) == 11 and gathered[-1] == [11]  # an unmatched prompt bounds it


def test_server_mode_with_no_rank_holding_anything_asks_for_everything(monkeypatch):
    monkeypatch.setattr(vllm_routes, "gather_object", lambda values: [None, *values])
    assert route_source("server", processes=2).request_prompt_start(None, []) == 0


def test_one_process_and_colocate_without_tp_use_their_own_held_positions_with_no_collective(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("one request serves this rank's samples only: nothing to gather")

    monkeypatch.setattr(vllm_routes, "gather_object", no_collective)
    monkeypatch.setattr(torch.distributed, "all_gather_object", no_collective)
    for source in (route_source("server"), route_source("colocate", processes=8)):
        assert source.request_prompt_start(12, [30]) == 12 and source.request_prompt_start(None, []) == 0
        assert source.request_prompt_start(12, [9, 30]) == 8


def test_colocate_with_tensor_parallelism_takes_the_minimum_within_the_tp_group(monkeypatch):
    calls = []

    def all_gather_object(output, value, group=None):  # TRL's idiom: fills one entry per rank of the group
        calls.append(group)
        output[:] = [value, 18, None][: len(output)]

    monkeypatch.setattr(vllm_routes, "gather_object", lambda values: pytest.fail("not the global gather"))
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    source = route_source("colocate", processes=6, tp_size=3)
    assert source.request_prompt_start(30, [31]) == 18 and source.request_prompt_start(9, [31]) == 9
    assert source.request_prompt_start(None, []) == 18
    assert calls == ["tp-group"] * 3  # within the group that shares one engine, never across groups
