"""Training-step overhead of MoEReplayGRPOTrainer (R3) against plain trl.GRPOTrainer, side by side in one process.

Both trainers get identical models and the same sampling seed per round, and run one generation cycle each
(generation, old-logprob pass, and `num_iterations` training micro-steps with backward; no optimizer step, so both
models stay identical). Rounds alternate which trainer goes first. Prints the median per-round ratio (target <= 1.05).
The config is off-policy (num_iterations=2), so plain TRL runs the old-logprob pass too and the comparison is like
for like; R3 adds route recording during generate, alignment, replay and the mismatch metrics.

    python bench/step_overhead.py            # qwen3_moe, hidden 256, 4 layers, 16 experts top-4, 16 completions x 64 tokens
    python bench/step_overhead.py --rounds 3 # a quicker look
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer  # noqa: E402
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer  # noqa: E402

transformers.logging.set_verbosity_error()


def reward_len(completions, **kwargs):
    return [-abs(12 - len(c)) for c in completions]


def build(trainer_cls, config_cls, args, **extra):
    model = tiny_moe_model(
        "qwen3_moe", hidden_size=args.hidden, num_hidden_layers=args.layers, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.hidden // 2, intermediate_size=args.hidden * 2,
        router_aux_loss_coef=0.0,  # R3 turns the aux loss off; keep both sides doing the same work
    )
    config = config_cls(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=16,
        num_generations=8, max_completion_length=args.completion, num_iterations=2, gradient_accumulation_steps=1,
        save_strategy="no", disable_tqdm=True, logging_steps=1000, **extra,
    )
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    trainer = trainer_cls(model=model, reward_funcs=reward_len, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which we bypass
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer, batch


def one_cycle(trainer, batch, seed: int) -> float:
    torch.manual_seed(seed)
    start = time.perf_counter()
    for _ in range(trainer.args.num_iterations):
        trainer.training_step(trainer.model, batch, None)
    elapsed = time.perf_counter() - start
    trainer.model.zero_grad(set_to_none=True)
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    plain, plain_batch = build(GRPOTrainer, GRPOConfig, args)
    ours, ours_batch = build(MoEReplayGRPOTrainer, MoEReplayGRPOConfig, args, routing_replay="r3")
    one_cycle(plain, plain_batch, 0), one_cycle(ours, ours_batch, 0)  # warm-up
    ratios, plain_times, our_times = [], [], []
    for seed in range(1, args.rounds + 1):
        if seed % 2:
            p, o = one_cycle(plain, plain_batch, seed), one_cycle(ours, ours_batch, seed)
        else:
            o, p = one_cycle(ours, ours_batch, seed), one_cycle(plain, plain_batch, seed)
        ratios.append(o / p)
        plain_times.append(p)
        our_times.append(o)
    print(f"qwen3_moe hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}; "
          f"16 completions x {args.completion} tokens; num_iterations=2; {args.rounds} rounds")
    print(f"plain GRPOTrainer      median {statistics.median(plain_times):.3f}s per cycle")
    print(f"MoEReplayGRPOTrainer   median {statistics.median(our_times):.3f}s per cycle (r3)")
    print(f"ratio r3 / plain: median {statistics.median(ratios):.3f}  (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
