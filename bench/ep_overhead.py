"""R3 step time with expert parallelism against DDP, side by side on the same processes and data.

Each process builds the benchmark MoE once (saved to a folder) and, per round, two R3 trainers on it
(``MoEReplayGRPOTrainer``, transformers ``generate``): one on the plain model (DDP), one on the model transformers
shards at load time (``distributed_config``: fsdp_size N, ep_size N, all_to_all). Each trains a few steps; the median
step time after the first step is the round's figure. Rounds alternate which side goes first (ABBA). Prints the median
ratio EP/DDP (min-max) and writes a JSON with ``--json``.

On CPU processes (gloo) EP buys memory, not time: every MoE layer adds two all-to-alls and FSDP's all-gathers to the
step; the figure says how much that costs here. On GPUs (NCCL) the same script measures the real trade-off.

    python bench/ep_overhead.py                   # 2 CPU processes (starts torchrun itself); ~2 minutes
    python bench/ep_overhead.py --rounds 2 --steps 3
    torchrun --nproc_per_node 8 bench/ep_overhead.py --device cuda --json ep.json   # GPUs (bench/gpu_check.py)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
warnings.filterwarnings("ignore")

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="processes torchrun starts when not launched by it")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="completions per process and step")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per trainer and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default=None, help="write the figures here (rank 0)")
    return parser.parse_args(argv)


def relaunch(args: argparse.Namespace) -> int:
    """Not under torchrun: start ``args.processes`` copies of this script with it (CPU processes over gloo)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.processes),
        __file__,
        *sys.argv[1:],
    ]
    return subprocess.run(command, env=env).returncode


def step_times(checkpoint: str, args, sharded: bool, seed: int) -> list[float]:
    """Per-step wall times of one R3 training run (a fresh trainer; every rank runs it)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
    from trl_moe_replay.testing import tiny_tokenizer

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            if args.device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

    world = int(os.environ["WORLD_SIZE"])
    loading = {"dtype": "float32"}
    if sharded:
        loading["distributed_config"] = {"fsdp_size": world, "ep_size": world, "ep_implementation": "all_to_all"}
    config = MoEReplayGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=args.device == "cpu",
        bf16=False,
        report_to="none",
        per_device_train_batch_size=args.batch,
        num_generations=8,
        max_completion_length=args.completion,
        num_iterations=1,
        max_steps=args.steps,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1000,
        routing_replay="r3",
        seed=seed,
        model_init_kwargs=loading,
        learning_rate=1e-5,
    )
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    trainer = MoEReplayGRPOTrainer(
        model=checkpoint,
        args=config,
        processing_class=tiny_tokenizer(),
        reward_funcs=lambda completions, **kw: [-abs(12 - len(c)) for c in completions],
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    clock = Clock()
    trainer.add_callback(clock)
    trainer.train()
    return clock.times


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return relaunch(args)
    import torch
    import transformers
    from _harness import bench_moe

    transformers.logging.set_verbosity_error()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    checkpoint = tempfile.mkdtemp(prefix="ep_overhead_model_")  # one per process: no race on the save
    bench_moe(args.hidden, args.layers, args.experts, args.top_k, router_aux_loss_coef=0.0).save_pretrained(checkpoint)
    runs = {"ddp": [], "ep": []}
    ratios = []
    for round_ in range(args.rounds + 1):  # round 0 warms both up
        order = ("ddp", "ep") if round_ % 2 == 0 else ("ep", "ddp")
        figures = {}
        for side in order:
            times = step_times(checkpoint, args, sharded=side == "ep", seed=round_)
            figures[side] = statistics.median(times[1:]) if len(times) > 1 else times[0]
        if round_ == 0:
            continue
        for side in runs:
            runs[side].append(figures[side])
        ratios.append(figures["ep"] / figures["ddp"])
    torch.distributed.barrier()
    result = {
        "device": args.device,
        "processes": world,
        "model": dict(hidden=args.hidden, layers=args.layers, experts=args.experts, top_k=args.top_k),
        "batch_per_process": args.batch,
        "completion": args.completion,
        "steps": args.steps,
        "rounds": args.rounds,
        "median_step_s": runs,
        "ep_over_ddp": {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if rank == 0:
        r = result["ep_over_ddp"]
        print(
            f"qwen3_moe hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}; "
            f"{args.batch} completions x {args.completion} tokens per process; {world} {args.device} processes; "
            f"{args.rounds} rounds of {args.steps} steps"
        )
        for side in ("ddp", "ep"):
            rounds = ", ".join(f"{t:.3f}" for t in runs[side])
            print(f"{side.upper():4} median step {statistics.median(runs[side]):.3f}s  ({rounds})")
        print(f"R3 step EP/DDP: median {r['median']:.3f} (min {r['low']:.3f}, max {r['high']:.3f})")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    torch.distributed.destroy_process_group()
    shutil.rmtree(checkpoint, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
