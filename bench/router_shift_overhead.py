"""Cost of RSPO's router-shift weight: MoEReplayGRPOTrainer with loss_type="rspo" against "gspo" (the same loss
without γ), side by side in one process, both with R3.

rspo adds, per generation batch, a softmax over the experts at every MoE layer in the old-logprob pass (stored as
int16 ids + float16 probabilities, [B, P+C, L, K]) and, per training micro-step, the same softmax plus the γ
computation and its metrics. Both trainers get identical models and the same sampling seed per round, and run one
generation cycle each (generation, old-logprob pass, `num_iterations` training micro-steps with backward; no
optimizer step), then the training micro-step alone (loss forward + backward on the same buffered micro-batch).
Rounds alternate which trainer goes first; times are CPU seconds of this process. Prints the median per-round
ratios and the bytes the batch carries for γ next to those of the replayed routes.

    python bench/router_shift_overhead.py             # qwen3_moe, hidden 256, 4 layers, 16 experts top-4
    python bench/router_shift_overhead.py --rounds 3  # a quicker look
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

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer  # noqa: E402
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)  # one thread: no OpenMP spin-waiting in the CPU-time measurement


def reward_len(completions, **kwargs):
    return [-abs(12 - len(c)) for c in completions]


def build(args, loss_type: str):
    model = tiny_moe_model(
        "qwen3_moe", hidden_size=args.hidden, num_hidden_layers=args.layers, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.hidden // 2, intermediate_size=args.hidden * 2,
        router_aux_loss_coef=0.0,
    )
    config = MoEReplayGRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=16,
        num_generations=8, max_completion_length=args.completion, num_iterations=2, gradient_accumulation_steps=1,
        save_strategy="no", disable_tqdm=True, logging_steps=1000, routing_replay="r3", loss_type=loss_type,
    )
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    trainer = MoEReplayGRPOTrainer(model=model, reward_funcs=reward_len, args=config,
                                   train_dataset=Dataset.from_dict({"prompt": prompts}),
                                   processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which we bypass
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer, batch


def one_cycle(trainer, batch, seed: int) -> float:
    """CPU seconds (this process, all threads) of one generation cycle: less sensitive to other processes' load
    on a shared machine than wall time."""
    torch.manual_seed(seed)
    start = time.process_time()
    for _ in range(trainer.args.num_iterations):
        trainer.training_step(trainer.model, batch, None)
    elapsed = time.process_time() - start
    trainer.model.zero_grad(set_to_none=True)
    return elapsed


def one_update(trainer) -> float:
    """CPU seconds of one training micro-step (loss forward with γ + backward) on the buffered micro-batch."""
    inputs = trainer._buffered_inputs[0]
    start = time.process_time()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    trainer._train_replay.close()
    elapsed = time.process_time() - start
    trainer.model.zero_grad(set_to_none=True)
    return elapsed


def median_ratio(first, second, rounds: int) -> tuple[float, float, float, float, float]:
    """Alternating order per round; returns (median first, median second, median, min, max of second/first)."""
    a_times, b_times, ratios = [], [], []
    for seed in range(1, rounds + 1):
        if seed % 2:
            a, b = first(seed), second(seed)
        else:
            b, a = second(seed), first(seed)
        a_times.append(a)
        b_times.append(b)
        ratios.append(b / a)
    return statistics.median(a_times), statistics.median(b_times), statistics.median(ratios), min(ratios), max(ratios)


def batch_bytes(trainer, *keys) -> int:
    buffered = trainer._buffered_inputs[0]
    return sum(buffered[k].numel() * buffered[k].element_size() for k in keys if k in buffered)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    gspo, gspo_batch = build(args, "gspo")
    rspo, rspo_batch = build(args, "rspo")
    one_cycle(gspo, gspo_batch, 0), one_cycle(rspo, rspo_batch, 0)  # warm-up; fills the buffers
    print(f"qwen3_moe hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}; "
          f"16 completions x {args.completion} tokens; num_iterations=2; r3; CPU seconds (process_time)")
    g, r, median, low, high = median_ratio(lambda s: one_cycle(gspo, gspo_batch, s),
                                           lambda s: one_cycle(rspo, rspo_batch, s), args.rounds)
    print(f"full cycle ({args.rounds} rounds): gspo {g:.3f}s  rspo {r:.3f}s  "
          f"ratio rspo/gspo median {median:.3f} (min {low:.3f}, max {high:.3f})")
    rounds = 5 * args.rounds
    g, r, median, low, high = median_ratio(lambda s: one_update(gspo), lambda s: one_update(rspo), rounds)
    print(f"training micro-step ({rounds} rounds): gspo {g:.4f}s  rspo {r:.4f}s  "
          f"ratio rspo/gspo median {median:.3f} (min {low:.3f}, max {high:.3f})")
    routes = batch_bytes(rspo, "replay_routes")
    extra = batch_bytes(rspo, "old_router_ids", "old_router_probs")
    print(f"per micro-batch: replay_routes {routes} bytes, old_router_ids + old_router_probs {extra} bytes "
          f"({extra / max(routes, 1):.1f}x)")


if __name__ == "__main__":
    main()
