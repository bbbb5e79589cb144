"""PR2 checkpoints cannot half-save (issue 21): the predictors are written before TRL's files, atomically; a process
killed after any write leaves the previous checkpoint whole and the new one either complete or refused on resume;
non-finite predictors and checkpoints of another routing mode are refused with a clear message."""

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trl_moe_replay import MoEReplayGRPOTrainer
from trl_moe_replay.pr2.state import PREDICTORS_FILE, PR2CheckpointError, PR2StateError
from trl_moe_replay.testing import tiny_moe_model

from tests.pr2.test_state import OFF_POLICY, predictor_state
from tests.trainer.test_grpo_trainer import logged, make_trainer


SCRIPT = Path(__file__).parents[1] / "scripts" / "pr2_checkpoint_kill.py"
KILL_POINTS = ("predictors-partial", "predictors", "model", "optimizer", "rng", "trainer-state")
PR2 = dict(routing_replay="pr2", pr2_lr_multiplier=10.0, **OFF_POLICY)


def killed_runs(root: Path, points: list[str]) -> dict[str, int]:
    """Run tests/scripts/pr2_checkpoint_kill.py: ``{point: wait status}`` of the forked run of each point."""
    repo = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(root), *points],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=repo,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    statuses = dict(line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RESULT "))
    assert list(statuses) == points, result.stdout + result.stderr[-3000:]
    # a run that was not killed must end cleanly: its traceback (the children share stderr) says why it did not
    assert int(statuses.get("none", 0)) == 0, result.stderr[-6000:]
    return {point: int(status) for point, status in statuses.items()}


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def resumed_predictors(output_dir: Path, checkpoint: Path) -> dict:
    restored = {}

    class Spy(MoEReplayGRPOTrainer):
        def _load_optimizer_and_scheduler(self, folder):
            super()._load_optimizer_and_scheduler(folder)
            restored.update(predictor_state(self))

    trainer = make_trainer(output_dir, tiny_moe_model("qwen3_moe"), cls=Spy, max_steps=3, **PR2)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 3
    return restored


@pytest.mark.slow  # seven short PR2 runs in a subprocess, six of them killed while saving their second checkpoint
def test_a_kill_after_any_write_leaves_the_old_or_the_new_predictors(tmp_path):
    statuses = killed_runs(tmp_path, ["none", *KILL_POINTS])
    assert statuses["none"] == 0
    reference = {step: load_file(tmp_path / "none" / f"checkpoint-{step}" / PREDICTORS_FILE) for step in (1, 2)}
    assert not same(reference[1], reference[2])  # the predictors trained in step 2: old and new states differ
    judge = make_trainer(tmp_path / "judge", tiny_moe_model("qwen3_moe"), max_steps=3, **PR2)
    for point in KILL_POINTS:
        run = tmp_path / point
        assert os.WIFSIGNALED(statuses[point]) and os.WTERMSIG(statuses[point]) == signal.SIGKILL, point
        old, new = run / "checkpoint-1", run / "checkpoint-2"
        assert same(load_file(old / PREDICTORS_FILE), reference[1]), point  # the previous checkpoint is whole
        # the new one: our file absent or whole and new, never half written; TRL's last file only after it
        predictors = new / PREDICTORS_FILE
        if point == "predictors-partial":
            assert not predictors.exists() and list(new.glob(PREDICTORS_FILE + ".partial-*")), point
        else:
            assert same(load_file(predictors), reference[2]), point
        complete = (new / "trainer_state.json").exists()
        assert complete == (point == "trainer-state"), point
        if not complete:  # an incomplete checkpoint is refused, whatever it holds
            with pytest.raises(PR2CheckpointError, match="stopped while saving it"):
                judge._check_pr2_checkpoint(str(new))
    # resuming: the complete new checkpoint gives the new state, an old one beside an incomplete new one the old
    assert same(
        resumed_predictors(tmp_path / "trainer-state", tmp_path / "trainer-state" / "checkpoint-2"), reference[2]
    )
    assert same(resumed_predictors(tmp_path / "model", tmp_path / "model" / "checkpoint-1"), reference[1])


def test_a_checkpoint_without_predictors_or_of_another_mode_is_refused(tmp_path):
    trainer = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1, save_strategy="steps", save_steps=1, **PR2
    )
    trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    # PR2 as R3: refused by name, not by torch's "different number of parameter groups"
    r3 = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=2, routing_replay="r3")
    with pytest.raises(
        PR2CheckpointError, match="saved by a routing_replay='pr2' run .* this run uses routing_replay='r3'"
    ):
        r3.train(resume_from_checkpoint=str(checkpoint))
    # the predictors lost: refused, not restarted from zero under their restored optimizer state
    (checkpoint / PREDICTORS_FILE).unlink()
    pr2 = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=2, **PR2)
    with pytest.raises(PR2CheckpointError, match=f"cannot resume from .* it has no {PREDICTORS_FILE}"):
        pr2.train(resume_from_checkpoint=str(checkpoint))
    # a save into a folder where a killed save left its temporary file replaces it
    (checkpoint / f"{PREDICTORS_FILE}.partial-4242").write_bytes(b"half")
    pr2._pr2.save(str(checkpoint))
    assert not list(checkpoint.glob("*.partial-*")) and set(load_file(checkpoint / PREDICTORS_FILE)) == {
        "layers.0.weight",
        "layers.1.weight",
    }
    # R3 as PR2: the same refusal (an R3 checkpoint has no predictors)
    r3_out = tmp_path / "r3"
    make_trainer(r3_out, tiny_moe_model("qwen3_moe"), max_steps=1, save_strategy="steps", save_steps=1).train()
    pr2 = make_trainer(r3_out, tiny_moe_model("qwen3_moe"), max_steps=2, **PR2)
    with pytest.raises(PR2CheckpointError, match="did not use PR2"):
        pr2.train(resume_from_checkpoint=str(r3_out / "checkpoint-1"))


def test_non_finite_predictors_are_refused_when_loaded_and_stop_training(tmp_path):
    trainer = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1, save_strategy="steps", save_steps=1, **PR2
    )
    trainer.train()
    path = tmp_path / "checkpoint-1" / PREDICTORS_FILE
    weights = load_file(path)
    weights["layers.1.weight"][0, 0] = math.nan
    save_file(weights, path)
    resumed = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=2, **PR2)
    with pytest.raises(PR2CheckpointError, match=r"\['layers.1.weight'\] are not finite \(loaded from"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))

    # trained into NaN (a NaN gradient, as from an overflow): the run stops at that optimizer step, before the
    # predictors steer any route, and no checkpoint with them is written
    diverging = make_trainer(
        tmp_path / "nan", tiny_moe_model("qwen3_moe"), max_steps=2, save_strategy="steps", save_steps=1, **PR2
    )
    for param in diverging._pr2.predictors.parameters():
        param.register_hook(lambda grad: grad * math.nan)
    with pytest.raises(PR2StateError, match=r"PR2 predictor weights \[.*\] are not finite \(after an optimizer step"):
        diverging.train()
    assert logged(diverging, "pr2/loss") == []  # the first update that trained them was the last
    assert not (tmp_path / "nan" / "checkpoint-1" / PREDICTORS_FILE).exists() or all(
        torch.isfinite(v).all() for v in load_file(tmp_path / "nan" / "checkpoint-1" / PREDICTORS_FILE).values()
    )
