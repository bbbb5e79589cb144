"""Two ranks (torchrun, gloo) drive SaveOnInterrupt through steps 1-8 as the Trainer does; rank 1 alone gets SIGTERM
in step 3. Prints one ``REPORT {json}`` line per rank: the step at which it stopped and the checkpoint it names.

Used by tests/checkpointing/test_checkpoints.py; argv[1] is the shared output_dir. The generation period is 2 steps (steps_per_generation
4, gradient_accumulation_steps 2), so both ranks must stop at step 4, the end of the generation batch.
"""

import json
import signal
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import TrainerControl

from trl_moe_replay.checkpointing.checkpoints import SaveOnInterrupt


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args = SimpleNamespace(
        output_dir=sys.argv[1],
        steps_per_generation=4,
        num_iterations=1,
        gradient_accumulation_steps=2,
        world_size=2,
        device=torch.device("cpu"),
    )
    state = SimpleNamespace(is_world_process_zero=rank == 0, global_step=0)
    callback, control = SaveOnInterrupt(), TrainerControl()
    callback.on_train_begin(args, state, control)
    stopped_at = None
    for step in range(1, 9):
        if rank == 1 and step == 3:
            signal.raise_signal(signal.SIGTERM)
        state.global_step = step
        callback.on_step_end(args, state, control)
        if control.should_training_stop:
            stopped_at = step
            break
    callback.on_train_end(args, state, control)
    print(
        "REPORT "
        + json.dumps(
            {
                "rank": rank,
                "stopped_at": stopped_at,
                "checkpoint": callback.checkpoint,
                "save": control.should_save,
                "exit_status": callback.exit_status,
                "sigterm_restored": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
