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
import time
import warnings


os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers  # noqa: E402
from _harness import build_trainer, interleaved_ratio, one_cycle, report  # noqa: E402

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer  # noqa: E402


transformers.logging.set_verbosity_error()
torch.set_num_threads(1)  # one thread: no OpenMP spin-waiting in the CPU-time measurement


def one_update(trainer) -> float:
    """CPU seconds of one training micro-step (loss forward with γ + backward) on the buffered micro-batch."""
    inputs = trainer._buffered_inputs[0]
    start = time.process_time()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    trainer._end_micro_batch()
    elapsed = time.process_time() - start
    trainer.model.zero_grad(set_to_none=True)
    return elapsed


def held_bytes(trainer, *keys) -> int:
    """Bytes of the per-sample inputs ``keys`` the trainer holds for its first buffered micro-batch (with its routes)."""
    held = trainer._routes.buffer.gather_held(trainer._buffered_inputs[0]["route_rows"]).per_sample
    return sum(held[k].numel() * held[k].element_size() for k in keys if k in held)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    def build(loss_type):
        return build_trainer(MoEReplayGRPOTrainer, MoEReplayGRPOConfig, args, routing_replay="r3", loss_type=loss_type)

    gspo, gspo_batch = build("gspo")
    rspo, rspo_batch = build("rspo")
    print(
        f"qwen3_moe hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}; "
        f"16 completions x {args.completion} tokens; num_iterations=2; r3; CPU seconds (process_time)"
    )
    # CPU seconds of this process (all threads): less sensitive to other processes' load than wall time
    cycle = interleaved_ratio(
        lambda seed: one_cycle(gspo, gspo_batch, seed, time.process_time),
        lambda seed: one_cycle(rspo, rspo_batch, seed, time.process_time),
        args.rounds,
    )
    print(
        f"full cycle ({args.rounds} rounds): gspo {cycle.baseline:.3f}s  rspo {cycle.candidate:.3f}s  "
        f"ratio rspo/gspo median {cycle.median:.3f} (min {cycle.low:.3f}, max {cycle.high:.3f})"
    )
    report("RSPO cycle / GSPO cycle (CPU time)", cycle.median, 1.05)
    rounds = 5 * args.rounds  # the micro-steps reuse the batches the cycles buffered
    step = interleaved_ratio(lambda _: one_update(gspo), lambda _: one_update(rspo), rounds)
    print(
        f"training micro-step ({rounds} rounds): gspo {step.baseline:.4f}s  rspo {step.candidate:.4f}s  "
        f"ratio rspo/gspo median {step.median:.3f} (min {step.low:.3f}, max {step.high:.3f})"
    )
    replayed = rspo.replayed_routes(rspo._buffered_inputs[0])  # held by the trainer; the batch carries route_rows
    routes = replayed.numel() * replayed.element_size() if replayed is not None else 0
    extra = held_bytes(rspo, "old_router_ids", "old_router_probs")
    print(
        f"per micro-batch: replayed routes {routes} bytes, old_router_ids + old_router_probs {extra} bytes "
        f"({extra / max(routes, 1):.1f}x)"
    )


if __name__ == "__main__":
    main()
