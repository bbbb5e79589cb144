"""Train the same tiny MoE with routing_replay none, r2 and r3 and plot their mismatch curves side by side.

Offline and CPU-sized (about a minute for the defaults on 2 cores). The sampler stands in for a bf16 inference engine:
generation runs under bfloat16 autocast while the trainer computes in float32, so the two round differently and route
a few percent of (token, layer) pairs to different experts, the mismatch R3 removes. Each generation batch feeds 2
optimizer updates (off-policy, the papers' "off-2"), so R2 (the old policy's routes replayed in the second update)
differs from none as well. Mismatch metrics are logged once per generation batch (every 2 steps).

    python examples/compare_replay_modes.py                      # -> runs/compare_replay_modes/compare.png
    python examples/compare_replay_modes.py --max_steps 40 --modes none r3 --output_dir /tmp/cmp

What to look at: `mismatch/kl_k3`, `mismatch/extreme_frac` and `sampling/sampling_logp_difference/max` (sampler vs
trainer log-probs of the sampled tokens: lower is better; r3 lowest) and `routing/mismatch_frac` (how often the
trainer's own router disagrees with the rollout's routes; under r3 the earlier layers' replayed routes keep the
hidden states closer, so later routers disagree a little less too).
"""

import os


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see recipes/grpo_r3.py: keeps 2 busy cores usable
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer  # noqa: E402
from trl_moe_replay.cli.plotting import plot_comparison  # noqa: E402
from trl_moe_replay.extras.math.cold_start import (  # noqa: E402
    ColdStartConfig,
    cached_cold_start,
    cold_start_sft,
    default_cache_dir,
    settings_key,
)
from trl_moe_replay.extras.math.data import BOXED_INSTRUCTION, synthetic_math_dataset  # noqa: E402
from trl_moe_replay.extras.math.rewards import accuracy_reward  # noqa: E402
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer  # noqa: E402


METRICS = [
    "mismatch/kl_k3",
    "mismatch/extreme_frac",
    "routing/mismatch_frac",
    "sampling/sampling_logp_difference/max",
    "clip_ratio/region_mean",
    "reward",
]
# More experts, top-8 and a wider router init than the tests' default: many close router scores, so bf16 rounding
# flips some top-k choices, as in a real 128-expert top-8 model.
MODEL = dict(model_type="qwen3_moe", num_experts=64, num_experts_per_tok=8, num_hidden_layers=4, initializer_range=0.1)


def math_data(num_samples: int, seed: int):
    # The instruction makes prompts ~35 tokens long: on CPU, bf16 cached decoding and full forwards of sequences
    # this long round differently (very short ones happen to match bit for bit).
    return synthetic_math_dataset(num_samples, seed=seed, kinds=("arithmetic",), instruction=BOXED_INSTRUCTION)


def cold_started_model(seed: int, cache_dir: str | None, steps: int) -> str:
    """The tiny MoE after a short cached SFT on noisy boxed answers (see trl_moe_replay.extras.math.cold_start)."""
    data = math_data(2000, seed)
    sft = ColdStartConfig(steps=steps, label_noise=0.5, seed=seed)
    data_key = settings_key({"prompt": data["prompt"], "solution": data["solution"]})
    settings = dict(model=MODEL, sft=asdict(sft), data=data_key, version=1)

    def build():
        config = {k: v for k, v in MODEL.items() if k != "model_type"}
        model = tiny_moe_model(MODEL["model_type"], seed=seed, **config)
        tokenizer = tiny_tokenizer()
        return model, tokenizer, cold_start_sft(model, tokenizer, data, sft)

    folder, _ = cached_cold_start(cache_dir or default_cache_dir(), settings, build)
    return str(folder)


class BF16EngineTrainer(MoEReplayGRPOTrainer):
    """Samples under bfloat16 autocast, a stand-in for a bf16 inference engine, while training in float32."""

    def _generate_single_turn(self, *args, **kwargs):
        with torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16):
            return super()._generate_single_turn(*args, **kwargs)


def train(mode: str, model_dir: str, args) -> list[dict]:
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = MoEReplayGRPOConfig(
        output_dir=str(Path(args.output_dir) / mode),
        routing_replay=mode,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=32,
        steps_per_generation=2,
        num_generations=8,
        max_completion_length=8,
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
        # measure and correct "none" like the replay modes: log its routing agreement, and score every batch against
        # the sampler's log-probs (TRL's importance-sampling correction, as with vLLM)
        routing_metrics=True,
        transformers_importance_sampling_correction=True,
    )
    trainer = BF16EngineTrainer(
        model=model,
        reward_funcs=accuracy_reward,
        args=config,
        processing_class=tiny_tokenizer(),
        train_dataset=math_data(2000, args.seed + 1),
    )
    trainer.train()
    return trainer.state.log_history


def mean_of(history: list[dict], name: str) -> float:
    values = [h[name] for h in history if isinstance(h.get(name), float) and math.isfinite(h[name])]
    return sum(values) / len(values) if values else float("nan")


def main(argv=None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["none", "r2", "r3"], choices=["none", "r2", "r3", "pr2"])
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="runs/compare_replay_modes")
    parser.add_argument("--sft_steps", type=int, default=100, help="cold-start SFT steps (cached)")
    parser.add_argument("--cache_dir", default=None, help="cold-start cache (default ~/.cache/trl_moe_replay)")
    args = parser.parse_args(argv)

    model_dir = cold_started_model(args.seed, args.cache_dir, args.sft_steps)
    histories = {}
    for mode in args.modes:
        print(f"training routing_replay={mode} for {args.max_steps} steps ...", flush=True)
        histories[mode] = train(mode, model_dir, args)

    out = plot_comparison(
        histories,
        METRICS,
        Path(args.output_dir) / "compare.png",
        log_y=("mismatch/kl_k3",),
        title=f"routing replay modes: tiny MoE, bf16 sampling vs fp32 training, {args.max_steps} steps",
    )
    summary = {mode: {m: mean_of(h, m) for m in METRICS} for mode, h in histories.items()}
    (Path(args.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{'metric (mean over steps)':<40}" + "".join(f"{m:>12}" for m in histories))
    for metric in METRICS:
        print(f"{metric:<40}" + "".join(f"{summary[m][metric]:>12.4g}" for m in histories))
    print(f"\nplot: {out}")
    return summary


if __name__ == "__main__":
    main()
