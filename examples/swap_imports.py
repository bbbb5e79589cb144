# train_grpo.py: TRL's GRPO quick start on a Mixture-of-Experts model.
#
# examples/swap_imports_trl_original.py is the plain-TRL script; examples/swap_imports.py is the same script with
# routing replay (R3 by default). The two files differ only in the line that imports GRPOConfig and GRPOTrainer.
#
#     python examples/swap_imports.py MODEL    # MODEL: a Hub id or a local checkpoint (model + tokenizer)
#
# Offline, on a tiny random MoE saved first (its reward rises from about -43 to -23 in the 30 steps, ~1 min on a CPU):
#
#     python -m trl_moe_replay.testing runs/tiny-moe && python examples/swap_imports.py runs/tiny-moe
#
# The settings are sized for a quick run on a small model; for a billion-parameter model lower learning_rate to
# TRL's default, 1e-6. Checkpoints go to runs/swap_imports/.
import sys

import torch
from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig as GRPOConfig, MoEReplayGRPOTrainer as GRPOTrainer

if len(sys.argv) != 2:
    sys.exit(
        f"usage: python {sys.argv[0]} MODEL, a Hub id (e.g. ibm-granite/granite-3.1-1b-a400m-instruct) or a "
        "checkpoint folder; offline: python -m trl_moe_replay.testing runs/tiny-moe, then MODEL=runs/tiny-moe"
    )
model = sys.argv[1]

# A small prompt-only dataset, built in place (TRL's quick start loads trl-lib/tldr from the Hub)
topics = ["the sea", "a cat", "rain", "the moon", "bread", "a train", "snow", "music"]
dataset = Dataset.from_dict({"prompt": [f"Write about {topic}:" for topic in topics] * 32})


# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(
    output_dir="runs/swap_imports",
    learning_rate=1e-3,
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=48,
    max_steps=30,
    logging_steps=1,
    seed=0,
    report_to="none",
    bf16=torch.cuda.is_available(),  # TRL's default (bf16) needs a GPU; on a CPU train in float32
)
trainer = GRPOTrainer(
    model=model,
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
