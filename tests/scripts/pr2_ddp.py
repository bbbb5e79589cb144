"""PR2 under DDP (`torchrun --nproc_per_node 2`, CPU/gloo): each rank writes its predictor weights to
`<argv[1]>/rank<i>.json`.

The predictors live outside the DDP-wrapped model, so their gradients must be averaged by the trainer itself;
the ranks see different prompts, so without that their predictors would drift apart.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer


def reward_len(completions, **kwargs):
    return [-abs(8 - len(c)) for c in completions]


def main():
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})
    args = MoEReplayGRPOConfig(
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
        gradient_accumulation_steps=1,
        num_iterations=2,
        save_strategy="no",
        routing_replay="pr2",
        pr2_lr_multiplier=10.0,
    )
    trainer = MoEReplayGRPOTrainer(
        model=tiny_moe_model("qwen3_moe"),
        reward_funcs=reward_len,
        args=args,
        train_dataset=dataset,
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    weights = torch.cat([p.detach().reshape(-1) for p in trainer._pr2.predictors.parameters()])
    rank = trainer.accelerator.process_index
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "weights": weights.tolist(),
        "pr2_loss": [h["pr2/loss"] for h in trainer.state.log_history if "pr2/loss" in h],
    }
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(result))
    trainer.end()  # destroys the process group before exit (see MoEReplayTrainerMixin.end)


if __name__ == "__main__":
    main()
