"""Updates that round away, measured on a real training run (issue 42): a mid-size MoE trained a few GRPO steps (R3 on
the transformers path) at lr 1e-6 with bf16 parameters updated in place, and with fp32 master weights (an fp32 model
under bf16 autocast: what the shipped configs do). Per side: the fraction of trainable elements that changed (all of
them, counted from a copy taken before training, and the trainer's own ``precision/updated_frac``), the peak device
memory and the time per optimizer step. The sides run in ABBA order in one process.

    python bench/precision_updates.py              # on a GPU: 8 layers at hidden 1,024 (docs/benchmarks.md)
    python bench/precision_updates.py --smoke      # on a CPU, seconds: the same code at a tiny size

Prints one JSON object (also written to ``--out``); the figures in docs/benchmarks.md name the card, the versions and
the date they came from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback


sys.path.insert(0, str(Path(__file__).parent))
from _harness import bench_moe  # noqa: E402

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer  # noqa: E402
from trl_moe_replay.testing import tiny_tokenizer  # noqa: E402


SIDES = {"bf16 in place": torch.bfloat16, "fp32 masters": torch.float32}


class StepClock(TrainerCallback):
    """Wall time of each optimizer step (synchronised on a GPU)."""

    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(self._now() - self._start)


def _reward_len(completions, **kwargs):
    return [-abs(12 - len(c)) for c in completions]


def train_side(dtype: torch.dtype, size: dict, steps: int, lr: float, on_gpu: bool) -> dict:
    model = bench_moe(size["hidden"], size["layers"], size["experts"], size["top_k"]).to(dtype)
    if on_gpu:
        model = model.cuda()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    clock = StepClock()
    config = MoEReplayGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=not on_gpu,
        bf16=on_gpu,
        report_to="none",
        learning_rate=lr,
        per_device_train_batch_size=size["batch"],
        num_generations=8,
        max_completion_length=size["completion"],
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        routing_replay="r3",
    )
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    trainer = MoEReplayGRPOTrainer(
        model=model,
        reward_funcs=_reward_len,
        args=config,
        callbacks=[clock],
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    changed = total = 0
    for name, param in trainer.model.named_parameters():
        if name in before:
            changed += int((param.detach() != before[name]).sum())
            total += param.numel()
    logged = [
        entry["precision/updated_frac"] for entry in trainer.state.log_history if "precision/updated_frac" in entry
    ]
    return {
        "dtype": str(dtype),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "changed_frac_after_all_steps": changed / total,
        "probe_updated_frac": logged,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        "step_seconds": clock.times,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny size on the CPU (the suite runs this)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.smoke
    size = (
        dict(hidden=64, layers=2, experts=8, top_k=2, batch=8, completion=8)
        if args.smoke
        else dict(hidden=1024, layers=8, experts=32, top_k=4, batch=32, completion=64)
    )
    runs = {name: [] for name in SIDES}
    for name in ["bf16 in place", "fp32 masters", "fp32 masters", "bf16 in place"]:  # ABBA
        runs[name].append(train_side(SIDES[name], size, args.steps, args.lr, on_gpu))
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "trl": __import__("trl").__version__,
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "size": size,
        "lr": args.lr,
        "steps": args.steps,
        "sides": {
            name: {
                "runs": side,
                "changed_frac_after_all_steps": [run["changed_frac_after_all_steps"] for run in side],
                "probe_updated_frac_step1": [
                    run["probe_updated_frac"][0] for run in side if run["probe_updated_frac"]
                ],
                "peak_memory_gib": max((run["peak_memory_gib"] or 0) for run in side) if on_gpu else None,
                # the first step carries warm-up (kernels, allocator): the median of the later ones
                "median_step_seconds": statistics.median(t for run in side for t in run["step_seconds"][1:]),
            }
            for name, side in runs.items()
        },
    }
    base, masters = result["sides"]["bf16 in place"], result["sides"]["fp32 masters"]
    result["step_time_ratio_fp32_masters_over_bf16"] = masters["median_step_seconds"] / base["median_step_seconds"]
    if on_gpu:
        result["peak_memory_ratio_fp32_masters_over_bf16"] = masters["peak_memory_gib"] / base["peak_memory_gib"]
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    return result


if __name__ == "__main__":
    main()
