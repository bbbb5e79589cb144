"""A stock TRL GRPO script; the only change for MoE routing replay is the import line marked below.

Used by the tests under `torchrun --nproc_per_node 2` (two real CPU processes, gloo); prints the world size and the
logged metrics as JSON.
"""

import json
import sys
import tempfile

from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig as GRPOConfig, MoEReplayGRPOTrainer as GRPOTrainer  # the swap
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer


def reward_len(completions, **kwargs):
    return [-abs(8 - len(c)) for c in completions]


def main():
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})
    training_args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-3,
        gradient_accumulation_steps=2,
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=tiny_moe_model(sys.argv[1] if len(sys.argv) > 1 else "qwen3_moe"),
        reward_funcs=reward_len,
        args=training_args,
        train_dataset=dataset,
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        logged = [h for h in trainer.state.log_history if "routing/mismatch_frac" in h]
        print("METRICS " + json.dumps({"world": trainer.accelerator.num_processes, "logs": logged}))
    trainer.end()  # destroys the process group before exit (see MoEReplayGRPOTrainer.end)


if __name__ == "__main__":
    main()
