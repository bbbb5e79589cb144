"""R3 with your own rollout engine: a TRL `rollout_func` that returns the routes its engine used.

Any engine or agent framework (SGLang, a custom server, an agent loop) can feed R3: besides TRL's `prompt_ids`,
`completion_ids` and `logprobs`, the rollout function returns per sample `routed_experts` in vLLM's layout, the
experts the engine routed every forwarded position to:

    routed_experts[i]: [len(prompt_ids[i]) + len(completion_ids[i]) - 1 - s, num_layers, top_k] integer array
                       (or vLLM's base64 `.npy` string), row j = position s + j; dense layers all zero
    routed_experts_prompt_start: s (optional, an int or one per sample; default 0)

SGLang returns that layout too (its default wire format is flat base64 int32: reshape it to
`[len(tokens) - 1 - start, L, K]`). The trainer takes both fields out of what TRL hands to the reward functions,
checks every sample (a sample whose routes do not fit its tokens is routed by the trainer itself and counted in
`routing/fallback_frac`) and replays them in the old-logprob, reference and training forwards.

Here the "engine" is a transformers copy of the policy (trl_moe_replay.testing.TransformersEngine, which
records routes like vLLM returns them), kept in sync with the trainer's weights before each rollout:

    python examples/rollout_func_routes.py --max_steps 5     # offline, tiny MoE, CPU, a few seconds
"""

import argparse
import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer  # noqa: E402
from trl_moe_replay.extras.math.data import synthetic_math_dataset  # noqa: E402
from trl_moe_replay.extras.math.rewards import accuracy_reward  # noqa: E402
from trl_moe_replay.routing import encode_routed_experts  # noqa: E402
from trl_moe_replay.testing import TransformersEngine, tiny_moe_model, tiny_tokenizer  # noqa: E402


class EngineRollout:
    """`rollout_func(prompts, trainer) -> dict`: sample with the engine, return its routes with the tokens."""

    def __init__(self, engine: TransformersEngine, max_tokens: int):
        self.engine, self.max_tokens = engine, max_tokens

    def __call__(self, prompts: list[str], trainer) -> dict:
        # your engine: sync the policy's weights, then sample (TRL repeats each prompt num_generations times)
        self.engine.load_weights(iter(trainer.model.state_dict().items()))
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        completions = [group[0] for group in self.engine.generate(prompt_ids, n=1, max_tokens=self.max_tokens)]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [c.token_ids for c in completions],
            "logprobs": [c.logprobs for c in completions],  # the sampled tokens' log-probs
            # the routes, as vLLM sends them over HTTP (numpy arrays work too)
            "routed_experts": [encode_routed_experts(c.routed_experts) for c in completions],
        }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=5)
    parser.add_argument("--output_dir", default="runs/rollout_func_routes")
    args = parser.parse_args(argv)

    config = MoEReplayGRPOConfig(
        output_dir=args.output_dir,
        routing_replay="r3",
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=8,
        learning_rate=1e-3,
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
    )
    trainer = MoEReplayGRPOTrainer(
        model=tiny_moe_model("qwen3_moe"),
        reward_funcs=accuracy_reward,
        args=config,
        train_dataset=synthetic_math_dataset(256, kinds=("arithmetic",)),
        processing_class=tiny_tokenizer(),
        rollout_func=EngineRollout(TransformersEngine(tiny_moe_model("qwen3_moe")), max_tokens=8),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "routing/fallback_frac" in entry]
    for entry in logs:
        print(
            f"step {entry['step']}: routing/fallback_frac={entry['routing/fallback_frac']:.3g} "
            f"mismatch/kl_k3={entry['mismatch/kl_k3']:.3g}"
        )
    return logs


if __name__ == "__main__":
    main()
