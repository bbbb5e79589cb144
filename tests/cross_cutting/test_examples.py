"""examples/: the import-swap script differs from TRL's only in its imports and learns offline; the none/r2/r3
comparison trains, plots and shows R3 lowest; the rollout_func example replays its engine's routes."""

import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_swap_imports_differs_from_the_trl_original_in_import_lines_only():
    original = (EXAMPLES / "swap_imports_trl_original.py").read_text().splitlines()
    swapped = (EXAMPLES / "swap_imports.py").read_text().splitlines()
    changed = [
        line
        for line in difflib.unified_diff(original, swapped, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed == [
        "-from trl import GRPOConfig, GRPOTrainer",
        "+from trl_moe_replay import MoEReplayGRPOConfig as GRPOConfig, MoEReplayGRPOTrainer as GRPOTrainer",
    ]


@pytest.mark.slow
def test_swap_imports_example_learns_offline(tmp_path):
    """The documented offline command: save a tiny MoE checkpoint, then the swapped TRL quick start trains it with R3
    and its length reward rises (~25 s)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HF_HUB_OFFLINE", None)  # a local checkpoint needs no Hub, and must not try it
    saved = subprocess.run(
        [sys.executable, "-m", "trl_moe_replay.testing", "runs/tiny-moe"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert saved.returncode == 0 and (tmp_path / "runs" / "tiny-moe" / "tokenizer.json").is_file(), saved.stderr
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "swap_imports.py"), "runs/tiny-moe"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads((tmp_path / "runs" / "swap_imports" / "checkpoint-30" / "trainer_state.json").read_text())
    logged = [entry for entry in state["log_history"] if "reward" in entry]
    assert len(logged) == 30
    # the replay trainer ran (R3, the default): every step replayed the rollout's routes, none fell back
    assert all(entry["routing/fallback_frac"] == 0.0 for entry in logged)
    rewards = [entry["reward"] for entry in logged]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # measured (seed 0): first 5 steps -42.7, last 5 steps -23.2; a step's mean reward varies by ~8 from step to step
    assert last > first + 8, rewards


def test_swap_imports_example_without_a_model_says_how_to_run_it_offline(tmp_path):
    for script in ("swap_imports.py", "swap_imports_trl_original.py"):
        result = subprocess.run(
            [sys.executable, str(EXAMPLES / script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 1 and "python -m trl_moe_replay.testing runs/tiny-moe" in result.stderr
        assert not list(tmp_path.iterdir())  # nothing written, nothing downloaded


def test_examples_write_under_a_git_ignored_folder():
    root = EXAMPLES.parent
    if not (root / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    for folder in ("runs/swap_imports/checkpoint-30", "runs/tiny-moe"):
        assert subprocess.run(["git", "check-ignore", "-q", folder], cwd=root).returncode == 0, folder


def test_compare_replay_modes(tmp_path, capsys):
    module = load_script(EXAMPLES / "compare_replay_modes.py", "compare_replay_modes")
    out = tmp_path / "cmp"
    # no cold start: the seeded random model makes the run deterministic (SFT's CPU backward is not bit-exact)
    summary = module.main(
        [
            "--max_steps",
            "2",
            "--modes",
            "none",
            "r3",
            "--sft_steps",
            "0",
            "--output_dir",
            str(out),
            "--cache_dir",
            str(tmp_path / "cache"),
        ]
    )
    assert (out / "compare.png").read_bytes()[:8] == PNG_SIGNATURE
    assert json.loads((out / "summary.json").read_text()) == summary
    assert "plot:" in capsys.readouterr().out
    none, r3 = summary["none"], summary["r3"]
    # 2 steps = one generation batch, sampled identically in both runs (same seed and model): the bf16 sampler
    # routes some (token, layer) pairs differently from the fp32 trainer, and replaying its routes brings the
    # trainer's log-probs closer to the sampler's
    assert none["routing/mismatch_frac"] > 0
    assert r3["mismatch/kl_k3"] < none["mismatch/kl_k3"] / 3  # measured 2.1e-4 -> 1.8e-5
    assert r3["sampling/sampling_logp_difference/max"] < none["sampling/sampling_logp_difference/max"]


def test_rollout_func_routes_example_replays_the_engines_routes(tmp_path):
    module = load_script(EXAMPLES / "rollout_func_routes.py", "rollout_func_routes")
    logs = module.main(["--max_steps", "2", "--output_dir", str(tmp_path / "run")])
    assert len(logs) == 2
    # every forwarded position came with the engine's route, and the engine holds the trainer's weights (fp32): the
    # replayed trainer reproduces its sampling log-probs
    assert all(entry["routing/fallback_frac"] == 0.0 and entry["mismatch/kl_k3"] < 1e-6 for entry in logs)
