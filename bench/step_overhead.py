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
import warnings


os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import transformers  # noqa: E402
from _harness import build_trainer, interleaved_ratio, one_cycle, report  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer  # noqa: E402


transformers.logging.set_verbosity_error()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    plain, plain_batch = build_trainer(GRPOTrainer, GRPOConfig, args)
    ours, ours_batch = build_trainer(MoEReplayGRPOTrainer, MoEReplayGRPOConfig, args, routing_replay="r3")
    result = interleaved_ratio(
        lambda seed: one_cycle(plain, plain_batch, seed), lambda seed: one_cycle(ours, ours_batch, seed), args.rounds
    )
    print(
        f"qwen3_moe hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}; "
        f"16 completions x {args.completion} tokens; num_iterations=2; {args.rounds} rounds"
    )
    print(f"plain GRPOTrainer      median {result.baseline:.3f}s per cycle")
    print(f"MoEReplayGRPOTrainer   median {result.candidate:.3f}s per cycle (r3)")
    print(f"ratio r3 / plain: median {result.median:.3f}  (min {result.low:.3f}, max {result.high:.3f})")
    report("R3 trainer cycle / plain GRPOTrainer (HF generate)", result.median, 1.05)


if __name__ == "__main__":
    main()
