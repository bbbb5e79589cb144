"""PR2 runs that save a checkpoint every step and are SIGKILLed while saving the second one, right after one write.

    python pr2_checkpoint_kill.py ROOT KILL_POINT [KILL_POINT ...]

For each ``KILL_POINT`` a forked child (the imports are paid once) trains into ``ROOT/KILL_POINT`` and kills itself
while saving ``checkpoint-2``, right after that write: ``predictors-partial`` (the predictors' temporary file written,
not yet renamed), ``predictors`` (renamed into place), ``model``, ``optimizer`` (optimizer and scheduler), ``rng``,
``trainer-state`` (TRL's trainer_state.json, its last file); ``none`` is a run that is not killed (the reference).
The kill is ``os.kill(os.getpid(), SIGKILL)``: nothing is flushed or cleaned up, as when the OOM killer or a
preempted node stops a run. Prints one line per point: ``RESULT <point> <wait status>``.
"""

import functools
import os
import signal
import sys

import torch


torch.set_num_threads(1)  # no OpenMP pool in the parent: forked children start clean

import safetensors.torch  # noqa: E402
from transformers import Trainer, TrainerState  # noqa: E402

import trl_moe_replay.pr2.state as pr2  # noqa: E402
from trl_moe_replay.testing import tiny_moe_model  # noqa: E402

from tests.trainer.test_grpo_trainer import make_trainer  # noqa: E402


KILL_POINTS = ("predictors-partial", "predictors", "model", "optimizer", "rng", "trainer-state")


def train_and_kill(output_dir: str, kill_point: str) -> None:
    state = {"trainer": None}

    def kill_after(point, write):
        @functools.wraps(write)  # the seam checks the signatures of the Trainer methods it relies on
        def wrapped(*args, **kwargs):
            result = write(*args, **kwargs)
            trainer = state["trainer"]
            if point == kill_point and trainer is not None and trainer.state.global_step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return wrapped

    pr2.save_file = kill_after("predictors-partial", safetensors.torch.save_file)
    real_replace = os.replace
    os.replace = lambda src, dst: kill_after(  # only the predictors' rename counts
        "predictors" if str(dst).endswith(pr2.PREDICTORS_FILE) else "-", real_replace
    )(src, dst)
    Trainer.save_model = kill_after("model", Trainer.save_model)
    Trainer._save_optimizer_and_scheduler = kill_after("optimizer", Trainer._save_optimizer_and_scheduler)
    Trainer._save_rng_state = kill_after("rng", Trainer._save_rng_state)
    TrainerState.save_to_json = kill_after("trainer-state", TrainerState.save_to_json)

    trainer = make_trainer(
        output_dir,
        tiny_moe_model("qwen3_moe"),
        routing_replay="pr2",
        max_steps=2,
        pr2_lr_multiplier=10.0,
        save_strategy="steps",
        save_steps=1,
        gradient_accumulation_steps=1,
        num_iterations=2,
    )
    state["trainer"] = trainer
    trainer.train()
    trainer.end()


def main(root: str, points: list[str]) -> None:
    for point in points:
        if point not in ("none", *KILL_POINTS):
            raise SystemExit(f"KILL_POINT must be none or one of {KILL_POINTS}, got {point!r}")
    for point in points:
        pid = os.fork()
        if pid == 0:
            try:
                train_and_kill(os.path.join(root, point), point)
            except BaseException:  # noqa: BLE001 - report and leave the child without running the parent's code
                import traceback

                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(f"RESULT {point} {status}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
