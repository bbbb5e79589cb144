"""A stock TRL GRPO script for a Mixture-of-Experts model, switched to routing replay by swapping two imports.

The whole change is the marked import line: TRL's `GRPOTrainer`/`GRPOConfig` become `MoEReplayGRPOTrainer`/
`MoEReplayGRPOConfig` (same constructor and fields, plus `routing_replay`, default "r3"). Everything else is TRL's
quickstart: a model name, a dataset with a `prompt` column, a reward function.

    accelerate launch examples/swap_imports.py                  # OLMoE-1B-7B on GSM8K (GPU, downloads from the Hub)
    python examples/swap_imports.py --tiny --max_steps 5        # offline: tiny MoE, synthetic math, CPU
"""

import argparse
import os
import sys

if "--tiny" in sys.argv:  # the offline mode must not reach for the Hub (set before transformers is imported)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

# from trl import GRPOConfig, GRPOTrainer                                    # before
from trl_moe_replay import MoEReplayGRPOConfig as GRPOConfig, MoEReplayGRPOTrainer as GRPOTrainer  # after  # noqa: E402

from trl_moe_replay.extras.math.data import (  # noqa: E402
    REASONING_INSTRUCTION,
    load_math_dataset,
    synthetic_math_dataset,
)
from trl_moe_replay.extras.math.rewards import accuracy_reward, format_reward  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="offline: tiny random MoE and synthetic math (CPU)")
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument("--output_dir", default="runs/swap_imports")
    args = parser.parse_args()

    if args.tiny:
        from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

        model, tokenizer = tiny_moe_model("qwen3_moe"), tiny_tokenizer()
        dataset = synthetic_math_dataset(256, kinds=("arithmetic",))
        extra = dict(per_device_train_batch_size=8, max_completion_length=8, bf16=False, use_cpu=True,
                     gradient_checkpointing=False, report_to="none", save_strategy="no")
    else:
        model, tokenizer = "allenai/OLMoE-1B-7B-0924-Instruct", None
        dataset = load_math_dataset("openai/gsm8k", instruction=REASONING_INSTRUCTION)
        extra = dict(per_device_train_batch_size=8, max_completion_length=1024, learning_rate=1e-6)

    training_args = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, num_generations=8, logging_steps=1, **extra
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy_reward, format_reward],
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
