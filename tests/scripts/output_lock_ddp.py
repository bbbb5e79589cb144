"""Two ranks (torchrun, gloo) train into one output_dir: prints, per rank, which pid owns the lock during training.

Used by tests/core/test_output_lock.py; argv[1] is the shared output_dir.
"""

import json
import os
import sys

from datasets import Dataset
from transformers import TrainerCallback

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.core.output_lock import LOCK_NAME
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer


class LockProbe(TrainerCallback):
    lock_pid = None

    def on_step_end(self, args, state, control, **kwargs):
        with open(os.path.join(args.output_dir, LOCK_NAME)) as f:
            self.lock_pid = json.load(f)["pid"]


def main():
    probe = LockProbe()
    trainer = MoEReplayGRPOTrainer(
        model=tiny_moe_model("qwen3_moe"),
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=MoEReplayGRPOConfig(
            output_dir=sys.argv[1],
            use_cpu=True,
            bf16=False,
            report_to="none",
            max_steps=1,
            logging_steps=1,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=4,
            save_strategy="no",
        ),
        train_dataset=Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(8)]}),
        processing_class=tiny_tokenizer(),
        callbacks=[probe],
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    print(
        "REPORT "
        + json.dumps(
            {"rank": rank, "pid": os.getpid(), "lock_pid": probe.lock_pid, "steps": trainer.state.global_step}
        ),
        flush=True,
    )
    trainer.end()  # releases the lock and destroys the process group


if __name__ == "__main__":
    main()
